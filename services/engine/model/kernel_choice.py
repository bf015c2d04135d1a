"""Which bfloat16 matmuls a CPU worker runs, measured at start where more than one can.

On a CPU with AVX512-BF16, pdserve's own matmul kernels (`NativeMatmul`, `vdpbf16ps`;
with them a decode step's layers run in one native call) and oneDNN's (through torch,
weights packed once; on AMX tiles where the CPU has them) both run. Which is faster
depends on the CPU and on the rows a worker multiplies: a decode worker's few rows are
memory-bound, a prefill worker's hundreds compute-bound. The static rule
(`hardware.CpuKernels.bf16_matmul`: ours without AMX, oneDNN with it) was measured on
one CPU of each kind; `--matmul-kernel auto` measures instead, at worker start, the
model's own first-layer projections (q|k|v, o, gate|up, down: its real weights, up to
MAX_COLUMNS outputs each) through both, at the rows of the worker's role, on the worker's threads. The
static rule's choice stands unless the other is at least `MARGIN` faster, and the
first measurement is kept (`remembered`, in the kernel cache, by CPU model, shapes,
rows, threads and torch version): every later start on that machine takes the same
path, with no noise to flip it and no time spent. Delete the file, or pass
`--matmul-kernel`, to choose again. The time of our path leaves out what the one-call
decode step saves besides (~180 us of dispatch a layer), so a decode worker leans to
oneDNN, if anything.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from services.common.settings import MATMUL_KERNELS
from services.engine.model.hardware import cpu_flags, cpu_kind

# Rows a worker's matmuls take: decode steps of 1-32 sequences, prompt passes of
# hundreds of tokens; aggregated (""), both.
ROWS = {"decode": (1, 8, 32), "prefill": (256, 512), "": (1, 8, 32, 256, 512)}
# Output columns measured of each projection at most: a matmul's time grows in
# proportion past a few hundred, and a large model's layer must not take seconds.
MAX_COLUMNS = 1024
# The other path is taken only when its time is under this share of the rule's.
MARGIN = 0.9
REPEATS = 5


@dataclass(frozen=True)
class MatmulChoice:
    native: bool                        # pdserve's matmuls (else oneDNN's)
    reason: str
    ratio: float | None = None          # ours over oneDNN's time, geometric mean over the rows


def projections(layer: nn.Module) -> list[torch.Tensor] | None:
    """A Llama-family decoder layer's projection weights as the fused layers hold them:
    q|k|v, o, gate|up, down. None for another kind of layer."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    try:
        return [torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), attn.o_proj.weight,
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj.weight]
    except AttributeError:
        return None


def time_path(make: Callable[[torch.Tensor], nn.Module], weights: list[torch.Tensor], rows: tuple[int, ...],
              repeats: int = REPEATS) -> list[float]:
    """Seconds one pass over `weights`' linears (each made by `make`) takes at each row
    count: the median of `repeats` after a warm-up."""
    linears = [make(w.detach()[:MAX_COLUMNS]) for w in weights]
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(1, m, lin.in_features, dtype=torch.bfloat16) for lin in linears]
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                for lin, x in zip(linears, xs):
                    lin(x)
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times[1:]))
    return out


Measure = Callable[[tuple[int, ...]], tuple[list[float], list[float]]]


def choose(requested: str, rule: bool, role: str, measure: Measure | None, remembered: Path | None = None,
           shapes: tuple = ()) -> MatmulChoice:
    """`--matmul-kernel requested` for a worker of `role` whose CPU's static rule says
    `rule` (ours, or not); `measure(rows)` gives (ours, oneDNN's) seconds at each row
    count, or is None where only one path runs. A measurement is kept under the folder
    `remembered`, by `shapes` (the measured weights') and this machine."""
    if requested not in MATMUL_KERNELS:
        raise ValueError(f"matmul kernel must be one of {', '.join(MATMUL_KERNELS)}, not {requested!r}")
    if requested != "auto":
        return MatmulChoice(requested == "native", "asked for")
    if measure is None:
        return MatmulChoice(rule, "this CPU's rule (one path runs here, or the model's layers are of another kind)")
    rows = ROWS.get(role, ROWS[""])
    path = None if remembered is None else remembered / f"{_key(rule, rows, shapes)}.json"
    if path is not None and path.exists():
        try:
            kept = MatmulChoice(**json.loads(path.read_text()))
            return MatmulChoice(kept.native, f"{kept.reason}; kept from the first start on this machine", kept.ratio)
        except (OSError, ValueError, TypeError):
            pass                                # unreadable: measured again
    ours, theirs = measure(rows)
    ratio = statistics.geometric_mean([a / b for a, b in zip(ours, theirs)])
    native = ratio <= 1 / MARGIN if rule else ratio < MARGIN
    at = ", ".join(str(m) for m in rows)
    choice = MatmulChoice(native, f"measured: ours {ratio:.2f}x oneDNN's time at {at} rows "
                                  f"(this CPU's rule: {'ours' if rule else 'oneDNN'})", round(ratio, 4))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps(asdict(choice)))
            part.replace(path)                  # whole or not at all, for workers starting together
        except OSError:
            pass                                # a read-only cache: measured at every start
    return choice


def _key(rule: bool, rows: tuple[int, ...], shapes: tuple) -> str:
    """This machine (CPU model and flags), torch, threads, rows and shapes, hashed."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        model = ""
    what = [model, cpu_kind(), sorted(cpu_flags()), torch.__version__, torch.get_num_threads(), rule, rows, shapes]
    return f"{cpu_kind()}-" + hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
