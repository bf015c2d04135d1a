"""Runs a Hugging Face causal LM over pdserve's paged KV cache.

The model's own modelling code does all the math; pdserve swaps in one attention
function (registered with transformers' AttentionInterface) that writes each layer's
new K/V into the block pool and attends over the blocks. No transformers cache object
exists, so nothing is concatenated or reallocated per step.

On CPU, attention runs in native kernels (`services/engine/native`): decode reads the
blocks in place, and bfloat16 prefill is a flash-style kernel on CPUs with AVX512-BF16.
Elsewhere, or where they cannot be built, decode gathers each sequence's blocks and
uses two batched matmuls (`_decode_attention`), and prefill uses torch's SDPA.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from kv_transfer.memory import KVLayout, KVPoolMemory, compat_hash
from services.common.settings import ATTENTION_KERNELS
from services.engine.native import NativeAttention, NativeBuildError, load_attention

log = logging.getLogger(__name__)

ATTN_IMPL = "pdserve_paged"


@dataclass
class PagedBatch:
    """What the attention function needs for one forward pass."""
    kv: torch.Tensor                    # [layers, 2, blocks, block_size, kv_heads, dim]
    slots: torch.Tensor                 # [new tokens] flat slot of each new token's K/V
    # prefill (one sequence): slots of every token attended to, cached prefix included
    context_slots: torch.Tensor | None = None
    prefix_len: int = 0
    # decode (one new token per sequence): rows sorted by context length and cut into
    # groups of similar length, each gathering only as many blocks as its longest
    groups: "list[DecodeGroup] | None" = None
    workspace: "Workspace | None" = None
    # decode through the native kernel: every row's block ids and context length
    native: "NativeDecode | None" = None
    prefill_kernel: NativeAttention | None = None   # prefill through the native kernel
    threads: int = 1                            # the native kernels' threads
    on_layer: Callable[[int], None] | None = None


@dataclass
class NativeDecode:
    kernel: NativeAttention
    block_table: torch.Tensor                   # int64 [rows, widest row's blocks]
    context_lens: torch.Tensor                  # int32 [rows]


@dataclass
class DecodeGroup:
    """Rows start:stop of a decode batch, with block table and mask [rows, width * block
    size] (True = attend) cut to the group's own width."""
    start: int
    stop: int
    block_table: torch.Tensor                   # [rows, blocks]
    context_mask: torch.Tensor


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


