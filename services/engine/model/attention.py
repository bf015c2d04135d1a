"""Attention over the paged KV cache: the function transformers calls in each layer.

It hands the layer to the step's execution backend (backends.py), which writes the
layer's new K/V into the block pool, then attends. A forward pass's rows come in two
kinds: single tokens over a cached context (decode), first, then chunks of prompts
(prefill), each attending causally to its own cached prefix and itself.

This module holds what every backend shares: the step's data (`PagedBatch`, and the
decode rows' tables in the form each backend reads), and torch's reference ops, which
the torch backend runs and the others fall back to: decode gathers each sequence's
blocks and uses two batched matmuls; prefill runs in torch's SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from services.engine.model.device import Fence, HostStream


@dataclass
class Segment:
    """A prefill segment as the attention function sees it."""
    row: int                            # first row in the packed batch
    num_tokens: int
    prefix_len: int
    context_slots: torch.Tensor | None  # slots of every token attended to, when prefix_len > 0


@dataclass
class NativeDecode:
    """Decode rows through the native kernel: int64 tables and int32 lengths on the host."""
    block_table: torch.Tensor                   # int64 [rows, widest row's blocks]
    context_lens: torch.Tensor                  # int32 [rows]


@dataclass
class GPUDecode:
    """Decode rows through `gpu_kernels.paged_decode`: int32 tables and lengths on the
    device, the split count for this batch size, the kernel's scratch, and which rows it
    attends together (`gpu_kernels.decode_groups`; None: each alone)."""
    block_table: torch.Tensor                   # int32 [rows, width]
    context_lens: torch.Tensor                  # int32 [rows]
    splits: int
    scratch: object                             # gpu_kernels.DecodeScratch
    groups: torch.Tensor | None = None          # int32 [rows]


@dataclass
class DecodeGroup:
    """Decode rows `rows` (similar context lengths), with block table and mask [rows,
    width * block size] (True = attend) cut to the group's own width."""
    rows: torch.Tensor
    block_table: torch.Tensor
    context_mask: torch.Tensor


@dataclass
class PagedBatch:
    """One forward pass's data for the attention function, and the backend that runs it."""
    kv: torch.Tensor                    # [layers, 2, blocks, block_size, kv_heads, dim]
    slots: torch.Tensor                 # [tokens] flat slot of each new token's K/V
    backend: object                     # the runner's execution backend (backends.py)
    num_decode: int = 0
    # the decode rows' tables, as the backend made them (`Backend.decode_rows`)
    decode: NativeDecode | GPUDecode | list[DecodeGroup] | None = None
    segments: list[Segment] = field(default_factory=list)
    workspace: "Workspace | None" = None
    threads: int = 1
    on_layer: Callable[[int, Fence], None] | None = None     # layer L's KV is written (once the fence passes)
    stream: HostStream = field(default_factory=HostStream)


def decode_widths(positions: list[int], tables: list[list[int]], block_size: int) -> list[int]:
    """Each decode row's blocks in use (those holding positions 0..p); ValueError for a
    table too short to hold its position."""
    widths = [p // block_size + 1 for p in positions]
    for t, w, p in zip(tables, widths, positions):
        if len(t) < w:
            raise ValueError(f"a block table of {len(t)} blocks cannot hold position {p}")
    return widths


def check_block_ids(lowest: int, highest: int, num_blocks: int) -> None:
    """The kernels trust their block ids: ValueError for any outside the pool."""
    if lowest < 0 or highest >= num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks})")


def length_groups(widths: list[int], min_width: int = 8) -> list[tuple[int, int]]:
    """Cut ascending block counts into runs whose longest is at most twice the first
    (or at most `min_width` blocks): a short sequence batched with a long one then
    gathers at most twice its own context instead of the longest one's. Returns
    [start, stop) ranges."""
    cuts, first = [0], widths[0] if widths else 0
    for i, w in enumerate(widths):
        if w > max(2 * first, min_width):
            cuts.append(i)
            first = w
    return list(zip(cuts, cuts[1:] + [len(widths)]))


