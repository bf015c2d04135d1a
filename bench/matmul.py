"""The matmuls pdserve can run on this CPU, timed over a whole model's linear layers
(SmolLM2-135M's shapes, 30 layers of distinct weights, so they stream from memory as in
a real step) at several row counts:

  onednn bf16   bfloat16 weights packed for oneDNN (pdserve's bf16 path on AMX CPUs)
  native bf16   pdserve's own bfloat16 matmul (services/engine/kernels/native/matmul.c; its bf16
                path on AVX512-BF16 CPUs without AMX; absent elsewhere)
  native amx    the same on AMX tiles (CPUs with AMX-BF16 only)
  onednn int8   `--quantization int8`'s layers (services/engine/model/int8.py `Int8Linear`:
                weights int8 per channel, activations quantized per token by the native
                kernels, oneDNN's u8 x s8 GEMM, VNNI where the CPU has it, products scaled
                back per row), quantizing and scaling back included (its path on AMX CPUs)
  native int8   the same with pdserve's own u8 x s8 matmul (its path on AVX512-VNNI CPUs
                without AMX; the same products, bit for bit)

In float32 (`--dtype float32`, or `auto` on a CPU without native bfloat16, where pdserve
serves float32):

  torch f32     torch's own float32 linear (MKL / oneDNN), what the model would run alone
  native f32    pdserve's own float32 matmul (its path on AVX2 + FMA CPUs without AVX-512)

One thread, medians; weights random (the time does not depend on their values). Output
quality is measured apart: `python -m bench.int8_quality`.

    python -m bench.matmul --json build/matmul.json [--rows 1,4,16,64,256] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json

import torch

from bench.engine import median_ms

# (out, in) of each projection: q|k|v fused, o, gate|up fused, down (SmolLM2-135M)
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def measure(rows: int, kernels, matmul) -> dict:
    from services.engine.kernels.native import NativeMatmul
    from services.engine.model.int8 import Int8Linear
    # on an AMX CPU the library's bf16 matmul runs on tiles: vdpbf16ps's path beside it
    vector = NativeMatmul(matmul.path, tiles=False) if matmul is not None and matmul.amx else matmul
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen).bfloat16() * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in weights]
    native = [[matmul.pack(w)[0] for w in layer] for layer in weights] if matmul is not None and matmul.bf16 else []
    int8 = [[Int8Linear(w, None) for w in layer] for layer in weights]
    native_int8 = ([[Int8Linear(w, None, matmul=matmul) for w in layer] for layer in weights]
                   if matmul is not None and matmul.int8 else [])
    x = {k: torch.randn(1, rows, k, generator=gen).bfloat16() for _, k in SHAPES}

    def bf16_pass():
        for layer in packed:
            for (_, k), w in zip(SHAPES, layer):
                torch.ops.mkldnn._linear_pointwise(x[k], w, None, "none", [], "")

    def native_pass(path=vector):
        for layer in native:
            for (n, k), w in zip(SHAPES, layer):
                path.linear(x[k], w, n)

    def int8_pass(layers=int8):
        for layer in layers:
            for (_, k), linear in zip(SHAPES, layer):
                q, scales = kernels.quantize_rows(x[k])
                kernels.dequant_rows(linear.products(q), scales, None, None, torch.bfloat16)

    flops = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
    with torch.inference_mode():
        times = {"onednn_bf16": median_ms(bf16_pass, 15), "onednn_int8": median_ms(int8_pass, 15)}
        if native:
            times["native_bf16"] = median_ms(native_pass, 15)
        if native and matmul.amx:
            times["native_amx"] = median_ms(lambda: native_pass(matmul), 15)
        if native_int8:
            times["native_int8"] = median_ms(lambda: int8_pass(native_int8), 15)
    return {"rows": rows, **{f"{name}_ms": ms for name, ms in times.items()},
            **{f"{name}_gflops": flops / ms / 1e6 for name, ms in times.items()},
            **{f"{name}_speedup": times["onednn_bf16"] / ms for name, ms in times.items() if name != "onednn_bf16"}}


def measure_f32(rows: int, matmul) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES] for _ in range(LAYERS)]
    native = ([[matmul.pack(w, dtype=torch.float32)[0] for w in layer] for layer in weights]
              if matmul is not None and matmul.f32 else [])
    x = {k: torch.randn(1, rows, k, generator=gen) for _, k in SHAPES}

    def torch_pass():
        for layer in weights:
            for (_, k), w in zip(SHAPES, layer):
                torch.nn.functional.linear(x[k], w)

    def native_pass():
        for layer in native:
            for (n, k), w in zip(SHAPES, layer):
                matmul.linear(x[k], w, n)

    flops = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
    times: dict[str, list[float]] = {"torch_f32": [], **({"native_f32": []} if native else {})}
    with torch.inference_mode():
        for _ in range(3):                  # alternate, so drift on a shared machine hits both
            times["torch_f32"].append(median_ms(torch_pass, 7))
            if native:
                times["native_f32"].append(median_ms(native_pass, 7))
    ms = {name: sorted(t)[1] for name, t in times.items()}
    return {"rows": rows, **{f"{name}_ms": t for name, t in ms.items()},
            **{f"{name}_gflops": flops / t / 1e6 for name, t in ms.items()},
            **{f"{name}_speedup": ms["torch_f32"] / t for name, t in ms.items() if name != "torch_f32"}}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.matmul", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,64,256", help="rows per matmul (decode batch, prompt chunk)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="auto: what pdserve's --dtype auto picks on this CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from services.engine.model.hardware import cpu_flags, cpu_kind, pick_dtype
    from services.engine.text.model_store import cache_dir
    from services.engine.kernels.native import NativeBuildError, load_layers, load_matmul
    flags = cpu_flags()
    kind, vnni = cpu_kind(flags), bool({"avx512_vnni", "avx_vnni"} & flags)
    dtype = pick_dtype(args.dtype, torch.device("cpu"), flags).torch_dtype
    try:
        matmul = load_matmul(cache_dir())
    except NativeBuildError as e:
        print(f"native matmul: not here ({e})")
        matmul = None
    rows = [int(r) for r in args.rows.split(",")]
    if dtype == torch.float32:
        results = [measure_f32(r, matmul) for r in rows]
        base, names = "torch f32", [n for n in ("torch_f32", "native_f32") if f"{n}_ms" in results[0]]
    else:
        kernels = load_layers(cache_dir())
        results = [measure(r, kernels, matmul) for r in rows]
        base = "oneDNN bf16"
        names = [n for n in ("onednn_bf16", "native_bf16", "native_amx", "onednn_int8", "native_int8")
                 if f"{n}_ms" in results[0]]
    print(f"one core, {kind} ({'VNNI' if vnni else 'no VNNI'}), {LAYERS} layers of SmolLM2-135M's projections; "
          f"speed-ups against {base}")
    print("| rows | " + " | ".join(n.replace("_", " ") for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in results:
        cells = [f"{r[f'{n}_ms']:.1f} ms ({r[f'{n}_gflops']:.0f} GFLOP/s"
                 + (f", {r[f'{n}_speedup']:.2f}x)" if n != names[0] else ")") for n in names]
        print(f"| {r['rows']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": kind, "vnni": vnni, "dtype": str(dtype).removeprefix("torch."), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
