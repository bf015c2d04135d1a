"""A decode step's decoder layers in one call to decoder.c, from Python."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.kernels.native.attention import NativeAttention
from services.engine.kernels.native.layers import NativeLayers
from services.engine.kernels.native.library import load
from services.engine.kernels.native.matmul import NativeMatmul


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One Llama-family layer as `decoder.c` takes it: bfloat16 norm weights, and the
    native matmul's packed weights (and packed float32 biases, or None) of q|k|v, o,
    gate|up (gated) and down."""
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    eps_in: float
    eps_post: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    down: tuple[torch.Tensor, torch.Tensor | None]


class NativeDecoder:
    """A decode step's decoder layers in one native call (decoder.c), bfloat16: the same
    kernels, in the same order, as the layers' own forward calls one by one, so the
    same bits, without ~180 us of Python per layer."""

    def __init__(self, library: Path, attention: NativeAttention, layers: NativeLayers, matmul: NativeMatmul,
                 weights: list[DecoderLayerWeights], q_heads: int, kv_heads: int, dim: int, inter: int,
                 scale: float) -> None:
        lib = load(library)
        self._run = lib.function("pdserve_decode_layers")
        self._scratch_size = lib.function("pdserve_decode_scratch")
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value     # noqa: E731
        self._kernels = lib.struct("pdserve_kernels")(
            linear=address(matmul._linear[torch.bfloat16]), norm=address(layers._norm),
            rotary=address(layers._rotary), attend=address(attention._decode))
        ptr = lambda t: None if t is None else t.data_ptr()              # noqa: E731
        # What the pointers below point into: the weights and the kernels' libraries.
        self._weights, self._kernel_libraries = list(weights), (attention, layers, matmul)
        self._norms = [(w.norm_in.to(torch.bfloat16).contiguous(), w.norm_post.to(torch.bfloat16).contiguous())
                       for w in weights]
        layer = lib.struct("pdserve_layer")
        self._layers = (layer * len(weights))(*[
            layer(norm_in=n_in.data_ptr(), norm_post=n_post.data_ptr(), qkv=w.qkv[0].data_ptr(),
                  o=w.o[0].data_ptr(), gate_up=w.gate_up[0].data_ptr(), down=w.down[0].data_ptr(),
                  qkv_bias=ptr(w.qkv[1]), o_bias=ptr(w.o[1]), gate_up_bias=ptr(w.gate_up[1]),
                  down_bias=ptr(w.down[1]), eps_in=w.eps_in, eps_post=w.eps_post)
            for w, (n_in, n_post) in zip(weights, self._norms)])
        self._model = lib.struct("pdserve_model")(
            layers=len(weights), hidden=weights[0].norm_in.numel(), q_heads=q_heads, kv_heads=kv_heads, dim=dim,
            inter=inter, scale=scale, layer=ctypes.addressof(self._layers))      # the pool's strides: in `run`
        self._pool: tuple | None = None
        self._scratch = torch.empty(0, dtype=torch.bfloat16)
        self._lib = lib

    def run(self, hidden: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            slots: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, threads: int = 1) -> None:
        """hidden [rows, hidden] bfloat16, contiguous: the layers' input, overwritten with
        the last layer's output; kv: the pool [layers, 2, blocks, block_size, kv_heads,
        dim]; cos/sin [rows, dim]; slots int64 [rows]: each row's new K/V; table int64
        [rows, width] and lens int32 [rows] as `NativeAttention.decode` takes them."""
        rows = hidden.shape[0]
        if (hidden.dtype != torch.bfloat16 or not hidden.is_contiguous() or kv.dtype != torch.bfloat16
                or not kv.is_contiguous() or kv.shape[0] != self._model.layers):
            raise ValueError("the native decoder takes contiguous bfloat16 rows and a bfloat16 pool of its layers")
        if (slots.dtype != torch.int64 or not slots.is_contiguous() or table.dtype != torch.int64
                or table.stride(1) != 1 or lens.dtype != torch.int32 or not lens.is_contiguous()
                or not rows == slots.shape[0] == table.shape[0] == lens.shape[0] == cos.shape[0]):
            raise ValueError("slots int64, block table int64 rows and lengths int32, one of each per row")
        if self._pool != tuple(kv.shape):
            self._pool = tuple(kv.shape)
            m = self._model
            m.layer_stride, m.half_stride, m.block_stride, m.token_stride = kv.stride()[:4]
            m.block_size = kv.shape[3]
        need = self._scratch_size(ctypes.byref(self._model), rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.bfloat16)
        cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        rc = self._run(ctypes.byref(self._kernels), ctypes.byref(self._model), kv.data_ptr(), hidden.data_ptr(),
                       self._scratch.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
                       table.data_ptr(), table.stride(0), lens.data_ptr(), threads)
        if rc:
            raise ValueError(f"the native decoder's step {rc} refused its arguments")
