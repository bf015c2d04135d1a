"""Native CPU kernels, built on first use with the machine's C compiler.

`attention.c` runs decode attention straight from the paged KV cache, and causal
prefill attention in bfloat16 on CPUs with AVX512-BF16; `matmul.c` the matmuls
themselves, bfloat16 on those CPUs, uint8 x int8 on CPUs with AVX512-VNNI and float32 on
CPUs with AVX2 and FMA;
`layers.c` the element-wise
work around the matmuls (RMSNorm, SiLU-and-multiply; with int8 weights, quantizing
activations per token and scaling products back) in one pass each; `decoder.c` a decode
step's decoder layers through those kernels in one call (bfloat16). Each is
compiled for the CPU it runs on (-march=native) into the cache directory, under a name
keyed by its source, flags, compiler and CPU, so a cache shared between machines never
hands one machine another's build; building takes about a second. Where there is no
compiler (or the build fails) the loaders raise `NativeBuildError` and the engine
keeps torch's own ops.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
LAYERS_SOURCE = Path(__file__).with_name("layers.c")
MATMUL_SOURCE = Path(__file__).with_name("matmul.c")
DECODER_SOURCE = Path(__file__).with_name("decoder.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC"]
# Linked without -ffast-math: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads. -fopenmp links libgomp.so.1,
# which resolves to the copy torch already loaded: one OpenMP thread team for torch's ops
# and these kernels (two teams would spin against each other on the same cores).
LINK_LIBS = (["-fopenmp", "-lmvec", "-lm"], ["-fopenmp", "-lm"])
BUILD_TIMEOUT_S = 120
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


class NativeBuildError(RuntimeError):
    """The kernel could not be built or loaded here."""


def _cpu_signature() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{argv[0]}: {e}") from e


def _build(source: Path, out_dir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise NativeBuildError("no C compiler (cc, gcc or clang) on PATH")
    version = _run([cc, "--version"]).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]     # what the source includes
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(COMPILE_FLAGS), version,
                                    platform.machine(), _cpu_signature()]).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise NativeBuildError(f"cannot create {out_dir}: {e}") from e
    obj, tmp = out_dir / f".{key}.{os.getpid()}.o", out_dir / f".{key}.{os.getpid()}.so"
    try:
        result = _run([cc, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)])
        if result.returncode:
            raise NativeBuildError(f"{cc} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        for libs in LINK_LIBS:
            result = _run([cc, "-shared", str(obj), "-o", str(tmp), *libs])
            if result.returncode == 0:
                break
        else:
            raise NativeBuildError(f"linking {source.name} failed: {result.stderr.strip()[-2000:]}")
        tmp.replace(target)                 # atomic: workers building at once all end with one file
    finally:
        obj.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    log.info("built %s", target)
    return target


def _load(library: Path) -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(library))
    except OSError as e:
        raise NativeBuildError(f"cannot load {library}: {e}") from e


class NativeAttention:
    """The kernels of one loaded library: `decode` (one query token per sequence over
    its cached blocks) and, where `prefills` is true, `prefill` (causal, bfloat16)."""

    def __init__(self, library: Path) -> None:
        lib = _load(library)
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._decode = lib.pdserve_paged_decode_attention
        self._decode.argtypes = [p, p, p, p, p, i64, p, i32, i32, i32, i32, i32, i64, i64, f32, i32, i32]
        self._decode.restype = i32
        self._prefill = lib.pdserve_prefill_attention
        self._prefill.argtypes = [p, i64, i64, p, i64, i64, p, i64, i64, p, i32, i32, i32, i32, i32, i32, f32, i32]
        self._prefill.restype = i32
        self.prefills = bool(lib.pdserve_prefill_supported())
        self.library = library
        self._lib = lib

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES

    def prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offset: int, scale: float,
                threads: int = 1) -> torch.Tensor:
        """Causal attention for one sequence, bfloat16: query [q_len, q_heads, dim], key
        and value [k_len, kv_heads, dim] (any token and head strides, last dimension
        contiguous); query i sees keys 0 .. i + offset. Returns [q_len, q_heads, dim]."""
        q_len, q_heads, dim = query.shape
        k_len, kv_heads, _ = key.shape
        if not self.prefills or {query.dtype, key.dtype, value.dtype} != {torch.bfloat16}:
            raise ValueError("native prefill attention takes bfloat16 on CPUs with AVX512-BF16")
        if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
            raise ValueError("the last dimension must be contiguous")
        out = torch.empty(q_len, q_heads, dim, dtype=query.dtype)
        rc = self._prefill(query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0),
                           key.stride(1), value.data_ptr(), value.stride(0), value.stride(1), out.data_ptr(),
                           q_len, k_len, offset, q_heads, kv_heads, dim, scale, threads)
        if rc:
            raise ValueError(f"prefill attention refused its arguments (code {rc})")
        return out

    def decode(self, query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
               scale: float, threads: int = 1) -> torch.Tensor:
        """query [batch, q_heads, dim]; cache: one layer, [2, blocks, block_size, kv_heads,
        dim], contiguous; table int64 [batch, width] (block ids, row-major); lens int32
        [batch] (tokens to attend to, at most width * block_size). Returns [batch, q_heads,
        dim] in the query's dtype."""
        query = query.contiguous()
        batch, q_heads, dim = query.shape
        _, _, block_size, kv_heads, _ = cache.shape
        if cache.dtype != query.dtype or not cache.is_contiguous():
            raise ValueError("the cache must be contiguous and in the query's dtype")
        if table.dtype != torch.int64 or table.stride(1) != 1 or lens.dtype != torch.int32 or not lens.is_contiguous():
            raise ValueError("the block table must be int64 rows and the lengths contiguous int32")
        out = torch.empty_like(query)
        rc = self._decode(query.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), out.data_ptr(),
                          table.data_ptr(), table.stride(0), lens.data_ptr(), batch, q_heads, kv_heads, dim,
                          block_size, cache.stride(1), cache.stride(2), scale, DTYPES[query.dtype], threads)
        if rc:
            raise ValueError(f"paged decode attention refused its arguments (code {rc})")
        return out


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK)


