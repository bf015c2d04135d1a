"""Pools of workers found through a real Redis registry: 2 prefill + 2 decode processes
and a router that knows only the Redis URL. Parity holds across the pools; a shared
prefix is routed to the prefill worker holding it; a tiny queue answers 429; a killed
decode worker drops out within the TTL while new requests keep succeeding, and its
restart (a new epoch, at the same address) receives traffic again within 2 s of serving;
a Redis that restarts empty fails no request."""
from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.common.security import ClusterSecret, new_secret_file
from services.local_processes import start_private_redis
from tests.processes import free_port, spawn_service, spawn_services, terminate, wait_ready, worker_stats
from tests.parity_cases import CASES, chat_body

TTL = 2.0
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (make test installs it)")


def route(r: httpx.Response) -> dict:
    return dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))


class Pools:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-pools-"))
        self.redis, self.url = start_private_redis(self.tmp)
        self.secret_file = str(new_secret_file(self.tmp / "cluster-secret"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.info: dict[str, dict] = {}

    def argv(self, *argv: str) -> list[str]:
        return [*argv, "--redis", self.url, "--registry-ttl", str(TTL), "--log-level", "warning",
                "--cluster-secret-file", self.secret_file]

    def spawn(self, name: str, *argv: str) -> dict:
        self.procs[name], self.info[name] = spawn_service(self.tmp, name, name.split("-")[0], self.argv(*argv))
        return self.info[name]

    def worker_argv(self, name: str, *extra: str) -> list[str]:
        argv = ["--dtype", "float32", "--threads", "1"]
        if name.startswith("decode"):
            argv += ["--kv-cache-tokens", "16384"]
        return [*argv, *extra]

    def worker(self, name: str, *extra: str) -> dict:
        return self.spawn(name, *self.worker_argv(name, *extra))

    def router_argv(self, *extra: str) -> list[str]:
        return ["--http-port", "0", "--grpc-port", "0", "--local-prefill-max-tokens", "0", *extra]

    def router(self, name: str = "router", *extra: str) -> str:
        info = self.spawn(name, *self.router_argv(*extra))
        url = f"http://127.0.0.1:{info['http_port']}"
        wait_ready(url, {"prefill": 1, "decode": 1})
        return url

    def start(self, workers: list[str]) -> None:
        """`workers` and a router, all at once; returns once the router counts them all."""
        names = [*workers, "router"]
        argvs = [self.argv(*self.worker_argv(n)) for n in workers] + [self.argv(*self.router_argv())]
        for name, (proc, info) in zip(names, spawn_services(
                self.tmp, [(n, n.split("-")[0], a) for n, a in zip(names, argvs)])):
            self.procs[name], self.info[name] = proc, info
        self.http = f"http://127.0.0.1:{self.info['router']['http_port']}"
        wait_ready(self.http, {role: sum(n.startswith(role) for n in workers) for role in ("prefill", "decode")})

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.info[name]['grpc_port']}"

    def stats(self, name: str):
        return worker_stats(self.addr(name), name.split("-")[0], self.secret_file)

    def id(self, name: str) -> str:
        """How responses name the worker: role-epoch (addresses stay in logs and metrics)."""
        return f"{name.split('-')[0]}-{self.stats(name).info.epoch}"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def stop(self) -> None:
        for name in [n for n in self.procs if n.startswith("router")] + list(self.procs):
            proc = self.procs.pop(name, None)
            if proc is not None:
                terminate(proc)
        self.redis.terminate()
        self.redis.wait(timeout=10)
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def pools(model_dir):
    p = Pools()
    try:
        p.start(["decode-0", "decode-1", "prefill-0", "prefill-1"])
        yield p
    finally:
        p.stop()


def wait_pools_idle(p: Pools, names, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = {n: p.stats(n) for n in names}
        idle = all(s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0 and s.info.running == 0
                   for s in stats.values())
        if idle:
            return
        assert time.monotonic() < deadline, f"decode pools not back to full: {stats}"
        time.sleep(0.2)


def test_workers_register_with_epoch_address_and_capacity(pools):
    import redis
    r = redis.Redis.from_url(pools.url)
    from services.rpc import worker_pb2
    keys = sorted(k.decode() for k in r.keys("pdserve:worker:*"))
    assert len(keys) == 4 and sum(":decode:" in k for k in keys) == 2
    secret = ClusterSecret.from_file(pools.secret_file)
    records = [worker_pb2.WorkerInfo.FromString(secret.open(r.get(k))) for k in keys]
    assert {x.address for x in records} == {pools.addr(n) for n in ("decode-0", "decode-1", "prefill-0", "prefill-1")}
    assert all(x.epoch in k for x, k in zip(records, keys))
    assert all(x.num_blocks > 0 and x.compat_hash for x in records)
    assert 0 < r.pttl(keys[0]) <= TTL * 1000


# Parity is test_parity's (one worker of each); routing across two pools, the shared-prefix test's.
@pytest.mark.slow
def test_parity_across_two_prefill_and_two_decode_workers(pools, expected):
    async def one(client, case):
        r = await client.post(f"{pools.http}/v1/chat/completions", json=chat_body(case))
        return case, r

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, c) for c in CASES for _ in range(2)))

    used = set()
    for case, r in asyncio.run(run()):
        assert r.status_code == 200, r.text
        exp = expected[case.name]
        assert r.json()["choices"][0]["token_ids"] == exp.token_ids, case.name
        assert route(r)["decision"] == "remote"
        used.add(route(r)["decode"])
    assert used == {pools.id("decode-0"), pools.id("decode-1")}
    wait_pools_idle(pools, ("decode-0", "decode-1"))


