"""A tensor-parallel worker against the same worker with threads instead, on this CPU:

  tp1 x1     one process, one torch thread
  tp1 xN     one process, N torch threads (what a worker does with N cores)
  tpN        N rank processes of one thread each (--tensor-parallel-size N), an
             all-reduce through gloo after each layer's attention and MLP

timed on the same steps: a prompt of --prompt tokens in one pass, and decode steps of
1 and --batch sequences over a context of that prompt. The model is random-initialised
with the default model's depth and width but 8 attention heads and 2 KV heads (SmolLM2's
9 do not split two ways); medians of --repeats. Prints a table and writes JSON.

    python -m bench.tensor_parallel [--tp 2] [--dtype auto] [--json build/tensor_parallel.json]
    python -m bench.tensor_parallel --device cuda --tp 2     (on GPUs: NCCL, no threads rows)

On GPUs the rows are TP 1 and TP N on as many cards (ranks sharing a card when there are
fewer: a correctness run, not a figure), eager (no CUDA graphs: the runner's own calls).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.engine.model.hardware import cpu_kind


def shaped(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _timed(fn) -> float:
    """Seconds `fn` takes, its device work included (its result read back)."""
    t0 = time.perf_counter()
    fn().float().sum().item()
    return time.perf_counter() - t0


def time_steps(runner, pool, prompt: int, batch: int, repeats: int) -> dict:
    bs = pool.layout.block_size
    blocks = -(-(prompt + repeats + 2) // bs)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(batch)]
    ids = [(i * 7919) % 40000 + 100 for i in range(prompt)]
    out = {}
    runs = [_timed(lambda: runner.prefill(pool, ids, tables[0])) for _ in range(repeats)]
    out["prefill_ms"] = statistics.median(runs) * 1000
    for n in (1, batch):
        for t in tables[:n]:
            runner.prefill(pool, ids, t)
        runs = [_timed(lambda: runner.decode(pool, [5] * n, [prompt + i] * n, tables[:n])) for i in range(repeats)]
        out[f"decode_b{n}_ms"] = statistics.median(runs) * 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ranks on cuda:0..N-1)")
    ap.add_argument("--json", default="build/tensor_parallel.json")
    args = ap.parse_args()
    from services.common.settings import WorkerSettings
    from services.engine.model.kv_cache import KVPoolMemory
    from services.engine.model.runner import ModelRunner
    from services.worker.ranks import start_ranks
    model = shaped(Path(tempfile.mkdtemp(prefix="pdserve-tp-bench-")))
    blocks = args.batch * (-(-(args.prompt + args.repeats + 2) // 16)) + 1
    results = {}
    gpu = args.device.startswith("cuda")
    rows = ((("tp1", 1, 1),) if gpu else (("tp1 x1", 1, 1), (f"tp1 x{args.tp}", args.tp, 1))) + \
        ((f"tp{args.tp}", 1, args.tp),)
    for name, threads, tp in rows:
        torch.set_num_threads(threads)
        ranks = None
        if tp > 1:
            settings = WorkerSettings(role="decode", model=str(model), tensor_parallel_size=tp, dtype=args.dtype,
                                      device=args.device, threads=1, kv_transport="nixl" if gpu else "tcp",
                                      enforce_eager=True)        # every rank eager, as rank 0 below
            ranks = start_ranks(settings, model)
        try:
            runner = ModelRunner(model, args.dtype, args.device, group=ranks.group if ranks else None,
                                 cuda_graphs=False)
            if ranks:
                ranks.open_pools(blocks, 16, False, "bench")
            pool = KVPoolMemory.allocate(runner.layout(blocks, 16), device=str(runner.device))
            time_steps(runner, pool, args.prompt, args.batch, 2)          # warm up
            results[name] = time_steps(runner, pool, args.prompt, args.batch, args.repeats)
            results[name]["dtype"] = runner.dtype_name
        finally:
            if ranks:
                ranks.stop()
    kind = torch.cuda.get_device_name() if gpu else cpu_kind()
    print(f"{'GPU' if gpu else 'CPU'}: {kind}, {os.cpu_count()} cores; model: SmolLM2-135M-like (30 layers, hidden 512), 8 heads / 2 KV heads, "
          f"{results['tp1 x1']['dtype']}; medians of {args.repeats}")
    print(f"{'':10} {'prefill ' + str(args.prompt):>14} {'decode b1':>10} {'decode b' + str(args.batch):>11}")
    for name, r in results.items():
        decode_b = r[f"decode_b{args.batch}_ms"]
        print(f"{name:10} {r['prefill_ms']:12.1f}ms {r['decode_b1_ms']:8.1f}ms {decode_b:9.1f}ms")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"device": args.device, "kind": kind, "cores": os.cpu_count(),
                                           "results": results}, indent=1))


if __name__ == "__main__":
    main()
