"""The native attention kernels (services/engine/kernels/native), built here with the machine's
C compiler. Decode: its output against a float64 reference over scattered blocks, in
float32 and bfloat16, for several head layouts and thread counts. Prefill (bfloat16,
AVX512-BF16): causal attention against a float64 reference, with and without a cached
prefix. Their refusals; the engine's fallback to the torch path where no compiler
exists; and the real model's decode step and prefill through both paths."""
import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.engine.model.kv_cache import KVPoolMemory
from services.engine.kernels import native
from services.engine.kernels.native import library
from services.engine.model.runner import ModelRunner


@pytest.fixture(scope="module")
def kernel(kernel_cache):
    return native.load_attention(kernel_cache)


def reference(q, cache, table, lens, scale):
    """softmax(q k^T * scale) v per sequence and head, in float64, from a gather."""
    batch, q_heads, dim = q.shape
    kv_heads = cache.shape[3]
    out = torch.zeros(batch, q_heads, dim, dtype=torch.float64)
    for b in range(batch):
        n = int(lens[b])
        k = cache[0][table[b]].reshape(-1, kv_heads, dim)[:n].double()
        v = cache[1][table[b]].reshape(-1, kv_heads, dim)[:n].double()
        for head in range(q_heads):
            kv_head = head // (q_heads // kv_heads)
            p = torch.softmax(k[:, kv_head] @ q[b, head].double() * scale, 0)
            out[b, head] = p @ v[:, kv_head]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (4, 1, 48), (6, 2, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_float64_reference(kernel, dtype, tol, q_heads, kv_heads, dim, threads):
    torch.manual_seed(q_heads * 1000 + dim)
    block_size, width = 16, 20
    lens = torch.tensor([1, 16, 17, 200, 320, 45], dtype=torch.int32)
    blocks = len(lens) * width + 7
    cache = torch.randn(2, blocks, block_size, kv_heads, dim).to(dtype)
    table = torch.randperm(blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    q = torch.randn(len(lens), q_heads, dim).to(dtype)
    scale = dim ** -0.5
    out = kernel.decode(q, cache, table, lens, scale, threads)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), reference(q, cache, table, lens, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,threads", [(9, 3, 64, 1), (9, 3, 64, 2), (8, 8, 128, 1),
                                                          (32, 4, 64, 1)])
def test_rows_of_one_sequence_attend_as_a_group_with_each_rows_own_result(kernel, dtype, q_heads, kv_heads, dim,
                                                                         threads):
    """Rows at consecutive positions of one sequence over the same blocks (a verified
    draft's, a short prompt chunk's) are scored from one pass over their keys. Each row's
    output is bit for bit what it gets alone in a call of its own, and matches the
    float64 reference: 20 rows of one sequence (more than one group), then a row one
    longer whose table differs from theirs only in the block the row before it ends in,
    then a row of another sequence with the next length. With two threads the rows are
    split between them inside a group."""
    torch.manual_seed(q_heads + dim)
    block_size, width = 16, 10
    cache = torch.randn(2, 40, block_size, kv_heads, dim).to(dtype)
    seq = torch.randperm(40)[:width]
    other = torch.randperm(40)[:width]
    forked = seq.clone()
    forked[7] = int(other[7]) if int(other[7]) != int(seq[7]) else int(other[8])
    table = torch.stack([seq] * 20 + [forked, other]).contiguous()
    lens = torch.tensor(list(range(100, 120)) + [120, 121], dtype=torch.int32)
    q = torch.randn(len(lens), q_heads, dim).to(dtype)
    scale = dim ** -0.5
    together = kernel.decode(q, cache, table, lens, scale, threads)
    for row in range(len(lens)):
        alone = kernel.decode(q[row:row + 1], cache, table[row:row + 1], lens[row:row + 1], scale)
        assert torch.equal(together[row], alone[0]), row
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(together.double(), reference(q, cache, table, lens, scale), atol=tol, rtol=tol)


