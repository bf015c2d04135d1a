"""Paged attention and KV writes on CUDA devices, in Triton.

The kernels read and write pdserve's KV pool in place (layout [layer, k/v, block,
slot, kv_head, dim], services/engine/model/kv_cache.py): no gather of a sequence's blocks
into a contiguous copy, no Python per sequence.

    write_kv(kv_layer, slots, key, value)        each new token's K and V into its slot;
                                                 a slot of -1 is a padding row, skipped
    paged_decode(query, kv_layer, table, lens)   one query token per row over its sequence's
                                                 blocks (split-K, "flash-decoding"); the rows
                                                 of a verify step's drafts as one group
    TritonLayers                                 RMSNorm, SiLU-and-multiply, rotary: one
                                                 kernel each (fusion.LeanDecoderLayer)

`paged_decode` splits each sequence's context into `splits` equal parts, each part
attended by one program per KV head for the whole GQA group of query heads (the
group's rows share every K/V load), then merges the parts by their log-sum-exp. The
rows of one sequence at consecutive positions (a speculative step's drafts) go to one
program when `groups` says so (`decode_groups`): its tile rows are then (row, query
head) pairs, so the GQA group's padding to BLOCK_H carries the sequence's other rows,
and each K/V tile is read once for all of them instead of once a row. The
grid depends only on the batch size and `splits`, never on the context lengths, so a
CUDA graph captured once per batch size replays for any lengths (cuda_graphs.py).
The design is that of vLLM's and SGLang's Triton decode backends.

On a machine without a GPU the same kernels run in Triton's interpreter
(TRITON_INTERPRET=1), which is how tests/test_gpu_kernels.py checks them against
torch's attention on the CPU.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:                                     # pragma: no cover - triton ships with CUDA torch
    triton = None

# The query-head rows a program computes (tl.dot needs at least 16; GQA groups of up to
# 16 heads are padded to it), and the most parts a context is split into.
BLOCK_H = 16
MAX_SPLITS = 32


@dataclass(frozen=True)
class DecodeTiling:
    """The split kernel's shape: tokens a program loads at a time, its warps and
    pipeline stages, and the programs a step aims for (several per multiprocessor, so
    loads overlap). `python -m bench.gpu_speed --sweep` measures the choices; TILING had
    the best mean over four batch/context cases of an 8B-shaped layer on an H200
    (docs/benchmarks-gpu.md): 190 us against 229 for 1,024 programs at batch 64, 2k."""
    block_n: int = 32
    warps: int = 4
    stages: int = 2
    target_programs: int = 4096


# Triton's interpreter multiplies bfloat16 matrices as raw bits (Triton 3.9): there the
# kernels upcast tl.dot's operands to float32, which gives the same products.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter (the tests on a CPU) runs programs one after another, with no
# multiprocessors to fill: aiming for 4,096 programs there only multiplies empty splits.
TILING = DecodeTiling(target_programs=64) if INTERPRETED else DecodeTiling()


def available() -> bool:
    return triton is not None


def takes_group(query_heads_per_kv_head: int) -> bool:
    """Whether paged_decode takes a model with this many query heads per KV head."""
    return 1 <= query_heads_per_kv_head <= BLOCK_H


def splits_for(batch: int, kv_heads: int, tiling: DecodeTiling = TILING) -> int:
    """How many parts each sequence's context is split into at this batch size: enough
    programs to keep the device's load units busy, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, -(-tiling.target_programs // max(1, batch * kv_heads))))


