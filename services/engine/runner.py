"""Runs a Hugging Face causal LM over pdserve's paged KV cache, one ragged batch a pass.

The model's own modelling code does all the math; pdserve swaps in one attention
function (registered with transformers' AttentionInterface) that writes each layer's
new K/V into the block pool and attends over the blocks. No transformers cache object
exists, so nothing is concatenated or reallocated per step.

A forward pass runs every token of a step as one packed sequence [1, tokens]: the
linear layers see one tall matrix, whatever mix of sequences it holds. Rows come in
two kinds: single tokens over a cached context (decode), first, then chunks of prompts
(prefill), each attending causally to its own cached prefix and itself.

On CPU, attention runs in native kernels (`services/engine/native`) where they win:
decode reads the blocks in place; bfloat16 prefill has a flash-style kernel for CPUs
with AVX512-BF16 and no AMX (with AMX, torch's SDPA is faster and is used). Elsewhere,
or where they cannot be built, decode gathers each sequence's blocks and uses two
batched matmuls (`_decode_attention`), and prefill uses torch's SDPA.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from services.common.settings import ATTENTION_KERNELS
from services.engine.hardware import has_amx, pick_dtype
from services.engine.kv_cache import KVLayout, KVPoolMemory, compat_hash
from services.engine.native import NativeAttention, NativeBuildError, load_attention

log = logging.getLogger(__name__)

ATTN_IMPL = "pdserve_paged"


@dataclass(frozen=True)
class PrefillSegment:
    """A prompt chunk in a forward pass: tokens at positions start .. start + num_tokens
    of a sequence whose blocks are `block_ids` (positions before `start` are cached)."""
    start: int
    num_tokens: int
    block_ids: list[int]


@dataclass
class ForwardBatch:
    """One step's input, packed: `decode_tokens` (one per sequence, at `decode_positions`
    over `decode_tables`), then each prefill segment's `prefill_tokens`, in order."""
    decode_tokens: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    segments: list[PrefillSegment] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)      # rows whose logits are returned

    @property
    def num_tokens(self) -> int:
        return len(self.decode_tokens) + len(self.prefill_tokens)


@dataclass
class Segment:
    """A prefill segment as the attention function sees it."""
    row: int                            # first row in the packed batch
    num_tokens: int
    prefix_len: int
    context_slots: torch.Tensor | None  # slots of every token attended to, when prefix_len > 0


@dataclass
class NativeDecode:
    kernel: NativeAttention
    block_table: torch.Tensor                   # int64 [rows, widest row's blocks]
    context_lens: torch.Tensor                  # int32 [rows]


@dataclass
class DecodeGroup:
    """Decode rows `rows` (similar context lengths), with block table and mask [rows,
    width * block size] (True = attend) cut to the group's own width."""
    rows: torch.Tensor
    block_table: torch.Tensor
    context_mask: torch.Tensor


@dataclass
class PagedBatch:
    """What the attention function needs for one forward pass."""
    kv: torch.Tensor                    # [layers, 2, blocks, block_size, kv_heads, dim]
    slots: torch.Tensor                 # [tokens] flat slot of each new token's K/V
    num_decode: int = 0
    native: NativeDecode | None = None          # decode rows through the native kernel
    groups: list[DecodeGroup] | None = None     # decode rows through torch's ops
    segments: list[Segment] = field(default_factory=list)
    prefill_kernel: NativeAttention | None = None
    workspace: "Workspace | None" = None
    threads: int = 1
    on_layer: Callable[[int], None] | None = None


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


