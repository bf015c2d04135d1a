"""Aggregated mode: decode workers that prefill every prompt themselves, in chunks
interleaved with decoding, and the same float32 greedy parity with `model.generate`."""
from __future__ import annotations

import asyncio

import httpx

from services.local_cluster import plan_cpus
from tests.conftest import start_cluster, stop_cluster
from tests.parity_cases import CASES


def test_disaggregated_workers_get_a_core_each_when_they_fit():
    assert plan_cpus(["decode", "prefill"], [0, 1]) == [{0}, {1}]
    assert plan_cpus(["decode", "decode", "prefill"], [0, 1]) == [None, None, None]


def test_aggregated_chunked_prefill_matches_generate(model_dir, expected):
    c = start_cluster("--mode", "aggregated", "--decode", "1", "--prefill-chunk-tokens", "64")
    try:
        assert c.info["prefills"] == [] and len(c.info["decodes"]) == 1

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(client.post(f"{c.http}/v1/chat/completions", json={
                    "messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0,
                    "return_token_ids": True, **({"stop": case.stop} if case.stop else {})}) for case in CASES))

        for case, r in zip(CASES, asyncio.run(run())):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
            assert "decision=local" in r.headers["x-pdserve-route"]
        s = c.stats("decode")
        assert s.prompt_tokens_computed >= sum(len(expected[case.name].prompt_ids) for case in CASES)
        assert c.wait_idle().info.free_blocks == s.info.num_blocks
    finally:
        stop_cluster(c)


def test_aggregated_on_cpu_runs_a_single_threaded_worker_per_core():
    from services.common.settings import ClusterSettings
    from services.local_cluster import LocalCluster
    agg = LocalCluster(ClusterSettings(mode="aggregated", device="cpu"))
    assert agg._default_decode_workers(2) == 2 and agg._default_decode_workers(8) == 8
    assert LocalCluster(ClusterSettings(device="cpu"))._default_decode_workers(8) == 1
