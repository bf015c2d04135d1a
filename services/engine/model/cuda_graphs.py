"""Decode steps on a CUDA device as captured graphs, one per batch-size bucket.

An eager decode step of an 8B model launches some 500 kernels, each paying Python and
launch time that dwarfs its work at small batches. vLLM and SGLang capture the step
once per batch size in a CUDA graph and replay it; so does this.

A graph replays fixed addresses, so its inputs live in persistent device tensors (token
ids, positions, KV slots, block table, context lengths) that each step overwrites from
one pinned host staging buffer; its kernels' grids depend only on the bucket's size
(gpu_kernels.paged_decode splits by batch size, never by context length). A step of n
sequences replays the smallest bucket >= n; the rows past n are padding: slot -1 (their
K/V is not written), context length 0 (their attention is zeros), logits ignored. A
speculative step's rows (a sequence's next positions) replay the same graphs, the
kernel told which rows to attend together (gpu_kernels.decode_groups). The only host
sync of the step is the sampler reading its tokens.

Graphs are captured on the first decode-only step over a pool, for every bucket; a
step with prompt rows, prompt log-probabilities, more rows than the largest bucket or
a KV push (prefill) runs eagerly.
"""
from __future__ import annotations

import logging
import time
from itertools import chain

import numpy as np
import torch

from services.engine.kernels import gpu_kernels
from services.engine.model.attention import GPUDecode, PagedBatch, check_block_ids, decode_widths

log = logging.getLogger(__name__)

# vLLM's capture sizes, to 512: 1, 2, 4, then multiples of 8.
BASE_SIZES = (1, 2, 4)
STEP = 8


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in BASE_SIZES if s < max_batch] + list(range(STEP, max_batch, STEP)) + [max_batch]
    return sorted(set(sizes))


