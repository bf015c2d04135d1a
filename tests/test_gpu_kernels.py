"""The CUDA path's Triton kernels (services/engine/kernels/gpu_kernels.py) against torch.

Without a GPU they run in Triton's interpreter on the CPU (TRITON_INTERPRET=1, set in
a child process: the switch is read when the kernels are defined), which checks their
indexing and arithmetic but not their speed; with a GPU, on it.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]


def _reference(query, kv_layer, tables, lens, scale):
    """Attention in float64 over each row's gathered context."""
    out = []
    heads, kv_heads = query.shape[1], kv_layer.shape[3]
    bs = kv_layer.shape[2]
    for b, (table, n) in enumerate(zip(tables, lens)):
        if n == 0:
            out.append(torch.zeros_like(query[b], dtype=torch.float64))
            continue
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])
        k = kv_layer[0].reshape(-1, kv_heads, kv_layer.shape[4])[slots].double()   # [n, kv_heads, dim]
        v = kv_layer[1].reshape(-1, kv_heads, kv_layer.shape[4])[slots].double()
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", query[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("hn,nhd->hd", w, v))
    return torch.stack(out)


def check_decode(device: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, lens: list[int],
                 splits: int, block_size: int = 16) -> float:
    from services.engine.kernels.gpu_kernels import DecodeScratch, paged_decode
    g = torch.Generator().manual_seed(len(lens) * 31 + dim)
    blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).tolist()                 # blocks scattered through the pool
    tables, at = [], 0
    for n in lens:
        w = -(-n // block_size)
        tables.append(perm[at:at + w])
        at += w
    width = max(1, max(len(t) for t in tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    got = paged_decode(query.to(device), kv.to(device), table.to(device),
                       torch.tensor(lens, dtype=torch.int32, device=device), scale, splits, DecodeScratch())
    want = _reference(query, kv, tables, lens, scale)
    return float((got.cpu().double() - want).abs().max())


def check_grouped(device: str, dtype: torch.dtype, heads: int, kv_heads: int, dim: int, splits: int,
                  tol: float) -> list[str]:
    """A speculative step's rows: several sequences' next positions, each row over its
    sequence's table (one list for all its rows, as the engine passes them), attended in
    the groups `decode_groups` makes, against float64 attention of each row alone."""
    import numpy as np
    from services.engine.kernels.gpu_kernels import DecodeScratch, decode_groups, paged_decode, rows_per_program
    g = torch.Generator().manual_seed(heads * 7 + dim)
    bs, blocks = 16, 24
    kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=g).to(dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    a, b, c = perm[0:3], perm[3:4], perm[4:9]
    forked = perm[9:11] + [perm[12]]      # d's copy: its last block is its own
    d = perm[9:12]
    rows = ([(a, n) for n in range(30, 37)] + [(b, 5)] + [(c, n) for n in range(60, 69)]   # c crosses a block
            + [(d, 40), (forked, 41)])       # the fork's table differs in the block row 40 ends in: not grouped
    tables, lens = [t for t, _ in rows], [n for _, n in rows]
    width = max(len(t) for t in tables)
    widths = np.array([-(-n // bs) for n in lens])
    table = np.array([t[:w] + [0] * (width - w) for t, w in zip(tables, widths)], dtype=np.int64)
    per = rows_per_program(heads // kv_heads)
    groups = decode_groups(np.array(lens) - 1, table, widths, per)
    runs = [7, 1, 9, 1, 1]                # the rows of each sequence, as they should group
    want_groups = [min(per, n - i) if i % per == 0 else 0 for n in runs for i in range(n)]
    failures = [] if groups.tolist() == want_groups else [f"groups {groups.tolist()}, not {want_groups}"]
    query = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    got = paged_decode(query.to(device), kv.to(device), torch.tensor(table, dtype=torch.int32, device=device),
                       torch.tensor(lens, dtype=torch.int32, device=device), scale, splits, DecodeScratch(),
                       groups=torch.from_numpy(groups).to(device))
    err = float((got.cpu().double() - _reference(query, kv, tables, lens, scale)).abs().max())
    if not err <= tol:
        failures.append(f"grouped decode {dtype} ({heads}, {kv_heads}, {dim}, splits {splits}): max error {err:.2e}")
    return failures


def check_write(device: str, dtype: torch.dtype) -> bool:
    from services.engine.kernels.gpu_kernels import write_kv
    g = torch.Generator().manual_seed(5)
    kv = torch.zeros(2, 6, 4, 2, 24, dtype=dtype)
    key, value = torch.randn(5, 2, 24, generator=g).to(dtype), torch.randn(5, 2, 24, generator=g).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, 22])
    got = kv.to(device)
    # a strided key: the [tokens, heads, dim] view of a [1, heads, tokens, dim] tensor
    write_kv(got, slots.to(device), key.transpose(0, 1).contiguous().to(device).transpose(0, 1), value.to(device))
    want = kv.clone()
    keep = slots >= 0
    want[0].view(-1, 2, 24)[slots[keep]] = key[keep]
    want[1].view(-1, 2, 24)[slots[keep]] = value[keep]
    return torch.equal(got.cpu(), want)


def check_layers(device: str, dtype: torch.dtype) -> list[str]:
    """TritonLayers against Llama's own ops, on a strided q|k|v view as the layer has it."""
    from services.engine.model.fusion import _rms_norm_torch, _rotate_half
    from services.engine.kernels.gpu_kernels import TritonLayers
    g = torch.Generator().manual_seed(9)
    layers, failures = TritonLayers(), []
    # bfloat16: two units in the last place (Triton's interpreter rounds to bfloat16 by
    # truncation, a GPU to nearest); float32: exact
    tol = 0 if dtype == torch.float32 else 2 ** -6
    x = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + torch.randn(96, generator=g) / 4).to(dtype)
    got = layers.rms_norm(x.to(device), w.to(device), 1e-5).cpu()
    if not torch.allclose(got.float(), _rms_norm_torch(x, w, 1e-5).float(), rtol=tol, atol=1e-5):
        failures.append(f"rms_norm {dtype}")
    gu = torch.randn(5, 2 * 40, generator=g).to(dtype)
    want = torch.nn.functional.silu(gu[:, :40]) * gu[:, 40:]
    if not torch.allclose(layers.silu_mul(gu.to(device)).cpu().float(), want.float(), rtol=tol, atol=1e-5):
        failures.append(f"silu_mul {dtype}")
    qkv = torch.randn(1, 5, (6 + 2 + 2) * 16, generator=g).to(dtype)          # 6 q heads, 2 kv heads, dim 16
    angle = torch.randn(5, 8, generator=g)
    cos, sin = torch.cat([angle.cos()] * 2, -1).to(dtype), torch.cat([angle.sin()] * 2, -1).to(dtype)
    q = qkv[..., :96].view(1, 5, 6, 16)
    want = (q.transpose(1, 2) * cos) + (_rotate_half(q.transpose(1, 2)) * sin)
    dev_qkv = qkv.to(device)
    layers.rotary_(dev_qkv[..., :96].view(1, 5, 6, 16)[0], cos.to(device), sin.to(device))
    got = dev_qkv.cpu()                     # atol: a difference of two rounded products
    if not torch.allclose(got[..., :96].view(1, 5, 6, 16).transpose(1, 2).float(), want.float(), rtol=tol,
                          atol=4 * tol or 1e-6) or not torch.equal(got[..., 96:], qkv[..., 96:]):
        failures.append(f"rotary_ {dtype}")
    return failures


CASES = [  # heads, kv_heads, dim, lens, splits
    (8, 2, 32, [1, 17, 40, 0, 100], 1),
    (8, 2, 32, [1, 17, 40, 0, 100], 4),
    (4, 4, 64, [33, 5], 32),                  # no GQA; more splits than tiles
    (12, 2, 80, [50, 64, 3], 3),              # a head dim that is no power of two
]
GROUPED_CASES = [  # heads, kv_heads, dim, splits: 4, 4, 16 and 2 rows a program (bfloat16: the second)
    (8, 2, 32, 1),
    (9, 3, 32, 3),                            # a GQA group of 3, padded to 4
    (4, 4, 64, 5),
    (12, 2, 80, 4),
]


def run_all(device: str) -> list[str]:
    failures = []
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        for case in CASES:
            err = check_decode(device, dtype, *case)
            if not err <= tol:
                failures.append(f"decode {dtype} {case}: max error {err:.2e} > {tol:g}")
        for heads, kv_heads, dim, splits in GROUPED_CASES if dtype == torch.float32 else GROUPED_CASES[1:2]:
            failures += check_grouped(device, dtype, heads, kv_heads, dim, splits, tol)
        if not check_write(device, dtype):
            failures.append(f"write_kv {dtype}: slots differ")
        failures += check_layers(device, dtype)
    return failures


def check_runner(model_dir: str, device: str = "cpu") -> list[str]:
    """The runner's CUDA path (Triton KV writes and decode, the graph runner's staging
    and padding) against its torch path: the same logits and KV bytes. On a CPU the
    graphs are replaced by their eager step, as on any machine without CUDA; on a GPU
    they are captured and replayed."""
    from bench.gpu_speed import BLOCK_SIZE
    from services.engine.model.backends import CudaBackend
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.model.runner import ForwardBatch, ModelRunner, PrefillSegment
    torch.set_num_threads(1)
    ref = ModelRunner(Path(model_dir), "float32", device, attention="torch")
    if device == "cpu":
        gpu = ModelRunner(Path(model_dir), "float32", device, attention="torch")
        config = gpu.model.config
        gpu.backend = CudaBackend(torch.device(device), torch.float32,
                                  config.num_attention_heads // config.num_key_value_heads)
        gpu.graph_sizes = [1, 2, 4, 8]
    else:
        gpu = ModelRunner(Path(model_dir), "float32", device, max_batch=8)
    g = torch.Generator().manual_seed(3)
    lens = [5, 40, 17]
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    tables = [list(range(10 * i + 7, 10 * i + 10)) for i in range(len(lens))]      # 3 blocks, not from 0
    layout = ref.layout(40, BLOCK_SIZE)
    pools = [KVPoolMemory.allocate(layout, device=device), KVPoolMemory.allocate(layout, device=device)]
    tol = 1e-4 if device == "cpu" else 1e-3
    failures = []
    for runner, pool in zip((ref, gpu), pools):
        for p, t in zip(prompts, tables):
            runner.prefill(pool, p, t)
    if not torch.allclose(pools[0].tensor, pools[1].tensor, atol=1e-6):
        failures.append("prefill KV differs")
    # decode-only (the graph runner: 3 rows padded to a bucket of 4), then a mixed step
    # (decode rows and a prompt chunk: the eager path)
    steps = [ForwardBatch(decode_tokens=[11, 12, 13], decode_positions=lens, decode_tables=tables,
                          sample_rows=[0, 1, 2]),
             ForwardBatch(decode_tokens=[14, 15], decode_positions=[lens[0] + 1, lens[1] + 1],
                          decode_tables=tables[:2], prefill_tokens=[21, 22, 23, 24],
                          segments=[PrefillSegment(lens[2] + 1, 4, tables[2])], sample_rows=[0, 1, 5]),
             # async scheduling: some rows' tokens are still on the device, sampled by the
             # step before (a decode-only step through the graph runner, then a mixed one)
             ForwardBatch(decode_tokens=[16, 17, 18], decode_positions=[lens[0] + 2, lens[1] + 2, lens[2] + 5],
                          decode_tables=tables, sample_rows=[0, 1, 2]),
             ForwardBatch(decode_tokens=[19, 20], decode_positions=[lens[0] + 3, lens[1] + 3],
                          decode_tables=tables[:2], prefill_tokens=[25, 26, 27],
                          segments=[PrefillSegment(lens[2] + 6, 3, tables[2])], sample_rows=[0, 1, 4]),
             # a speculative step: sequence 1's next four positions, attended as one group
             ForwardBatch(decode_tokens=[28, 29, 30, 31, 32], decode_positions=[lens[0] + 4] + [lens[1] + 4 + i
                                                                                           for i in range(4)],
                          decode_tables=[tables[0]] + [tables[1]] * 4, sample_rows=[0, 1, 2, 3, 4])]
    pending = {2: [0, 2], 3: [1]}             # step: its rows whose tokens come from the device
    for i, step in enumerate(steps):
        mine = step
        if i in pending:                      # the tokens sit in a device tensor, in another order
            rows = pending[i]
            held = torch.tensor([0] + [step.decode_tokens[r] for r in reversed(rows)], device=device)
            mine = replace(step, decode_tokens=[0 if r in rows else t for r, t in enumerate(step.decode_tokens)],
                           pending_rows=rows, pending_sources=list(range(len(rows), 0, -1)), pending_tokens=held)
        want, got = ref.execute(pools[0], step), gpu.execute(pools[1], mine)
        err = float((want - got).abs().max())
        if not err < tol:
            failures.append(f"step {i}: logits differ by {err:.2e}")
        if not torch.allclose(pools[0].tensor, pools[1].tensor, atol=tol / 10):
            failures.append(f"step {i}: KV differs")
    if gpu._graphs is None or gpu._graphs.bucket(3) != 4:
        failures.append("the decode-only step did not go through the graph runner")
    elif gpu._graphs.groups[:5].tolist() != [1, 4, 0, 0, 0]:
        failures.append(f"the speculative step's rows were attended as {gpu._graphs.groups[:5].tolist()}")
    elif device != "cpu" and 4 not in gpu._graphs.graphs:
        failures.append("no CUDA graph was captured for the decode-only step's bucket")
    return failures


def _interpreted(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_runner_cuda_path_matches_torch_path_in_the_interpreter_on_cpu(tmp_path):
    from bench.gpu_check import build_tiny_model
    build_tiny_model(tmp_path / "tiny")
    r = _interpreted("import sys; from tests.test_gpu_kernels import check_runner; "
                     f"f = check_runner({str(tmp_path / 'tiny')!r}); print(*f, sep='\\n'); sys.exit(bool(f))")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


def test_kernels_match_torch_in_the_interpreter_on_cpu():
    """The kernels' indexing and math, run by Triton's interpreter on this CPU."""
    r = _interpreted("import sys; from tests.test_gpu_kernels import run_all; f = run_all('cpu'); "
                     "print(*f, sep='\\n'); sys.exit(bool(f))")
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")
def test_kernels_match_torch_on_the_gpu():
    assert run_all("cuda") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graph capture)")
def test_runner_cuda_graphs_match_torch_path_on_the_gpu(tmp_path):
    from bench.gpu_check import build_tiny_model
    assert check_runner(str(build_tiny_model(tmp_path / "tiny")), "cuda") == []


@pytest.mark.parametrize("error", [
    RuntimeError("operation not permitted when stream is capturing"),
    OSError(30, "Read-only file system", "/home/pdserve/.triton"),
], ids=["not-capturable", "kernel-cache-unwritable"])
def test_a_failed_graph_capture_leaves_the_steps_eager(tmp_path, monkeypatch, caplog, error):
    """A model whose decode step cannot be captured (a rotary embedding that reads its
    positions back to the host, say), or whose kernels cannot be compiled for the capture
    (Triton's cache under $HOME on a read-only root), is served eagerly, with the same
    logits, and the log says why, once."""
    from bench.gpu_check import build_tiny_model
    from services.engine.model import cuda_graphs
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.model.runner import ModelRunner

    def refuse(self):
        raise error
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "capture", refuse)
    model_dir = build_tiny_model(tmp_path / "tiny")
    ref = ModelRunner(model_dir, "float32", "cpu", attention="torch")
    runner = ModelRunner(model_dir, "float32", "cpu", attention="torch")
    runner.graph_sizes = [1, 2, 4]                        # as on a GPU
    pools = [KVPoolMemory.allocate(ref.layout(8, 16)) for _ in range(2)]
    for r, pool in zip((ref, runner), pools):
        r.prefill(pool, list(range(5, 25)), [3, 4])
    want = ref.decode(pools[0], [7], [20], [[3, 4]])
    with caplog.at_level(logging.WARNING, logger="services.engine.model.runner"):
        runner.capture_graphs(pools[1])                   # as a decode worker does at start
        got = runner.decode(pools[1], [7], [20], [[3, 4]])
    assert runner.graph_sizes == [] and torch.equal(got, want)
    (record,) = [r for r in caplog.records if r.name == "services.engine.model.runner"]
    assert f"{type(error).__name__}: {error}" in record.getMessage()


def test_graphs_are_captured_in_inference_mode_and_thread_local(tmp_path, monkeypatch):
    """A decode worker captures at start, after its NIXL transport's progress thread has
    started: in CUDA's global capture mode any CUDA call from that thread meanwhile fails
    the capture. Each capture is thread-local, and in inference mode as the steps run.
    torch.cuda's graph calls are doubles here that note how they were called."""
    from bench.gpu_check import build_tiny_model
    from services.engine.model import cuda_graphs
    from services.engine.model.runner import ModelRunner

    runner = ModelRunner(build_tiny_model(tmp_path / "tiny"), "float32", "cpu", attention="torch")
    graphs = cuda_graphs.DecodeGraphs(runner.backend, runner.model, torch.zeros(runner.layout(8, 16).shape), 16,
                                      runner.max_model_len, [1, 2])
    seen = []

    class Capture:
        def __init__(self, graph, pool=None, capture_error_mode="global"):
            seen.append((capture_error_mode, torch.is_inference_mode_enabled()))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(graphs, "_forward", lambda n: torch.zeros(n, 4))
    graphs.copied = object()                              # as with CUDA: capture for real
    graphs.capture()
    assert seen == [("thread_local", True)] * 2


def test_a_model_with_more_query_heads_per_kv_head_than_the_kernel_takes_gets_torchs_attention(tmp_path):
    """The Triton decode kernel takes up to 16 query heads per KV head: a model with more
    is given torch's attention at start, not a backend whose first decode step raises.
    Chosen on the host: no GPU is touched (none is here)."""
    from services.engine.kernels import gpu_kernels
    from services.engine.model import backends
    cuda = torch.device("cuda")
    assert type(backends.select("auto", cuda, torch.bfloat16, "none", tmp_path, heads_per_kv=4)) \
        is backends.CudaBackend
    chosen = backends.select("auto", cuda, torch.bfloat16, "none", tmp_path, heads_per_kv=gpu_kernels.BLOCK_H * 2)
    assert type(chosen) is backends.TorchBackend