def test_kernel_reads_only_the_blocks_it_is_given(kernel):
    """Blocks outside a row's table, and slots past its length, do not change its output."""
    torch.manual_seed(1)
    cache = torch.randn(2, 12, 16, 3, 64)
    table = torch.tensor([[3, 7, 0], [5, 1, 0]])
    lens = torch.tensor([20, 9], dtype=torch.int32)
    q = torch.randn(2, 9, 64)
    before = kernel.decode(q, cache, table, lens, 0.125)
    cache[:, [0, 2, 4, 6, 8, 9, 10, 11]] = float("nan")
    cache[:, 7, 4:] = float("nan")                  # row 0 uses 4 slots of its second block
    cache[:, 5, 9:] = float("nan")
    assert torch.equal(kernel.decode(q, cache, table, lens, 0.125), before)


def test_kernel_refuses_what_it_cannot_run(kernel):
    cache = torch.randn(2, 4, 16, 3, 64)
    table = torch.zeros(1, 1, dtype=torch.long)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="refused"):
        kernel.decode(torch.randn(1, 8, 64), cache, table, lens, 0.125)          # 8 query heads over 3 KV heads
    with pytest.raises(ValueError, match="dtype"):
        kernel.decode(torch.randn(1, 9, 64).bfloat16(), cache, table, lens, 0.125)
    with pytest.raises(ValueError, match="block table"):
        kernel.decode(torch.randn(1, 9, 64), cache, table.int(), lens, 0.125)
    with pytest.raises(ValueError, match="block table"):
        kernel.decode(torch.randn(1, 9, 64), cache, table, lens.long(), 0.125)


def test_a_build_is_made_once_kept_and_waited_for(tmp_path, monkeypatch):
    """A build is named by its source (and headers, flags, compiler and CPU): asked
    again, the file built first is loaded; four callers at once (the workers of a fresh
    machine starting together) compile it once, the others waiting for that build; a
    changed source builds anew; no temporary file is left."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    source = tmp_path / "src" / "tiny.c"
    source.parent.mkdir()
    source.write_text("int pdserve_tiny(int x) { return x + 1; }\n")
    out = tmp_path / "kernels"
    compiled = []
    compile_now = library._compile

    def slow_compile(*args):
        compiled.append(args[2])          # (cc, flags, source, target, key)
        time.sleep(0.3)                   # the other callers arrive while it builds
        compile_now(*args)
    monkeypatch.setattr(library, "_compile", slow_compile)
    with ThreadPoolExecutor(4) as pool:
        built = set(pool.map(lambda _: library.build(source, out), range(4)))
    assert len(built) == 1 and compiled == [source]
    first = built.pop()
    stamp = first.stat().st_mtime_ns
    assert library.build(source, out) == first and first.stat().st_mtime_ns == stamp and len(compiled) == 1
    source.write_text("int pdserve_tiny(int x) { return x + 2; }\n")
    second = library.build(source, out)
    assert second != first and len(compiled) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted([first.name, second.name])


def test_a_read_only_cache_builds_in_the_temp_directory(tmp_path):
    """A container's baked-in cache is read-only: the kernel is built under the temp
    directory instead (here the cache root is a file, so nothing can be made in it)."""
    blocked = tmp_path / "cache"
    blocked.write_text("")
    source = tmp_path / "tiny.c"            # a real kernel would cost a fresh machine ~5 s of CPU here
    source.write_text("int pdserve_tiny(int x) { return x + 3; }\n")
    built = library.build(source, library.kernel_dir(blocked))
    assert built.parent == Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}" and built.exists()
    assert built.parent.stat().st_mode & 0o777 == 0o700


def test_without_a_compiler_auto_falls_back_and_native_refuses(model_dir, tmp_path, monkeypatch, caplog):
    """A machine with no C compiler (an empty PATH here): `auto` keeps the torch path and
    says why; `native` fails at start instead of serving slower than asked."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(model_dir, "float32", "cpu", attention="auto", kernel_cache=tmp_path)
    assert runner.backend.decode_kernel == "torch" and runner.backend.prefill_kernel == "torch SDPA"
    assert "no C compiler" in caplog.text
    with pytest.raises(native.NativeBuildError, match="no C compiler"):
        ModelRunner(model_dir, "float32", "cpu", attention="native", kernel_cache=tmp_path)