if triton is not None:
    @triton.jit
    def _write_kv_kernel(key, value, kv_k, kv_v, slots, stride_kt, stride_kh, stride_vt, stride_vh,
                         HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, BLOCK_D)
            m = d < DIM
            k = tl.load(key + t * stride_kt + h * stride_kh + d, mask=m)
            v = tl.load(value + t * stride_vt + h * stride_vh + d, mask=m)
            dst = slot * (HEADS * DIM) + h * DIM + d
            tl.store(kv_k + dst, k, mask=m)
            tl.store(kv_v + dst, v, mask=m)

    @triton.jit
    def _decode_split_kernel(q, kv_k, kv_v, table, lens, groups, mid_o, mid_lse, scale,
                             stride_qb, stride_qh, stride_tb, stride_ob, stride_oh, stride_os,
                             stride_lb, stride_lh, splits,
                             BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr,
                             GROUP: tl.constexpr, GROUP_P2: tl.constexpr, GROUPED: tl.constexpr,
                             DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                             UPCAST: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        # The rows this program attends: row b alone, or (GROUPED) the groups[b] rows from
        # b on, consecutive positions of one sequence (0: b is in the group before it).
        # Its tile rows are (row, query head) pairs, m = r * GROUP_P2 + h.
        rows = 1
        if GROUPED:
            rows = tl.load(groups + b)
        if rows > 0:
            last = b + rows - 1
            ctx = tl.load(lens + last)
            # This part's tokens: [start, end) of the last row's context, whole BLOCK_N
            # tiles except the last part's end; each row masks what lies past its own.
            per = tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N
            start = s * per
            end = tl.minimum(start + per, ctx)
            m = tl.arange(0, BLOCK_H)
            r = m // GROUP_P2
            h = m % GROUP_P2
            live = (r < rows) & (h < GROUP)
            heads = kvh * GROUP + h
            row_len = tl.load(lens + b + r, mask=live, other=0)
            d = tl.arange(0, BLOCK_D)
            dmask = d < DIM
            lse_ptr = mid_lse + (b + r) * stride_lb + heads * stride_lh + s
            if start >= end:
                tl.store(lse_ptr, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=live)
            else:
                qv = tl.load(q + (b + r)[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :],
                             mask=live[:, None] & dmask[None, :], other=0.0)
                m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
                l_i = tl.zeros([BLOCK_H], tl.float32)
                acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
                for n0 in range(start, end, BLOCK_N):
                    n = n0 + tl.arange(0, BLOCK_N)
                    nmask = n < end
                    page = tl.load(table + last * stride_tb + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
                    row = (page * BLOCK_SIZE + n % BLOCK_SIZE) * (KV_HEADS * DIM) + kvh * DIM
                    lmask = nmask[:, None] & dmask[None, :]
                    k = tl.load(kv_k + row[:, None] + d[None, :], mask=lmask, other=0.0)
                    if UPCAST:
                        qk = tl.dot(qv.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
                    elif IEEE:
                        qk = tl.dot(qv, tl.trans(k), input_precision="ieee")
                    else:
                        qk = tl.dot(qv, tl.trans(k))
                    qk = tl.where(nmask[None, :] & (n[None, :] < row_len[:, None]), qk * scale, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(qk, 1))
                    # a row with no token here yet (an earlier row of a group, past its end)
                    # keeps max -inf: subtract 0 there, so its weights are 0, not NaN
                    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
                    p = tl.exp(qk - m_safe[:, None])
                    alpha = tl.exp(m_i - m_safe)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    v = tl.load(kv_v + row[:, None] + d[None, :], mask=lmask, other=0.0)
                    if UPCAST:
                        pv = p.to(v.dtype).to(tl.float32)
                        acc = acc * alpha[:, None] + tl.dot(pv, v.to(tl.float32), input_precision="ieee")
                    elif IEEE:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                    else:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    m_i = m_new
                some = l_i > 0
                out = acc / tl.where(some, l_i, 1.0)[:, None]
                tl.store(mid_o + (b + r)[:, None] * stride_ob + heads[:, None] * stride_oh + s * stride_os
                         + d[None, :], out, mask=live[:, None] & dmask[None, :])
                tl.store(lse_ptr, tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf")),
                         mask=live)

    @triton.jit
    def _decode_merge_kernel(mid_o, mid_lse, out, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                             stride_b, stride_h, splits, DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        smask = s < splits
        d = tl.arange(0, BLOCK_D)
        dmask = d < DIM
        lse = tl.load(mid_lse + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
        top = tl.max(lse, 0)
        live = lse > float("-inf")
        w = tl.where(live, tl.exp(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        parts = tl.load(mid_o + b * stride_ob + h * stride_oh + s[:, None] * stride_os + d[None, :],
                        mask=live[:, None] & dmask[None, :], other=0.0)
        total = tl.sum(w, 0)
        o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out + b * stride_b + h * stride_h + d, o.to(out.dtype.element_ty), mask=dmask)


def write_kv(kv_layer: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """kv_layer [2, blocks, block_size, kv_heads, dim] (contiguous); key/value [tokens,
    kv_heads, dim] with unit stride in dim; slots [tokens] (-1: skip the row)."""
    tokens, heads, dim = key.shape
    if tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _write_kv_kernel[(tokens, heads)](key, value, kv_layer[0], kv_layer[1], slots,
                                      key.stride(0), key.stride(1), value.stride(0), value.stride(1),
                                      HEADS=heads, DIM=dim, BLOCK_D=triton.next_power_of_2(dim))


class DecodeScratch:
    """The split kernel's partial outputs, [batch, q_heads, splits, dim] float32 and
    their log-sum-exps, kept across calls (and fixed in place for a captured graph)."""

    def __init__(self) -> None:
        self.o: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None

    def take(self, batch: int, heads: int, splits: int, dim: int, device: torch.device):
        need = (batch, heads, splits, dim)
        if self.o is None or self.o.device != device or any(a < b for a, b in zip(self.o.shape, need)):
            self.o = torch.empty(need, dtype=torch.float32, device=device)
            self.lse = torch.empty(need[:3], dtype=torch.float32, device=device)
        return self.o[:batch, :heads, :splits], self.lse[:batch, :heads, :splits]


def rows_per_program(query_heads_per_kv_head: int) -> int:
    """How many rows of one sequence a program of paged_decode attends together: its
    BLOCK_H tile rows are (row, query head) pairs, the GQA group padded to a power of two."""
    return BLOCK_H // triton.next_power_of_2(query_heads_per_kv_head) if triton is not None else 1


def decode_groups(positions: np.ndarray, table: np.ndarray, widths: np.ndarray, rows: int) -> np.ndarray:
    """Which decode rows paged_decode attends together (a verify step's drafts, the next
    positions of one sequence): int32 [n], at a group's first row its row count (at most
    `rows`), 0 at the rows after it. Row i + 1 joins row i's group when it is the next
    position and its table's first widths[i] blocks are row i's (so the group's last row's
    table serves every row); `table` int [n, width] (host), `widths` each row's blocks."""
    n = len(positions)
    out = np.ones(n, dtype=np.int32)
    if n < 2 or rows < 2:
        return out
    nxt = np.flatnonzero(positions[1:] == positions[:-1] + 1)      # row i + 1 is row i's next position
    if not len(nxt):
        return out                                              # a plain step: no table compared
    cols = np.arange(table.shape[1])
    same = ((table[nxt + 1] == table[nxt]) | (cols[None, :] >= widths[nxt, None])).all(1)
    joins = np.zeros(n, dtype=bool)
    joins[nxt[same] + 1] = True
    if not joins.any():
        return out
    starts = np.flatnonzero(~joins)
    run = np.cumsum(~joins) - 1
    at = np.arange(n) - starts[run]                      # place in its run of joined rows
    left = np.diff(np.append(starts, n))[run] - at       # rows of the run from this one on
    return np.where(at % rows == 0, np.minimum(rows, left), 0).astype(np.int32)


def paged_decode(query: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, splits: int, scratch: DecodeScratch, out: torch.Tensor | None = None,
                 tiling: DecodeTiling = TILING, groups: torch.Tensor | None = None) -> torch.Tensor:
    """query [batch, q_heads, dim]; kv_layer [2, blocks, block_size, kv_heads, dim];
    block_table int32 [batch, width] (row i's blocks in order); context_lens int32
    [batch] (tokens attended, the new one's K/V already written; 0 gives zeros);
    groups int32 [batch] (decode_groups: rows attended together, each of their KV tiles
    loaded once for all of them; None: every row alone).
    Returns [batch, q_heads, dim] in the query's dtype (into `out` where given)."""
    batch, q_heads, dim = query.shape
    _, _, block_size, kv_heads, _ = kv_layer.shape
    group = q_heads // kv_heads
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode splits a context into 1-{MAX_SPLITS} parts, not {splits}")
    if group > BLOCK_H:
        raise ValueError(f"paged_decode takes up to {BLOCK_H} query heads per KV head, not {group}")
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    mid_o, mid_lse = scratch.take(batch, q_heads, splits, dim, query.device)
    block_d = triton.next_power_of_2(dim)
    _decode_split_kernel[(batch, kv_heads, splits)](
        query, kv_layer[0], kv_layer[1], block_table, context_lens, context_lens if groups is None else groups,
        mid_o, mid_lse, scale,
        query.stride(0), query.stride(1), block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), splits,
        BLOCK_SIZE=block_size, KV_HEADS=kv_heads, GROUP=group, GROUP_P2=triton.next_power_of_2(group),
        GROUPED=groups is not None, DIM=dim, BLOCK_D=block_d,
        BLOCK_H=BLOCK_H, BLOCK_N=tiling.block_n, IEEE=query.dtype == torch.float32, UPCAST=INTERPRETED,
        num_warps=tiling.warps, num_stages=tiling.stages)
    _decode_merge_kernel[(batch, q_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), splits, DIM=dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS))
    return out


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x, w, out, stride_x, stride_o, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK)
        m = c < n
        v = tl.load(x + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(v * v, 0) / n + eps)
        g = tl.load(w + c, mask=m, other=0.0).to(tl.float32)
        # Llama's order: normalise in float32, round to the input's dtype, then scale.
        # Arithmetic is float32 with each rounding explicit (what a bfloat16 op does;
        # Triton's interpreter gets bfloat16 arithmetic wrong, the casts right).
        ty = out.dtype.element_ty
        y = (v * r).to(ty).to(tl.float32) * g
        tl.store(out + row * stride_o + c, y.to(ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gate_up, out, stride_g, stride_o, inter, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < inter
        g = tl.load(gate_up + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gate_up + row * stride_g + inter + c, mask=m, other=0.0).to(tl.float32)
        ty = out.dtype.element_ty
        s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
        tl.store(out + row * stride_o + c, (s * u).to(ty), mask=m)

    @triton.jit
    def _rotary_kernel(x, cos, sin, stride_t, stride_h, stride_c, heads, HALF: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        h = tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK)
        hm = h < heads
        cm = c < HALF
        m = hm[:, None] & cm[None, :]
        base = x + t * stride_t + h[:, None] * stride_h + c[None, :]
        f = tl.float32
        a = tl.load(base, mask=m, other=0.0).to(f)
        b = tl.load(base + HALF, mask=m, other=0.0).to(f)
        c1 = tl.load(cos + t * stride_c + c, mask=cm, other=0.0).to(f)[None, :]
        c2 = tl.load(cos + t * stride_c + HALF + c, mask=cm, other=0.0).to(f)[None, :]
        s1 = tl.load(sin + t * stride_c + c, mask=cm, other=0.0).to(f)[None, :]
        s2 = tl.load(sin + t * stride_c + HALF + c, mask=cm, other=0.0).to(f)[None, :]
        # x * cos + rotate_half(x) * sin, each product and sum rounded as torch's ops round it
        ty = x.dtype.element_ty
        lo = (a * c1).to(ty).to(f) - (b * s1).to(ty).to(f)
        hi = (b * c2).to(ty).to(f) + (a * s2).to(ty).to(f)
        tl.store(base, lo.to(ty), mask=m)
        tl.store(base + HALF, hi.to(ty), mask=m)


class TritonLayers:
    """RMSNorm, SiLU-and-multiply and rotary embedding as one kernel each on a CUDA
    device, with the interface of the CPU's `NativeLayers` (fusion.LeanDecoderLayer
    takes either): a Llama layer then runs ~14 kernels instead of ~40, which at decode's
    batch sizes is launch time saved, not arithmetic. `threads` is ignored."""
    name = "triton"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 1) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        if rows.shape[0]:
            n = rows.shape[1]
            _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), n, eps,
                                               BLOCK=triton.next_power_of_2(n), num_warps=8 if n > 2048 else 4)
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor, threads: int = 1) -> torch.Tensor:
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        inter = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
        if rows.shape[0]:
            block = 1024
            _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](rows, out, rows.stride(0), out.stride(0),
                                                                         inter, BLOCK=block)
        return out.view(*gate_up.shape[:-1], inter)

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int = 1) -> None:
        """Rotate x [tokens, heads, dim] in place ("rotate half") by cos and sin [tokens,
        dim]; x's tokens and heads may be strided, its last dimension not."""
        tokens, heads, dim = x.shape
        if x.stride(-1) != 1:
            raise ValueError("rotary_ takes x with a contiguous last dimension")
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        if tokens:
            _rotary_kernel[(tokens,)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, HALF=dim // 2,
                                      BLOCK_H=triton.next_power_of_2(heads), BLOCK=triton.next_power_of_2(dim // 2))
