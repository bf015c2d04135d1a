"""Aggregated mode: decode workers that prefill every prompt themselves, in chunks
interleaved with decoding, and the same float32 greedy parity with `model.generate`."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.local_processes import plan_cpus
from tests.processes import command_line, start_cluster, stop_cluster
from tests.parity_cases import CASES, chat_body


def test_disaggregated_workers_get_a_core_each_when_they_fit():
    assert plan_cpus(["decode", "prefill"], [0, 1]) == [{0}, {1}]
    assert plan_cpus(["decode", "decode", "prefill"], [0, 1]) == [None, None, None]


def test_prefill_workers_may_also_run_on_the_decode_cores():
    """Lent: a prefill worker's own core plus decode cores, dealt round robin; decode
    workers keep exactly their own core."""
    assert plan_cpus(["decode", "prefill"], [0, 1], lend=True) == [{0}, {0, 1}]
    assert plan_cpus(["decode", "decode", "prefill"], [4, 5, 6], lend=True) == [{4}, {5}, {4, 5, 6}]
    assert plan_cpus(["decode", "decode", "prefill", "prefill"], [0, 1, 2, 3], lend=True) == [
        {0}, {1}, {0, 2}, {1, 3}]
    assert plan_cpus(["decode", "decode"], [0, 1], lend=True) == [{0}, {1}]          # aggregated: nothing to lend
    assert plan_cpus(["decode", "decode", "prefill"], [0, 1], lend=True) == [None, None, None]


# Asked again one at a time, from the prefix cache: under make test-slow (prefix hits
# are test_pools' and test_api_extras' by default).
@pytest.mark.parametrize("again", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["once", "again"])
def test_aggregated_chunked_prefill_with_async_scheduling_matches_generate(model_dir, expected, again):
    """One aggregated worker, prompts in 16-token chunks beside the decodes, each step
    launched before the last one's tokens are read (on a CPU only when asked): every
    output is generate's, token for token, and every block comes back. The parity cases
    but the long one (test_parity's), whose float32 prompt would be most of the time."""
    cases = [case for case in CASES if case.name != "long"]
    c = start_cluster("--mode", "aggregated", "--decode", "1", "--prefill-chunk-tokens", "16",
                      "--async-scheduling", "on")
    try:
        assert c.info["prefills"] == [] and len(c.info["decodes"]) == 1

        async def run():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(client.post(f"{c.http}/v1/chat/completions", json=chat_body(case))
                                              for case in cases))

        hits = 0                # prompts admitted while others ran may share their template's blocks
        for case, r in zip(cases, asyncio.run(run())):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
            assert "decision=local" in r.headers["x-pdserve-route"]
            hits += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        s = c.stats("decode")
        assert s.prompt_tokens_computed + hits >= sum(len(expected[case.name].prompt_ids) for case in cases)
        assert c.wait_idle().info.free_blocks == s.info.num_blocks
        if not again:
            return

        # Again, one at a time (three of them): every full block but the last token's is
        # the prefix cache's now, and the output still matches generate's, token for token.
        again, asked = 0, [case for case in cases if case.name in ("non_ascii", "multi_turn", "stop_string")]
        for case in asked:
            r = httpx.post(f"{c.http}/v1/chat/completions", timeout=300, json=chat_body(case))
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
            cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == (len(expected[case.name].prompt_ids) - 1) // 16 * 16, case.name
            again += cached
        metrics = {s.name: s.value for f in text_string_to_metric_families(httpx.get(c.metrics_url("decode")).text)
                   for s in f.samples}
        assert metrics["vllm:prefix_cache_hits_total"] == hits + again
        assert metrics["vllm:prefix_cache_queries_total"] == sum(
            len(expected[case.name].prompt_ids) for case in [*cases, *asked])
        assert c.stats("decode").prompt_tokens_computed < s.prompt_tokens_computed + again
        assert c.wait_idle().info.free_blocks == s.info.num_blocks      # cached blocks count as free
    finally:
        stop_cluster(c)