class DecodeGraphs:
    """The graphs of one model over one KV pool."""

    def __init__(self, backend, model: torch.nn.Module, kv: torch.Tensor, block_size: int, max_model_len: int,
                 sizes: list[int], head: bool = True) -> None:
        """`backend`: the runner's (backends.CudaBackend), whose kernels the graphs capture;
        `head`: whether they end in the vocabulary head (not on tensor-parallel ranks
        after the first, which sample nothing: their logits are [rows, 0])."""
        self.backend = backend
        self.head = head
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.sizes = sorted(sizes)
        self.num_kv_heads = kv.shape[-2]
        device = kv.device
        top = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        self.ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=device)
        self.lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.table = torch.zeros(top, self.width, dtype=torch.int32, device=device)
        # rows the decode kernel attends together (a verify step's drafts; padding alone)
        self.groups = torch.ones(top, dtype=torch.int32, device=device)
        # async scheduling: rows whose token comes from the step before's tokens on the
        # device, then their places there
        self.fill = torch.zeros(2 * top, dtype=torch.long, device=device)
        # host staging: ids, positions, slots (int64) | lengths, then the table (int32)
        pinned = device.type == "cuda"
        self.stage_rows = torch.empty(3, top, dtype=torch.long, pin_memory=pinned)
        self.stage_lens = torch.empty(2, top, dtype=torch.int32, pin_memory=pinned)     # lengths | groups
        self.stage_table = torch.empty(top * self.width, dtype=torch.int32, pin_memory=pinned)
        self.stage_fill = torch.empty(2 * top, dtype=torch.long, pin_memory=pinned)
        # the last step's staging has been read (on a CPU, where tests run the steps
        # eagerly through Triton's interpreter, copies are done when they return)
        self.copied = torch.cuda.Event() if pinned else None
        self.scratch = gpu_kernels.DecodeScratch()
        config = model.config
        heads = config.num_attention_heads
        dim = kv.shape[-1]
        # the largest the split kernel asks for: no allocation during a capture
        self.scratch.take(top, heads, gpu_kernels.MAX_SPLITS, dim, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, n: int) -> torch.Tensor:
        """The decode step of rows [0, n) of the persistent inputs: logits [n, vocab] float32."""
        body = self.model.model
        paged = PagedBatch(kv=self.kv, slots=self.slots[:n], backend=self.backend, num_decode=n,
                           decode=GPUDecode(self.table[:n], self.lens[:n], gpu_kernels.splits_for(n, self.num_kv_heads),
                                            self.scratch, self.groups[:n]))
        hidden = body.embed_tokens(self.ids[:n]).unsqueeze(0)
        position_embeddings = body.rotary_emb(hidden, position_ids=self.positions[:n].unsqueeze(0))
        for layer in body.layers:
            hidden = layer(hidden, position_embeddings=position_embeddings, pdserve_batch=paged)
        hidden = body.norm(hidden)
        if not self.head:
            return hidden.new_empty(n, 0, dtype=torch.float32)
        return self.model.lm_head(hidden[0]).float()

    @torch.inference_mode()
    def capture(self) -> None:
        """Every bucket, largest first (the smaller ones reuse its memory pool). The
        persistent inputs are all padding meanwhile: nothing is written to the pool.
        Without CUDA (tests) nothing is captured: `run` does the step eagerly. Under
        inference mode, as the steps run; in thread-local capture mode, so another
        thread's CUDA call meanwhile (NIXL's progress thread, a transfer) is no error."""
        started = time.perf_counter()
        self.slots.fill_(-1)
        self.lens.zero_()
        self.groups.fill_(1)
        if self.copied is None:
            return
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            self._forward(n)                     # compiles the kernels, outside the capture
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                logits = self._forward(n)
            self.graphs[n] = (graph, logits)
        torch.cuda.synchronize(self.kv.device)
        log.info("captured CUDA graphs of decode steps for %d batch sizes (1-%d) in %.1f s", len(self.sizes),
                 self.sizes[-1], time.perf_counter() - started)

    def bucket(self, rows: int) -> int | None:
        for size in self.sizes:
            if size >= rows:
                return size
        return None

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]], num_blocks: int,
            pending=None) -> torch.Tensor:
        """Logits [rows, vocab] (float32) of one decode step: row i is token tokens[i] at
        positions[i] over blocks tables[i]. `pending` (a ForwardBatch, async scheduling):
        row pending_rows[j] takes pending_tokens[pending_sources[j]], on the device."""
        n = len(tokens)
        size = self.bucket(n)
        bs = self.block_size
        widths = decode_widths(positions, tables, bs)
        width = max(widths)
        if width > self.width:
            raise ValueError(f"position {max(positions)} is past the longest sequence ({self.width * bs} tokens)")
        if self.copied is not None:
            self.copied.synchronize()               # the staging is free again (at once, after a sampled step)
        # numpy over the pinned staging: ~4x faster than building tensors from lists
        # (0.15 against 0.6 ms for 64 rows of 129 blocks on one CPU core)
        table = self.stage_table[:size * width].view(size, width)
        flat = np.fromiter(chain.from_iterable(t[:w] if w == width else t[:w] + [0] * (width - w)
                                               for t, w in zip(tables, widths)), dtype=np.int32, count=n * width)
        check_block_ids(int(flat.min()), int(flat.max()), num_blocks)
        grid = table.numpy()
        grid[:n] = flat.reshape(n, width)
        rows = self.stage_rows[:, :size]
        r = rows.numpy()
        r[0, :n] = tokens
        r[1, :n] = positions
        pos = r[1, :n]
        r[2, :n] = grid[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        r[0, n:], r[1, n:], r[2, n:] = 0, 0, -1
        lens, groups = self.stage_lens.numpy()
        lens[:n] = pos + 1
        lens[n:size] = 0
        groups[:n] = gpu_kernels.decode_groups(pos, grid[:n], np.asarray(widths), self.backend.rows_per_program)
        groups[n:size] = 1
        self.ids[:size].copy_(rows[0], non_blocking=True)
        self.positions[:size].copy_(rows[1], non_blocking=True)
        self.slots[:size].copy_(rows[2], non_blocking=True)
        self.lens[:size].copy_(self.stage_lens[0, :size], non_blocking=True)
        self.groups[:size].copy_(self.stage_lens[1, :size], non_blocking=True)
        self.table[:size, :width].copy_(table, non_blocking=True)
        m = len(pending.pending_rows) if pending is not None else 0
        if m:
            fill = self.stage_fill.numpy()
            fill[:m], fill[m:2 * m] = pending.pending_rows, pending.pending_sources
            self.fill[:2 * m].copy_(self.stage_fill[:2 * m], non_blocking=True)
            self.ids.index_copy_(0, self.fill[:m], pending.pending_tokens.index_select(0, self.fill[m:2 * m]))
        if self.copied is None:                     # no CUDA: the step itself, eagerly
            return self._forward(size)[:n].clone()
        self.copied.record(torch.cuda.current_stream(self.kv.device))
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n].clone()