class Workspace:
    """Scratch memory reused by every layer and step: decode gathers each layer's
    context into it instead of allocating (a fresh multi-MiB tensor per layer costs
    page faults on every touch once the allocator hands the memory back)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._bufs[name] = buf
        return buf[:n].view(shape)


def write(kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """key/value: [tokens, kv_heads, dim]."""
    heads, dim = kv.shape[-2:]
    kv[layer, 0].view(-1, heads, dim).index_copy_(0, slots, key)
    kv[layer, 1].view(-1, heads, dim).index_copy_(0, slots, value)


def decode_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor,
                      scale: float, ws: Workspace) -> torch.Tensor:
    """One query token per sequence over its blocks; query [batch, q_heads, dim], kv
    [2, blocks, block_size, kv_heads, dim] (one layer). The blocks are gathered with one
    row copy per block (index_select, not advanced indexing) into [2, batch, kv_heads,
    ctx, dim], and attention is two batched matmuls per KV head group: at one query
    token that beats the fused CPU kernels, whose blocking is built for long queries.
    Softmax runs in float32. Returns [batch, q_heads, dim]."""
    batch, q_heads, dim = query.shape
    _, blocks, block_size, kv_heads, _ = kv.shape
    ctx = block_table.shape[1] * block_size
    rows = kv.view(2, blocks, -1)
    gathered = ws.take("gather", (2, block_table.numel(), rows.shape[2]), kv)
    torch.index_select(rows, 1, block_table.flatten(), out=gathered)
    kv_ctx = ws.take("context", (2, batch, kv_heads, ctx, dim), kv)
    kv_ctx.copy_(gathered.view(2, batch, ctx, kv_heads, dim).transpose(2, 3))
    k, v = kv_ctx
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale            # [batch, kv_heads, group, ctx]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, q_heads, dim)


def chunk_kv(b: PagedBatch, s: Segment, layer: int, key: torch.Tensor,
             value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a prompt chunk attends to, [tokens, kv_heads, dim] each: its own new K/V
    (key/value [1, kv_heads, n, dim], as views), or with a cached prefix, the prefix's
    and its own gathered from the pool (written there already)."""
    if s.prefix_len == 0:
        return key[0].transpose(0, 1), value[0].transpose(0, 1)
    heads, dim = b.kv.shape[-2:]
    return (b.kv[layer, 0].view(-1, heads, dim).index_select(0, s.context_slots),
            b.kv[layer, 1].view(-1, heads, dim).index_select(0, s.context_slots))


def prefill_attention(b: PagedBatch, s: Segment, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk's causal attention in torch's SDPA; query [1, heads, n, dim], key/value
    [1, kv_heads, n, dim] (its own new tokens). Returns [n, heads, dim]."""
    if s.prefix_len == 0:
        # on a GPU in float32 (no flash attention), blocked as over a prefix: the math
        # kernel materialises heads x n x n scores, ~26 GB for an 8k chunk of an 8B model
        rows = prefix_rows(query.shape[1], key.shape[2], query.dtype, query.shape[-1]) \
            if query.device.type != "cpu" else None
        if rows is not None and rows < query.shape[2]:
            return attend_over_prefix(query, key, value, 0, scale, rows)[0].transpose(0, 1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    k, v = chunk_kv(b, s, layer, key, value)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if query.device.type != "cpu":
        rows = prefix_rows(query.shape[1], k.shape[2], query.dtype, query.shape[-1])
        return attend_over_prefix(query, k, v, s.prefix_len, scale, rows)[0].transpose(0, 1)
    q_len, kv_len = query.shape[2], k.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(diagonal=s.prefix_len)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# A chunk over a cached prefix, on a GPU: SDPA runs flash attention with a lower-right
# causal mask in half precision, scores never materialised. Elsewhere (float32) it
# materialises heads x rows x context scores and their softmax, so the chunk goes in
# blocks of query rows whose scores stay within this: an 8k chunk over a 32k context of
# an 8B model, in one call, needed ~34 GB.
PREFIX_SCORES_BYTES = 256 * 2**20


def prefix_rows(heads: int, kv_len: int, dtype: torch.dtype, head_dim: int) -> int | None:
    """Query rows per SDPA call for a chunk over a cached prefix of a context `kv_len`
    long; None: every row in one call (flash attention materialises nothing)."""
    if dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return None
    return max(1, PREFIX_SCORES_BYTES // (heads * kv_len * 4 * 2))


def attend_over_prefix(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_len: int, scale: float,
                       rows: int | None) -> torch.Tensor:
    """Causal attention of `query` [1, heads, n, dim] (the chunk's tokens, which follow
    `prefix_len` cached ones) over k/v [1, kv_heads, prefix_len + n, dim], `rows` query
    rows a call (None: all): rows r0..r1 see keys up to prefix_len + r1, lower-right
    aligned. Returns [1, heads, n, dim]."""
    from torch.nn.attention.bias import causal_lower_right
    n = query.shape[2]
    out = []
    for r0 in range(0, n, rows or n):
        r1 = min(n, r0 + (rows or n))
        seen = prefix_len + r1
        out.append(F.scaled_dot_product_attention(query[:, :, r0:r1], k[:, :, :seen], v[:, :, :seen],
                                                  attn_mask=causal_lower_right(r1 - r0, seen), scale=scale,
                                                  enable_gqa=True))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    pdserve_batch: PagedBatch | None = None, **_):
    """query: [1, heads, tokens, dim]; key/value: [1, kv_heads, tokens, dim] (new tokens
    only). Returns [1, tokens, heads, dim]."""
    b = pdserve_batch
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _, heads, tokens, dim = query.shape
    out = query.new_empty(1, tokens, heads, dim)
    b.stream.launch(lambda: b.backend.attend(b, layer, query, key, value, scale, out))
    if b.on_layer is not None:
        b.on_layer(layer, b.stream.record())
    b.stream.ready()
    return out, None
