"""Decode steps' decoder layers in one native call (services/engine/kernels/native/decoder.c):
on the real model in bfloat16, a decode step through it gives the same logits and
writes the same KV bytes, bit for bit, as the layers' own forward calls one by one;
and it is used only where every layer already runs in the native kernels."""
from __future__ import annotations

import pytest
import torch

from services.engine.model.hardware import cpu_kernels, cpu_kind
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ForwardBatch, ModelRunner

BLOCK = 16
# The engine's own rule (hardware.CpuKernels), not a copy of it.
needs_bf16 = pytest.mark.skipif(not cpu_kernels().one_call_decoder,
                                reason=f"the engine builds the one-call decoder where its bf16 matmuls run "
                                       f"(AVX512-BF16 without AMX); this CPU is {cpu_kind()}")


@pytest.fixture(scope="module")
def runner(model_dir, kernel_cache):
    # ours asked for: a start-up measurement (kernel_choice.py) must not take it away
    return ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=kernel_cache,
                       matmul="native" if cpu_kernels().one_call_decoder else "auto")


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
