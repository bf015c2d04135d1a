"""Flags, the plan and the run: install the peers, prepare the model, then for each
system in turn start it, find it ready, run the same `pdserve bench` --repeats times,
stop it, and summarise.

Flags this command does not know are `pdserve bench` flags, passed to every run alike
(checked with pdserve bench's own parser before anything starts). The comparison sets
--base-url, --model, --json, --label and --plot per run itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Sequence

from bench.peers.install import ensure_peer
from bench.peers.model import has_weights, is_bf16_safetensors
from bench.peers.shell import Shell, quoted
from bench.peers.summary import SystemResult, add_ratios, format_table, plot_summary, summary_document, \
    system_result
from bench.peers.systems import DEFAULT_SYSTEMS, SYSTEMS, Context, Server, ServerError, System, free_port, \
    parse_systems

ROOT = Path(__file__).resolve().parents[2]
SET_PER_RUN = ("--base-url", "--model", "--json", "--label", "--plot")
EPILOG = """\
every other flag goes to `pdserve bench`, the same for every system, e.g.
  bench/compare_peers.sh --workload chat --num-prompts 64 --max-concurrency 32 --warmup 4
  bench/compare_peers.sh --systems pdserve-disaggregated,vllm --repeats 5 --plot -- --request-rate 4
  bench/compare_peers.sh --dry-run
