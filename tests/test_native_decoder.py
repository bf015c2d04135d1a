"""Decode steps' decoder layers in one native call (services/engine/kernels/native/decoder.c):
on the real model in bfloat16, a decode step through it gives the same logits and
writes the same KV bytes, bit for bit, as the layers' own forward calls one by one;
small prompt chunks go through it as decode rows; and it is used only where every layer
already runs in the native kernels."""
from __future__ import annotations

import pytest
import torch

from services.engine.model.hardware import cpu_flags, cpu_kind
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.engine import PAUSABLE_ONE_CALL_TOKENS, one_call_tokens
from services.engine.model.runner import (DECODER_PROMPT_TOKENS, ONE_CALL_PROMPT_TOKENS, ForwardBatch, ModelRunner,
                                          PrefillSegment, as_decode_rows)

BLOCK = 16
# The engine builds the one-call decoder where pdserve's bf16 matmuls run: AVX512-BF16
# (on AMX tiles where the CPU has them, which are then tested here for real).
HAS_BF16 = "avx512_bf16" in cpu_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason=f"the one-call decoder runs pdserve's bf16 matmuls "
                                                     f"(AVX512-BF16); this CPU is {cpu_kind()}")


@pytest.fixture(scope="module")
def runner(model_dir, kernel_cache):
    # ours asked for: a start-up measurement (kernel_choice.py) must not take it away
    return ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=kernel_cache,
                       matmul="native" if HAS_BF16 else "auto")