class NativeLayers:
    """The per-token layer kernels of one loaded library (float32 or bfloat16, CPU)."""
    name = "native"

    def __init__(self, library: Path) -> None:
        lib = _load(library)
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._norm = lib.pdserve_rms_norm
        self._norm.argtypes = [p, i64, p, p, i64, i32, i32, f32, i32, i32]
        self._norm.restype = i32
        self._silu = lib.pdserve_silu_mul
        self._silu.argtypes = [p, i64, p, i64, i32, i32, i32, i32]
        self._silu.restype = i32
        self._rotary = lib.pdserve_rotary
        self._rotary.argtypes = [p, i64, i64, p, p, i64, i32, i32, i32, i32, i32]
        self._rotary.restype = i32
        self._quantize = lib.pdserve_quantize_rows
        self._quantize.argtypes = [p, i64, p, i64, p, i32, i32, i32, i32]
        self._norm_quantize = lib.pdserve_rms_norm_quantize
        self._norm_quantize.argtypes = [p, i64, p, p, i64, p, i32, i32, f32, i32, i32]
        self._dequant = lib.pdserve_dequant_rows
        self._dequant.argtypes = [p, i64, p, p, p, i64, p, i64, i32, i32, i32, i32]
        self._silu_quantize = lib.pdserve_silu_mul_quantize
        self._silu_quantize.argtypes = [p, i64, p, p, i64, p, i32, i32, i32]
        for fn in (self._quantize, self._norm_quantize, self._dequant, self._silu_quantize):
            fn.restype = i32
        self._lib = lib

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


class NativeMatmul:
    """The matmuls of one loaded library (matmul.c). bfloat16 (`bf16`: the CPU has
    AVX512-BF16) and float32 (`f32`: AVX2 and FMA): weights packed once by `pack`, then
    `linear` per call, with a residual add or SiLU-and-multiply applied as the output is
    written. uint8 x int8 (`int8`: the CPU has AVX512-VNNI): `pack_int8`, then
    `products`, `Int8Linear`'s product."""

    GROUP = 16                              # output columns per packed group (bfloat16, int8)
    GROUPS = {torch.bfloat16: 16, torch.float32: 8}
    PAIRS = {torch.bfloat16: 2, torch.float32: 1}     # k values per packed step

    def __init__(self, library: Path) -> None:
        lib = _load(library)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = {torch.bfloat16: lib.pdserve_linear_bf16, torch.float32: lib.pdserve_linear_f32}
        for fn in self._linear.values():
            fn.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, p, i64, i32, i32]
            fn.restype = i32
        self._u8s8 = lib.pdserve_linear_u8s8
        self._u8s8.argtypes = [p, i64, i64, p, i64, i64, p, p, p, i64, i32]
        self._u8s8.restype = i32
        self.bf16 = bool(lib.pdserve_matmul_supported())
        self.int8 = bool(lib.pdserve_int8_supported())
        self.f32 = bool(lib.pdserve_f32_supported())
        self._lib = lib

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