def _write(kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """key/value: [tokens, kv_heads, dim]."""
    heads, dim = kv.shape[-2:]
    kv[layer, 0].view(-1, heads, dim).index_copy_(0, slots, key)
    kv[layer, 1].view(-1, heads, dim).index_copy_(0, slots, value)


def _decode_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, mask: torch.Tensor,
                      scaling: float | None, ws: Workspace) -> torch.Tensor:
    """One query token per sequence over its blocks. kv: [2, blocks, block_size, kv_heads,
    dim] (one layer). The blocks are gathered with one row copy per block (index_select,
    not advanced indexing) into [2, batch, kv_heads, ctx, dim], and attention is two
    batched matmuls per KV head group: at one query token that beats the fused CPU
    kernels, whose blocking is built for long queries. Softmax runs in float32."""
    batch, q_heads, _, dim = query.shape
    _, blocks, block_size, kv_heads, _ = kv.shape
    ctx = block_table.shape[1] * block_size
    rows = kv.view(2, blocks, -1)
    gathered = ws.take("gather", (2, block_table.numel(), rows.shape[2]), kv)
    torch.index_select(rows, 1, block_table.flatten(), out=gathered)
    kv_ctx = ws.take("context", (2, batch, kv_heads, ctx, dim), kv)
    kv_ctx.copy_(gathered.view(2, batch, ctx, kv_heads, dim).transpose(2, 3))
    k, v = kv_ctx
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
    scale = scaling if scaling is not None else dim ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale            # [batch, kv_heads, group, ctx]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(batch, q_heads, 1, dim)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    pdserve_batch: PagedBatch | None = None, **_):
    """query: [batch, heads, q_len, dim]; key/value: [batch, kv_heads, q_len, dim] (new tokens only)."""
    b = pdserve_batch
    layer = module.layer_idx
    kv = b.kv
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if b.groups is None and b.native is None:                   # prefill, one sequence
        _write(kv, layer, b.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        if b.prefix_len == 0 and b.prefill_kernel is None:
            out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            if b.prefix_len == 0:                               # [tokens, kv_heads, dim] views
                k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
            else:                                               # the cached prefix and the new tokens
                heads, dim = kv.shape[-2:]
                k = kv[layer, 0].view(-1, heads, dim).index_select(0, b.context_slots)
                v = kv[layer, 1].view(-1, heads, dim).index_select(0, b.context_slots)
            if b.prefill_kernel is not None:
                out = b.prefill_kernel.prefill(query[0].transpose(0, 1), k, v, b.prefix_len, scale, b.threads)
                out = out.unsqueeze(0).transpose(1, 2)           # [1, heads, q_len, dim], a view
            else:
                q_len, kv_len = query.shape[2], k.shape[0]
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(diagonal=b.prefix_len)
                out = F.scaled_dot_product_attention(query, k.transpose(0, 1).unsqueeze(0),
                                                     v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scaling,
                                                     enable_gqa=True)
    else:                                                       # decode, one token per sequence
        _write(kv, layer, b.slots, key[:, :, 0], value[:, :, 0])
        if b.native is not None:
            n = b.native
            out = n.kernel.decode(query[:, :, 0], kv[layer], n.block_table, n.context_lens, scale,
                                  b.threads).unsqueeze(2)
        else:
            outs = [_decode_attention(query[g.start:g.stop], kv[layer], g.block_table, g.context_mask, scaling,
                                      b.workspace) for g in b.groups]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if b.on_layer is not None:
        b.on_layer(layer)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPL, paged_attention)


