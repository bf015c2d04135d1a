"""Soak: a few hundred requests with random cancellations and one worker restart in
the middle. Afterwards no KV block is held on either side, no handoff is live, no
socket or file descriptor has leaked, and no shared-memory segment is left.
Two minutes on a two-core machine, so it runs with `make test-slow`, not in CI's default."""
from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from services.common.shm import live_segments
from tests.processes import Services, pid_alive

REQUESTS = 200
CONCURRENCY = 8


def fd_count(pid: int) -> tuple[int, int]:
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = sum(os.readlink(f"/proc/{pid}/fd/{f}").startswith("socket:") for f in fds
                  if os.path.exists(f"/proc/{pid}/fd/{f}"))
    return len(fds), sockets


async def one(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    body = {"messages": [{"role": "user", "content": f"Note {i}: " + "tell me something. " * rng.randint(1, 60)}],
            "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "seed": i}
    mode = rng.choice(["full", "stream", "cancel"])
    try:
        if mode == "full":
            r = await client.post("/v1/chat/completions", json=body)
            return f"full:{r.status_code}"
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            keep = 10**9 if mode == "stream" else rng.randint(0, 6)
            n = 0
            async for line in r.aiter_lines():
                n += line.startswith("data:")
                if n > keep:
                    break
            return f"{mode}:{r.status_code}"
    except httpx.HTTPError as exc:
        return f"{mode}:{type(exc).__name__}"


@pytest.mark.slow
def test_soak_with_cancellations_and_a_worker_restart(model_dir):
    svc = Services(dtype="bfloat16").start_all()
    try:
        decode_pid = svc.info["decode"]["pid"]
        httpx.post(f"{svc.http}/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=60)
        base_fds, base_socks = fd_count(decode_pid)
        rng = random.Random(99)
        restarted = asyncio.Event()

        async def run():
            sem = asyncio.Semaphore(CONCURRENCY)
            async with httpx.AsyncClient(base_url=svc.http, timeout=120) as client:
                async def guarded(i):
                    async with sem:
                        if i == REQUESTS // 2 and not restarted.is_set():
                            restarted.set()
                            await asyncio.to_thread(svc.kill, "prefill")
                            await asyncio.to_thread(svc.start_worker, "prefill")
                        return await one(client, rng, i)
                return await asyncio.gather(*(guarded(i) for i in range(REQUESTS)))

        t0 = time.monotonic()
        outcomes = asyncio.run(run())
        assert time.monotonic() - t0 < 600
        assert restarted.is_set()
        assert all(o.endswith(":200") for o in outcomes), sorted(set(outcomes))
        stats = svc.wait_idle(timeout=60)
        assert stats.info.free_blocks == stats.info.num_blocks, "decode blocks held after the soak"
        assert stats.active_handoffs == 0
        prefill = svc.stats("prefill")
        assert prefill.info.free_blocks == prefill.info.num_blocks
        fds, socks = fd_count(decode_pid)
        assert socks <= base_socks + 2 and fds <= base_fds + 4, (base_fds, base_socks, fds, socks)
    finally:
        svc.stop()
    deadline = time.monotonic() + 10
    while pid_alive(decode_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not live_segments(decode_pid)
