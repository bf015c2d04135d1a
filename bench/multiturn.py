"""A conversation's next turn: how much of its prompt the prefix cache holds, and its TTFT.

    python -m bench.multiturn --json build/multiturn.json

Starts `pdserve up` (disaggregated, the default dtype and routing) and holds --conversations
two-turn chats, one after the other: turn 1 is a system and a user message answered with
--answer-tokens tokens; turn 2 sends that history, the answer and one more user message,
streamed. Reports turn 2's prompt tokens served from the prefix cache and its time to the
first content token (medians). Prints a line and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _turn_two(base: str, i: int, answer_tokens: int) -> dict:
    msgs = [{"role": "system", "content": f"You are assistant number {i}. Answer in detail."},
            {"role": "user", "content": f"Tell me about the history of city number {i} in Europe."}]
    first = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
        "messages": msgs, "max_tokens": answer_tokens, "temperature": 0, "ignore_eos": True}).json()
    msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And what about its food?"}]
    started, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=300, json={
            "messages": msgs, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - started
            usage = event.get("usage") or usage
    return {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "ttft": ttft}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--up-arg", action="append", default=[], help="passed to pdserve up (repeat)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdserve-multiturn-"))
    announce = work / "cluster.json"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--grpc-port", "0",
                           "--announce-file", str(announce), "--log-level", "warning", *a.up_arg],
                          cwd=ROOT, stdout=open(work / "up.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not announce.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve up did not start:\n{(work / 'up.log').read_text()[-3000:]}")
            time.sleep(0.2)
        base = json.loads(announce.read_text())["http"]
        turns = [_turn_two(base, i, a.answer_tokens) for i in range(a.conversations)]
    finally:
        up.terminate()
        up.wait(timeout=60)
    from services.engine.model.hardware import cpu_kind
    result = {"cpu": cpu_kind(), "date": time.strftime("%Y-%m-%d"), "turns": turns,
              "prompt_tokens_p50": statistics.median(t["prompt_tokens"] for t in turns),
              "cached_tokens_p50": statistics.median(t["cached_tokens"] for t in turns),
              "ttft_p50": statistics.median(t["ttft"] for t in turns)}
    print(f"CPU {result['cpu']}; {a.conversations} conversations, turn 2: {result['cached_tokens_p50']:.0f} of "
          f"{result['prompt_tokens_p50']:.0f} prompt tokens cached (median), TTFT p50 "
          f"{1000 * result['ttft_p50']:.1f} ms")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
