"""pdserve's own matmuls (services/engine/kernels/native/matmul.c). bfloat16 and float32 against
float64 references: plain with bias and residual, gated (silu(gate) * up), ragged shapes,
strided rows and two threads; each row's result the same whatever rows share the call;
the real model's decode and prefill logits against oneDNN's (bfloat16) and torch's own
(float32); and the refusals. uint8 x int8 against oneDNN's products, bit for bit. The
bfloat16 kernel needs AVX512-BF16, the int8 one AVX512-VNNI, the float32 one AVX2 and
FMA: where a CPU has none of them the loader must refuse and the engine keep torch's.
The AMX tile kernel: emulated on any CPU with AVX512-BF16 (the SDM's order, bit for bit),
on real tiles where the CPU has them; a tile kernel that disagrees is refused at load."""
import logging

import pytest
import torch
import torch.nn.functional as F

from services.engine.kernels import native
from services.engine.kernels.native import library
from services.engine.model.backends import CpuBackend
from services.engine.model.hardware import cpu_flags, cpu_kind
from services.engine.model.int8 import Int8Linear
from services.engine.model.runner import ModelRunner

HAS_BF16 = "avx512_bf16" in cpu_flags()
HAS_VNNI = "avx512_vnni" in cpu_flags()
HAS_F32 = {"avx2", "fma"} <= cpu_flags()
HAS_AMX = "amx_bf16" in cpu_flags()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason=f"needs AVX512-BF16; this CPU is {cpu_kind()}")
needs_vnni = pytest.mark.skipif(not HAS_VNNI, reason=f"needs AVX512-VNNI; this CPU is {cpu_kind()}")
needs_f32 = pytest.mark.skipif(not HAS_F32, reason=f"needs AVX2 and FMA; this CPU is {cpu_kind()}")


@pytest.fixture(scope="module")
def matmul(kernel_cache):
    if not (HAS_BF16 or HAS_VNNI or HAS_F32):
        pytest.skip(f"needs AVX512-BF16, AVX512-VNNI or AVX2 with FMA; this CPU is {cpu_kind()}")
    loaded = native.load_matmul(kernel_cache)
    assert (loaded.bf16, loaded.int8, loaded.f32) == (HAS_BF16, HAS_VNNI, HAS_F32)
    return loaded


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = x.double() @ w.double().T
    return y if b is None else y + b.double()


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Within bfloat16 rounding of the output (plus float32 summation over k)."""
    return bool(((out.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-2).all())


@needs_bf16
@pytest.mark.parametrize("n,k", [(960, 576), (50, 64), (33, 1536), (4096, 96)])
@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 9, 33, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_plain_matches_float64_with_bias_and_residual(matmul, n, k, rows, threads):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    wide = torch.randn(rows, k + 10, generator=gen).bfloat16()
    x = wide[:, 3:3 + k]                                 # strided rows
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    packed, bias = matmul.pack(w, b)
    out = matmul.linear(x, packed, n, bias, residual, threads=threads)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    assert close(out, reference(x, w, b) + residual.double())
    assert close(matmul.linear(x, packed, n, threads=threads), reference(x, w))


@needs_bf16
@pytest.mark.parametrize("rows", [1, 2, 6, 12])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_is_silu_gate_times_up(matmul, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    inter, k = 160, 576
    gate, up = ((torch.randn(inter, k, generator=gen) * 0.05).bfloat16() for _ in range(2))
    bg, bu = (torch.randn(inter, generator=gen).bfloat16() if with_bias else None for _ in range(2))
    x = torch.randn(1, rows, k, generator=gen).bfloat16()
    packed, bias = matmul.pack(gate, bg, (up, bu))
    out = matmul.linear(x, packed, 2 * inter, bias, gated=True)
    assert out.shape == (1, rows, inter)
    assert close(out[0], F.silu(reference(x[0], gate, bg)) * reference(x[0], up, bu))


@needs_bf16
def test_each_rows_result_is_the_same_whatever_shares_the_call(matmul):
    """Sums run in one k order per output whatever the tile or the prefetching:
    batch-invariant, and the same with two threads (split by output columns and, past 64
    rows, by row blocks; never by k)."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(3072, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(150, 576, generator=gen).bfloat16()
    packed, _ = matmul.pack(w)
    whole = matmul.linear(x, packed, 3072)
    assert all(torch.equal(matmul.linear(x[i:i + 1], packed, 3072)[0], whole[i]) for i in range(0, 150, 7))
    # one thread over 3 to 64 rows prefetches the next panel as it goes: the same bits
    assert all(torch.equal(matmul.linear(x[:rows], packed, 3072), whole[:rows]) for rows in (3, 8, 13, 16, 40, 64))
    assert torch.equal(matmul.linear(x[4:11], packed, 3072, threads=2), whole[4:11])
    assert torch.equal(matmul.linear(x, packed, 3072, threads=2), whole)
    assert torch.equal(matmul.linear(x[:1], packed, 3072, threads=2)[0], whole[0])


