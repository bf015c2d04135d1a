"""Native CPU kernels, built on first use with the machine's C compiler.

`paged_attention.c` runs decode attention straight from the paged KV cache. It is
compiled for the CPU it runs on (-march=native) into the cache directory, under a name
keyed by its source, flags, compiler and CPU, so a cache shared between machines never
hands one machine another's build; building takes about a second. Where there is no
compiler (or the build fails) `load_paged_decode` raises `NativeBuildError` and the
engine keeps its torch path.
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

SOURCE = Path(__file__).with_name("paged_attention.c")
COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"]
# Linked without -ffast-math: linking with it would add crtfastmath.o, which turns on
# flush-to-zero for the whole process when the library loads.
LINK_LIBS = (["-lmvec", "-lm", "-lpthread"], ["-lm", "-lpthread"])
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


def _build(source: Path, out_dir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise NativeBuildError("no C compiler (cc, gcc or clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(COMPILE_FLAGS), version, platform.machine(),
                                    _cpu_signature()]).encode()).hexdigest()[:16]
    target = out_dir / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    obj, tmp = out_dir / f".{key}.{os.getpid()}.o", out_dir / f".{key}.{os.getpid()}.so"
    try:
        result = subprocess.run([cc, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
                                capture_output=True, text=True)
        if result.returncode:
            raise NativeBuildError(f"{cc} failed on {source.name}: {result.stderr.strip()[-2000:]}")
        for libs in LINK_LIBS:
            result = subprocess.run([cc, "-shared", str(obj), "-o", str(tmp), *libs], capture_output=True, text=True)
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


class PagedDecodeKernel:
    """One query token per sequence, attending over that sequence's cached blocks."""

    def __init__(self, library: Path) -> None:
        try:
            lib = ctypes.CDLL(str(library))
        except OSError as e:
            raise NativeBuildError(f"cannot load {library}: {e}") from e
        fn = lib.pdserve_paged_decode_attention
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, p, p, p, p, i64, p, i32, i32, i32, i32, i32, i64, i64, ctypes.c_float, i32, i32]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._lib = lib

    @staticmethod
    def supports(dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and dtype in DTYPES

    def __call__(self, query: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
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
        out = torch.empty_like(query)
        rc = self._fn(query.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), out.data_ptr(),
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


def load_paged_decode(cache_root: Path) -> PagedDecodeKernel:
    """Build (once per machine and source) and load the kernel under `cache_root`/kernels,
    or under the temp directory where that is read-only (a container's baked-in cache)."""
    out_dir = cache_root / "kernels"
    if not _writable(out_dir):
        out_dir = Path(tempfile.gettempdir()) / "pdserve-kernels"
    return PagedDecodeKernel(_build(SOURCE, out_dir))
