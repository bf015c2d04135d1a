"""Native CPU kernels, built on first use with the machine's C compiler.

`attention.c` runs decode attention straight from the paged KV cache, and causal
prefill attention in bfloat16 on CPUs with AVX512-BF16. It is compiled for the CPU it
runs on (-march=native) into the cache directory, under a name keyed by its source,
flags, compiler and CPU, so a cache shared between machines never hands one machine
another's build; building takes about a second. Where there is no compiler (or the
build fails) `load_attention` raises `NativeBuildError` and the engine keeps torch's
own ops.
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
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"]
# Linked without -ffast-math: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads.
LINK_LIBS = (["-lmvec", "-lm", "-lpthread"], ["-lm", "-lpthread"])
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
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(COMPILE_FLAGS), version, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
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


class NativeAttention:
    """The kernels of one loaded library: `decode` (one query token per sequence over
    its cached blocks) and, where `prefills` is true, `prefill` (causal, bfloat16)."""

    def __init__(self, library: Path) -> None:
        try:
            lib = ctypes.CDLL(str(library))
        except OSError as e:
            raise NativeBuildError(f"cannot load {library}: {e}") from e
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


def load_attention(cache_root: Path) -> NativeAttention:
    """Build (once per machine and source) and load the kernel under `cache_root`/kernels,
    or under the temp directory where that is read-only (a container's baked-in cache)."""
    out_dir = cache_root / "kernels"
    if not _writable(out_dir):
        out_dir = Path(tempfile.gettempdir()) / "pdserve-kernels"
    return NativeAttention(_build(SOURCE, out_dir))