def _step(runner, pool, batch: ForwardBatch, one_call: bool) -> tuple[torch.Tensor, torch.Tensor]:
    decoder = runner.decoder
    if not one_call:
        runner.decoder = None
    try:
        return runner.execute(pool, batch), pool.tensor.clone()
    finally:
        runner.decoder = decoder


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("positions", [[0], [5, 17, 330, 31, 64, 100, 1, 16], [47] * 20])
def test_one_call_is_bit_for_bit_the_layer_by_layer_step(runner, threads, positions):
    assert runner.decoder is not None
    gen = torch.Generator().manual_seed(len(positions))
    widths = [p // BLOCK + 1 for p in positions]
    num_blocks = sum(widths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()          # scattered blocks
    tables = [order[sum(widths[:i]):sum(widths[:i + 1])] for i in range(len(widths))]
    tokens = torch.randint(100, 10000, (len(positions),), generator=gen).tolist()
    # every row sampled but the second; the first also asks for its logprobs' row again
    sample = [r for r in range(len(positions)) if r != 1]
    batch = ForwardBatch(decode_tokens=tokens, decode_positions=positions, decode_tables=tables,
                         sample_rows=sample, logprob_rows=[0])
    pool = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool.tensor.normal_(generator=gen)
        start = pool.tensor.clone()
        logits, kv = _step(runner, pool, batch, one_call=True)
        pool.tensor.copy_(start)
        ref_logits, ref_kv = _step(runner, pool, batch, one_call=False)
    finally:
        torch.set_num_threads(threads_before)
        pool.close()
    assert logits.shape == (len(sample) + 1, runner.vocab_size)
    assert torch.equal(logits, ref_logits)
    assert torch.equal(kv, ref_kv) and not torch.equal(kv, start)


@needs_bf16
def test_tokens_still_on_the_device_feed_the_one_call_step(runner):
    """Async scheduling hands a step some rows' tokens as the step before's output
    tensor: the one-call step takes them from there, the same bits as inline."""
    positions, tables, tokens = [9, 40, 3], [[0], [1, 2, 3], [4]], [311, 4242, 77]
    pending = ForwardBatch(decode_tokens=[0, 4242, 0], decode_positions=positions, decode_tables=tables,
                           sample_rows=[0, 1, 2], pending_rows=[0, 2], pending_sources=[1, 0],
                           pending_tokens=torch.tensor([77, 311]))
    inline = ForwardBatch(decode_tokens=tokens, decode_positions=positions, decode_tables=tables,
                          sample_rows=[0, 1, 2])
    pool = KVPoolMemory.allocate(runner.layout(6, BLOCK))
    try:
        start = pool.tensor.normal_(generator=torch.Generator().manual_seed(1)).clone()
        got, got_kv = _step(runner, pool, pending, one_call=True)
        pool.tensor.copy_(start)
        want, want_kv = _step(runner, pool, inline, one_call=True)
    finally:
        pool.close()
    assert torch.equal(got, want) and torch.equal(got_kv, want_kv)


@needs_bf16
def test_small_prompt_chunks_run_in_the_one_call_as_decode_rows(runner):
    """A step whose prompt chunks hold at most DECODER_PROMPT_TOKENS tokens runs whole in
    the one call, each prompt token a decode row at its position over its sequence's
    blocks: bit for bit the layer-by-layer step of those rows, and within bfloat16's
    rounding of the prefill kernels' pass, with its greedy tokens. A layer hook (the
    prefill worker's KV push) hears of every layer, in order, once the call returns. A
    step of more prompt tokens keeps the prefill kernels, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    decode_pos, prefix = [12, 70, 33], 40
    # blocks: the decode rows' 1, 5 and 3, then a chunk after a computed prefix, then one from 0
    tables = [[0], [1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16, 17]]
    prompt_a = torch.randint(100, 10000, (prefix + 10,), generator=gen).tolist()
    prompt_b = torch.randint(100, 10000, (70,), generator=gen).tolist()
    decode = dict(decode_tokens=[311, 4242, 77], decode_positions=decode_pos, decode_tables=tables[:3])

    def step(b_tokens: int) -> ForwardBatch:
        return ForwardBatch(**decode, prefill_tokens=prompt_a[prefix:] + prompt_b[:b_tokens],
                            segments=[PrefillSegment(prefix, 10, tables[3]), PrefillSegment(0, b_tokens, tables[4])],
                            sample_rows=[0, 2, 12, 12 + b_tokens], logprob_rows=[5, 14])

    pool = KVPoolMemory.allocate(runner.layout(18, BLOCK))
    try:
        pool.tensor.normal_(std=0.5, generator=gen)
        runner.prefill(pool, prompt_a[:prefix], tables[3])          # the chunk's cached prefix, computed
        start = pool.tensor.clone()
        for b_tokens, one_call in ((16, True), (DECODER_PROMPT_TOKENS - 9, False)):
            batch = step(b_tokens)
            assert (len(batch.prefill_tokens) <= DECODER_PROMPT_TOKENS) is one_call
            heard = []
            pool.tensor.copy_(start)
            got = runner.execute(pool, batch, lambda layer, fence: heard.append(layer) or fence.wait())
            got_kv = pool.tensor.clone()
            pool.tensor.copy_(start)
            rows, rows_kv = _step(runner, pool, as_decode_rows(batch), one_call=False)
            pool.tensor.copy_(start)
            chunks, chunks_kv = _step(runner, pool, batch, one_call=False)
            assert heard == list(range(runner.num_layers))
            if one_call:
                assert torch.equal(got, rows) and torch.equal(got_kv, rows_kv)
                torch.testing.assert_close(got, chunks, atol=1.0, rtol=0)
                torch.testing.assert_close(got_kv, chunks_kv, atol=0.25, rtol=0.05)
                assert torch.equal(got[2:].argmax(-1), chunks[2:].argmax(-1))      # the prompts' rows
            else:
                assert torch.equal(got, chunks) and torch.equal(got_kv, chunks_kv)
    finally:
        pool.close()


@needs_bf16
def test_a_whole_prompt_runs_in_the_one_call_where_no_layer_is_handed_on(runner):
    """Without a layer hook (a decode worker's own prompts) the engine lets up to
    ONE_CALL_PROMPT_TOKENS prompt tokens into the one call; with one (a prefill worker's
    push), DECODER_PROMPT_TOKENS; in a pass that yields, PAUSABLE_ONE_CALL_TOKENS. A
    200-token prompt after a 40-token cached prefix, beside two decode rows, in one call:
    bit for bit its tokens as decode rows layer by layer, and within bfloat16's rounding
    of the prefill kernels' pass, with the same greedy tokens."""
    assert one_call_tokens(pausing=False, hooked=False) == ONE_CALL_PROMPT_TOKENS
    assert one_call_tokens(pausing=False, hooked=True) == DECODER_PROMPT_TOKENS < ONE_CALL_PROMPT_TOKENS
    assert one_call_tokens(pausing=True, hooked=False) == PAUSABLE_ONE_CALL_TOKENS
    gen = torch.Generator().manual_seed(11)
    prefix, tokens = 40, 200
    tables = [[0, 1], [2], list(range(3, 3 + -(-(prefix + tokens) // BLOCK)))]
    prompt = torch.randint(100, 10000, (prefix + tokens,), generator=gen).tolist()
    batch = ForwardBatch(decode_tokens=[311, 4242], decode_positions=[20, 9], decode_tables=tables[:2],
                         prefill_tokens=prompt[prefix:], segments=[PrefillSegment(prefix, tokens, tables[2])],
                         sample_rows=[0, 1, 2 + tokens - 1], logprob_rows=[2, 100])
    pool = KVPoolMemory.allocate(runner.layout(3 + len(tables[2]), BLOCK))
    try:
        pool.tensor.normal_(std=0.5, generator=gen)
        runner.prefill(pool, prompt[:prefix], tables[2])
        start = pool.tensor.clone()
        got = runner.execute(pool, batch, None, ONE_CALL_PROMPT_TOKENS)
        got_kv = pool.tensor.clone()
        pool.tensor.copy_(start)
        rows, rows_kv = _step(runner, pool, as_decode_rows(batch), one_call=False)
        pool.tensor.copy_(start)
        chunks, chunks_kv = _step(runner, pool, batch, one_call=False)
        assert torch.equal(got, rows) and torch.equal(got_kv, rows_kv)
        torch.testing.assert_close(got, chunks, atol=1.0, rtol=0)
        torch.testing.assert_close(got_kv, chunks_kv, atol=0.25, rtol=0.05)
        assert torch.equal(got.argmax(-1), chunks.argmax(-1))
    finally:
        pool.close()


@needs_bf16
def test_a_block_outside_the_pool_is_refused_before_the_kernels(runner):
    pool = KVPoolMemory.allocate(runner.layout(4, BLOCK))
    try:
        with pytest.raises(ValueError, match="block ids"):
            runner.decode(pool, [100], [3], [[7]])
    finally:
        pool.close()


def test_used_only_where_every_layer_runs_natively(model_dir, kernel_cache):
    """float32 keeps torch's ops for exact parity, `--attention-kernel torch` keeps
    torch's everywhere, and int8 layers run their own matmuls: no one-call decoder in any."""
    assert ModelRunner(model_dir, "float32", "cpu", kernel_cache=kernel_cache).decoder is None
    assert ModelRunner(model_dir, "bfloat16", "cpu", attention="torch", kernel_cache=kernel_cache).decoder is None
    assert ModelRunner(model_dir, "bfloat16", "cpu", quantization="int8", kernel_cache=kernel_cache).decoder is None
