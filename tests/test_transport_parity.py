"""The end-to-end parity bar holds with each KV transport selected explicitly: float32
greedy output through the cluster equals `model.generate`, with the prompts in flight
together, and the KV really crossed through the named backend. The tcp cluster runs
without a registry (the router is given the workers' addresses)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.processes import start_cluster, stop_cluster
from tests.parity_cases import CASES


# shm is what the session cluster uses (auto), where test_parity holds the same bar; NIXL
# carries the speculative cluster's KV (test_speculative_cluster.py: two prompts against
# generate by default), its transfers between processes and their failures are
# test_kv_transfer_nixl.py's, and tcp's are test_kv_transfer.py's: each backend's run
# here goes with the slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["shm", "tcp", "nixl"])
def test_parity_through_each_backend(model_dir, expected, backend):
    static = backend == "tcp"
    c = start_cluster("--kv-transport", backend, *(["--no-private-registry"] if static else []))
    try:
        assert (c.info["redis"] is None) == static
        before = c.stats("decode").kv_bytes_received

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(client.post(f"{c.http}/v1/chat/completions", json={
                    "messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0,
                    "return_token_ids": True, "stop": case.stop}) for case in CASES))

        for case, r in zip(CASES, asyncio.run(run())):
            assert r.status_code == 200, r.text
            route = dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))
            assert route["decision"] == "remote" and route["transport"] == backend
            assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
        stats = c.stats("decode")
        assert stats.prompt_tokens_computed == 0
        assert stats.kv_bytes_received > before
        assert list(stats.info.kv_transports) == [backend]
    finally:
        assert stop_cluster(c) == 0
