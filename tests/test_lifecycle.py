"""Blocks are never lost: finished, cancelled and disconnected requests all return
their KV blocks on both workers; the decode worker computes no prompt token of a
remotely prefilled request; the local cluster stops cleanly on Ctrl-C."""
from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import httpx
import pytest

from services.common.shm import live_segments
from services.local_processes import child_pids
from tests.processes import command_line, pid_alive, start_cluster, stop_cluster

STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name}{labels} missing from metrics"
    return float(m.group(1))


async def _one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    body = {"messages": [{"role": "user", "content": f"Request {i}: write about the number {i}."}],
            "max_tokens": rng.randint(4, 48), "temperature": rng.choice([0, 0.7]), "seed": i}
    mode = rng.choice(["finish", "finish_stream", "drop_early", "drop_mid", "drop_at_once"])
    if mode == "finish":
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return mode
    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        if mode == "drop_at_once":
            return mode
        keep = {"finish_stream": 10**9, "drop_early": 1, "drop_mid": rng.randint(2, 8)}[mode]
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data:")
            if n >= keep:
                break
    return mode


@pytest.mark.slow          # a disconnect mid-prefill below, by default
def test_random_disconnects_return_every_block(cluster):
    rng = random.Random(1234)

    async def run():
        sem = asyncio.Semaphore(6)
        async with httpx.AsyncClient(base_url=cluster.http, timeout=120) as client:
            async def guarded(i):
                async with sem:
                    return await _one(client, rng, i)
            return await asyncio.gather(*(guarded(i) for i in range(40)))

    modes = asyncio.run(run())
    assert {"drop_early", "drop_mid", "drop_at_once", "finish", "finish_stream"} <= set(modes)
    stats = cluster.wait_idle()
    assert stats.info.free_blocks == stats.info.num_blocks, "decode blocks leaked"
    assert stats.active_handoffs == 0
    prefill = cluster.stats("prefill")
    assert prefill.info.free_blocks == prefill.info.num_blocks, "prefill blocks leaked"
    assert httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60,
                      json={"messages": STORY, "max_tokens": 3}).status_code == 200


def test_disconnect_during_a_long_prefill_stops_it_and_releases_the_reservation(cluster):
    """A client gone while its prompt is prefilled: the prefill worker stops it (it
    computed the whole prompt, and the decode worker held its blocks until then, while
    the router counted the request gone: a client could occupy both at no cost)."""
    long_prompt = [{"role": "user", "content": "alpha beta gamma delta " * 1600}]   # ~6,400 tokens: seconds
    computed = cluster.stats("prefill").prompt_tokens_computed

    async def run():
        async with httpx.AsyncClient(base_url=cluster.http, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions",
                                     json={"messages": long_prompt, "max_tokens": 50, "stream": True}) as r:
                assert r.status_code == 200
                # the first line is the role chunk, sent before prefill finishes: leave now
                async for _ in r.aiter_lines():
                    break

    asyncio.run(run())
    stats = cluster.wait_idle(timeout=60)
    assert stats.info.free_blocks == stats.info.num_blocks and stats.active_handoffs == 0
    prefill = cluster.stats("prefill")
    assert prefill.info.waiting == 0 and prefill.prompt_tokens_computed - computed < 6000


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses"])
def test_a_client_that_stops_waiting_for_a_whole_answer_cancels_it(cluster, route):
    """Not streamed, the client times out (as the `openai` client does, then retries):
    its request ends on the workers at once, not ~80 s later after 2,000 tokens nobody
    reads, and the router's running count falls back."""
    # The Responses API has no ignore_eos: a schema of 500 numbers keeps it going.
    numbers = {"type": "json_schema", "name": "numbers",
               "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 500}}
    body = ({"messages": STORY, "max_tokens": 2000, "ignore_eos": True} if route != "/v1/responses" else
            {"input": "Count to 500.", "max_output_tokens": 2000, "text": {"format": numbers}})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{cluster.http}{route}", timeout=2.0, json=body)
    stats = cluster.wait_idle(timeout=10)
    assert stats.info.running == 0 and stats.info.free_blocks == stats.info.num_blocks, stats
    assert _metric(httpx.get(f"{cluster.http}/metrics").text, "pdserve_running_requests") == 0
    assert httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60,
                      json={"messages": STORY, "max_tokens": 3}).status_code == 200


