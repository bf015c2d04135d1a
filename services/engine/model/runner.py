"""Runs a Hugging Face causal LM over pdserve's paged KV cache, one ragged batch a pass.

The model's own modelling code does the math; pdserve swaps in one attention function
(registered with transformers' AttentionInterface, `attention.paged_attention`) that
writes each layer's new K/V into the block pool and attends over the blocks, and
faster equivalents of known layers (`fusion`). No transformers cache object exists, so
nothing is concatenated or reallocated per step.

A forward pass runs every token of a step as one packed sequence [1, tokens]: the
linear layers see one tall matrix, whatever mix of sequences it holds: single tokens
over a cached context (decode) first, then chunks of prompts (prefill).

Which kernels run is the execution backend's choice, made once at start
(backends.py): on a CUDA device Triton kernels that read and write the blocks in place,
and decode-only steps replayed from CUDA graphs (`cuda_graphs`); on a CPU pdserve's
native kernels where they build and win; torch's own ops otherwise, or with
`--attention-kernel torch`.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from services.common.devices import device_type
from services.common.settings import QUANTIZATIONS
from services.engine.model import backends
from services.engine.core.scheduler import PROMPT_LOGPROB_ROWS
from services.engine.model.attention import (PREFIX_SCORES_BYTES, PagedBatch, Segment, Workspace, check_block_ids,
                                             decode_widths, paged_attention)
from services.engine.model.cuda_graphs import DecodeGraphs
from services.engine.model.device import Fence, stream_for, to_device, use_device
from services.engine.model.hardware import pick_dtype
from services.engine.model.int8 import CALIBRATION_TEXT
from services.engine.model.kv_cache import (CPU_KV_TOKENS, KVLayout, KVPoolMemory, compat_hash, device_memory,
                                            tokens_for_memory)
from services.engine.model.parallel import (Command, RankGroup, TensorParallel, drop_head, encode_batch,
                                             load_shard, shard_model)
from services.engine.model.shapes import head_dim, layer_matmul_weights
from services.engine.text.model_store import context_length

log = logging.getLogger(__name__)

ATTN_IMPL = "pdserve_paged"

# A step whose prompt chunks hold at most this many tokens runs whole in the one-call
# decoder (`NativeDecoder`), each prompt token a decode row over its sequence's blocks
# (as a verify chunk's drafts are): its K/V is written before any row attends, so the
# rows attend causally, a chunk's rows as one group (attention.c: each tile of keys read
# once for up to 16 rows). Measured on an AVX512-BF16 CPU, one thread, bfloat16
# SmolLM2-135M (ms, the layer-by-layer pass / the one call): 10 tokens after 40 cached
# 23 / 16; 64 tokens after 192 with 32 decode rows 196 / 139, alone 94 / 95. Since rows
# attend in groups (Zen 4): 64 after 960 with 8 decode rows 177 / 133, 128 after 500 with
# 8 rows 234 / 214, 256 after 700 with 8 rows 439 / 404, 256 from the start with 32 rows
# 385 / 352, alone 321 / 291, 512 alone 637 / 621. With a layer hook (a prefill worker's
# KV push) a step keeps to DECODER_PROMPT_TOKENS: the call returns before any layer is
# handed on, so a larger chunk would hold back the push it overlaps with. Without one,
# up to ONE_CALL_PROMPT_TOKENS (`one_call_tokens`).
DECODER_PROMPT_TOKENS = 64
ONE_CALL_PROMPT_TOKENS = 256


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
    # Rows whose logits are returned after those: prompt positions whose next prompt
    # token's log probability was asked for (services/engine/engine.py).
    logprob_rows: list[int] = field(default_factory=list)
    # Async scheduling: decode rows whose token the step before sampled and the host has
    # not read: row pending_rows[i] takes pending_tokens[pending_sources[i]] on the device.
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    pending_tokens: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.decode_tokens) + len(self.prefill_tokens)


def as_decode_rows(batch: ForwardBatch) -> ForwardBatch:
    """`batch` with each prompt chunk's tokens as decode rows of their own (each at its
    position, over its sequence's blocks), after the decode rows: the same rows in the
    same order, so its sample, log-probability and pending rows stand as they are."""
    positions = [p for seg in batch.segments for p in range(seg.start, seg.start + seg.num_tokens)]
    tables = [seg.block_ids for seg in batch.segments for _ in range(seg.num_tokens)]
    return dataclasses.replace(batch, decode_tokens=batch.decode_tokens + batch.prefill_tokens,
                               decode_positions=batch.decode_positions + positions,
                               decode_tables=batch.decode_tables + tables, prefill_tokens=[], segments=[])


def check_batch(batch: ForwardBatch, layout: KVLayout) -> None:
    """ValueError for a batch whose block tables could not hold its positions or name
    blocks outside the pool: what the forward pass would refuse, found before it starts."""
    bs = layout.block_size
    decode_widths(batch.decode_positions, batch.decode_tables, bs)
    tables = [t for t in batch.decode_tables if t] + [s.block_ids for s in batch.segments if s.block_ids]
    if tables:
        check_block_ids(min(map(min, tables)), max(map(max, tables)), layout.num_blocks)
    for seg in batch.segments:
        if len(seg.block_ids) * bs < seg.start + seg.num_tokens:
            raise ValueError(f"a block table of {len(seg.block_ids)} blocks cannot hold position "
                             f"{seg.start + seg.num_tokens - 1}")


def _register_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPL, paged_attention)


def pick_device(requested: str | None = None) -> torch.device:
    if requested and requested != "auto":
        return torch.device(requested)
    return torch.device(device_type())


class ModelRunner:
    """Loads the model once; runs forward passes over a given KV pool."""

    def __init__(self, model_dir: Path, dtype: str = "auto", device: str | None = None,
                 attention: str = "auto", kernel_cache: Path | None = None, max_model_len: int = 0,
                 quantization: str = "none", cuda_graphs: bool = True, max_batch: int = 64,
                 model: torch.nn.Module | None = None, group: RankGroup | None = None, matmul: str = "auto",
                 role: str = "", own_threads: int = 0) -> None:
        """`model`: an already built model (random weights of a real shape, for
        benchmarks) instead of loading `model_dir`'s; `max_batch`: the largest decode
        step captured as a CUDA graph; `group`: this rank's place among a worker's
        tensor-parallel ranks (parallel.py), its shard of the model kept; `matmul`:
        --matmul-kernel, measured at the rows a worker of `role` multiplies, on
        `own_threads` of torch's threads (0: all; kernel_choice.py)."""
        from transformers import AutoConfig, AutoModelForCausalLM
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
        self.quantization = quantization
        _register_attention()
        # current for this thread (the one that loads the model and captures graphs);
        # the engine's threads make it theirs too
        self.device = use_device(pick_device(device))
        self.stream = stream_for(self.device)           # where KV writes run; see device.py
        choice = pick_dtype(dtype, self.device)
        self.dtype_name = choice.name
        self.dtype_reason = choice.reason
        self.model_dir = Path(model_dir)
        self.group = group
        self.tp = group.tp if group is not None else TensorParallel()
        if quantization != "none" and self.tp.size > 1:
            raise ValueError("int8 layers and tensor parallelism do not combine yet: use one or the other")
        sharded = False
        if model is not None:
            config = model.config
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(ATTN_IMPL)
            else:
                config._attn_implementation = ATTN_IMPL
            self.model = model.to(self.device, choice.torch_dtype).eval()
        else:
            config = AutoConfig.from_pretrained(self.model_dir)
            self.model = None
            if self.tp.size > 1:            # this rank's slices alone, read from the checkpoint
                self.model = load_shard(self.model_dir, config, self.tp, choice.torch_dtype, self.device,
                                        group.all_reduce, ATTN_IMPL)
                sharded = self.model is not None
            if self.model is None:
                # Straight onto the device: loading a large model on the host first needs its whole
                # size in host memory (more than a pod's limit above ~14B parameters in bf16).
                placement = {} if self.device.type == "cpu" else {"device_map": str(self.device)}
                self.model = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=choice.torch_dtype, attn_implementation=ATTN_IMPL,
                    **placement).to(self.device).eval()
        self.config = config
        if self.tp.size > 1 and not sharded:
            shard_model(self.model, self.tp, group.all_reduce)
            drop_head(self.model, self.tp)
        self.num_layers = config.num_hidden_layers
        self.total_kv_heads = config.num_key_value_heads
        self.kv_heads = self.tp.kv_heads(self.total_kv_heads)       # the global KV heads in this rank's pool
        self.num_kv_heads = len(self.kv_heads)
        self.head_dim = head_dim(config)
        self.max_model_len = context_length(config, max_model_len)
        self.vocab_size = config.vocab_size
        self.workspace = Workspace()
        if kernel_cache is None:
            from services.engine.text.model_store import cache_dir
            kernel_cache = cache_dir()
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        self.backend = backends.select(attention, self.device, self.model.dtype, quantization, kernel_cache,
                                       self.dtype_name, matmul, layers[0] if layers else None, role, own_threads,
                                       config.num_attention_heads // self.total_kv_heads)
        calibration = None
        if quantization != "none":
            from services.engine.text.tokenizer import load_tokenizer
            calibration = load_tokenizer(self.model_dir)(CALIBRATION_TEXT)["input_ids"]
        self.fusions = self.backend.fuse(self.model, quantization, calibration)
        self.decoder = self.backend.decoder(self.model)
        self.graph_sizes = self.backend.graph_sizes(self.model, max_batch, cuda_graphs)
        self._graphs: DecodeGraphs | None = None

    @property
    def leads(self) -> bool:
        """Rank 0 of several: each step is sent to the other ranks first."""
        return self.tp.size > 1 and self.tp.rank == 0

    @property
    def context_cost(self) -> float:
        """Attending one token of context, as a share of one token's decoder-layer
        matmuls, in FLOPs: 4 x query heads x head dim a layer (scores and values) over
        twice the layers' weights (the scheduler sizes prompt chunks beside decoding rows
        by it)."""
        return 4 * self.config.num_attention_heads * self.head_dim / (2 * layer_matmul_weights(self.config))

    def describe(self) -> str:
        decode = self.backend.decode_kernel
        if self.graph_sizes:
            decode += f", CUDA graphs for 1-{self.graph_sizes[-1]} sequences"
        if self.decoder is not None:
            decode += (f", its layers in one call (with prompt chunks of up to {ONE_CALL_PROMPT_TOKENS} tokens, "
                       f"{DECODER_PROMPT_TOKENS} where each layer's KV is pushed as it is written)")
        prefill = self.backend.prefill_kernel
        weights = "" if self.quantization == "none" else f", {self.quantization} weights"
        choice = getattr(self.backend, "matmul_choice", None)
        if choice is not None:
            weights += f", {'pdserve' if choice.native else 'oneDNN'} matmuls ({choice.reason})"
        if self.tp.size > 1:
            heads = self.kv_heads
            weights += f", tensor parallel over {self.tp.size} ranks (KV heads {heads.start}-{heads.stop - 1} here)"
        return (f"{self.dtype_name} ({self.dtype_reason}){weights} on {self.device}; attention: decode {decode}, "
                f"prefill {prefill}; fused: {', '.join(self.fusions) or 'nothing'}")

    def activation_bytes(self, tokens: int, rows: int) -> int:
        """A generous bound on one forward pass's working memory: `tokens` through the
        layers (hidden states, q/k/v, the MLP's two intermediate tensors, twice over
        for temporaries), `rows` of float32 logits, the prompt positions a step computes
        log probabilities of (scheduler.PROMPT_LOGPROB_ROWS: the head's output, in
        float32, and its log-softmax), and the scores of a chunk over a cached prefix
        where SDPA materialises them (attention.PREFIX_SCORES_BYTES)."""
        c = self.config
        per_token = 2 * (4 * c.hidden_size + 3 * c.intermediate_size) * self.model.dtype.itemsize
        logprobs = PROMPT_LOGPROB_ROWS * self.vocab_size * (self.model.dtype.itemsize + 8)
        return tokens * per_token + rows * self.vocab_size * 4 * 2 + logprobs + PREFIX_SCORES_BYTES

    def kv_bytes_per_token(self) -> int:
        return self.layout(1, 1).block_bytes_per_layer * self.num_layers          # a block of one token

    def kv_tokens(self, requested: int, utilization: float, batched_tokens: int, rows: int,
                  draft: "ModelRunner | None" = None) -> int:
        """The KV pool's size in tokens: `requested` if given; on a CPU, CPU_KV_TOKENS;
        on a GPU, what `utilization` of the card leaves after the weights (loaded by
        now: a `draft` model's too) and a forward pass's activations. A draft model keeps
        a pool of as many tokens beside this one, and its own activations."""
        if requested:
            return requested
        if self.device.type != "cuda":
            return CPU_KV_TOKENS
        # The weights' copies from before their fusion are free but cached by torch's
        # allocator (a fused gate|up fits in none of their blocks): counted as this
        # worker's, they took ~7 GiB of an 8B model's card off the pool.
        torch.cuda.empty_cache()
        free, total = device_memory(self.device)
        per_token = self.kv_bytes_per_token()
        # Each captured decode graph keeps its float32 logits in the graphs' shared pool,
        # where a later graph cannot reuse them: a bucket of n rows holds n x vocab.
        reserve = self.activation_bytes(batched_tokens, rows) + sum(self.graph_sizes) * self.vocab_size * 4
        if draft is not None:
            per_token += draft.kv_bytes_per_token()
            reserve += draft.activation_bytes(batched_tokens, rows)
        tokens = tokens_for_memory(free, total, utilization, per_token, reserve,
                                   own=torch.cuda.memory_reserved(self.device))
        log.info("KV pool: %d tokens (%.1f GiB) from %.0f%% of %s's %.1f GiB", tokens, tokens * per_token / 2**30,
                 utilization * 100, self.device, total / 2**30)
        return tokens

    def layout(self, num_blocks: int, block_size: int) -> KVLayout:
        return KVLayout(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, self.dtype_name)

    def compat_hash(self, layout: KVLayout) -> str:
        """Of the whole model's KV (every head), whatever this rank holds: workers of other
        tensor-parallel degrees pair, and the head split travels with each rank's pool
        (`KVPoolMemory.heads`)."""
        layout = dataclasses.replace(layout, num_kv_heads=self.total_kv_heads)
        model_id = f"{self.config.model_type}:{self.config.vocab_size}:{self.config.hidden_size}:{self.model_dir.name}"
        if self.quantization != "none":             # the same prompt makes other KV bytes
            model_id += f":{self.quantization}"
        return compat_hash(model_id, layout)

    # ---- one forward pass ----
    @torch.inference_mode()
    def execute(self, pool: KVPoolMemory, batch: ForwardBatch,
                on_layer: Callable[[int, Fence], None] | None = None,
                one_call_prompt_tokens: int = DECODER_PROMPT_TOKENS) -> torch.Tensor:
        """Run `batch`; returns the logits of its `sample_rows` then its `logprob_rows`,
        [rows, vocab] float32.
        `on_layer(layer, fence)` is called as each layer's KV write is launched; the
        write is done once `fence.wait()` returns (services/engine/model/device.py).
        A step in the one-call decoder (prompt chunks of up to `one_call_prompt_tokens`
        tokens) calls it for every layer once the call returns.
        Rank 0 of several sends the batch to the others first; on the others the result
        is empty (only rank 0 samples)."""
        if self.tp.size == 1:
            return self._execute(pool, batch, on_layer, one_call_prompt_tokens)
        if self.leads:
            check_batch(batch, pool.layout)     # a bad batch fails alone, before any rank starts it
            self._send(batch)
        try:
            return self._execute(pool, batch, on_layer, one_call_prompt_tokens)
        except Exception as exc:
            # A rank can fail alone (out of memory on rank 0, which alone holds the
            # sampler's buffers): the others then wait in, or have passed, one of this
            # step's all-reduces, and every later step would sum two steps' partials.
            self.group.lost(f"a forward pass failed ({type(exc).__name__}: {exc})")
            raise

    def _execute(self, pool: KVPoolMemory, batch: ForwardBatch, on_layer: Callable[[int, Fence], None] | None,
                 one_call_prompt_tokens: int) -> torch.Tensor:
        if (self.graph_sizes and batch.decode_tokens and not batch.segments and not batch.logprob_rows
                and on_layer is None and len(batch.decode_tokens) <= self.graph_sizes[-1]):
            graphs = self._decode_graphs(pool)
            if graphs is not None:
                logits = graphs.run(batch.decode_tokens, batch.decode_positions, batch.decode_tables,
                                    pool.layout.num_blocks, batch)
                if self.tp.rank:                    # no head here (DecodeGraphs.head): nothing to sample
                    return logits.new_empty(0, self.vocab_size)
                if batch.sample_rows != list(range(len(batch.decode_tokens))):
                    logits = logits.index_select(0, to_device(batch.sample_rows, torch.long, self.device))
                return logits
        if self.decoder is not None and batch.segments and len(batch.prefill_tokens) <= one_call_prompt_tokens:
            batch = as_decode_rows(batch)
        if self.decoder is not None and batch.decode_tokens and not batch.segments:
            logits = self._native_decode(pool, batch)
            if on_layer is not None:            # every layer's K/V is written once the call returns
                written = self.stream.record()
                for layer in range(self.num_layers):
                    on_layer(layer, written)
            return logits
        bs = pool.layout.block_size
        paged = PagedBatch(kv=pool.tensor, slots=torch.empty(0, dtype=torch.long), backend=self.backend,
                           on_layer=on_layer, stream=self.stream, num_decode=len(batch.decode_tokens),
                           threads=torch.get_num_threads(), workspace=self.workspace)
        slots: list[torch.Tensor] = []
        if batch.decode_tokens:
            slots.append(self._decode_slots(paged, batch.decode_positions, batch.decode_tables, pool))
        positions = [torch.tensor(batch.decode_positions, dtype=torch.long)]
        row = paged.num_decode
        for seg in batch.segments:
            seg_slots = self._slots(seg.block_ids, seg.start, seg.start + seg.num_tokens, bs)
            slots.append(seg_slots)
            context = (to_device(self._slots(seg.block_ids, 0, seg.start + seg.num_tokens, bs), torch.long,
                                 self.device) if seg.start else None)
            paged.segments.append(Segment(row, seg.num_tokens, seg.start, context))
            positions.append(torch.arange(seg.start, seg.start + seg.num_tokens))
            row += seg.num_tokens
        paged.slots = to_device(torch.cat(slots), torch.long, self.device)
        ids = self._input_ids(batch).unsqueeze(0)
        pos = to_device(torch.cat(positions), torch.long, self.device).unsqueeze(0)
        hidden = self.model.model(input_ids=ids, position_ids=pos, use_cache=False,
                                  pdserve_batch=paged).last_hidden_state
        return self._logits(hidden[0], batch)

    def _send(self, batch: ForwardBatch) -> None:
        pending = [] if not batch.pending_rows else [batch.pending_tokens.numel()]
        self.group.send(Command.STEP, encode_batch(batch) + pending)
        if batch.pending_rows:
            self.group.send_tensor(batch.pending_tokens)

    def copy_blocks(self, pool: KVPoolMemory, pairs: list[tuple[int, int]]) -> None:
        """KV blocks copied on every rank (`KVPoolMemory.copy_blocks`)."""
        if not self.leads:
            pool.copy_blocks(pairs)
            return
        self.group.send(Command.COPY, [x for pair in pairs for x in pair])
        try:
            pool.copy_blocks(pairs)
        except Exception as exc:
            self.group.lost(f"a block copy the other ranks made failed ({type(exc).__name__}: {exc})")
            raise

    def _logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The head over the rows of `hidden` [tokens, hidden] that `batch` samples, then
        its log-probability rows: [rows, vocab] float32 (none on ranks after the first)."""
        if self.tp.rank:
            return hidden.new_empty(0, self.vocab_size, dtype=torch.float32)
        rows = to_device(batch.sample_rows + batch.logprob_rows, torch.long, self.device)
        return self.model.lm_head(hidden.index_select(0, rows)).float()

    def _input_ids(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's token ids [tokens] on the device, the pending ones taken from the
        step before's tokens there."""
        ids = to_device(batch.decode_tokens + batch.prefill_tokens, torch.long, self.device)
        if batch.pending_rows:
            rows = to_device(batch.pending_rows, torch.long, self.device)
            sources = to_device(batch.pending_sources, torch.long, self.device)
            ids.index_copy_(0, rows, batch.pending_tokens.index_select(0, sources))
        return ids

    def _native_decode(self, pool: KVPoolMemory, batch: ForwardBatch) -> torch.Tensor:
        """A step of decode rows alone (prompt tokens made rows included: `as_decode_rows`)
        with its decoder layers in one native call (`NativeDecoder`):
        the model's own embedding, rotary angles, final norm and head around it, as its
        forward runs them."""
        paged = PagedBatch(kv=pool.tensor, slots=torch.empty(0, dtype=torch.long), backend=self.backend)
        slots = self._decode_slots(paged, batch.decode_positions, batch.decode_tables, pool)
        inner = self.model.model
        hidden = inner.embed_tokens(self._input_ids(batch)).contiguous()
        cos, sin = inner.rotary_emb(hidden[None], torch.tensor([batch.decode_positions], dtype=torch.long))
        self.decoder.run(hidden, pool.tensor, cos[0], sin[0], slots, paged.decode.block_table,
                         paged.decode.context_lens, torch.get_num_threads())
        return self._logits(inner.norm(hidden), batch)

    def _decode_graphs(self, pool: KVPoolMemory) -> DecodeGraphs | None:
        """The graphs over `pool`, captured on first use (a new pool: captured again);
        None where capture failed (the steps then run eagerly)."""
        if self._graphs is None or self._graphs.kv is not pool.tensor:
            self._graphs = None
            graphs = DecodeGraphs(self.backend, self.model, pool.tensor, pool.layout.block_size,
                                  self.max_model_len, self.graph_sizes, head=not self.tp.rank)
            try:
                graphs.capture()
            except Exception as e:
                if self.tp.size > 1:
                    # the other ranks may have captured theirs: a step eager here and replayed
                    # there would not meet in its all-reduces
                    raise RuntimeError(f"capturing the tensor-parallel decode graphs failed on rank "
                                       f"{self.tp.rank}; run with --enforce-eager") from e
                # e.g. a rotary embedding that reads its positions back to the host (dynamic
                # scaling, a RuntimeError), or a kernel compiler that cannot write its cache
                # (an OSError): the steps run eagerly rather than the worker failing
                log.warning("decode steps run eagerly: capturing a CUDA graph failed (%s: %s)",
                            type(e).__name__, e)
                self.graph_sizes = []
                return None
            self._graphs = graphs
        return self._graphs

    def capture_graphs(self, pool: KVPoolMemory) -> None:
        """Capture the decode graphs over `pool` now (a decode worker at start: its first
        request then pays no capture), not on the first decode-only step. A no-op
        without CUDA graphs."""
        if self.graph_sizes:
            if self.leads:
                self.group.send(Command.CAPTURE)
            self._decode_graphs(pool)

    def drop_graphs(self) -> None:
        """Free the captured graphs (and their hold on a pool's memory)."""
        self._graphs = None

    def _slots(self, block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
        return blocks * block_size + pos % block_size

    def _decode_slots(self, paged: PagedBatch, positions: list[int], tables: list[list[int]],
                      pool: KVPoolMemory) -> torch.Tensor:
        """Decode rows' slots (CPU), with their block tables set up on `paged` the way
        the backend's attention reads them."""
        bs = pool.layout.block_size
        widths = decode_widths(positions, tables, bs)
        width = max(widths)
        table = torch.tensor([list(t[:w]) + [0] * (width - w) for t, w in zip(tables, widths)], dtype=torch.long)
        check_block_ids(int(table.min()), int(table.max()), pool.layout.num_blocks)
        pos = torch.tensor(positions, dtype=torch.long)
        paged.decode = self.backend.decode_rows(pool.tensor, table, pos, widths)
        return table[torch.arange(len(positions)), pos // bs] * bs + pos % bs

    # ---- single-purpose passes (benchmarks, tests) ----
    def prefill(self, pool: KVPoolMemory, token_ids: list[int], block_ids: list[int], start: int = 0,
                on_layer: Callable[[int, Fence], None] | None = None) -> torch.Tensor:
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