@pytest.mark.slow          # prefix routing is test_pools'; aggregated mode's check is the parity above
def test_aggregated_conversation_returns_to_the_worker_holding_its_prefix(model_dir):
    """Two aggregated workers: a conversation's next turn goes where its earlier turns
    are cached (round robin would send it to the idle other one), and reuses them."""
    c = start_cluster("--mode", "aggregated", "--decode", "2", "--threads", "1")
    try:
        client = openai.OpenAI(base_url=f"{c.http}/v1", api_key="none", max_retries=0)
        messages = [{"role": "system", "content": "You answer in one short sentence. " * 8},
                    {"role": "user", "content": "Name a large river in Africa."}]
        workers = []
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8, temperature=0)
            reply = raw.parse()
            workers.append(dict(p.split("=", 1) for p in raw.headers["x-pdserve-route"].split(";"))["decode"])
            if turn:
                assert reply.usage.prompt_tokens_details.cached_tokens >= previous_prompt // 16 * 16, turn
            previous_prompt = reply.usage.prompt_tokens
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"And another one, number {turn + 2}?"}]
        assert len(set(workers)) == 1, workers
    finally:
        stop_cluster(c)


def test_aggregated_on_cpu_runs_a_single_threaded_worker_per_core():
    from services.common.settings import ClusterSettings
    from services.local_cluster import LocalCluster
    agg = LocalCluster(ClusterSettings(mode="aggregated", device="cpu"))
    assert agg._default_decode_workers(2) == 2 and agg._default_decode_workers(8) == 8
    assert LocalCluster(ClusterSettings(device="cpu"))._default_decode_workers(8) == 1


def test_aggregated_on_cpu_takes_short_prompts_whole_and_long_ones_in_chunks_unless_told():
    """An aggregated decode worker on a CPU takes a prompt of up to the token budget
    whole into a step that decodes and a longer one 64 tokens a step; disaggregated ones
    keep the CPU's 64 and nothing whole, and what the user gives is kept as given."""
    from services.common.settings import ClusterSettings
    from services.local_cluster import LocalCluster
    from services.common.budgets import DECODE_TOKEN_BUDGET, MIXED_PREFILL_AGGREGATED_CPU, MIXED_PREFILL_CPU
    from services.worker.main import scheduler_config

    def decode_config(**kw):
        settings = LocalCluster(ClusterSettings(device="cpu", **kw))._worker_settings("decode", None, None)
        return scheduler_config(settings, "cpu")

    aggregated = decode_config(mode="aggregated")
    assert aggregated.max_mixed_prefill == MIXED_PREFILL_AGGREGATED_CPU == 64
    assert aggregated.mixed_whole_prompt == aggregated.max_num_batched_tokens == DECODE_TOKEN_BUDGET
    assert decode_config(mode="aggregated", max_num_batched_tokens=256).mixed_whole_prompt == 256
    disaggregated = decode_config()
    assert (disaggregated.max_mixed_prefill, disaggregated.mixed_whole_prompt) == (MIXED_PREFILL_CPU, 0)
    told = decode_config(mode="aggregated", mixed_prefill_tokens=96, mixed_whole_prompt_tokens=0)
    assert (told.max_mixed_prefill, told.mixed_whole_prompt) == (96, 0)
    prefill = LocalCluster(ClusterSettings(mode="aggregated", device="cpu"))._worker_settings("prefill", None, None)
    assert prefill.mixed_prefill_tokens == -1 and scheduler_config(prefill, "cpu").mixed_whole_prompt == 0


@pytest.mark.slow
def test_the_prefill_worker_runs_on_the_decode_core_when_lent():
    """`up --lend-decode-cores` on a host with a core per worker: the decode worker is
    pinned to its core alone; the prefill worker to its own and the decode worker's,
    with a torch thread for each, and at a lower priority, so decode has its core first
    (read from the live processes), which runs its small passes on its own core's thread
    alone."""
    import os
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the workers are not pinned")
    c = start_cluster("--lend-decode-cores", pinned=True)
    try:
        decode, prefill = c.info["decode"]["pid"], c.info["prefill"]["pid"]
        decode_cores, prefill_cores = os.sched_getaffinity(decode), os.sched_getaffinity(prefill)
        assert len(decode_cores) == 1 and len(prefill_cores) == 2 and decode_cores < prefill_cores
        assert "--threads=2" in command_line(prefill)
        from services.local_processes import LENT_CORE_NICE
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, decode) == ours
        assert os.getpriority(os.PRIO_PROCESS, prefill) == min(19, ours + LENT_CORE_NICE)
        assert "--own-threads=1" in command_line(prefill), "its small passes must run on its own core's thread alone"
    finally:
        stop_cluster(c)
