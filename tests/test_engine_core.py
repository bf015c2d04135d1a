"""The engine core in one process, float32: every parity prompt added at once runs in
mixed steps (decode tokens and prompt chunks of several sequences in one forward pass),
and each sequence's greedy output is token for token `model.generate`'s, whatever the
token budget, the chunk size or the preemptions a small pool forces."""
from __future__ import annotations

import pytest
import torch

from services.engine.block_manager import BlockManager
from services.engine.block_pool import BlockPool
from services.engine.engine import LLMEngine
from services.engine.kv_cache import KVPoolMemory
from services.engine.runner import ModelRunner
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from services.engine.tokenizer import eos_token_ids
from tests.parity_cases import CASES

BLOCK = 16


@pytest.fixture(scope="module")
def runner(model_dir):
    torch.set_num_threads(2)
    return ModelRunner(model_dir, "float32", "cpu")


def run_all(runner, model_dir, expected, config: SchedulerConfig, num_blocks: int, prefix_caching=False):
    blocks = BlockManager(BlockPool(num_blocks, BLOCK), prefix_caching=prefix_caching)
    memory = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, config))
    eos = eos_token_ids(model_dir)
    out: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for case in CASES:
        prompt = expected[case.name].prompt_ids
        n = len(expected[case.name].token_ids) if case.stop else case.max_tokens
        engine.add(Sequence(case.name, list(prompt), len(prompt), SamplingParams(max_tokens=n, temperature=0), eos))
        out[case.name] = []
    mixed = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        s = engine.last_step
        mixed += bool(s and s.prefill_tokens and s.decode_tokens)
    memory.close()
    assert blocks.num_available == num_blocks            # every block came back
    return out, finished, mixed, engine


def test_mixed_steps_match_generate(runner, model_dir, expected):
    out, finished, mixed, _ = run_all(runner, model_dir, expected,
                                      SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256), 512)
    for case in CASES:
        assert out[case.name] == expected[case.name].token_ids, case.name
        assert finished[case.name] in ("stop", "length")
    assert mixed > 0                                      # decode tokens shared passes with prompt chunks


def test_small_chunks_and_preemption_still_match_generate(runner, model_dir, expected):
    longest = max(len(e.prompt_ids) + len(e.token_ids) for e in expected.values())
    blocks = -(-longest // BLOCK) + 4                     # barely more than the longest sequence
    out, _, _, engine = run_all(runner, model_dir, expected,
                                SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64, max_prefill_chunk=48),
                                blocks, prefix_caching=True)
    for case in CASES:
        assert out[case.name] == expected[case.name].token_ids, case.name
    assert engine.scheduler.num_preemptions > 0


def test_a_sequence_that_breaks_the_forward_pass_fails_alone(runner, model_dir, expected):
    """An id past the embedding table (what a caller that skips the worker's checks
    could send) makes the batch's forward pass raise: the engine runs the step again
    one sequence at a time, fails only that one, and the others' output is unchanged."""
    blocks = BlockManager(BlockPool(256, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(256, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512)))
    eos = eos_token_ids(model_dir)
    good = [c for c in CASES if not c.stop][:2]
    for case in good:
        prompt = expected[case.name].prompt_ids
        engine.add(Sequence(case.name, list(prompt), len(prompt), SamplingParams(max_tokens=case.max_tokens,
                                                                                  temperature=0), eos))
    poison = [5, 6, runner.vocab_size + 5, 7]
    engine.add(Sequence("poison", poison, len(poison), SamplingParams(max_tokens=4, temperature=0), eos))
    out, finished = {c.name: [] for c in good}, {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
    memory.close()
    assert finished["poison"] == "error" and out["poison"] == []
    for case in good:
        assert out[case.name] == expected[case.name].token_ids, case.name
    assert blocks.num_available == 256