"""


@dataclass(frozen=True)
class PeersSettings:
    systems: tuple[System, ...]
    repeats: int
    out: Path
    peers_dir: Path
    bench_args: tuple[str, ...]
    plot: bool = False
    dry_run: bool = False
    skip_install: bool = False
    start_timeout: float = 600.0
    vllm_max_model_len: int = 4096
    ignore_eos: bool = True             # what the bench flags say (--no-ignore-eos makes it False)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be at least 1")
        if self.start_timeout <= 0:
            raise ValueError("--start-timeout must be positive")
        if given := [f for f in self.bench_args if f.split("=")[0] in SET_PER_RUN]:
            raise ValueError(f"{', '.join(given)}: set per run by the comparison itself")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/compare_peers.sh", allow_abbrev=False, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="pdserve against vLLM-CPU and transformers serve: the same "
                                            "`pdserve bench` against each, one system at a time")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated, in this order (default: all: {','.join(SYSTEMS)})")
    p.add_argument("--repeats", type=int, default=3, help="bench runs per system; the summary takes medians")
    p.add_argument("--out", default=None, help="results folder (default build/peers/<timestamp>)")
    p.add_argument("--peers-dir", default=None,
                   help="virtualenvs and the model copy (default $PDSERVE_PEERS_DIR or ~/.cache/pdserve/peers)")
    p.add_argument("--plot", action="store_true", help="a PNG per run and summary.png")
    p.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    p.add_argument("--skip-install", action="store_true", help="use the peers as installed; never install")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a system may take to serve")
    p.add_argument("--vllm-max-model-len", type=int, default=4096,
                   help="vLLM's --max-model-len (4096 holds the mixed workload's 2,048-token prompts)")
    return p


def _check_bench_args(args: list[str]) -> bool:
    """Parse them as `pdserve bench` would (exit 2 on a bad flag); returns ignore_eos."""
    from services.bench.command import add_arguments, settings_from_args
    p = argparse.ArgumentParser(prog="pdserve bench", allow_abbrev=False)
    add_arguments(p)
    settings = settings_from_args(p.parse_args(args))
    return settings.ignore_eos


def settings_from_argv(argv: list[str]) -> PeersSettings:
    a, rest = _parser().parse_known_args(argv)
    rest = [x for x in rest if x != "--"]
    if not any(x == "--endpoint" or x.startswith("--endpoint=") for x in rest):
        rest = ["--endpoint", "chat", *rest]        # every system here speaks chat completions
    ignore_eos = _check_bench_args(rest)
    peers_dir = Path(a.peers_dir or os.environ.get("PDSERVE_PEERS_DIR")
                     or Path.home() / ".cache" / "pdserve" / "peers").expanduser().resolve()
    out = Path(a.out) if a.out else ROOT / "build" / "peers" / datetime.now().strftime("%Y%m%d-%H%M%S")
    return PeersSettings(tuple(parse_systems(a.systems)), a.repeats, out.resolve(), peers_dir, tuple(rest),
                         a.plot, a.dry_run, a.skip_install, a.start_timeout, a.vllm_max_model_len, ignore_eos)


def prepare_model(s: PeersSettings, sh: Shell) -> Path:
    """The bf16 safetensors copy of pdserve's default model that the peers serve."""
    argv = [sys.executable, "-m", "services.cli", "convert-model"]
    sh.say(f"+ {quoted(argv)}")
    if sh.dry_run:
        from services.engine.text.model_store import default_model_dir
        source = default_model_dir()
    else:
        source = Path(subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
    if is_bf16_safetensors(source):
        sh.say(f"model: {source} is already bf16 safetensors")
        return source
    target = s.peers_dir / "models" / f"{source.name}-bf16"
    if has_weights(target):
        sh.say(f"model: {target} (bf16 copy of {source})")
        return target
    sh.run([sys.executable, "-m", "bench.peers.model", str(source), str(target)])
    return target


def run_seed(bench_args: Sequence[str], run: int) -> tuple[list[str], int]:
    """`bench_args` without their --seed, and run `run`'s seed: the given one (default 0)
    plus run - 1. Each run draws prompts no system has seen in an earlier run: a repeat
    of the same prompts would be served from pdserve's prefix cache (the peers run with
    theirs off), measuring the cache, not the engine."""
    args, base, i = [], 0, 0
    while i < len(bench_args):
        a = bench_args[i]
        if a == "--seed" and i + 1 < len(bench_args):
            base, i = int(bench_args[i + 1]), i + 2
            continue
        if a.startswith("--seed="):
            base = int(a.split("=", 1)[1])
        else:
            args.append(a)
        i += 1
    return args, base + run - 1


def bench_argv(s: PeersSettings, system: str, base_url: str, server_args: list[str], run: int) -> list[str]:
    folder = s.out / system
    args, seed = run_seed(s.bench_args, run)
    argv = [sys.executable, "-m", "services.cli", "bench", "--base-url", base_url, "--label", system,
            "--json", str(folder / f"run-{run}.json"), *server_args, *args, "--seed", str(seed)]
    if s.plot:
        argv += ["--plot", str(folder / f"run-{run}.png")]
    return argv


def measure(s: PeersSettings, system: System, context: Context, sh: Shell) -> str | None:
    """Start `system`, bench it --repeats times, stop it; returns why it failed, if it did."""
    folder = s.out / system.name
    port = free_port()
    launch = system.launch(context, port, folder)
    base_url = f"http://127.0.0.1:{port}"
    sh.say(f"\n== {system.name} on {base_url}\n+ {quoted(launch.argv, launch.env)}  > {folder / 'server.log'}")
    if sh.dry_run:
        for run in range(1, s.repeats + 1):
            sh.run(bench_argv(s, system.name, base_url, launch.bench_args, run))
        return None
    folder.mkdir(parents=True, exist_ok=True)
    server = Server(system.name, launch, base_url, folder / "server.log")
    try:
        server.start()
        sh.say(f"{system.name}: serving after {server.wait_ready(s.start_timeout):.0f} s (pid {server.proc.pid})")
        for run in range(1, s.repeats + 1):
            code = sh.run(bench_argv(s, system.name, base_url, launch.bench_args, run),
                          log=folder / f"run-{run}.txt", echo=True, check=False)
            if code == 2:
                return f"pdserve bench could not measure it (exit 2); see {folder / f'run-{run}.txt'}"
        return None
    except ServerError as exc:
        return str(exc)
    finally:
        server.stop()
        sh.say(f"{system.name}: stopped")


def summarize_runs(s: PeersSettings, errors: dict[str, str]) -> tuple[str, list[SystemResult]]:
    from services.bench.report import load_run
    results = []
    for system in s.systems:
        runs = sorted((s.out / system.name).glob("run-*.json"))
        summaries = [load_run(path)["summary"] for path in runs]
        results.append(system_result(system.name, system.peer is not None, summaries, errors.get(system.name)))
    best = add_ratios(results)
    title = f"pdserve bench {shlex.join(s.bench_args)}, {s.repeats} run{'s' * (s.repeats > 1)} per system"
    table = title + "\n" + format_table(results, best)
    (s.out / "summary.txt").write_text(table + "\n")
    config = {"bench_args": list(s.bench_args), "repeats": s.repeats, "systems": [x.name for x in s.systems],
              "peers_dir": str(s.peers_dir), "finished_at": datetime.now().isoformat(timespec="seconds")}
    (s.out / "summary.json").write_text(json.dumps(summary_document(results, best, config), indent=1) + "\n")
    if s.plot:
        plot_summary(s.out / "summary.png", results, title)
    return table, results


def run(s: PeersSettings) -> int:
    sh = Shell(dry_run=s.dry_run)
    sh.say(f"results: {s.out}\npeers: {s.peers_dir}")
    for peer in dict.fromkeys(x.peer for x in s.systems if x.peer):
        t0 = time.monotonic()
        ensure_peer(peer, s.peers_dir, sh, s.skip_install)
        if time.monotonic() - t0 > 5:
            sh.say(f"{peer}: ready after {time.monotonic() - t0:.0f} s")
    model = prepare_model(s, sh) if any(x.peer for x in s.systems) else None
    import torch
    from services.engine.model.hardware import pick_dtype
    dtype = pick_dtype("auto", torch.device("cpu")).name
    sh.say(f"every system computes in {dtype} (what --dtype auto picks on this CPU)")
    context = Context(s.peers_dir, model, sys.executable, s.ignore_eos, s.vllm_max_model_len, dtype)
    if not s.dry_run:
        s.out.mkdir(parents=True, exist_ok=True)
    errors = {}
    for system in s.systems:
        if error := measure(s, system, context, sh):
            errors[system.name] = error
            sh.say(f"{system.name}: {error}")
    if s.dry_run:
        sh.say(f"\nthen: medians per system into {s.out}/summary.txt, summary.json"
               + (" and summary.png" if s.plot else ""))
        return 0
    table, results = summarize_runs(s, errors)
    sh.say("\n" + table + f"\n\nwritten to {s.out}")
    return 1 if errors or any(r.failed_requests for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        print(f"compare_peers: {exc}", file=sys.stderr)
        return 2
    try:
        return run(settings)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"compare_peers: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncompare_peers: interrupted", file=sys.stderr)
        return 130