@needs_bf16
def test_refuses_what_it_cannot_run(matmul):
    w = torch.randn(64, 63).bfloat16()
    with pytest.raises(ValueError, match="even number of input features"):
        matmul.pack(w)
    with pytest.raises(ValueError, match="gated pair"):
        matmul.pack(torch.randn(40, 64).bfloat16(), None, (torch.randn(40, 64).bfloat16(), None))
    packed, _ = matmul.pack(torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match="bfloat16 CPU rows of 64"):
        matmul.linear(torch.randn(2, 64), packed, 64)
    with pytest.raises(ValueError, match="bfloat16 CPU rows of 64"):
        matmul.linear(torch.randn(2, 32).bfloat16(), packed, 64)
    with pytest.raises(ValueError, match="do not fit"):
        matmul.linear(torch.randn(2, 64).bfloat16(), packed, 80)
    with pytest.raises(ValueError, match="residual of 3 rows for 2"):
        matmul.linear(torch.randn(2, 64).bfloat16(), packed, 64, residual=torch.randn(3, 64).bfloat16())


@pytest.fixture(scope="module")
def emulated_amx(built_kernels):
    """The library built with the AMX tile instructions emulated in C, as the SDM defines
    them (matmul.c, PDSERVE_AMX_EMULATE): the tiling and the epilogues run on any CPU
    with AVX512-BF16, real tiles only on a CPU that has them."""
    if not HAS_BF16:
        pytest.skip(f"the emulated tiles' epilogues need AVX512-BF16; this CPU is {cpu_kind()}")
    loaded = native.NativeMatmul(library.build(native.MATMUL_SOURCE, built_kernels, ("PDSERVE_AMX_EMULATE",)))
    assert loaded.amx and loaded.bf16_path == "amx"
    return loaded


def in_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """float32 sums as the SDM defines tdpbf16ps, tile after tile of 32 k values from the
    bias: in each, the even products and the odd ones summed apart from zero, in turn
    (each product exact in float32, each add rounded), then the two added, then that to
    the sum."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0]) if b is None else b.float().expand(x.shape[0], -1).clone()
    for start in range(0, x.shape[1], 32):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for i in range(start, start + 32, 2):
            even = even + xf[:, i:i + 1] * wf[:, i]
            odd = odd + xf[:, i + 1:i + 2] * wf[:, i + 1]
        acc = acc + (even + odd)
    return acc


@needs_bf16
@pytest.mark.parametrize("n,k", [(80, 576), (50, 64), (1040, 96), (24, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
def test_amx_tiles_sum_in_the_instructions_order_bit_for_bit(emulated_amx, n, k, rows):
    """Emulated tiles: every strip shape (up to 16 rows by 4 groups, 32 by 2, a last
    strip padded), odd group counts and k over several tiles, each output the float32
    sum tdpbf16ps makes (as the SDM defines it), rounded once to bfloat16; with a
    residual, that sum plus it."""
    gen = torch.Generator().manual_seed(n * k + rows)
    w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k + 6, generator=gen).bfloat16()[:, 2:2 + k]          # strided rows
    residual = torch.randn(rows, n, generator=gen).bfloat16()
    packed, bias = emulated_amx.pack(w, b)
    sums = in_order(x, w, b)
    assert torch.equal(emulated_amx.linear(x, packed, n, bias), sums.bfloat16())
    assert torch.equal(emulated_amx.linear(x, packed, n, bias, residual, threads=2),
                       (sums + residual.float()).bfloat16())
    assert torch.equal(emulated_amx.linear(x, packed, n), in_order(x, w, None).bfloat16())


@needs_bf16
def test_amx_tiles_sum_even_and_odd_products_apart(emulated_amx):
    """The SDM's order, where it shows in the output: products 2^24, 1, -2^24 (even,
    odd, even) sum to 1 with the even and odd products apart, but to 0 added in turn
    (2^24 + 1 rounds to 2^24), as the intrinsics guide's shorter pseudo-code has it."""
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, :3] = 1.0
    w = torch.zeros(16, 32, dtype=torch.bfloat16)
    w[0, :3] = torch.tensor([2.0 ** 24, 1.0, -2.0 ** 24])
    packed, _ = emulated_amx.pack(w)
    assert emulated_amx.linear(x, packed, 16)[0, 0].item() == 1.0
    assert in_order(x, w, None)[0, 0].item() == 1.0