def pick_device(requested: str | None = None) -> torch.device:
    if requested and requested != "auto":
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Loads the model once; runs prefill and decode passes over a given KV pool."""

    def __init__(self, model_dir: Path, dtype: str = "bfloat16", device: str | None = None,
                 attention: str = "auto", kernel_cache: Path | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        _register_attention()
        self.device = pick_device(device)
        self.dtype_name = dtype
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=getattr(torch, dtype), attn_implementation=ATTN_IMPL).to(self.device).eval()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = config.vocab_size
        self.workspace = Workspace()
        self.native = self._native(attention, kernel_cache)
        self.native_prefill = self.native is not None and self.native.prefills and self.model.dtype == torch.bfloat16

    def _native(self, attention: str, kernel_cache: Path | None) -> NativeAttention | None:
        """The native kernels for `attention` "native" (required) or "auto" (where they
        apply and build), else None: the torch path."""
        if attention not in ATTENTION_KERNELS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, not {attention!r}")
        if attention == "torch":
            return None
        if not NativeAttention.supports(self.model.dtype, self.device):
            if attention == "native":
                raise ValueError(f"the native attention kernels run on CPU in float32 or bfloat16, "
                                 f"not {self.device} {self.dtype_name}")
            return None
        if kernel_cache is None:
            from services.engine.model_store import cache_dir
            kernel_cache = cache_dir()
        try:
            return load_attention(kernel_cache)
        except NativeBuildError as e:
            if attention == "native":
                raise
            log.warning("attention stays on torch's own ops: %s", e)
            return None

    def layout(self, num_blocks: int, block_size: int) -> KVLayout:
        return KVLayout(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype_name)

    def compat_hash(self, layout: KVLayout) -> str:
        model_id = f"{self.config.model_type}:{self.config.vocab_size}:{self.config.hidden_size}:{self.model_dir.name}"
        return compat_hash(model_id, layout)

    def _slots(self, block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
        return (blocks * block_size + pos % block_size).to(self.device)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: PagedBatch,
                 last: torch.Tensor | None) -> torch.Tensor:
        hidden = self.model.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                  pdserve_batch=batch).last_hidden_state
        hidden = hidden[:, -1] if last is None else hidden[last]
        return self.model.lm_head(hidden).float()

    @torch.inference_mode()
    def prefill(self, pool: KVPoolMemory, token_ids: list[int], block_ids: list[int], start: int = 0,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute KV for `token_ids` at positions start.. (the first `start` tokens are
        already in `block_ids`); returns the last token's logits [vocab] in float32."""
        bs = pool.layout.block_size
        end = start + len(token_ids)
        batch = PagedBatch(kv=pool.tensor, slots=self._slots(block_ids, start, end, bs), prefix_len=start,
                           on_layer=on_layer, prefill_kernel=self.native if self.native_prefill else None,
                           threads=torch.get_num_threads())
        if start:
            batch.context_slots = self._slots(block_ids, 0, end, bs)
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        return self._forward(ids, pos, batch, None)[0]

    @torch.inference_mode()
    def decode(self, pool: KVPoolMemory, last_tokens: list[int], positions: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """One token per sequence at `positions`; returns logits [batch, vocab] in float32.

        The rows run in order of context length, cut into groups of similar length
        (`length_groups`), so one long sequence does not make every other sequence in
        the batch gather its context length; the logits come back in the caller's order."""
        bs = pool.layout.block_size
        if self.native is not None:
            return self._decode_native(pool, last_tokens, positions, block_tables)
        order = sorted(range(len(positions)), key=lambda i: positions[i])
        tables = [block_tables[i] for i in order]
        pos = torch.tensor([positions[i] for i in order], dtype=torch.long)
        widths = [p // bs + 1 for p in pos.tolist()]            # blocks holding positions 0..p
        table = torch.zeros(len(tables), widths[-1], dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, :widths[i]] = torch.tensor(t[:widths[i]], dtype=torch.long)
        slots = table[torch.arange(len(tables)), pos // bs] * bs + pos % bs
        groups = []
        for start, stop in length_groups(widths):
            width = widths[stop - 1]
            mask = torch.arange(width * bs)[None, :] <= pos[start:stop, None]
            groups.append(DecodeGroup(start, stop, table[start:stop, :width].to(self.device), mask.to(self.device)))
        batch = PagedBatch(kv=pool.tensor, slots=slots.to(self.device), groups=groups, workspace=self.workspace)
        ids = torch.tensor([last_tokens[i] for i in order], dtype=torch.long, device=self.device).unsqueeze(1)
        logits = self._forward(ids, pos.to(self.device).unsqueeze(1), batch, None)
        if order == list(range(len(order))):
            return logits
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order)] = torch.arange(len(order))
        return logits[back.to(self.device)]

    def _decode_native(self, pool: KVPoolMemory, last_tokens: list[int], positions: list[int],
                       block_tables: list[list[int]]) -> torch.Tensor:
        """decode() through the native kernel: each row reads only its own blocks, so
        rows need no sorting or grouping."""
        bs = pool.layout.block_size
        widths = [p // bs + 1 for p in positions]
        width = max(widths)
        rows = []
        for t, w in zip(block_tables, widths):
            if len(t) < w:
                raise ValueError(f"a block table of {len(t)} blocks cannot hold position {(w - 1) * bs}")
            rows.append(list(t[:w]) + [0] * (width - w))
        table = torch.tensor(rows, dtype=torch.long)
        if int(table.min()) < 0 or int(table.max()) >= pool.layout.num_blocks:   # the kernel trusts its ids
            raise ValueError(f"block ids must lie in [0, {pool.layout.num_blocks})")
        pos = torch.tensor(positions, dtype=torch.long)
        slots = table[torch.arange(len(positions)), pos // bs] * bs + pos % bs
        native = NativeDecode(self.native, table, (pos + 1).to(torch.int32))
        batch = PagedBatch(kv=pool.tensor, slots=slots, native=native, threads=torch.get_num_threads())
        ids = torch.tensor(last_tokens, dtype=torch.long).unsqueeze(1)
        return self._forward(ids, pos.unsqueeze(1), batch, None)