def _prefill_attention(b: PagedBatch, s: Segment, layer: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, scale: float) -> torch.Tensor:
    """One chunk's causal attention; query [1, heads, n, dim], key/value [1, kv_heads,
    n, dim] (its own new tokens). Returns [n, heads, dim]."""
    if s.prefix_len == 0 and b.prefill_kernel is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    if s.prefix_len == 0:                                   # [tokens, kv_heads, dim] views
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    else:                                                   # the cached prefix and the new tokens
        heads, dim = b.kv.shape[-2:]
        k = b.kv[layer, 0].view(-1, heads, dim).index_select(0, s.context_slots)
        v = b.kv[layer, 1].view(-1, heads, dim).index_select(0, s.context_slots)
    if b.prefill_kernel is not None:
        return b.prefill_kernel.prefill(query[0].transpose(0, 1), k, v, s.prefix_len, scale, b.threads)
    q_len, kv_len = query.shape[2], k.shape[0]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(diagonal=s.prefix_len)
    out = F.scaled_dot_product_attention(query, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    pdserve_batch: PagedBatch | None = None, **_):
    """query: [1, heads, tokens, dim]; key/value: [1, kv_heads, tokens, dim] (new tokens
    only). Returns [1, tokens, heads, dim]."""
    b = pdserve_batch
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _write(b.kv, layer, b.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    _, heads, tokens, dim = query.shape
    out = query.new_empty(1, tokens, heads, dim)
    d = b.num_decode
    if d:
        q = query[0, :, :d].transpose(0, 1)                # [rows, heads, dim]
        if b.native is not None:
            n = b.native
            out[0, :d] = n.kernel.decode(q, b.kv[layer], n.block_table, n.context_lens, scale, b.threads)
        else:
            for g in b.groups:
                out[0].index_copy_(0, g.rows, _decode_attention(q.index_select(0, g.rows), b.kv[layer],
                                                                g.block_table, g.context_mask, scale, b.workspace))
    for s in b.segments:
        rows = slice(s.row, s.row + s.num_tokens)
        out[0, rows] = _prefill_attention(b, s, layer, query[:, :, rows], key[:, :, rows], value[:, :, rows], scale)
    if b.on_layer is not None:
        b.on_layer(layer)
    return out, None


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPL, paged_attention)