@needs_bf16
def test_amx_tiles_gated_batch_invariant_and_k_off_the_tiles(emulated_amx, matmul):
    """Emulated tiles: silu(gate) * up; each row's result the same whatever rows share
    the call; k not a whole number of tiles (here 48) goes to vdpbf16ps's path."""
    gen = torch.Generator().manual_seed(11)
    inter, k = 96, 576
    gate, up = ((torch.randn(inter, k, generator=gen) * 0.05).bfloat16() for _ in range(2))
    x = torch.randn(40, k, generator=gen).bfloat16()
    packed, _ = emulated_amx.pack(gate, None, (up, None))
    out = emulated_amx.linear(x, packed, 2 * inter, gated=True)
    assert close(out, F.silu(reference(x, gate)) * reference(x, up))
    assert all(torch.equal(emulated_amx.linear(x[i:i + r], packed, 2 * inter, gated=True), out[i:i + r])
               for i, r in ((0, 1), (3, 16), (5, 17), (7, 33)))
    w = (torch.randn(64, 48, generator=gen) * 0.05).bfloat16()
    packed, _ = emulated_amx.pack(w)
    vdp = native.NativeMatmul(emulated_amx.path, tiles=False)
    assert torch.equal(emulated_amx.linear(x[:, :48], packed, 64), vdp.linear(x[:, :48], packed, 64))


@needs_bf16
def test_tiles_that_disagree_with_vdpbf16ps_are_not_used(emulated_amx, caplog):
    """A tile kernel first run on a new CPU is checked against vdpbf16ps's at load: one
    that drops the bias (a stand-in for a fault the emulator cannot show) is refused with
    an error in the log, and the bfloat16 calls stay on vdpbf16ps; the emulated tiles pass."""
    vector = native.NativeMatmul(emulated_amx.path, tiles=False)
    assert not vector.amx and vector.bf16_path == "avx512-bf16"

    def without_bias(x, ldx, rows, w, n, k, bias, *rest):
        return vector._vector(x, ldx, rows, w, n, k, None, *rest)
    with caplog.at_level(logging.ERROR):
        assert not vector._tiles_agree(without_bias)
    assert vector._linear[torch.bfloat16] is vector._vector and "disagrees" in caplog.text
    assert emulated_amx.amx                  # its own check at load passed


@pytest.mark.skipif(not HAS_AMX, reason=f"needs AMX tiles; this CPU is {cpu_kind()} (the tiles are tested emulated)")
def test_on_an_amx_cpu_the_bfloat16_matmuls_run_on_real_tiles(matmul):
    """The real tiles, where the CPU has them (elsewhere: the emulated tests above): the
    OS lets the process use them, and they agree with vdpbf16ps's path within float32
    summation; every bfloat16 test of this module runs on them here too."""
    assert matmul.amx, "this CPU has AMX-BF16 but the process could not use the tiles (Linux 5.16+ grants them)"
    gen = torch.Generator().manual_seed(5)
    w = (torch.randn(1040, 576, generator=gen) * 0.05).bfloat16()
    x = torch.randn(37, 576, generator=gen).bfloat16()
    packed, _ = matmul.pack(w)
    vdp = native.NativeMatmul(matmul.path, tiles=False)
    tiles, vector = matmul.linear(x, packed, 1040).double(), vdp.linear(x, packed, 1040).double()
    assert close(tiles, reference(x, w)) and ((tiles - vector).abs() <= vector.abs() * 2 ** -7 + 1e-3).all()


@pytest.mark.skipif(HAS_BF16 or HAS_VNNI or HAS_F32, reason="this CPU has AVX512-BF16, AVX512-VNNI or AVX2 with "
                                                         "FMA: the kernels run here")
def test_without_any_of_their_instructions_the_loader_refuses(kernel_cache):
    with pytest.raises(native.NativeBuildError, match="AVX512-BF16"):
        native.load_matmul(kernel_cache)


