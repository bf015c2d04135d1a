"""What int8 weights buy on this CPU: a whole model's linear layers (SmolLM2-135M's
shapes, 30 layers of distinct weights, so they stream from memory as in a real step)
at several row counts, bfloat16 packed for oneDNN (what pdserve runs by default) against
pdserve's `--quantization int8` matmul (services/engine/fusion.py `Int8Linear`: weights
int8 per channel, activations quantized per token by the native kernels, oneDNN's u8 x
s8 GEMM, VNNI where the CPU has it, products scaled back per row), quantizing and
scaling back included. One thread, medians; weights random (the time does not depend
on their values). Quality is measured apart: `python -m bench.int8_quality`.

    python -m bench.int8_gemm --json build/int8-gemm.json [--rows 16,64,256]
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.engine import median_ms

# (out, in) of each projection: q|k|v fused, o, gate|up fused, down (SmolLM2-135M)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def measure(rows: int, kernels) -> dict:
    from services.engine.fusion import Int8Linear
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).bfloat16() * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in weights]
    int8 = [[Int8Linear(w, None) for w in layer] for layer in weights]
    x = {k: torch.randn(1, rows, k, generator=gen).bfloat16() for _, k in SHAPES}

    def bf16_pass():
        for layer in packed:
            for (_, k), w in zip(SHAPES, layer):
                torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

    def int8_pass():
        for layer in int8:
            for (_, k), linear in zip(SHAPES, layer):
                q, scales = kernels.quantize_rows(x[k])
                kernels.dequant_rows(linear.products(q), scales, None, None, torch.bfloat16)

    flops = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
    with torch.inference_mode():
        bf16_ms, int8_ms = median_ms(bf16_pass, 15), median_ms(int8_pass, 15)
    return {"rows": rows, "bf16_ms": bf16_ms, "int8_ms": int8_ms, "bf16_gflops": flops / bf16_ms / 1e6,
            "int8_gflops": flops / int8_ms / 1e6, "int8_speedup": bf16_ms / int8_ms}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_gemm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64,256", help="rows per matmul (decode batch, prompt chunk)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from services.engine.hardware import cpu_flags, cpu_kind
    from services.engine.model_store import cache_dir
    from services.engine.native import load_layers
    flags = cpu_flags()
    kind, vnni = cpu_kind(flags), bool({"avx512_vnni", "avx_vnni"} & flags)
    kernels = load_layers(cache_dir())
    results = [measure(int(r), kernels) for r in args.rows.split(",")]
    print(f"one core, {kind} ({'VNNI' if vnni else 'no VNNI'}), {LAYERS} layers of SmolLM2-135M's projections")
    print("| rows | bf16 packed | pdserve int8 | int8 speed-up |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['rows']} | {r['bf16_ms']:.1f} ms ({r['bf16_gflops']:.0f} GFLOP/s) | {r['int8_ms']:.1f} ms "
              f"({r['int8_gflops']:.0f} GFLOP/s) | {r['int8_speedup']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": kind, "vnni": vnni, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