def pick_device(requested: str | None = None) -> torch.device:
    if requested and requested != "auto":
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Loads the model once; runs forward passes over a given KV pool."""

    def __init__(self, model_dir: Path, dtype: str = "auto", device: str | None = None,
                 attention: str = "auto", kernel_cache: Path | None = None) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        _register_attention()
        self.device = pick_device(device)
        choice = pick_dtype(dtype, self.device)
        self.dtype_name = choice.name
        self.dtype_reason = choice.reason
        self.model_dir = Path(model_dir)
        config = AutoConfig.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=choice.torch_dtype, attn_implementation=ATTN_IMPL).to(self.device).eval()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.max_model_len = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size = config.vocab_size
        self.workspace = Workspace()
        self.native = self._native(attention, kernel_cache)
        # With AMX, torch's SDPA (oneDNN on AMX tiles) beats the vdpbf16ps kernel: measured
        # 2.3 ms against ~7 ms a layer at 512 tokens on a Sapphire Rapids core.
        self.native_prefill = (self.native is not None and self.native.prefills
                               and self.model.dtype == torch.bfloat16 and not has_amx())

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

    def describe(self) -> str:
        decode = "native" if self.native is not None else "torch"
        prefill = "native" if self.native_prefill else "torch SDPA"
        return (f"{self.dtype_name} ({self.dtype_reason}) on {self.device}; attention: decode {decode}, "
                f"prefill {prefill}")

    def layout(self, num_blocks: int, block_size: int) -> KVLayout:
        return KVLayout(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype_name)

    def compat_hash(self, layout: KVLayout) -> str:
        model_id = f"{self.config.model_type}:{self.config.vocab_size}:{self.config.hidden_size}:{self.model_dir.name}"
        return compat_hash(model_id, layout)

    # ---- one forward pass ----
    @torch.inference_mode()
    def execute(self, pool: KVPoolMemory, batch: ForwardBatch,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Run `batch`; returns the logits of its `sample_rows`, [rows, vocab] float32."""
        bs = pool.layout.block_size
        paged = PagedBatch(kv=pool.tensor, slots=torch.empty(0, dtype=torch.long), on_layer=on_layer,
                           num_decode=len(batch.decode_tokens), threads=torch.get_num_threads(),
                           prefill_kernel=self.native if self.native_prefill else None, workspace=self.workspace)
        slots: list[torch.Tensor] = []
        if batch.decode_tokens:
            slots.append(self._decode_slots(paged, batch.decode_positions, batch.decode_tables, pool))
        positions = [torch.tensor(batch.decode_positions, dtype=torch.long)]
        row = paged.num_decode
        for seg in batch.segments:
            seg_slots = self._slots(seg.block_ids, seg.start, seg.start + seg.num_tokens, bs)
            slots.append(seg_slots)
            context = self._slots(seg.block_ids, 0, seg.start + seg.num_tokens, bs) if seg.start else None
            paged.segments.append(Segment(row, seg.num_tokens, seg.start, context))
            positions.append(torch.arange(seg.start, seg.start + seg.num_tokens))
            row += seg.num_tokens
        paged.slots = torch.cat(slots).to(self.device)
        ids = torch.tensor([batch.decode_tokens + batch.prefill_tokens], dtype=torch.long, device=self.device)
        pos = torch.cat(positions).to(self.device).unsqueeze(0)
        hidden = self.model.model(input_ids=ids, position_ids=pos, use_cache=False,
                                  pdserve_batch=paged).last_hidden_state
        rows = torch.tensor(batch.sample_rows, dtype=torch.long, device=self.device)
        return self.model.lm_head(hidden[0].index_select(0, rows)).float()

    def _slots(self, block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
        return blocks * block_size + pos % block_size

    def _decode_slots(self, paged: PagedBatch, positions: list[int], tables: list[list[int]],
                      pool: KVPoolMemory) -> torch.Tensor:
        """Decode rows' slots (CPU), with their block tables set up on `paged` for the
        native kernel or for torch's grouped path."""
        bs = pool.layout.block_size
        widths = [p // bs + 1 for p in positions]           # blocks holding positions 0..p
        for t, w, p in zip(tables, widths, positions):
            if len(t) < w:
                raise ValueError(f"a block table of {len(t)} blocks cannot hold position {p}")
        width = max(widths)
        table = torch.tensor([list(t[:w]) + [0] * (width - w) for t, w in zip(tables, widths)], dtype=torch.long)
        if int(table.min()) < 0 or int(table.max()) >= pool.layout.num_blocks:   # the kernel trusts its ids
            raise ValueError(f"block ids must lie in [0, {pool.layout.num_blocks})")
        pos = torch.tensor(positions, dtype=torch.long)
        slots = table[torch.arange(len(positions)), pos // bs] * bs + pos % bs
        if self.native is not None:
            paged.native = NativeDecode(self.native, table, (pos + 1).to(torch.int32))
            return slots
        order = sorted(range(len(positions)), key=lambda i: positions[i])
        paged.groups = []
        for start, stop in length_groups([widths[i] for i in order]):
            rows = torch.tensor(order[start:stop], dtype=torch.long)
            w = widths[order[stop - 1]]
            mask = torch.arange(w * bs)[None, :] <= pos[rows, None]
            paged.groups.append(DecodeGroup(rows.to(self.device), table[rows, :w].to(self.device),
                                            mask.to(self.device)))
        return slots

    # ---- single-purpose passes (benchmarks, tests) ----
    def prefill(self, pool: KVPoolMemory, token_ids: list[int], block_ids: list[int], start: int = 0,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute KV for `token_ids` at positions start.. (the first `start` tokens are
        already in `block_ids`); returns the last token's logits [vocab] in float32."""
        batch = ForwardBatch(prefill_tokens=list(token_ids), segments=[PrefillSegment(start, len(token_ids),
                                                                                     list(block_ids))],
                             sample_rows=[len(token_ids) - 1])
        return self.execute(pool, batch, on_layer)[0]

    def decode(self, pool: KVPoolMemory, last_tokens: list[int], positions: list[int],
               block_tables: list[list[int]]) -> torch.Tensor:
        """One token per sequence at `positions`; returns logits [batch, vocab] in float32."""
        batch = ForwardBatch(decode_tokens=list(last_tokens), decode_positions=list(positions),
                             decode_tables=[list(t) for t in block_tables], sample_rows=list(range(len(positions))))
        return self.execute(pool, batch)
