"""Which bfloat16 kernels a CPU worker runs, measured at start where more than one can.

On a CPU with AVX512-BF16, pdserve's own matmul kernels (`NativeMatmul`, `vdpbf16ps`;
with them a decode step's layers run in one native call) and oneDNN's (through torch,
weights packed once; on AMX tiles where the CPU has them) both run, and so do pdserve's
bfloat16 prefill attention and torch's SDPA (oneDNN's flash attention). Which is faster
depends on the CPU and on the sizes a worker computes: a decode worker's few rows are
memory-bound, a prefill worker's hundreds compute-bound. The static rules
(`hardware.CpuKernels`: ours without AMX, the library's with it) were measured on one
CPU of each kind; `auto` measures instead, at worker start, at the sizes of the
worker's role, on the threads of its own cores (a prefill worker that also runs on the
decode workers' cores: its own core's thread; the other one waits on a busy core),
timing both paths back to back in each round (`paired_ratio`):
- matmuls (`--matmul-kernel auto`): the model's own first-layer projections (q|k|v, o,
  gate|up, down: its real weights, up to MAX_COLUMNS outputs each) through both;
- prefill attention (`--attention-kernel auto`): one layer's causal attention in the
  model's head shape over prompts of PROMPT_TOKENS, through both.
Timed one path after the other, on two threads, while the decode worker measured on
the core the second thread shares, a prefill worker once found ours 1.47x oneDNN's
(0.92-1.00x on an idle machine) and kept oneDNN: another key's 10-token prompt then
took 35 ms on it, 25 through ours.
The rule's choice stands unless the other is at least `MARGIN` faster, and the first
measurement is kept (`remembered`, in the kernel cache, by CPU model and flags, torch,
threads, sizes and shapes): every later start on that machine takes the same path, with
no noise to flip it and no time spent. Delete the file, or pass the setting, to choose
again. The time of our matmuls leaves out what the one-call decode step saves besides
(~180 us of dispatch a layer), so a decode worker leans to oneDNN, if anything.
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
import torch.nn.functional as F
from torch import nn

from services.common.settings import MATMUL_KERNELS
from services.engine.model.hardware import cpu_flags, cpu_kind

# Rows a worker's matmuls take: decode steps of 1-32 sequences, prompt passes of
# hundreds of tokens; aggregated (""), both.
ROWS = {"decode": (1, 8, 32), "prefill": (256, 512), "": (1, 8, 32, 256, 512)}
# Output columns measured of each projection at most: a matmul's time grows in
# proportion past a few hundred, and a large model's layer must not take seconds.
MAX_COLUMNS = 1024
# Prompt tokens a worker's prefill attention takes at once: a decode worker's chunks and
# short prompts, a prefill worker's prompts; aggregated, both.
PROMPT_TOKENS = {"decode": (64, 256), "prefill": (256, 512), "": (64, 256, 512)}
# The other path is taken only when its time is under this share of the rule's.
MARGIN = 0.9
REPEATS = 7
# How a kept measurement was made: one kept by an earlier way is measured again.
METHOD = "paired rounds on the worker's own threads"


@dataclass(frozen=True)
class KernelChoice:
    native: bool                        # pdserve's kernel (else the library's: oneDNN, torch's SDPA)
    reason: str
    ratio: float | None = None          # ours over theirs in time, geometric mean over the sizes


def projections(layer: nn.Module) -> list[torch.Tensor] | None:
    """A Llama-family decoder layer's projection weights as the fused layers hold them
    (q|k|v, o, gate|up, down), their first MAX_COLUMNS outputs each. None for another
    kind of layer."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    try:
        parts = [(attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                 (mlp.down_proj,)]
        # sliced before they are joined: a large model's whole gate|up is hundreds of MB
        return [torch.cat([m.weight.detach()[:MAX_COLUMNS] for m in linears])[:MAX_COLUMNS] for linears in parts]
    except AttributeError:
        return None


def _seconds(run: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def paired_ratio(ours: Callable[[], object], theirs: Callable[[], object], repeats: int = REPEATS) -> float:
    """Our time over theirs: the median of `repeats` rounds, each timing both back to
    back (in turn first), after a warm-up of each. A worker starting beside another
    shares cores with that one's start; a load that comes or goes moves both times of a
    round alike, where timing all of ours and then all of theirs would charge it to one."""
    ours(), theirs()
    ratios = []
    for r in range(repeats):
        if r % 2:
            b, a = _seconds(theirs), _seconds(ours)
        else:
            a, b = _seconds(ours), _seconds(theirs)
        ratios.append(a / b)
    return statistics.median(ratios)


def compare_paths(ours: Callable[[torch.Tensor], nn.Module], theirs: Callable[[torch.Tensor], nn.Module],
                  weights: list[torch.Tensor], rows: tuple[int, ...], repeats: int = REPEATS) -> list[float]:
    """Our time over theirs for one pass over `weights`' linears (`projections`), each
    made by `ours` and by `theirs`, at each row count."""
    paths = [[make(w) for w in weights] for make in (ours, theirs)]
    out = []
    with torch.inference_mode():
        for m in rows:
            xs = [torch.randn(1, m, w.shape[1], dtype=torch.bfloat16) for w in weights]
            run = [lambda linears=linears: [lin(x) for lin, x in zip(linears, xs)] for linears in paths]
            out.append(paired_ratio(*run, repeats))
    return out


def attention_shape(layer: nn.Module) -> tuple[int, int, int, float] | None:
    """(heads, KV heads, head size, scale) of a Llama-family layer's attention; None for
    another kind of layer."""
    attn = getattr(layer, "self_attn", None)
    try:
        dim = attn.head_dim
        return attn.q_proj.out_features // dim, attn.k_proj.out_features // dim, dim, float(attn.scaling)
    except AttributeError:
        return None


def compare_prefill_attention(native, shape: tuple[int, int, int, float], tokens: tuple[int, ...],
                              repeats: int = REPEATS) -> list[float]:
    """Our time over torch's SDPA's for one layer's causal attention over a prompt of
    each length in `tokens` (no cached prefix), through pdserve's kernel
    (`NativeAttention.prefill`)."""
    heads, kv_heads, dim, scale = shape
    threads = torch.get_num_threads()
    out = []
    with torch.inference_mode():
        for n in tokens:
            q, k, v = (torch.randn(n, h, dim, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads))
            qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out.append(paired_ratio(
                lambda: native.prefill(q, k, v, 0, scale, threads),
                lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True),
                repeats))
    return out


# Our time over theirs at each size asked for.
Measure = Callable[[tuple[int, ...]], list[float]]


def choose(requested: str, rule: bool, role: str, measure: Measure | None, remembered: Path | None = None,
           shapes: tuple = (), ours: str = "") -> KernelChoice:
    """`--matmul-kernel requested` for a worker of `role` whose CPU's static rule says
    `rule` (ours, or not); `measure(rows)` gives our time over oneDNN's at each row
    count, or is None where only one path runs. A measurement is kept under the folder
    `remembered`, by `shapes` (the measured weights'), `ours` (the instructions our
    matmuls run on: `NativeMatmul.bf16_path`) and this machine."""
    if requested not in MATMUL_KERNELS:
        raise ValueError(f"matmul kernel must be one of {', '.join(MATMUL_KERNELS)}, not {requested!r}")
    if requested != "auto":
        return KernelChoice(requested == "native", "asked for")
    return measured(rule, ROWS.get(role, ROWS[""]), "rows", "oneDNN", measure, remembered, ("matmul", shapes, ours))


def choose_prefill_attention(requested: str, rule: bool, role: str, measure: Measure | None,
                             remembered: Path | None = None, shape: tuple = ()) -> KernelChoice:
    """bfloat16 prefill attention under `--attention-kernel requested` ("native" insists
    on ours; "auto" measures where both run), for a worker of `role` whose CPU's rule
    says `rule`."""
    if requested == "native":
        return KernelChoice(True, "asked for")
    return measured(rule, PROMPT_TOKENS.get(role, PROMPT_TOKENS[""]), "prompt tokens", "torch's SDPA", measure,
                    remembered, ("prefill attention", shape))


def measured(rule: bool, sizes: tuple[int, ...], unit: str, theirs: str, measure: Measure | None,
             remembered: Path | None, key: tuple) -> KernelChoice:
    """Ours or `theirs`: the static `rule` unless `measure(sizes)` finds the other path
    clearly faster (MARGIN); the rule where nothing can be measured. The first
    measurement is kept under `remembered` by `key` and this machine."""
    if measure is None:
        return KernelChoice(rule, "this CPU's rule (one path runs here, or the model's layers are of another kind)")
    path = None if remembered is None else remembered / f"{_key(rule, sizes, key)}.json"
    if path is not None and path.exists():
        try:
            kept = KernelChoice(**json.loads(path.read_text()))
            return KernelChoice(kept.native, f"{kept.reason}; kept from the first start on this machine", kept.ratio)
        except (OSError, ValueError, TypeError):
            pass                                # unreadable: measured again
    ratio = statistics.geometric_mean(measure(sizes))
    native = ratio <= 1 / MARGIN if rule else ratio < MARGIN
    at = ", ".join(str(m) for m in sizes)
    choice = KernelChoice(native, f"measured: ours {ratio:.2f}x {theirs}'s time at {at} {unit} "
                                  f"(this CPU's rule: {'ours' if rule else theirs})", round(ratio, 4))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(f".{os.getpid()}.part")
            part.write_text(json.dumps(asdict(choice)))
            part.replace(path)                  # whole or not at all, for workers starting together
        except OSError:
            pass                                # a read-only cache: measured at every start
    return choice


def _key(rule: bool, sizes: tuple[int, ...], key: tuple) -> str:
    """This machine (CPU model and flags), torch, threads, the sizes and `key`, hashed."""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        model = ""
    what = [METHOD, model, cpu_kind(), sorted(cpu_flags()), torch.__version__, torch.get_num_threads(), rule, sizes, key]
    return f"{cpu_kind()}-" + hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