PREFIX = 512                    # tokens: 32 blocks, all of them cached on the holder


def test_shared_prefix_goes_to_the_worker_holding_it(pools):
    prefix = [(i * 7919) % 40000 + 100 for i in range(PREFIX)]
    before = {n: pools.stats(n).prompt_tokens_computed for n in ("prefill-0", "prefill-1")}
    routes = []
    for i in range(11):
        suffix = [(j * 31 + i * 977) % 30000 + 200 for j in range(64)]
        r = httpx.post(f"{pools.http}/v1/completions", timeout=300,
                       json={"prompt": prefix + suffix, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        routes.append(route(r))
    holder = routes[0]["prefill"]
    later = routes[1:]
    on_holder = [x for x in later if x["prefill"] == holder and int(x["cached_tokens"]) == PREFIX]
    assert len(on_holder) >= 0.9 * len(later), routes
    metrics = httpx.get(f"{pools.http}/metrics").text
    holder_addr = next(pools.addr(n) for n in ("prefill-0", "prefill-1") if pools.id(n) == holder)
    assert f'pdserve_routed_requests_total{{role="prefill",worker="{holder_addr}"}}' in metrics
    assert "pdserve_prefix_cached_tokens_total" in metrics
    computed = sum(pools.stats(n).prompt_tokens_computed - before[n] for n in before)
    assert computed <= PREFIX + 11 * 64 + 64, computed        # the prefix ran (about) once


def test_a_tiny_queue_answers_429_and_loses_nothing(pools):
    url = pools.router("router-tiny", "--max-pending", "1")

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "prompt": f"Count to fifty, attempt {i}:", "max_tokens": 16, "ignore_eos": True})
                for i in range(6)))

    rs = asyncio.run(run())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(200) >= 1 and codes.count(429) >= 1 and set(codes) <= {200, 429}, codes
    busy = next(r for r in rs if r.status_code == 429)
    assert busy.headers["retry-after"].isdigit() and busy.json()["error"]["code"] == "overloaded"
    wait_pools_idle(pools, ("decode-0", "decode-1"))
    pools.kill("router-tiny", signal.SIGTERM)


def test_sigterm_drains_a_decode_worker_without_failing_its_requests(pools):
    import redis
    pools.worker("decode-2")
    r = redis.Redis.from_url(pools.url)
    deadline = time.monotonic() + 10
    while pools.id("decode-2") not in {
            route(httpx.post(f"{pools.http}/v1/completions", json={"prompt": "x", "max_tokens": 1}))["decode"]
            for _ in range(3)}:
        assert time.monotonic() < deadline, "the third decode worker never got traffic"

    async def stream(client, i):
        body = {"prompt": f"List animals, number {i}:", "max_tokens": 48, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", f"{pools.http}/v1/completions", json=body) as resp:
            lines = [line async for line in resp.aiter_lines()]
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        usage = [e["usage"] for e in events if e.get("usage")]
        return resp.status_code, usage[-1]["completion_tokens"] if usage else None, lines[-2:]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(6)]
            await asyncio.sleep(2.0)                  # all six are decoding, some on decode-2
            proc = pools.procs["decode-2"]
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while r.keys("pdserve:worker:decode:*").__len__() > 2:     # deregistered first
                assert time.monotonic() - t0 < 2, "draining worker still registered"
                await asyncio.sleep(0.05)
            results = await asyncio.gather(*tasks)
            return results, proc

    results, proc = asyncio.run(run())
    assert proc.wait(timeout=40) == 0
    pools.procs.pop("decode-2")
    for status, tokens, tail in results:
        assert status == 200 and tokens == 48, (status, tokens, tail)
    wait_pools_idle(pools, ("decode-0", "decode-1"))


