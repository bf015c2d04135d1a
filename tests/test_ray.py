"""`pdserve up --ray` on a real local Ray instance (started by `up`, loopback only): greedy
float32 parity through the actors, `pdserve scale` from a separate process adding a
decode actor that the router then uses, and removing it while requests run without
one failing, and a stop that leaves none of the processes Ray started.

The pure helpers (pool-size parsing, placement) are tested without Ray."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from services.ray_cluster import parse_counts, placement
from tests.processes import ROOT, worker_stats
from tests.parity_cases import CASES

START_TIMEOUT = 240
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (make test installs it)")


def route(r: httpx.Response) -> dict:
    return dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))


def test_parse_counts():
    assert parse_counts(["prefill=2", "decode=0"]) == {"prefill": 2, "decode": 0}
    for bad in ("router=1", "decode", "decode=-1", "decode=x"):
        with pytest.raises(ValueError):
            parse_counts([bad])


def test_placement_uses_gpus_and_role_resources_when_the_cluster_has_them():
    assert placement("decode", {"CPU": 2.0}) == {"num_cpus": 0}
    assert placement("decode", {"CPU": 8.0, "GPU": 4.0}) == {"num_cpus": 0, "num_gpus": 1}
    assert placement("prefill", {"CPU": 8.0, "prefill": 2.0, "decode": 2.0}) == {
        "num_cpus": 0, "resources": {"prefill": 1}}
    assert placement("prefill", {"CPU": 8.0, "GPU": 8.0}, gpus=4) == {"num_cpus": 0, "num_gpus": 4}


def test_each_pool_starts_workers_of_its_own_tensor_parallel_size():
    """`up --ray --prefill-tp 4 --decode-tp 2`: the pools' new workers take their own
    degree (and, on a GPU cluster, as many GPUs: above)."""
    from services.common.settings import ClusterSettings
    from services.ray_cluster import ROLES, RayPools

    class NoRay:
        remote = staticmethod(lambda cls: cls)
    s = ClusterSettings(prefill_tp=4, decode_tp=2)
    pools = RayPools(NoRay(), s.worker("decode"), tp={role: s.tp(role) for role in ROLES})
    assert pools._template_for("prefill").tensor_parallel_size == 4
    assert pools._template_for("decode").tensor_parallel_size == 2

    class PrefillOnly(NoRay):
        """A cluster whose decode pool is empty: settings are copied from a prefill worker."""
        from types import SimpleNamespace
        util = SimpleNamespace(list_named_actors=lambda all_namespaces: [{"name": "pdserve-prefill-0",
                                                                          "namespace": "pdserve"}])
        get_actor = staticmethod(lambda name, namespace: PrefillOnly.SimpleNamespace(
            worker_settings=PrefillOnly.SimpleNamespace(remote=lambda: s.worker("prefill"))))
        get = staticmethod(lambda ref, timeout: ref)
    copied = RayPools(PrefillOnly(), tp={role: s.tp(role) for role in ROLES})._template_for("decode")
    assert copied.role == "decode" and copied.tensor_parallel_size == 2


class RayUp:
    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-ray-test-"))
        announce, self.log = self.tmp / "up.json", self.tmp / "up.log"
        cmd = [sys.executable, "-m", "services.cli", "up", "--ray", "--http-port", "0", "--grpc-port", "0",
               "--dtype", "float32", "--kv-cache-tokens", "16384", "--local-prefill-max-tokens", "0",
               "--log-level", "warning", "--announce-file", str(announce)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while not announce.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up --ray failed to start:\n{self.tail()}")
            time.sleep(0.2)
        self.info = json.loads(announce.read_text())
        self.http = self.info["http"]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def scale(self, *counts: str) -> str:
        r = subprocess.run([sys.executable, "-m", "services.cli", "scale", *counts,
                            "--address", self.info["ray_address"]], cwd=ROOT, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def registered(self, role: str) -> int:
        import redis
        return len(redis.Redis.from_url(self.info["redis"]).keys(f"pdserve:worker:{role}:*"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="module")
def ray_up(model_dir):
    up = RayUp()
    yield up
    up.stop()
    shutil.rmtree(up.tmp, ignore_errors=True)


async def _burst(http: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(client.post(f"{http}/v1/completions", json={
            "prompt": f"Tell me about the number {i}.", "max_tokens": 8, "ignore_eos": True}) for i in range(n)))


def _decode_id(worker: dict) -> str:
    """How responses name a decode worker: by id (role-epoch), not by address."""
    return f"decode-{worker_stats(worker['address'], 'decode').info.epoch}"


@needs_redis
def test_actors_serve_with_greedy_parity(expected, ray_up):
    assert ray_up.info["ray_started"] and ray_up.info["ray_address"].startswith("127.0.0.1:")
    cases = [c for c in CASES if c.name in ("short", "multi_turn")]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{ray_up.http}/v1/chat/completions", json={
                "messages": c.messages, "max_tokens": c.max_tokens, "temperature": 0, "return_token_ids": True})
                for c in cases))

    for case, r in zip(cases, asyncio.run(run())):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
        assert route(r)["decision"] == "remote"
        assert route(r)["decode"] == _decode_id(ray_up.info["decodes"][0])


# Ray's one check by default is serving with parity; scaling it goes with the slow tests.
@pytest.mark.slow
@needs_redis
def test_scale_decode_out_and_back_in_without_failed_requests(ray_up):
    assert "decode 1 -> 2" in ray_up.scale("decode=2")
    assert ray_up.registered("decode") == 2
    seen = set()
    for _ in range(8):                             # the router's refresh sees the new worker within 1 s
        for r in asyncio.run(_burst(ray_up.http, 4)):
            assert r.status_code == 200, r.text
            seen.add(route(r)["decode"])
        if len(seen) == 2:
            break
    assert len(seen) == 2 and _decode_id(ray_up.info["decodes"][0]) in seen, seen

    codes, done = [], threading.Event()

    def traffic():
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                r = client.post(f"{ray_up.http}/v1/completions",
                                json={"prompt": "Count to twenty:", "max_tokens": 24, "ignore_eos": True})
                codes.append(r.status_code)

    threads = [threading.Thread(target=traffic) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        assert "decode 2 -> 1" in ray_up.scale("decode=1")
        time.sleep(1.0)
    finally:
        done.set()
        for t in threads:
            t.join(timeout=120)
    assert codes and set(codes) == {200}, codes
    assert ray_up.registered("decode") == 1
    after = [route(r)["decode"] for r in asyncio.run(_burst(ray_up.http, 3))]
    assert set(after) == {_decode_id(ray_up.info["decodes"][0])}


@pytest.mark.slow
@needs_redis
def test_a_worker_whose_process_dies_is_started_again_and_serves(ray_up):
    """A decode worker's actor process killed (SIGKILL: a crash, the OOM killer): Ray
    starts the actor again under its name, and the worker serves again, as `up`
    restarts a dead worker."""
    before = _decode_id(ray_up.info["decodes"][0])
    os.kill(ray_up.info["decodes"][0]["pid"], signal.SIGKILL)
    deadline, seen = time.monotonic() + 240, None
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{ray_up.http}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        except httpx.HTTPError:
            r = None
        if r is not None and r.status_code == 200:
            seen = route(r)["decode"]
            if seen != before:
                break
        time.sleep(1.0)
    assert seen is not None and seen != before, ray_up.tail()
    assert ray_up.registered("decode") == 1


@needs_redis
def test_stop_leaves_no_ray_process(ray_up):
    started = psutil.Process(ray_up.proc.pid).children(recursive=True)
    names = {p.name() for p in started}
    assert {"raylet", "gcs_server", "redis-server"} <= names, names
    assert ray_up.stop() == 0, ray_up.tail()
    _, alive = psutil.wait_procs(started, timeout=5)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert "still running after shutdown" not in ray_up.tail()
