"""How many streamed tokens one router process carries, and what each one costs it.

    python -m bench.router_stream --concurrency 16,64 --json build/router-stream.json

On a GPU a decode worker makes thousands of tokens a second, and every one of them
passes through the router: a gRPC message in, incremental detokenization, an SSE event
out. Here the model is the default model's tokenizer on a 2-layer Llama of random
weights (hidden size 64, the tokenizer's first 8,192 tokens as its vocabulary: a full
vocabulary's output layer would be most of a step on a CPU, as it is not on a GPU),
whose decode worker makes thousands of tokens a second on one CPU core, so what runs out
first is the serving path around the model. Prompts are token ids below 8,192. `pdserve
up --mode aggregated --decode 1`: the router and one decode worker, no prefill worker,
no KV transfer.

The clients are one process of raw asyncio HTTP/1.1 connections that count SSE events
without parsing them (a full client would cost more CPU than the router and be what is
measured). Each concurrency level runs a warm-up wave, then --waves waves of streams of
--tokens tokens each (ignore_eos). Reported per level: streamed tokens a second, and the
CPU time per token of the router, the decode worker and the clients, read from /proc.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHAPE = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 8192}
TICKS = os.sysconf("SC_CLK_TCK")


def build_model(folder: Path, seed: int = 0) -> Path:
    """The default model's tokenizer and config, shrunk to SHAPE, with random weights
    (its special tokens, the first ids, are among those kept)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from services.engine.text.model_store import ensure_default_model
    source = ensure_default_model()
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    config = AutoConfig.from_pretrained(source)
    for key, value in SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def stream(host: str, port: int, body: bytes) -> tuple[int, bool]:
    """One streamed completion over its own connection: (SSE data events seen,
    ended with [DONE] and no error)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    events, tail = 0, b""
    while chunk := await reader.read(65536):
        data = tail + chunk
        events += data.count(b'data: {"id"')
        tail = data[-512:]              # the last event, an error one included
        events -= tail.count(b'data: {"id"')        # counted again with the next chunk
    events += tail.count(b'data: {"id"')
    writer.close()
    return events, b"data: [DONE]" in tail and b'"error"' not in tail


async def wave(host: str, port: int, concurrency: int, tokens: int, first: int) -> tuple[int, int]:
    """`concurrency` streams at once: (events, streams that ended cleanly)."""
    results = await asyncio.gather(*(stream(host, port, json.dumps({
        "prompt": [(first + i) * 7919 % 7000 + 100 + 37 * j for j in range(16)], "max_tokens": tokens,
        "ignore_eos": True, "temperature": 0, "stream": True}).encode()) for i in range(concurrency)))
    return sum(e for e, _ in results), sum(ok for _, ok in results)


def measure(http: str, pids: dict[str, int], concurrency: int, tokens: int, waves: int) -> dict:
    host, port = http.split("//")[1].rsplit(":", 1)
    asyncio.run(wave(host, int(port), concurrency, 16, 0))                     # warm-up
    pids = {**pids, "clients": os.getpid()}
    before, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
    events = clean = 0
    for w in range(waves):
        e, ok = asyncio.run(wave(host, int(port), concurrency, tokens, (w + 1) * concurrency))
        events, clean = events + e, clean + ok
    seconds = time.monotonic() - t0
    cpu = {k: cpu_seconds(p) - before[k] for k, p in pids.items()}
    if clean < waves * concurrency:
        raise SystemExit(f"{waves * concurrency - clean} of {waves * concurrency} streams did not end cleanly")
    streamed = clean * tokens
    return {"concurrency": concurrency, "seconds": round(seconds, 3), "streams": waves * concurrency,
            "clean_streams": clean, "tokens": streamed, "events": events,
            "tokens_per_second": round(streamed / seconds, 1),
            "cpu_us_per_token": {k: round(1e6 * v / max(1, streamed), 1) for k, v in cpu.items()},
            "cpu_share": {k: round(v / seconds, 3) for k, v in cpu.items()}}


def start(model: Path, workdir: Path, extra: list[str]) -> tuple[subprocess.Popen, dict]:
    announce = workdir / "cluster.json"
    cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(model), "--mode", "aggregated",
           "--decode", "1", "--dtype", "float32", "--http-port", "0", "--grpc-port", "0",
           "--max-batch", "256", "--announce-file", str(announce), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(workdir / "cluster.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not announce.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the cluster did not start:\n{(workdir / 'cluster.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(announce.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="16,64", help="comma-separated levels (default 16,64)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--waves", type=int, default=3, help="measured waves per level (default 3)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--up-arg", action="append", default=[], help="one more argument for `pdserve up`")
    a = p.parse_args(argv)
    from services.engine.model.hardware import cpu_kind
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-router-stream-"))
    model = build_model(workdir / "model")
    proc, info = start(model, workdir, a.up_arg)
    try:
        pids = {"router": info["router_pid"], "decode": info["decodes"][0]["pid"]}
        rows = [measure(info["http"], pids, int(c), a.tokens, a.waves) for c in a.concurrency.split(",")]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"CPU: {platform.processor() or platform.machine()}, {cpu_kind()}, {os.cpu_count()} cores")
    print("| streams at once | tok/s | router µs/token | decode µs/token | clients µs/token | router CPU share |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        us, share = r["cpu_us_per_token"], r["cpu_share"]
        print(f"| {r['concurrency']} | {r['tokens_per_second']:,.0f} | {us['router']} | {us['decode']} | "
              f"{us['clients']} | {share['router']:.0%} |")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"cpu_kind": cpu_kind(), "tokens": a.tokens, "waves": a.waves,
                                      "rows": rows, "median_router_us": statistics.median(
                                          r["cpu_us_per_token"]["router"] for r in rows)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