def test_native_is_cpu_float32_and_bfloat16_only(model_dir, kernel_cache):
    assert ModelRunner(model_dir, "float16", "cpu", kernel_cache=kernel_cache).backend.decode_kernel == "torch"
    with pytest.raises(ValueError, match="run on CPU in float32 or bfloat16"):
        ModelRunner(model_dir, "float16", "cpu", attention="native", kernel_cache=kernel_cache)
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelRunner(model_dir, "float32", "cpu", attention="fast", kernel_cache=kernel_cache)


def test_decode_step_agrees_with_the_torch_path(model_dir, kernel_cache):
    """The real model, float32: one decode step over prefilled prompts of different
    lengths gives the same logits (to float32 rounding) and the same greedy tokens."""
    torch.set_num_threads(1)
    fast = ModelRunner(model_dir, "float32", "cpu", attention="native", kernel_cache=kernel_cache)
    slow = ModelRunner(model_dir, "float32", "cpu", attention="torch")
    lengths, tables, cursor = [40, 3, 130], [], 0
    for n in lengths:
        tables.append(list(range(cursor, cursor + n // 16 + 1)))
        cursor += n // 16 + 1
    pool = KVPoolMemory.allocate(fast.layout(cursor, 16))
    torch.manual_seed(0)
    firsts = [int(fast.prefill(pool, torch.randint(100, 20000, (n,)).tolist(), t).argmax())
              for n, t in zip(lengths, tables)]
    snapshot = pool.tensor.clone()
    a = fast.decode(pool, firsts, lengths, tables)
    pool.tensor.copy_(snapshot)
    b = slow.decode(pool, firsts, lengths, tables)
    pool.close()
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-4)
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def prefill_reference(q, k, v, offset, scale):
    """q [q_len, q_heads, dim], k/v [k_len, kv_heads, dim]: causal SDPA in float64."""
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(diagonal=offset)
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1),
                                         v.double().transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("q_len,offset", [(1, 0), (7, 0), (16, 0), (130, 0), (300, 0), (65, 200), (1, 77)])
@pytest.mark.parametrize("q_heads,kv_heads,dim", [(9, 3, 64), (8, 8, 128), (4, 1, 64), (6, 2, 32)])
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_matches_float64_reference(kernel, q_len, offset, q_heads, kv_heads, dim, threads):
    if not kernel.prefills:
        pytest.skip("this CPU has no AVX512-BF16: prefill keeps torch's SDPA")
    torch.manual_seed(q_len * 7 + offset + dim)
    q = torch.randn(q_len, q_heads, dim).bfloat16()
    # keys as the paged path hands them over: [tokens, kv_heads, dim] rows; and as the
    # model's projections do, head-major, through a transposed view
    k = torch.randn(kv_heads, q_len + offset, dim).bfloat16().transpose(0, 1)
    v = torch.randn(q_len + offset, kv_heads, dim).bfloat16()
    out = kernel.prefill(q, k, v, offset, dim ** -0.5, threads)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), prefill_reference(q, k, v, offset, dim ** -0.5), atol=2e-2, rtol=2e-2)


