"""pdserve's cluster on one CUDA device against transformers' own generate. No download.

    python -m bench.gpu_cluster --shape 8b --json out.json   (make gpu-bench)
    python -m bench.gpu_cluster --device cpu --quick         (the script's own test, on a CPU)

One random-weight model of a real shape (bench/gpu_speed.py's SHAPES, bfloat16) with a
byte-level tokenizer is saved once and served three ways on the same card:

  generate        transformers' `model.generate` with a static cache, all prompts in
                  one batch (greedy, no early stop): the baseline's output tokens/s
  disaggregated   `pdserve up`, one prefill and one decode worker sharing the GPU
                  (--share-gpus, a memory share each), KV through NIXL, every prompt
                  prefilled remotely: `pdserve bench` at --concurrency, its output
                  tokens/s, TTFT and ITL; then one --long-prompt prompt at a time (one
                  output token): its TTFT
  aggregated      `pdserve up --mode aggregated`, one worker that computes its own
                  prompts: the same long prompts' TTFT; disaggregation's TTFT overhead
                  is disaggregated's median over this one's, minus 1
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_check import Cluster, build_tiny_model
from bench.gpu_speed import SHAPES, describe

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def generate_baseline(model_dir: Path, device: str, dtype: torch.dtype, batch: int, input_len: int,
                      output_len: int) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=device).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 250, (batch, input_len), generator=g).to(device)

    def run(new: int) -> float:
        _sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, cache_implementation="static")
        _sync(device)
        assert out.shape[1] == input_len + new
        return time.perf_counter() - t0
    # warm-up at the measured shape: generate compiles the forward for a static cache
    # (transformers does so by itself), and a new cache length would compile it again
    warm = run(output_len)
    seconds = run(output_len)
    del model
    gc.collect()                                # the model's reference cycles hold its memory until then
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"batch": batch, "input_len": input_len, "output_len": output_len, "seconds": seconds, "warmup_s": warm,
            "output_tok_s": batch * output_len / seconds}


def pdserve_bench(cluster: Cluster, model_dir: Path, concurrency: int, prompts: int, input_len: int,
                  output_len: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", cluster.info["http"], "--tokenizer",
           str(model_dir), "--workload", "fixed", "--input-len", str(input_len), "--output-len", str(output_len),
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--warmup", "2", "--json", str(out),
           "--no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(r.stdout[-3000:], r.stderr[-2000:], flush=True)
    r.check_returncode()
    doc = json.loads(out.read_text())
    return {"config": doc["config"], **doc["summary"]}


def long_prompt_ttft(cluster: Cluster, tokens: int, repeats: int) -> dict:
    """One prompt of `tokens` token ids at a time, one output token: seconds to the answer."""
    import httpx
    times, routes = [], []
    g = torch.Generator().manual_seed(7)
    for i in range(repeats + 1):
        prompt = torch.randint(3, 250, (tokens,), generator=g).tolist()       # no prefix shared with the last
        t0 = time.perf_counter()
        r = httpx.post(f"{cluster.info['http']}/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        if i:                                                   # the first is a warm-up
            times.append(time.perf_counter() - t0)
            routes.append(r.headers.get("x-pdserve-route", ""))
    return {"tokens": tokens, "ttft_s": times, "median_s": statistics.median(times), "routes": sorted(set(routes))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu with --quick (the script's test)")
    p.add_argument("--shape", default="8b", choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="a few short prompts on the tiny shape, float32")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-share", type=float, default=0.4, help="--gpu-memory-utilization of each worker")
    p.add_argument("--json", default=None, metavar="OUT.json")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_cluster: no CUDA device here; --device cpu --quick tests the script", file=sys.stderr)
        return 2
    if a.quick:
        a.shape, a.concurrency, a.num_prompts, a.input_len, a.output_len = "tiny", 4, 8, 32, 8
        a.long_prompt, a.repeats = 256, 2
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    dtype_name = str(dtype).removeprefix("torch.")
    work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-cluster-"))
    t0 = time.perf_counter()
    model_dir = build_tiny_model(work / a.shape, shape=SHAPES[a.shape] | {"max_position_embeddings": 8192},
                                 dtype=dtype, device=a.device)
    gc.collect()
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    results: dict = {"device": describe(torch.device(a.device)), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "shape": a.shape, "build_s": time.perf_counter() - t0}

    def save() -> None:
        print("gpu_cluster:", ", ".join(k for k in results if isinstance(results[k], dict)), "measured", flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    results["generate"] = generate_baseline(model_dir, a.device, dtype, a.concurrency, a.input_len, a.output_len)
    save()
    common = ("--dtype", dtype_name, "--max-batch", str(a.concurrency), "--max-model-len", "8192",
              "--gpu-memory-utilization", str(a.memory_share))
    cluster = Cluster(model_dir, a.device, work, common + ("--prefill", "1", "--decode", "1",
                                                          "--local-prefill-max-tokens", "0"))
    try:
        results["disaggregated"] = pdserve_bench(cluster, model_dir, a.concurrency, a.num_prompts, a.input_len,
                                                 a.output_len, work / "bench.json")
        save()
        results["ttft_disaggregated"] = long_prompt_ttft(cluster, a.long_prompt, a.repeats)
        save()
    finally:
        cluster.stop()
    cluster = Cluster(model_dir, a.device, work, common + ("--mode", "aggregated", "--decode", "1"))
    try:
        results["ttft_aggregated"] = long_prompt_ttft(cluster, a.long_prompt, a.repeats)
    finally:
        cluster.stop()
    d = results["disaggregated"]
    tok_s = d["output_throughput"]
    results["throughput_ratio"] = tok_s / results["generate"]["output_tok_s"]
    results["ttft_overhead"] = results["ttft_disaggregated"]["median_s"] / results["ttft_aggregated"]["median_s"] - 1
    save()
    print(f"{results['device']}, {a.shape}: pdserve {tok_s:.0f} output tok/s at {a.concurrency} concurrent = "
          f"{results['throughput_ratio']:.2f}x generate ({results['generate']['output_tok_s']:.0f}); "
          f"TTFT at {a.long_prompt} tokens: disaggregated {results['ttft_disaggregated']['median_s'] * 1e3:.1f} ms, "
          f"aggregated {results['ttft_aggregated']['median_s'] * 1e3:.1f} ms ({100 * results['ttft_overhead']:+.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
