"""The matmuls of matmul.c, from Python: weights packed in the kernels' order, then one
call per product."""
from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from services.engine.kernels.native.library import load

log = logging.getLogger(__name__)


class NativeMatmul:
    """The matmuls of one loaded library (matmul.c). bfloat16 (`bf16`: the CPU has
    AVX512-BF16; on AMX tiles, `amx`, where it has them too and the OS lets the process
    use them, unless `tiles` is False) and float32 (`f32`: AVX2 and FMA): weights packed
    once by `pack`, then `linear` per call, with a residual add or SiLU-and-multiply
    applied as the output is written. uint8 x int8 (`int8`: the CPU has AVX512-VNNI):
    `pack_int8`, then `products`, `Int8Linear`'s product."""

    GROUP = 16                              # output columns per packed group (bfloat16, int8)
    GROUPS = {torch.bfloat16: 16, torch.float32: 8}
    PAIRS = {torch.bfloat16: 2, torch.float32: 1}     # k values per packed step

    def __init__(self, library: Path, tiles: bool = True) -> None:
        self.path = library
        lib = load(library)
        self._vector = lib.function("pdserve_linear_bf16")
        self._linear = {torch.bfloat16: self._vector, torch.float32: lib.function("pdserve_linear_f32")}
        self._u8s8 = lib.function("pdserve_linear_u8s8")
        self.bf16 = bool(lib.function("pdserve_matmul_supported")())
        self.int8 = bool(lib.function("pdserve_int8_supported")())
        self.f32 = bool(lib.function("pdserve_f32_supported")())
        # the build has AMX tiles and the OS let this process use them
        self.tiles_granted = bool(lib.function("pdserve_amx_supported")())
        self.amx = False
        if tiles and self.bf16 and self.tiles_granted:
            self.amx = self._tiles_agree(lib.function("pdserve_linear_amx_bf16"))
        self._lib = lib

    def _tiles_agree(self, tiles) -> bool:
        """Whether the AMX tiles' products agree with vdpbf16ps's on a small random
        product (to float32 summation's rounding): then they take the bfloat16 calls. A
        kernel first run on a new CPU must not serve wrong numbers; where they disagree
        the worker says so and keeps vdpbf16ps."""
        gen = torch.Generator().manual_seed(0)
        w = (torch.randn(96, 128, generator=gen) * 0.05).bfloat16()
        x = torch.randn(19, 128, generator=gen).bfloat16()          # a whole tile of rows and a padded one
        bias = torch.randn(96, generator=gen)
        packed, packed_bias = self.pack(w, bias)
        want = self.linear(x, packed, 96, packed_bias).float()
        self._linear[torch.bfloat16] = tiles
        got = self.linear(x, packed, 96, packed_bias).float()
        if torch.allclose(got, want, rtol=2 ** -7, atol=1e-2):
            return True
        self._linear[torch.bfloat16] = self._vector
        log.error("pdserve's AMX tile matmul disagrees with its vdpbf16ps one on this CPU (largest difference "
                  "%.3g): bfloat16 matmuls stay on vdpbf16ps", float((got - want).abs().max()))
        return False

    @property
    def bf16_path(self) -> str:
        """Which instructions its bfloat16 products run on, for logs and kept choices."""
        return "amx" if self.amx else "avx512-bf16"

    def supports(self, dtype: torch.dtype) -> bool:
        """Whether `linear` runs in `dtype` on this CPU."""
        return {torch.bfloat16: self.bf16, torch.float32: self.f32}.get(dtype, False)

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None,
             up: tuple[torch.Tensor, torch.Tensor | None] | None = None,
             dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`weight` [n, k] (and `bias` [n]) in the kernel's order for `dtype`: bfloat16
        [groups, k/2, 16, 2], float32 [groups, k, 8], n padded to whole groups, and the
        bias as float32 in the same order. With `up` (its weight and bias), `weight` is
        the gate: gate and up groups alternate, for `linear(..., gated=True)`."""
        if dtype not in cls.GROUPS:
            raise ValueError(f"the native matmul packs bfloat16 or float32, not {dtype}")
        g, pair = cls.GROUPS[dtype], cls.PAIRS[dtype]
        n, k = weight.shape
        if k % pair:
            raise ValueError(f"the native matmul takes an even number of input features, not {k}")
        if up is not None:
            if n % g or up[0].shape != weight.shape or (bias is None) != (up[1] is None):
                raise ValueError(f"a gated pair needs gate and up of one shape with a multiple of {g} rows")
            weight = torch.stack([weight.reshape(n // g, g, k), up[0].reshape(n // g, g, k)], 1).reshape(2 * n, k)
            if bias is not None:
                bias = torch.stack([bias.reshape(n // g, g), up[1].reshape(n // g, g)], 1).reshape(-1)
            n *= 2
        pad = -n % g
        weight = F.pad(weight.detach().to(dtype), (0, 0, 0, pad))
        packed = weight.reshape(-1, g, k // pair, pair).permute(0, 2, 1, 3).contiguous()
        if dtype == torch.float32:
            packed = packed.reshape(-1, k, g)
        if bias is not None:
            bias = F.pad(bias.detach().float(), (0, pad)).contiguous()
        return packed, bias

    @classmethod
    def pack_int8(cls, weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int8 `weight` [n, k] and its float32 column `scale` [n] in the kernel's order:
        [groups, k/4, 16, 4] int8, n padded to whole groups; with 128 x each column's sum
        (int32: the input comes stored + 128) and the scales, padded alike."""
        g = cls.GROUP
        n, k = weight.shape
        if k % 4 or weight.dtype != torch.int8:
            raise ValueError(f"the native int8 matmul takes int8 weights with a multiple of 4 inputs, not {k}")
        pad = -n % g
        weight = F.pad(weight, (0, 0, 0, pad))
        packed = weight.reshape(-1, g, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        comp = (weight.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
        return packed, comp, F.pad(scale.float(), (0, pad), value=1.0).contiguous()

    def products(self, x: torch.Tensor, packed: torch.Tensor, n: int, comp: torch.Tensor, scale: torch.Tensor,
                 threads: int = 1) -> torch.Tensor:
        """x [rows, k] uint8 (value + 128) -> [rows, n] float32: (x - 128) . w * scale."""
        k = packed.shape[1] * 4
        if x.dtype != torch.uint8 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"the native int8 matmul takes uint8 rows of {k} features")
        padded = packed.shape[0] * self.GROUP
        if not 0 < n <= padded or comp.numel() != padded or scale.numel() != padded:
            raise ValueError(f"{n} columns do not fit the packed weight")
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = self._u8s8(x.data_ptr(), x.stride(0), x.shape[0], packed.data_ptr(), n, k, comp.data_ptr(),
                        scale.data_ptr(), out.data_ptr(), out.stride(0), threads)
        if rc:
            raise ValueError(f"the native int8 matmul refused its arguments (code {rc})")
        return out

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, gated: bool = False, threads: int = 1) -> torch.Tensor:
        """x [..., k] (the packed weight's dtype) times its n columns, plus `bias`, plus
        `residual` [..., n]; `gated`: silu(gate) * up, n / 2 columns."""
        dtype = packed.dtype
        k = packed.shape[1] * self.PAIRS.get(dtype, 1)
        if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != k or not self.supports(dtype):
            raise ValueError(f"the native matmul takes {dtype} CPU rows of {k} features, on a CPU that "
                             f"computes {dtype} natively")
        padded = packed.shape[0] * self.GROUPS[dtype]
        if not 0 < n <= padded or (bias is not None and bias.numel() != padded):
            raise ValueError(f"{n} columns do not fit the packed weight")
        rows = x.reshape(-1, k)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        width = n // 2 if gated else n
        out = torch.empty(rows.shape[0], width, dtype=dtype)
        res, ldr = None, 0
        if residual is not None:
            res = residual.reshape(-1, n)
            res = res if res.stride(-1) == 1 and res.dtype == dtype else res.to(dtype).contiguous()
            ldr = res.stride(0)
            if res.shape[0] != rows.shape[0]:
                raise ValueError(f"a residual of {res.shape[0]} rows for {rows.shape[0]} rows of input")
        rc = self._linear[dtype](rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), n, k,
                                 None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
                                 ldr, out.data_ptr(), out.stride(0), int(gated), threads)
        if rc:
            raise ValueError(f"the native matmul refused its arguments (code {rc})")
        return out.view(*x.shape[:-1], width)