def test_decode_worker_computes_no_prompt_tokens_and_kv_bytes_cross(cluster):
    """Deltas, not totals: the session cluster has served other tests' requests (n > 1
    choices compute their last prompt token on the decode worker)."""
    before = cluster.stats("decode")
    computed_before = _metric(httpx.get(cluster.metrics_url("decode")).text, "pdserve_prompt_tokens_computed_total")
    r = httpx.post(f"{cluster.http}/v1/chat/completions", timeout=60,
                   json={"messages": STORY, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    route = dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))
    assert route["decision"] == "remote" and route["transport"] == "shm" and int(route["kv_bytes"]) > 0
    after = cluster.stats("decode")
    prefill = cluster.stats("prefill")
    assert after.prompt_tokens_computed == before.prompt_tokens_computed
    assert after.kv_bytes_received - before.kv_bytes_received == int(route["kv_bytes"])
    assert prefill.prompt_tokens_computed > 0 and prefill.kv_bytes_sent >= after.kv_bytes_received

    decode_metrics = httpx.get(cluster.metrics_url("decode")).text
    assert _metric(decode_metrics, "pdserve_prompt_tokens_computed_total") == computed_before
    assert _metric(decode_metrics, "pdserve_kv_transfer_bytes_total", '{backend="shm",direction="received"}') > 0
    prefill_metrics = httpx.get(cluster.metrics_url("prefill")).text
    assert _metric(prefill_metrics, "pdserve_kv_transfer_bytes_total", '{backend="shm",direction="sent"}') > 0
    router_metrics = httpx.get(f"{cluster.http}/metrics").text
    assert _metric(router_metrics, "pdserve_disaggregation_decisions_total", '{decision="remote"}') > 0
    assert "pdserve_time_to_first_token_seconds_bucket" in router_metrics


@pytest.mark.slow          # test_api_features' n choices: the same seed again, the same draws
def test_same_seed_same_output(cluster):
    body = {"messages": STORY, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7,
            "return_token_ids": True}
    runs = [httpx.post(f"{cluster.http}/v1/chat/completions", json=body, timeout=60).json() for _ in range(2)]
    other = httpx.post(f"{cluster.http}/v1/chat/completions", json={**body, "seed": 8}, timeout=60).json()
    assert runs[0]["choices"][0]["token_ids"] == runs[1]["choices"][0]["token_ids"]
    assert runs[0]["choices"][0]["token_ids"] != other["choices"][0]["token_ids"]


def test_up_forks_its_workers_and_stops_every_process_on_ctrl_c_in_the_default_dtype(model_dir):
    """A separate cluster in the default dtype (auto: bfloat16 where the CPU computes it,
    float32 elsewhere). `up` forked each worker from its fork server and started the
    router (no torch in it) by exec: every one is `up`'s own child, under its own command
    line in `ps`. Each worker keeps to a core of its own where they fit (a host of two
    cores or more), with one torch thread, at `up`'s priority (--lend-decode-cores is
    test_modes'). It serves one request; after SIGINT nothing is left, the fork server
    included. Every KV transport is offered, as by default (auto). `up` is started as a
    user starts it, and holds no torch (it starts and watches the processes: torch would
    cost each start a second)."""
    c = start_cluster("--kv-transport", "auto", dtype="auto", pinned=True, by_exec=True)
    try:
        up, services = c.proc.pid, c.pids()[1:]
        forks = [k for k in child_pids(up) if command_line(k)[1:3] == ["-m", "services.forkserver"]]
        assert len(forks) == 1, "one fork server"
        assert set(services) | set(forks) == child_pids(up)
        for role, pid in (("router", c.info["router_pid"]), ("decode", c.info["decode"]["pid"]),
                          ("prefill", c.info["prefill"]["pid"])):
            titled = "\0" not in open(f"/proc/{pid}/cmdline").read().rstrip("\0")
            assert titled == (role != "router"), f"{role}: forked and titled, or the arguments of an exec"
            assert command_line(pid)[1:4] == ["-m", "services.cli", role]
        decode, prefill = c.info["decode"]["pid"], c.info["prefill"]["pid"]
        if len(os.sched_getaffinity(0)) >= 2:
            decode_cores, prefill_cores = os.sched_getaffinity(decode), os.sched_getaffinity(prefill)
            assert len(decode_cores) == len(prefill_cores) == 1 and decode_cores != prefill_cores
        assert "--threads=1" in command_line(prefill)
        assert "libtorch" not in open(f"/proc/{up}/maps").read() and "libtorch" in open(f"/proc/{decode}/maps").read()
        assert os.getpriority(os.PRIO_PROCESS, decode) == os.getpriority(os.PRIO_PROCESS, prefill) == \
            os.getpriority(os.PRIO_PROCESS, 0)
        r = httpx.post(f"{c.http}/v1/chat/completions", timeout=60, json={"messages": STORY, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        decode_pid = c.info["decode"]["pid"]
        assert live_segments(decode_pid), "decode pool should live in shared memory"
    finally:
        code = stop_cluster(c, signal.SIGINT)
    assert code == 0
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in c.pids() + forks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in c.pids() + forks)
    assert not live_segments(decode_pid)
    # The forked workers end without an interpreter teardown (forkserver.exit_code), which
    # had Triton's bindings list the objects they never freed on every stop.
    assert "nanobind" not in c.log_path.read_text(errors="replace")