@needs_vnni
@pytest.mark.parametrize("n,k", [(960, 576), (50, 64), (3072, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 9, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_products_are_onednns_bit_for_bit(matmul, n, k, rows, threads):
    """Exact int32 sums, scaled once per column: the same float32 products as oneDNN's
    u8 x s8 matmul, whatever the shape, rows or threads."""
    gen = torch.Generator().manual_seed(n * k + rows)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-3, 0, n)[:, None]
    onednn, ours = Int8Linear(weight, None), Int8Linear(weight, None, matmul=matmul)
    assert ours.native and not onednn.native
    x = torch.randint(0, 256, (rows, k), generator=gen, dtype=torch.uint8)
    torch.set_num_threads(threads)
    try:
        got = ours.products(x)
    finally:
        torch.set_num_threads(1)
    assert got.shape == (rows, n) and torch.equal(got, onednn.products(x))


@needs_vnni
def test_int8_refuses_what_it_cannot_run(matmul):
    with pytest.raises(ValueError, match="multiple of 4"):
        matmul.pack_int8(torch.zeros(16, 30, dtype=torch.int8), torch.ones(16))
    packed, comp, scale = matmul.pack_int8(torch.zeros(16, 32, dtype=torch.int8), torch.ones(16))
    with pytest.raises(ValueError, match="uint8 rows of 32"):
        matmul.products(torch.zeros(2, 32), packed, 16, comp, scale)
    with pytest.raises(ValueError, match="do not fit"):
        matmul.products(torch.zeros(2, 32, dtype=torch.uint8), packed, 17, comp, scale)
    assert not Int8Linear(torch.randn(8, 30), None, matmul=matmul).native     # oneDNN takes the odd width


@needs_bf16
def test_the_real_model_agrees_with_onednn(model_dir, kernel_cache, monkeypatch):
    """SmolLM2 in bfloat16: a prompt's last logits and one decode step's, through the
    native matmul and through oneDNN's; the same token or a tie within bfloat16's steps.
    (On AMX CPUs the engine keeps oneDNN; the native path is asked for here all the same.)"""
    monkeypatch.setattr("services.engine.model.backends.cpu_flags", lambda: cpu_flags() - {"amx_bf16"})
    fast = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=kernel_cache)
    monkeypatch.setattr(CpuBackend, "_matmul", lambda self, model: None)      # oneDNN's or torch's own
    slow = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=kernel_cache)
    assert "native bf16 matmul" in fast.fusions and "packed bf16 weights" in slow.fusions
    from services.engine.model.kv_cache import KVPoolMemory
    ids = [1, 504, 3458, 282, 4649, 314, 7042, 30, 216, 1911, 1060, 2909, 3]
    for runner in (fast, slow):
        runner.pool = KVPoolMemory.allocate(runner.layout(4, 16))
    try:
        last = {r: r.prefill(r.pool, ids, [0]).float() for r in (fast, slow)}
        step = {r: r.decode(r.pool, [ids[-1]], [len(ids)], [[0]]).float() for r in (fast, slow)}
    finally:
        for runner in (fast, slow):
            runner.pool.close()
    for logits in (last, step):
        a, b = logits[fast].reshape(-1), logits[slow].reshape(-1)
        spacing = 2.0 ** (torch.floor(torch.log2(b.abs().max())) - 7)
        assert (a - b).abs().max() < 8 * spacing
        assert b[a.argmax()] >= b.max() - 2 * spacing


def close_f32(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> bool:
    """Within float32 summation over k: a few ulps of the sum of |x_k w_k| (`bound`)."""
    return bool(((out.double() - ref).abs() <= bound * 2 ** -20 + 1e-6).all())


@needs_f32
@pytest.mark.parametrize("n,k", [(960, 576), (50, 64), (33, 1536), (4096, 95), (7, 3)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 6, 7, 13, 70])
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_matches_float64_with_bias_and_residual(matmul, n, k, rows, threads):
    gen = torch.Generator().manual_seed(n + k + rows)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k + 10, generator=gen)[:, 3:3 + k]          # strided rows
    residual = torch.randn(rows, n, generator=gen)
    packed, bias = matmul.pack(w, b, dtype=torch.float32)
    bound = x.double().abs() @ w.double().abs().T + b.double().abs() + residual.double().abs()
    out = matmul.linear(x, packed, n, bias, residual, threads=threads)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    assert close_f32(out, reference(x, w, b) + residual.double(), bound)
    assert close_f32(matmul.linear(x, packed, n, threads=threads), reference(x, w), bound)