class _Kernels(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("linear", "norm", "rotary", "attend")]


class _Layer(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("norm_in", "norm_post", "qkv", "o", "gate_up", "down",
                                                      "qkv_bias", "o_bias", "gate_up_bias", "down_bias")]
                + [("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float)])


class _Model(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("layers", "hidden", "q_heads", "kv_heads", "dim", "inter",
                                                     "layer_stride", "half_stride", "block_stride", "token_stride",
                                                     "block_size")]
                + [("scale", ctypes.c_float), ("layer", ctypes.POINTER(_Layer))])


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
        lib = _load(library)
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._run = lib.pdserve_decode_layers
        self._run.argtypes = [p, p, p, p, p, i32, p, p, p, p, i64, p, i32]
        self._run.restype = i32
        self._scratch_size = lib.pdserve_decode_scratch
        self._scratch_size.argtypes = [p, i64]
        self._scratch_size.restype = i64
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value     # noqa: E731
        self._kernels = _Kernels(address(matmul._linear[torch.bfloat16]), address(layers._norm),
                                 address(layers._rotary), address(attention._decode))
        ptr = lambda t: None if t is None else t.data_ptr()              # noqa: E731
        # What the pointers below point into: the weights and the kernels' libraries.
        self._weights, self._kernel_libraries = list(weights), (attention, layers, matmul)
        self._norms = [(w.norm_in.to(torch.bfloat16).contiguous(), w.norm_post.to(torch.bfloat16).contiguous())
                       for w in weights]
        self._layers = (_Layer * len(weights))(*[
            _Layer(n_in.data_ptr(), n_post.data_ptr(), w.qkv[0].data_ptr(), w.o[0].data_ptr(),
                   w.gate_up[0].data_ptr(), w.down[0].data_ptr(), ptr(w.qkv[1]), ptr(w.o[1]), ptr(w.gate_up[1]),
                   ptr(w.down[1]), w.eps_in, w.eps_post)
            for w, (n_in, n_post) in zip(weights, self._norms)])
        hidden = weights[0].norm_in.numel()
        self._model = _Model(len(weights), hidden, q_heads, kv_heads, dim, inter, 0, 0, 0, 0, 0, scale,
                             self._layers)
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


def _kernel_dir(cache_root: Path) -> Path:
    """`cache_root`/kernels, or the temp directory where that is read-only (a
    container's baked-in cache)."""
    out_dir = cache_root / "kernels"
    return out_dir if _writable(out_dir) else Path(tempfile.gettempdir()) / "pdserve-kernels"


def load_attention(cache_root: Path) -> NativeAttention:
    """Build (once per machine and source) and load the attention kernels."""
    return NativeAttention(_build(SOURCE, _kernel_dir(cache_root)))


def load_layers(cache_root: Path) -> NativeLayers:
    """Build (once per machine and source) and load the layer kernels."""
    return NativeLayers(_build(LAYERS_SOURCE, _kernel_dir(cache_root)))


def load_decoder(cache_root: Path) -> Path:
    """Build (once per machine and source) the one-call decoder layers; the library's
    path, for `NativeDecoder`."""
    return _build(DECODER_SOURCE, _kernel_dir(cache_root))


def load_matmul(cache_root: Path) -> NativeMatmul:
    """Build (once per machine and source) and load the matmuls; NativeBuildError where
    this CPU has none of AVX512-BF16, AVX512-VNNI or AVX2 with FMA for them (`bf16`,
    `int8` and `f32` say which it has)."""
    matmul = NativeMatmul(_build(MATMUL_SOURCE, _kernel_dir(cache_root)))
    if not (matmul.bf16 or matmul.int8 or matmul.f32):
        raise NativeBuildError("the native matmuls need AVX512-BF16 (bfloat16), AVX512-VNNI (int8) or AVX2 "
                               "with FMA (float32)")
    return matmul