def test_prefill_kernel_refuses_what_it_cannot_run(kernel):
    if not kernel.prefills:
        pytest.skip("this CPU has no AVX512-BF16")
    q, k = torch.randn(10, 9, 64).bfloat16(), torch.randn(10, 3, 64).bfloat16()
    with pytest.raises(ValueError, match="bfloat16"):
        kernel.prefill(q.float(), k.float(), k.float(), 0, 0.125)
    with pytest.raises(ValueError, match="refused"):
        kernel.prefill(q, k, k, 5, 0.125)                     # 10 queries after 5 cached need 15 keys
    with pytest.raises(ValueError, match="refused"):
        kernel.prefill(torch.randn(10, 8, 64).bfloat16(), k, k, 0, 0.125)


def test_bfloat16_prefill_agrees_with_sdpa_whole_and_in_chunks(model_dir, kernel_cache):
    """The real model in bfloat16: a prompt's last logits through the native prefill
    against torch's SDPA, and the same prompt in two chunks (the second attending to
    the first's cached blocks) against one pass."""
    torch.set_num_threads(1)
    fast = ModelRunner(model_dir, "bfloat16", "cpu", attention="native", kernel_cache=kernel_cache)
    if not fast.backend.attention.prefills:
        pytest.skip("this CPU has no AVX512-BF16")
    fast.backend.native_prefill = True      # on AMX the engine prefers torch's SDPA; test the kernel anyway
    slow = ModelRunner(model_dir, "bfloat16", "cpu", attention="torch")
    torch.manual_seed(3)
    prompt = torch.randint(100, 20000, (150,)).tolist()
    blocks = list(range(10))
    pool = KVPoolMemory.allocate(fast.layout(10, 16))
    whole = fast.prefill(pool, prompt, blocks)
    reference = slow.prefill(pool, prompt, blocks)
    fast.prefill(pool, prompt[:100], blocks)
    chunked = fast.prefill(pool, prompt[100:], blocks, start=100)
    pool.close()
    step = 2.0 ** (torch.floor(torch.log2(reference.abs().max())) - 7)      # bfloat16's spacing at the top logit
    for got in (whole, chunked):
        assert F.cosine_similarity(got, reference, dim=0) > 0.999
        # the token it would pick is the reference's, or ties with it within two bfloat16 steps
        assert reference[int(got.argmax())] >= reference.max() - 2 * step


def test_decode_refuses_block_tables_the_kernel_would_misread(model_dir, kernel_cache):
    """The kernel trusts its block ids, so the runner checks them first: an id outside
    the pool, or a table too short for the position, is a ValueError, not a stray read."""
    runner = ModelRunner(model_dir, "float32", "cpu", attention="native", kernel_cache=kernel_cache)
    pool = KVPoolMemory.allocate(runner.layout(4, 16))
    with pytest.raises(ValueError, match="block ids must lie in"):
        runner.decode(pool, [5], [20], [[0, 4]])
    with pytest.raises(ValueError, match="cannot hold position"):
        runner.decode(pool, [5], [40], [[0, 1]])
    pool.close()


@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 80), (32, 1, 128), (72, 8, 64)],
                         ids=["head-size-80", "group-32", "72-heads"])
def test_a_shape_the_kernels_refuse_stays_on_torch(kernel_cache, heads, kv_heads, dim):
    """A head size of 80 (Phi-2, StableLM), more than 16 query heads a KV head (MQA) or
    more than 64 query heads: the kernels refuse them, so `auto` keeps torch's attention
    for what they refuse (prefill, or decode and prefill) instead of failing the worker
    at start or every step; `native` says why at start."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from services.engine.model import backends
    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, intermediate_size=256)
    probe = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    cpu = torch.device("cpu")
    chosen = backends.select("auto", cpu, torch.bfloat16, "none", kernel_cache, probe=probe, role="decode")
    decodes = native.NativeAttention.takes_decode(heads, kv_heads, dim)
    assert chosen.decode_kernel == ("native" if decodes else "torch") and not chosen.native_prefill
    if not decodes:
        with pytest.raises(ValueError, match="query heads"):
            backends.select("native", cpu, torch.bfloat16, "none", kernel_cache, probe=probe, role="decode")