# test_supervision kills a decode worker under `up` and sees only its streams fail and it rejoin.
@pytest.mark.slow
def test_killed_decode_worker_leaves_and_its_restart_rejoins(pools):
    victim = "decode-1"
    old_id = pools.id(victim)

    async def stream(client, i):
        body = {"prompt": f"Write a long list of animals, number {i}:", "max_tokens": 60, "ignore_eos": True,
                "stream": True}
        try:
            async with client.stream("POST", f"{pools.http}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return r.status_code, await r.aread()
                text = [line async for line in r.aiter_lines()]
                return 200, "\n".join(text)
        except httpx.HTTPError as exc:
            return "transport", str(exc)

    async def during_kill():
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(stream(client, i)) for i in range(4)]
            await asyncio.sleep(1.5)
            pools.kill(victim)
            return await asyncio.gather(*tasks)

    for status, body in asyncio.run(during_kill()):
        # Finished, or a clear error: an HTTP status, or an error event in the stream.
        assert status in (200, 503), (status, body)
        if status == 200:
            assert "[DONE]" in body or '"error"' in body, body

    # New requests keep succeeding: one routed to the dead worker is retried elsewhere.
    t0 = time.monotonic()
    for i in range(6):
        r = httpx.post(f"{pools.http}/v1/completions", timeout=120, json={"prompt": f"Hello {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert route(r)["decode"] != old_id
    assert time.monotonic() - t0 < 60

    # A new process at the same address (as up or a supervisor restarts it): a new epoch.
    info = pools.worker(victim, "--port", str(pools.info[victim]["grpc_port"]))
    serving = time.monotonic()
    new_id = pools.id(victim)
    seen = set()
    while new_id not in seen:
        assert time.monotonic() - serving < 2.0, f"restarted worker {new_id} got no traffic: {seen}"
        rs = [httpx.post(f"{pools.http}/v1/completions", timeout=120,
                         json={"prompt": f"Hi {i}", "max_tokens": 2}) for i in range(3)]
        assert all(r.status_code == 200 for r in rs)
        seen |= {route(r)["decode"] for r in rs}
    assert info["pid"] != 0
    wait_pools_idle(pools, ("decode-0", "decode-1"))
    metrics = httpx.get(f"{pools.http}/metrics").text
    assert 'pdserve_pool_workers{role="decode"} 2.0' in metrics


def _pool_size(url: str, role: str) -> float:
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines()
                if x.startswith(f'pdserve_pool_workers{{role="{role}"}}'))
    return float(line.split()[-1])


def test_a_redis_restart_fails_no_request(pools):
    """Redis restarts empty while requests flow: the router keeps routing to the workers it
    knows (each still answers as itself) until they announce themselves again, and no
    request fails."""
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            r = httpx.post(f"{pools.http}/v1/completions", timeout=60, json={"prompt": "Hello", "max_tokens": 2})
            statuses.append(r.status_code)
    client = threading.Thread(target=load)
    client.start()
    try:
        time.sleep(1.0)
        pools.redis.terminate()
        pools.redis.wait(timeout=10)
        pools.redis, url = start_private_redis(pools.tmp)
        assert url == pools.url
        # Empty again and again for a while, as if it kept restarting: each refresh the
        # router makes may find no worker records at all.
        import redis
        with redis.Redis.from_url(url) as r:
            until = time.monotonic() + 3 * TTL
            while time.monotonic() < until:
                r.flushall()
                time.sleep(0.05)
    finally:
        stop.set()
        client.join(60)
    assert len(statuses) > 5 and set(statuses) == {200}, statuses
    assert _pool_size(pools.http, "decode") == 2 and _pool_size(pools.http, "prefill") == 2


def test_a_rogue_registration_is_never_routed(pools):
    """Records written straight to Redis for a 'decode worker' at an address of the
    writer's choosing, unsigned and signed with another secret, copying a real worker's
    record with a pool of free blocks that would win every pick: the router ignores both,
    and every request goes to the real workers. The same record signed with the
    cluster's secret does join (the check, not the record, keeps it out)."""
    import redis
    r = redis.Redis.from_url(pools.url)
    real = {pools.id("decode-0"), pools.id("decode-1")}
    info = pools.stats("decode-0").info
    info.epoch, info.address = "rogue", f"127.0.0.1:{free_port()}"
    info.num_blocks = info.free_blocks = 1 << 30
    info.running = info.waiting = 0
    payload = info.SerializeToString()
    stranger = ClusterSecret.from_bytes(b"not the cluster's" * 2)
    forged = {"pdserve:worker:decode:rogue-unsigned": payload,
              "pdserve:worker:decode:rogue-other-secret": stranger.sign(payload)}
    for key, value in forged.items():
        r.set(key, value, px=int(60_000))
    time.sleep(3 * TTL)                                   # several refreshes
    assert _pool_size(pools.http, "decode") == 2
    for i in range(4):
        resp = httpx.post(f"{pools.http}/v1/completions", timeout=120, json={"prompt": f"Hi {i}", "max_tokens": 2})
        assert resp.status_code == 200 and route(resp)["decode"] in real, resp.text
    r.delete(*forged)

    r.set("pdserve:worker:decode:rogue", ClusterSecret.from_file(pools.secret_file).sign(payload), px=60_000)
    deadline = time.monotonic() + 10 * TTL
    while _pool_size(pools.http, "decode") != 3:
        assert time.monotonic() < deadline, "a record signed with the cluster's secret never joined"
        time.sleep(0.2)
    r.delete("pdserve:worker:decode:rogue")
    while _pool_size(pools.http, "decode") != 2:
        assert time.monotonic() < deadline + 10 * TTL, "the deleted record never left"
        time.sleep(0.2)


def test_requests_waiting_on_a_frozen_decode_worker_go_elsewhere_once_it_leaves(pools):
    """A decode worker stops (SIGSTOP: a frozen process, a node cut off; its connections
    stay open, so calls to it wait, unanswered). Once the router finds it gone without an
    answer (within the registry's TTL), the requests still waiting for its first answer
    try the other worker: each is served in a few seconds, not when the frozen one wakes."""
    victim = pools.procs["decode-1"]
    victim.send_signal(signal.SIGSTOP)
    try:
        async def one(client, i):
            t0 = time.monotonic()
            r = await client.post(f"{pools.http}/v1/completions", json={"prompt": f"Frozen {i}", "max_tokens": 2})
            return r.status_code, time.monotonic() - t0, r.text

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                return await asyncio.gather(*(one(client, i) for i in range(4)))
        results = asyncio.run(run())
    finally:
        victim.send_signal(signal.SIGCONT)
    for status, seconds, text in results:
        assert status == 200, text
        assert seconds < 5 * TTL, results                  # the frozen one woke only after all of them
    wait_ready(pools.http, {"prefill": 2, "decode": 2})     # it announces itself again once it runs
    wait_pools_idle(pools, ("decode-0", "decode-1"))


def exit_code(proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> int:
    """`proc`'s exit code once it exits, with its log beside it when that is not 0; if it
    is still running after `timeout`, fails with its log and every thread's stack
    (SIGUSR1: services/common/lifecycle.py)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        proc.kill()
        proc.wait()
        pytest.fail(f"still running {timeout} s after SIGTERM:\n{log.read_text()[-12000:]}")
    if code != 0:
        print(f"exit code {code}; its log:\n{log.read_text()[-12000:]}")
    return code


def test_a_stopping_router_ends_its_streams_with_an_error_not_a_cut(pools):
    """SIGTERM to a router: a stream still running when its --drain-timeout (1 s here)
    is up ends with an error event and [DONE], never with the connection cut mid-body
    (uvicorn's own grace used to cancel it after 5 s, unsaid); the router then exits,
    cleanly though streams that clients left earlier had ended (their deadlines once
    broke the drain: "Cannot change state of finished Timeout")."""
    name = "router-draining"
    info = pools.spawn(name, *pools.router_argv("--drain-timeout", "1"))
    url = f"http://127.0.0.1:{info['http_port']}"
    wait_ready(url, {"prefill": 2, "decode": 2})
    body = {"prompt": "Tell me everything.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    for _ in range(4):                                  # streams their clients leave
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        stopped = time.monotonic()
        pools.procs[name].send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    took = time.monotonic() - stopped
    assert '"text"' in first and rest[-1] == "data: [DONE]", rest[-3:]
    assert "shutting down" in rest[-2] and '"error"' in rest[-2], rest[-2]
    assert took < 5, took
    assert exit_code(pools.procs.pop(name), pools.tmp / f"{name}.log") == 0
    assert "Traceback" not in (pools.tmp / f"{name}.log").read_text()
    wait_pools_idle(pools, ("decode-0", "decode-1"))
