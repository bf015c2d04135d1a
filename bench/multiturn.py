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
import sys
import time

import httpx

from bench.up import running_up, write_json


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
    with running_up(*a.up_arg, prefix="pdserve-multiturn-") as base:
        turns = [_turn_two(base, i, a.answer_tokens) for i in range(a.conversations)]
    from services.engine.model.hardware import cpu_kind
    result = {"cpu": cpu_kind(), "date": time.strftime("%Y-%m-%d"), "turns": turns,
              "prompt_tokens_p50": statistics.median(t["prompt_tokens"] for t in turns),
              "cached_tokens_p50": statistics.median(t["cached_tokens"] for t in turns),
              "ttft_p50": statistics.median(t["ttft"] for t in turns)}
    print(f"CPU {result['cpu']}; {a.conversations} conversations, turn 2: {result['cached_tokens_p50']:.0f} of "
          f"{result['prompt_tokens_p50']:.0f} prompt tokens cached (median), TTFT p50 "
          f"{1000 * result['ttft_p50']:.1f} ms")
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