@needs_f32
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 12])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_gated_is_silu_gate_times_up(matmul, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    inter, k = 40, 576
    gate, up = (torch.randn(inter, k, generator=gen) * 0.05 for _ in range(2))
    bg, bu = (torch.randn(inter, generator=gen) if with_bias else None for _ in range(2))
    x = torch.randn(1, rows, k, generator=gen)
    packed, bias = matmul.pack(gate, bg, (up, bu), dtype=torch.float32)
    out = matmul.linear(x, packed, 2 * inter, bias, gated=True)
    assert out.shape == (1, rows, inter)
    expected = F.silu(reference(x[0], gate, bg)) * reference(x[0], up, bu)
    assert ((out[0].double() - expected).abs() <= expected.abs() * 1e-5 + 1e-5).all()


@needs_f32
def test_float32_each_rows_result_is_the_same_whatever_shares_the_call(matmul):
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(3072, 576, generator=gen) * 0.05
    x = torch.randn(150, 576, generator=gen)
    packed, _ = matmul.pack(w, dtype=torch.float32)
    whole = matmul.linear(x, packed, 3072)
    assert all(torch.equal(matmul.linear(x[i:i + 1], packed, 3072)[0], whole[i]) for i in range(0, 150, 7))
    # one thread over 3 to 64 rows prefetches the next panel as it goes: the same bits
    assert all(torch.equal(matmul.linear(x[:rows], packed, 3072), whole[:rows]) for rows in (3, 8, 13, 16, 40, 64))
    assert torch.equal(matmul.linear(x[4:11], packed, 3072, threads=2), whole[4:11])
    assert torch.equal(matmul.linear(x, packed, 3072, threads=2), whole)
    # A fused product's columns are its parts' products, bit for bit (q|k|v fused stays exact).
    part, _ = matmul.pack(w[1000:1100], dtype=torch.float32)
    assert torch.equal(matmul.linear(x[:9], part, 100), whole[:9, 1000:1100])


@needs_f32
def test_float32_refuses_what_it_cannot_run(matmul):
    packed, _ = matmul.pack(torch.randn(64, 64), dtype=torch.float32)
    with pytest.raises(ValueError, match="float32 CPU rows of 64"):
        matmul.linear(torch.randn(2, 64).bfloat16(), packed, 64)
    with pytest.raises(ValueError, match="float32 CPU rows of 64"):
        matmul.linear(torch.randn(2, 32), packed, 64)
    with pytest.raises(ValueError, match="do not fit"):
        matmul.linear(torch.randn(2, 64), packed, 72)
    with pytest.raises(ValueError, match="gated pair"):
        matmul.pack(torch.randn(12, 64), None, (torch.randn(12, 64), None), dtype=torch.float32)
    with pytest.raises(ValueError, match="packs bfloat16 or float32"):
        matmul.pack(torch.randn(8, 64).half(), dtype=torch.float16)


@needs_f32
def test_float32_real_model_agrees_with_torch(model_dir, kernel_cache, monkeypatch):
    """SmolLM2 in float32: a prompt's last logits and one decode step's, through the
    native float32 matmul and through torch's own; within float32 summation noise, and
    the same greedy token. (On CPUs with AVX-512 the engine keeps torch's float32
    matmul; the native one is asked for here all the same.)"""
    monkeypatch.setattr("services.engine.model.backends.cpu_flags", lambda: frozenset({"avx2", "fma"}))
    fast = ModelRunner(model_dir, "float32", "cpu", kernel_cache=kernel_cache)
    monkeypatch.setattr(CpuBackend, "_matmul", lambda self, model: None)      # oneDNN's or torch's own
    slow = ModelRunner(model_dir, "float32", "cpu", kernel_cache=kernel_cache)
    assert "native f32 matmul" in fast.fusions and "native f32 matmul" not in slow.fusions
    from services.engine.model.kv_cache import KVPoolMemory
    ids = [1, 504, 3458, 282, 4649, 314, 7042, 30, 216, 1911, 1060, 2909, 3]
    for runner in (fast, slow):
        runner.pool = KVPoolMemory.allocate(runner.layout(4, 16))
    try:
        last = {r: r.prefill(r.pool, ids, [0]) for r in (fast, slow)}
        step = {r: r.decode(r.pool, [ids[-1]], [len(ids)], [[0]]) for r in (fast, slow)}
    finally:
        for runner in (fast, slow):
            runner.pool.close()
    for logits in (last, step):
        a, b = logits[fast].reshape(-1), logits[slow].reshape(-1)
        assert (a - b).abs().max() < 1e-3 * b.abs().max()
        assert a.argmax() == b.argmax()
