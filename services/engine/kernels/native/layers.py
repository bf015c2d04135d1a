"""The per-token layer kernels of layers.c, from Python."""
from __future__ import annotations

from pathlib import Path

import torch

from services.engine.kernels.native.library import DTYPES, load


# The widest rows the kernels take (layers.c refuses wider): a norm's, and int8's
# quantized rows (the MLP's intermediate ones).
NORM_WIDTH, QUANTIZED_WIDTH = 16384, 32768


class NativeLayers:
    """The per-token layer kernels of one loaded library (float32 or bfloat16, CPU)."""
    name = "native"

    def __init__(self, library: Path) -> None:
        lib = load(library)
        self._norm = lib.function("pdserve_rms_norm")
        self._silu = lib.function("pdserve_silu_mul")
        self._rotary = lib.function("pdserve_rotary")
        self._quantize = lib.function("pdserve_quantize_rows")
        self._norm_quantize = lib.function("pdserve_rms_norm_quantize")
        self._dequant = lib.function("pdserve_dequant_rows")
        self._silu_quantize = lib.function("pdserve_silu_mul_quantize")
        self._lib = lib

    @staticmethod
    def takes(config, int8: bool = False) -> bool:
        """Whether a model of `config` has rows the kernels take: its hidden size a
        norm's, and with int8 its intermediate size a quantized row's too."""
        return (getattr(config, "hidden_size", 0) <= NORM_WIDTH
                and (not int8 or getattr(config, "intermediate_size", 0) <= QUANTIZED_WIDTH))

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPES or x.device.type != "cpu":
            raise ValueError("the native layer kernels take float32 or bfloat16 CPU tensors")
        x = x.reshape(-1, x.shape[-1])
        return x if x.stride(-1) == 1 else x.contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int = 1) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * weight over the last dimension, in x's dtype."""
        rows = self._rows(x)
        weight = weight.to(x.dtype).contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype)
        rc = self._norm(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                        rows.shape[0], rows.shape[1], eps, DTYPES[x.dtype], threads)
        if rc:
            raise ValueError(f"rms_norm refused its arguments (code {rc})")
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor, threads: int = 1) -> torch.Tensor:
        """silu(gate) * up, where gate_up's last dimension is gate then up."""
        rows = self._rows(gate_up)
        inter = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype)
        rc = self._silu(rows.data_ptr(), rows.stride(0), out.data_ptr(), out.stride(0), rows.shape[0], inter,
                        DTYPES[gate_up.dtype], threads)
        if rc:
            raise ValueError(f"silu_mul refused its arguments (code {rc})")
        return out.view(*gate_up.shape[:-1], inter)

    # ---- int8 activations: uint8 rows (value + 128) and a float32 scale per row ----
    @staticmethod
    def _quantized(rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(rows, dim, dtype=torch.uint8), torch.empty(rows, dtype=torch.float32)

    def quantize_rows(self, x: torch.Tensor, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row of x to int8 with its own scale (max |x| / 127), as uint8 offset by
        128: returns ([rows, dim] uint8, [rows] float32 scales)."""
        rows = self._rows(x)
        out, scales = self._quantized(*rows.shape)
        rc = self._quantize(rows.data_ptr(), rows.stride(0), out.data_ptr(), out.stride(0), scales.data_ptr(),
                            rows.shape[0], rows.shape[1], DTYPES[x.dtype], threads)
        if rc:
            raise ValueError(f"quantize_rows refused its arguments (code {rc})")
        return out, scales

    def rms_norm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                          threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`rms_norm` then `quantize_rows`, in one pass."""
        rows = self._rows(x)
        weight = weight.to(x.dtype).contiguous()
        out, scales = self._quantized(*rows.shape)
        rc = self._norm_quantize(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
                                 scales.data_ptr(), rows.shape[0], rows.shape[1], eps, DTYPES[x.dtype], threads)
        if rc:
            raise ValueError(f"rms_norm_quantize refused its arguments (code {rc})")
        return out, scales

    def dequant_rows(self, products: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor | None, dtype: torch.dtype, threads: int = 1) -> torch.Tensor:
        """products [rows, n] (float32) times each row's scale, plus bias [n] and
        residual (rows of n) where given, in `dtype`: an int8 matmul's output."""
        if products.dtype != torch.float32 or products.stride(-1) != 1 or dtype not in DTYPES:
            raise ValueError("dequant_rows takes float32 products (last dimension contiguous) into float32 "
                             "or bfloat16")
        n = products.shape[-1]
        res = None if residual is None else self._rows(residual.to(dtype))
        bias = None if bias is None else bias.to(dtype).contiguous()
        out = torch.empty(products.shape[0], n, dtype=dtype)
        rc = self._dequant(products.data_ptr(), products.stride(0), scales.data_ptr(),
                           None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
                           0 if res is None else res.stride(0), out.data_ptr(), out.stride(0), products.shape[0],
                           n, DTYPES[dtype], threads)
        if rc:
            raise ValueError(f"dequant_rows refused its arguments (code {rc})")
        return out

    def silu_mul_quantize(self, products: torch.Tensor, scales: torch.Tensor,
                          threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 gate|up matmul's float32 products [rows, 2 * inter], scaled back per
        row, through silu(gate) * up, and quantized per row for the next int8 matmul."""
        if products.dtype != torch.float32 or products.stride(-1) != 1:
            raise ValueError("silu_mul_quantize takes float32 products, last dimension contiguous")
        inter = products.shape[1] // 2
        out, out_scales = self._quantized(products.shape[0], inter)
        rc = self._silu_quantize(products.data_ptr(), products.stride(0), scales.data_ptr(), out.data_ptr(),
                                 out.stride(0), out_scales.data_ptr(), products.shape[0], inter, threads)
        if rc:
            raise ValueError(f"silu_mul_quantize refused its arguments (code {rc})")
        return out, out_scales

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, threads: int = 1) -> None:
        """Rotate x [tokens, heads, dim] in place ("rotate half" layout) by cos and sin
        [tokens, dim]; x's heads and tokens may be strided, its last dimension not."""
        if x.dtype not in DTYPES or x.stride(-1) != 1 or cos.shape != sin.shape or cos.shape[0] != x.shape[0]:
            raise ValueError("rotary takes x [tokens, heads, dim] (last dimension contiguous) and cos/sin "
                             "[tokens, dim] of one dtype")
        cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
        rc = self._rotary(x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                          x.shape[0], x.shape[1], x.shape[2], DTYPES[x.dtype], threads)
        if rc:
            raise ValueError(f"rotary refused its arguments (code {rc})")
