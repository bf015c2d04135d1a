"""What the hardware computes well, so the engine picks dtypes and kernels to match.

On CPU, bfloat16 is fast only where the CPU multiplies it natively (AVX512-BF16, or
AMX tiles): elsewhere torch emulates it and a bf16 matmul ran ~70x slower than float32
on an AVX2-only EPYC. `--dtype auto` therefore means bfloat16 on GPUs and on CPUs with
native bf16, float32 on every other CPU, and the choice is logged with its reason.
"""
from __future__ import annotations

import functools
import platform
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from services.common.settings import DTYPES


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_kind(flags: frozenset[str] | None = None) -> str:
    """A short name for tables and logs: amx-bf16, avx512-bf16, avx512, avx2, neon or generic."""
    flags = cpu_flags() if flags is None else flags
    for name, flag in (("amx-bf16", "amx_bf16"), ("avx512-bf16", "avx512_bf16"), ("avx512", "avx512f"),
                       ("avx2", "avx2"), ("neon", "asimd")):
        if flag in flags:
            return name
    return platform.machine() or "generic"


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 natively."""
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags) or "bf16" in flags      # bf16: ARMv8.6 BF16


def has_amx(flags: frozenset[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return "amx_bf16" in flags


@dataclass(frozen=True)
class CpuKernels:
    """Which of pdserve's own CPU kernels the engine takes on a CPU with these flags: the
    one rule the runner applies and the tests skip by. Where a field is False the engine
    keeps torch's (oneDNN's) path, which was measured faster there or not measured
    against ours."""
    bf16_matmul: bool       # vdpbf16ps matmuls: AVX512-BF16 without AMX. With AMX, oneDNN's unless a measurement
    #                         at start finds ours (then on AMX tiles too) faster: not yet measured on such a CPU
    int8_matmul: bool       # vpdpbusd matmuls: AVX512-VNNI without AMX
    f32_matmul: bool        # AVX2 and FMA without AVX-512 (torch's AVX-512 float32 path not measured against it)
    bf16_prefill: bool      # prefill attention in bfloat16: AVX512-BF16 without AMX, where torch's SDPA
    #                         (oneDNN on AMX tiles) took 2.3 ms against ~7 ms a layer at 512 tokens

    @property
    def one_call_decoder(self) -> bool:
        """A bfloat16 decode step's layers in one native call: its matmuls are the bf16 ones."""
        return self.bf16_matmul


def cpu_kernels(flags: frozenset[str] | None = None) -> CpuKernels:
    flags = cpu_flags() if flags is None else flags
    amx = has_amx(flags)
    return CpuKernels(bf16_matmul="avx512_bf16" in flags and not amx,
                      int8_matmul="avx512_vnni" in flags and not amx,
                      f32_matmul={"avx2", "fma"} <= flags and "avx512f" not in flags,
                      bf16_prefill="avx512_bf16" in flags and not amx)


@dataclass(frozen=True)
class DtypeChoice:
    name: str                           # "bfloat16", "float32", "float16"
    reason: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.name)


def pick_dtype(requested: str, device: torch.device, flags: frozenset[str] | None = None) -> DtypeChoice:
    """Resolve `--dtype` (auto or a name) for `device`."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, "asked for")
    if device.type != "cpu":
        return DtypeChoice("bfloat16", f"auto on {device.type}")
    kind = cpu_kind(flags)
    if native_bf16(flags):
        return DtypeChoice("bfloat16", f"auto: this CPU ({kind}) computes bfloat16 natively")
    return DtypeChoice("float32", f"auto: this CPU ({kind}) has no native bfloat16, which torch would emulate "
                                  f"many times slower than float32")


@contextmanager
def threads_at_most(n: int) -> Iterator[None]:
    """torch's threads on the calling thread cut to `n` for the block (0: as they are)."""
    before = torch.get_num_threads() if n > 0 else 0
    if not 0 < n < before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
