"""Execution backends: how a forward pass runs on this hardware, chosen once when the
runner starts (`select`), and asked from then on. A backend owns attention (writing each
layer's new K/V, decode rows, prompt chunks), which faster layers the model gets
(`fuse`) and the one-call decoder; the runner never tests for a kind of device.

- `TorchBackend`, the reference (`--attention-kernel torch`, and any device the others
  do not cover): torch's own ops (attention.py), oneDNN's packed bfloat16 weights on a
  CPU that takes them.
- `CpuBackend`: pdserve's native kernels (kernels/native), each where it builds and
  this CPU runs it well (hardware.CpuKernels says where): decode attention straight
  from the blocks, the bfloat16 prefill kernel, the element-wise layer kernels, its own
  matmuls, and where all of those hold every layer, the decode step's layers in one call.
- `CudaBackend`: Triton kernels (kernels/gpu_kernels) for KV writes and decode
  attention, element-wise layers in half precision, and CUDA graphs of decode steps;
  prefill in torch's SDPA (flash attention).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
import torch
from torch import nn

from services.common.settings import ATTENTION_KERNELS
from services.engine.kernels import gpu_kernels
from services.engine.kernels.native import (DecoderLayerWeights, NativeAttention, NativeBuildError, NativeDecoder,
                                            NativeLayers, NativeMatmul, load_attention, load_decoder, load_layers,
                                            load_matmul)
from services.engine.kernels.native.attention import MAX_DIM, MAX_HEADS
from services.engine.model import fusion, int8, kernel_choice
from services.engine.model.attention import (DecodeGroup, GPUDecode, NativeDecode, PagedBatch, Segment, chunk_kv,
                                             decode_attention, length_groups, prefill_attention, write)
from services.engine.model.cuda_graphs import capture_sizes
from services.engine.model.device import to_device
from services.engine.model.hardware import cpu_flags, cpu_kernels, has_amx, threads_at_most

log = logging.getLogger(__name__)
T = TypeVar("T")


class TorchBackend:
    """torch's own ops: the reference every other backend is tested against."""
    decode_kernel = "torch"
    prefill_kernel = "torch SDPA"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # ---- the model's layers ----
    def fuse(self, model: nn.Module, quantization: str, calibration_ids: list[int] | None) -> list[str]:
        """Swap faster equivalents of known layers into `model`; returns what was applied."""
        applied = []
        if quantization == "int8":        # first: fusing then finds no q/k/v left to check in float32
            applied = int8.quantize_layers(model, self._int8_kernels(model), calibration_ids, self._int8_matmul())
        return sorted(applied + fusion.apply(model, self._layers(model), self._packs(model), self._matmul(model)))

    def _layers(self, model: nn.Module):
        return None

    def _packs(self, model: nn.Module) -> bool:
        """bfloat16 weights laid out once for oneDNN: torch's own kernels, on a CPU that takes them."""
        return model.device.type == "cpu" and model.dtype == torch.bfloat16 and fusion.packs_bf16()

    def _matmul(self, model: nn.Module) -> NativeMatmul | None:
        return None

    def _int8_kernels(self, model: nn.Module) -> NativeLayers | None:
        return None

    def _int8_matmul(self) -> NativeMatmul | None:
        return None

    def decoder(self, model: nn.Module) -> NativeDecoder | None:
        """The decode step's decoder layers as one call, where this backend has one."""
        return None

    def graph_sizes(self, model: nn.Module, max_batch: int, enabled: bool) -> list[int]:
        """The batch sizes whose decode steps are captured as CUDA graphs ([]: none)."""
        return []

    # ---- attention, one layer of one step ----
    def attend(self, b: PagedBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scale: float, out: torch.Tensor) -> None:
        """The layer's work on the device: write the new tokens' K/V, then attend. query
        [1, heads, tokens, dim], key/value [1, kv_heads, tokens, dim]; into out [1,
        tokens, heads, dim]."""
        self.write_kv(b.kv, layer, b.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
        d = b.num_decode
        if d:
            self.decode(b, layer, query[0, :, :d].transpose(0, 1), scale, out[0, :d])
        for s in b.segments:
            rows = slice(s.row, s.row + s.num_tokens)
            out[0, rows] = self.prefill(b, s, layer, query[:, :, rows], key[:, :, rows], value[:, :, rows], scale)

    def write_kv(self, kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        write(kv, layer, slots, key, value)

    def decode_rows(self, kv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, widths: list[int]):
        """The decode rows' tables as this backend's attention reads them, over the pool
        `kv`: `table` int64 [rows, widest] (host), `positions` int64 [rows], `widths`
        each row's blocks in use."""
        block_size = kv.shape[3]
        order = sorted(range(len(widths)), key=lambda i: int(positions[i]))
        groups = []
        for start, stop in length_groups([widths[i] for i in order]):
            rows = torch.tensor(order[start:stop], dtype=torch.long)
            w = widths[order[stop - 1]]
            mask = torch.arange(w * block_size)[None, :] <= positions[rows, None]
            groups.append(DecodeGroup(to_device(rows, torch.long, self.device),
                                      to_device(table[rows, :w], torch.long, self.device),
                                      to_device(mask, torch.bool, self.device)))
        return groups

    def decode(self, b: PagedBatch, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """Decode rows' attention: q [rows, heads, dim] into out [rows, heads, dim]."""
        for g in b.decode:
            out.index_copy_(0, g.rows, decode_attention(q.index_select(0, g.rows), b.kv[layer], g.block_table,
                                                        g.context_mask, scale, b.workspace))

    def prefill(self, b: PagedBatch, s: Segment, layer: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scale: float) -> torch.Tensor:
        """One prompt chunk's causal attention; returns [n, heads, dim]."""
        return prefill_attention(b, s, layer, query, key, value, scale)


class CpuBackend(TorchBackend):
    """pdserve's native kernels on a CPU, each one present where it built (None: that
    part stays on torch's ops)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, attention: NativeAttention | None,
                 layers: NativeLayers | None, matmul: NativeMatmul | None,
                 build_decoder: Callable[[], Path | None] = lambda: None,
                 prefill_choice: kernel_choice.KernelChoice | None = None,
                 matmul_choice: kernel_choice.KernelChoice | None = None) -> None:
        super().__init__(device)
        self.attention = attention
        self.layers = layers
        self.matmul = matmul
        self._build_decoder = build_decoder
        self.matmul_choice = matmul_choice          # bfloat16 matmuls: whose, and why
        # bfloat16 prefill attention in the native kernel where `prefill_choice` says so
        # (kernel_choice.py; the rule: CPUs with AVX512-BF16 and no AMX, where torch's
        # SDPA on AMX tiles is faster)
        self.prefill_choice = prefill_choice
        self.native_prefill = (attention is not None and attention.prefills and dtype == torch.bfloat16
                               and prefill_choice is not None and prefill_choice.native)

    @property
    def decode_kernel(self) -> str:
        return "native" if self.attention is not None else "torch"

    @property
    def prefill_kernel(self) -> str:
        kernel = "native" if self.native_prefill else "torch SDPA"
        return kernel if self.prefill_choice is None else f"{kernel} ({self.prefill_choice.reason})"

    def _layers(self, model: nn.Module):
        """Norms and activations in the native kernels in bfloat16, for rows they take;
        float32 keeps torch's ops there, for exact parity."""
        return self.layers if model.dtype == torch.bfloat16 and NativeLayers.takes(model.config) else None

    def _matmul(self, model: nn.Module) -> NativeMatmul | None:
        return self.matmul if self.matmul is not None and self.matmul.supports(model.dtype) else None

    def _int8_kernels(self, model: nn.Module) -> NativeLayers | None:
        return self.layers if NativeLayers.takes(model.config, int8=True) else None

    def _int8_matmul(self) -> NativeMatmul | None:
        return self.matmul if self.matmul is not None and self.matmul.int8 else None

    def decoder(self, model: nn.Module) -> NativeDecoder | None:
        """The model's decoder layers as one native call for decode steps, where every
        layer runs in the native kernels already (a bfloat16 Llama-family model on a CPU
        with AVX512-BF16, after `fuse`; not int8, whose layers are `Int8DecoderLayer`).
        The library is built only for a model that qualifies. None otherwise."""
        inner = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", None) or [])
        kernels, matmul = self.layers, self.matmul
        if (model.dtype != torch.bfloat16 or self.attention is None or kernels is None or matmul is None
                or not matmul.bf16 or type(inner).__name__ not in fusion.DECODER_MODELS or not layers
                or not all(type(layer) is fusion.LeanDecoderLayer and layer.kernels is kernels and layer.pack
                           and layer.reduce is None     # a tensor-parallel shard sums between its layers
                           for layer in layers)):      # not int8's
            return None
        first = layers[0]
        shape = (first.num_heads, first.num_kv_heads, first.head_dim, first.scaling)
        weights = []
        for layer in layers:
            qkv = layer.qkv.linear if layer.qkv is not None else None
            o, gated, down = layer.o_proj, layer.gated, layer.down_proj
            own = (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scaling)
            if (not all(isinstance(m, fusion.NativeLinear) for m in (qkv, o, gated, down)) or qkv.gated
                    or not gated.gated or own != shape):
                return None
            weights.append(DecoderLayerWeights(layer.norm_weights[0], layer.norm_weights[1], layer.eps[0],
                                               layer.eps[1], (qkv.packed, qkv.bias), (o.packed, o.bias),
                                               (gated.packed, gated.bias), (down.packed, down.bias)))
        library = self._build_decoder()
        if library is None:
            return None
        return NativeDecoder(library, self.attention, kernels, matmul, weights, first.num_heads, first.num_kv_heads,
                             first.head_dim, first.gated.out_features, first.scaling)

    def decode_rows(self, kv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, widths: list[int]):
        if self.attention is None:
            return super().decode_rows(kv, table, positions, widths)
        return NativeDecode(table, (positions + 1).to(torch.int32))

    def decode(self, b: PagedBatch, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        if self.attention is None:
            return super().decode(b, layer, q, scale, out)
        n = b.decode
        out[:] = self.attention.decode(q, b.kv[layer], n.block_table, n.context_lens, scale, b.threads)

    def prefill(self, b: PagedBatch, s: Segment, layer: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.native_prefill:
            return super().prefill(b, s, layer, query, key, value, scale)
        k, v = chunk_kv(b, s, layer, key, value)
        return self.attention.prefill(query[0].transpose(0, 1), k, v, s.prefix_len, scale, b.threads)


class CudaBackend(TorchBackend):
    """Triton kernels on a CUDA device: KV written and decode rows attended in place in
    the blocks; element-wise layers in bfloat16 and float16 (float32 keeps torch's ops
    there, for exact parity); decode steps replayed from CUDA graphs."""
    decode_kernel = "triton paged"

    def __init__(self, device: torch.device, dtype: torch.dtype, heads_per_kv: int) -> None:
        """`heads_per_kv`: the model's query heads per KV head, which sets how many rows of
        one sequence (a verify step's drafts) the decode kernel attends together."""
        super().__init__(device)
        self.layers = gpu_kernels.TritonLayers() if dtype != torch.float32 else None
        self.scratch = gpu_kernels.DecodeScratch()
        self.rows_per_program = gpu_kernels.rows_per_program(heads_per_kv)

    def _layers(self, model: nn.Module):
        return self.layers

    def graph_sizes(self, model: nn.Module, max_batch: int, enabled: bool) -> list[int]:
        """Every bucket to `max_batch`, for a model whose layers are all lean (their
        forward is what a captured step replays)."""
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        lean = bool(layers) and all(isinstance(m, fusion.LeanDecoderLayer) for m in layers)
        return capture_sizes(max_batch) if enabled and lean and max_batch > 0 else []

    def write_kv(self, kv: torch.Tensor, layer: int, slots: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        gpu_kernels.write_kv(kv[layer], slots, key, value)        # slot -1 (a graph's padding): skipped

    def decode_rows(self, kv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, widths: list[int]):
        groups = gpu_kernels.decode_groups(positions.numpy(), table.numpy(), np.asarray(widths), self.rows_per_program)
        return GPUDecode(to_device(table, torch.int32, self.device), to_device(positions + 1, torch.int32, self.device),
                         gpu_kernels.splits_for(len(widths), kv.shape[-2]), self.scratch,
                         to_device(torch.from_numpy(groups), torch.int32, self.device))

    def decode(self, b: PagedBatch, layer: int, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        g = b.decode
        gpu_kernels.paged_decode(q, b.kv[layer], g.block_table, g.context_lens, scale, g.splits, g.scratch, out=out,
                                 groups=g.groups)


# Under the kernel cache: the kernels measured at a worker's start, one file each (kernel_choice.py).
CHOICES = "kernel-choice"


def _built(load: Callable[[Path], T], kernel_cache: Path, attention: str, otherwise: str) -> T | None:
    """`load(kernel_cache)`, or None with a warning saying what runs `otherwise`; with
    `--attention-kernel native`, a build failure is the caller's error."""
    try:
        return load(kernel_cache)
    except NativeBuildError as e:
        if attention == "native":
            raise
        log.warning("%s: %s", otherwise, e)
        return None


def select(attention: str, device: torch.device, dtype: torch.dtype, quantization: str,
           kernel_cache: Path, dtype_name: str = "", matmul_kernel: str = "auto", probe: nn.Module | None = None,
           role: str = "", own_threads: int = 0, heads_per_kv: int = 1) -> TorchBackend:
    """The backend for `--attention-kernel attention` ("auto", "native" or "torch") on
    `device` in `dtype`. "native" insists on the native CPU kernels (ValueError or
    NativeBuildError where they cannot run); "auto" takes them where they apply.
    bfloat16 matmuls follow `--matmul-kernel matmul_kernel` (kernel_choice.py), measured
    on `probe` (the model's first decoder layer) at the rows of a worker of `role`, on
    `own_threads` of torch's threads (0: all; a worker with threads on cores lent to it
    measures on those of its own). On CUDA, pdserve's Triton decode attention where it
    takes the model's `heads_per_kv` (query heads per KV head), torch's otherwise."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_KERNELS)}, not {attention!r}")
    if attention == "torch":
        return TorchBackend(device)
    if not NativeAttention.supports(dtype, device):
        if attention == "native":
            raise ValueError(f"the native attention kernels run on CPU in float32 or bfloat16, "
                             f"not {device} {dtype_name or dtype}")
        if device.type == "cuda" and gpu_kernels.available():
            if gpu_kernels.takes_group(heads_per_kv):
                return CudaBackend(device, dtype, heads_per_kv)
            log.info("decode attention: torch's (pdserve's Triton kernel takes up to %d query heads per KV head, "
                     "this model has %d)", gpu_kernels.BLOCK_H, heads_per_kv)
        return TorchBackend(device)
    native = _built(load_attention, kernel_cache, attention, "attention stays on torch's own ops")
    shape = None if probe is None else kernel_choice.attention_shape(probe)
    if native is not None and shape is not None and not native.takes_decode(*shape[:3]):
        if attention == "native":
            raise ValueError(f"the native attention kernels take up to {MAX_HEADS} query heads of up to {MAX_DIM} "
                             f"values, not {shape[0]} of {shape[2]}")
        log.info("attention: torch's (pdserve's kernels take up to %d query heads of up to %d values; this model "
                 "has %d of %d)", MAX_HEADS, MAX_DIM, shape[0], shape[2])
        native = None
    layers = _built(load_layers, kernel_cache, attention, "norms and activations stay on torch's own ops")
    # pdserve's own matmuls where this CPU takes them (hardware.CpuKernels says where; in
    # bfloat16 a measurement at start may overrule it)
    flags = cpu_flags()
    kinds = cpu_kernels(flags)
    f32 = dtype == torch.float32 and kinds.f32_matmul
    bf16 = dtype == torch.bfloat16 and "avx512_bf16" in flags and matmul_kernel != "onednn"
    wanted = bf16 or (quantization == "int8" and kinds.int8_matmul) or f32
    matmul = _built(load_matmul, kernel_cache, "auto", "matmuls stay on oneDNN") if wanted else None
    choice = None
    if matmul is not None:
        matmul.f32 = matmul.f32 and f32      # int8 on AVX-512 in float32: the other layers keep torch's
        matmul.int8 = matmul.int8 and kinds.int8_matmul     # loaded for bf16 on AMX: int8 stays oneDNN's
        if dtype == torch.bfloat16 and matmul.bf16:
            if has_amx(flags) and not matmul.tiles_granted:
                log.warning("this CPU has AMX-BF16, but the process was not granted its tiles (Linux 5.16 and "
                            "later grant them on request): pdserve's bfloat16 matmuls run on vdpbf16ps")
            weights = None if probe is None else kernel_choice.projections(probe)
            choice = kernel_choice.choose(matmul_kernel, kinds.bf16_matmul, role,
                                          _on_threads(own_threads, _measure(matmul, weights))
                                          if fusion.packs_bf16() else None,
                                          kernel_cache / CHOICES, tuple(tuple(w.shape) for w in weights or ()),
                                          matmul.bf16_path)
            matmul.bf16 = choice.native
            log.info("bfloat16 matmuls: %s (%s)", f"pdserve's, on {matmul.bf16_path}" if choice.native else "oneDNN's",
                     choice.reason)
            if not (matmul.bf16 or matmul.int8 or matmul.f32):
                matmul = None
    if choice is None and matmul_kernel == "onednn" and dtype == torch.bfloat16:
        choice = kernel_choice.KernelChoice(False, "asked for")
    if matmul_kernel == "native" and (choice is None or not choice.native):
        raise ValueError("--matmul-kernel native: pdserve's matmuls run in bfloat16 on a CPU with AVX512-BF16 "
                         f"(not {dtype_name or dtype} here, or no AVX512-BF16)")
    prefill = None
    if native is not None and native.prefills and dtype == torch.bfloat16 and (
            shape is None or native.takes_prefill(*shape[:3])):
        prefill = kernel_choice.choose_prefill_attention(
            attention, kinds.bf16_prefill, role,
            None if shape is None else _on_threads(own_threads, lambda tokens: kernel_choice.compare_prefill_attention(
                native, shape, tokens)),
            kernel_cache / CHOICES, shape or ())
        log.info("bfloat16 prefill attention: %s (%s)", "pdserve's" if prefill.native else "torch's SDPA",
                 prefill.reason)
    return CpuBackend(device, dtype, native, layers, matmul,
                      lambda: _built(load_decoder, kernel_cache, "auto", "decode steps call their layers one by one"),
                      prefill, choice)


def _measure(matmul: NativeMatmul, weights: list[torch.Tensor] | None) -> kernel_choice.Measure | None:
    """Our time over oneDNN's for a layer's projections `weights`, at given rows
    (kernel_choice.choose's `measure`); None without weights our matmuls take."""
    if weights is None or not all(fusion.NativeLinear.fits(w) for w in weights):
        return None
    return lambda rows: kernel_choice.compare_paths(lambda w: fusion.NativeLinear(w, None, matmul),
                                                    lambda w: fusion.PackedLinear(w, None), weights, rows)


def _on_threads(n: int, measure: kernel_choice.Measure | None) -> kernel_choice.Measure | None:
    """`measure` run on `n` of torch's threads (0: all of them)."""
    if measure is None:
        return None

    def on(sizes: tuple[int, ...]) -> list[float]:
        with threads_at_most(n):
            return measure(sizes)
    return on
