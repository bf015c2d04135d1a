"""Fair share among API keys under a flood: one key floods, another sends a steady trickle.

    python -m bench.fairness --flood 500 --json build/fairness.json

Starts `pdserve up` (disaggregated, the default dtype) with two API keys, A and B, given
in a key file. First B alone: --alone streamed requests one after another, each one's
time to its first content token. Then A sends --flood streamed requests at once (each
--flood-tokens long, ignore_eos) while B sends one request a second until A's flood is
done. Reports B's TTFT under the flood against B's alone (p50 / p99; the bar: p99 within
2x), and A's share of the output tokens the cluster made during the flood (the bar: at
least 80 %: fairness must not waste the flood's work). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.up import running_up, write_json

KEYS = {"A": "sk-bench-flood-0123456789abcdef", "B": "sk-bench-trickle-0123456789abcd"}
FLOOD_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home at night."
TRICKLE_PROMPT = "What is the capital of France? Answer in one word."


async def _stream(client: httpx.AsyncClient, key: str, prompt: str, max_tokens: int,
                  ignore_eos: bool) -> tuple[float | None, int, bool]:
    """(seconds to the first content token, tokens streamed, finished cleanly)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}, "temperature": 0}
    t0 = time.monotonic()
    ttft, tokens, finished = None, 0, False
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return None, 0, False
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for c in event.get("choices") or ():
                if ttft is None and (c.get("delta") or {}).get("content"):
                    ttft = time.monotonic() - t0
                finished = finished or bool(c.get("finish_reason"))
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return ttft, tokens, finished


async def _decisions(client: httpx.AsyncClient) -> dict[str, int]:
    """The router's count of prompts computed remotely, locally, and by local fallback."""
    text = (await client.get("/metrics")).text
    return {m[1]: int(float(m[2])) for m in re.finditer(
        r'^pdserve_disaggregation_decisions_total\{decision="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M)}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _trickle(base: str, a: argparse.Namespace, events: dict) -> dict:
    """Key B, a client of its own: warm-up, --alone requests one after another, then one
    request a second from when the flood starts until it ends (`events`, shared with
    the flood's process)."""
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        for _ in range(2):                              # warm-up
            await _stream(client, KEYS["B"], TRICKLE_PROMPT, a.trickle_tokens, False)
        alone = []
        for _ in range(a.alone):
            ttft, _, ok = await _stream(client, KEYS["B"], TRICKLE_PROMPT, a.trickle_tokens, False)
            assert ok and ttft is not None, "a request alone failed"
            alone.append(ttft)
        events["alone_done"].set()
        events["flood_started"].wait()
        t0 = time.monotonic()
        trickle: list[tuple[float, asyncio.Task]] = []
        while not events["flood_done"].is_set():
            trickle.append((time.monotonic() - t0, asyncio.create_task(
                _stream(client, KEYS["B"], TRICKLE_PROMPT, a.trickle_tokens, False))))
            await asyncio.sleep(1.0)
        results = [(at, *(await task)) for at, task in trickle]
    return {"alone": alone, "under": results}


def _trickle_process(base: str, a: argparse.Namespace, events: dict, out) -> None:
    try:
        out.send(asyncio.run(_trickle(base, a, events)))
    except BaseException as exc:        # the flood must not wait for a client that is gone
        events["failed"].set()
        events["alone_done"].set()
        out.send(RuntimeError(f"key B's client failed: {exc!r}"))
        raise


def _wait_alone(events: dict, trickle) -> bool:
    """Until key B's requests alone are done: True, or False when its client failed."""
    while not events["alone_done"].wait(0.5):
        if not trickle.is_alive():
            return False
    return not events["failed"].is_set()


async def _flood(base: str, a: argparse.Namespace, events: dict, trickle) -> dict:
    """Key A, a client of its own: --flood streamed requests at once, once B's `trickle`
    process has measured B alone."""
    limits = httpx.Limits(max_connections=a.flood + 16, max_keepalive_connections=a.flood + 16)
    async with httpx.AsyncClient(base_url=base, timeout=1800, limits=limits) as client:
        if not await asyncio.to_thread(_wait_alone, events, trickle):
            return {}
        before = await _decisions(client)
        t0 = time.monotonic()
        events["flood_started"].set()
        flood = await asyncio.gather(*(_stream(client, KEYS["A"], FLOOD_PROMPT, a.flood_tokens, True)
                                       for _ in range(a.flood)))
        flood_done = time.monotonic() - t0
        events["flood_done"].set()
        after = await _decisions(client)
    return {"results": flood, "seconds": flood_done,
            "decisions": {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)}}


def _run(base: str, a: argparse.Namespace) -> dict:
    """B and A run as separate client processes, as two tenants would: neither client's
    event loop delays the other's timings."""
    ctx = multiprocessing.get_context("spawn")
    events = {name: ctx.Event() for name in ("alone_done", "flood_started", "flood_done", "failed")}
    receive, send = ctx.Pipe(duplex=False)
    b = ctx.Process(target=_trickle_process, args=(base, a, events, send), daemon=True)
    b.start()
    send.close()                        # B's end only: a client gone ends recv() with EOFError
    try:
        flood = asyncio.run(_flood(base, a, events, b))
        trickle = receive.recv()
    finally:
        events["flood_done"].set()
        b.join(timeout=60)
    if isinstance(trickle, Exception):
        raise trickle
    alone = trickle["alone"]
    under = [t for _, t, _, ok in trickle["under"] if ok and t is not None]
    a_tokens = sum(n for _, n, _ in flood["results"])
    b_tokens = sum(n for _, _, n, _ in trickle["under"])
    return {
        "flood": a.flood, "flood_tokens": a.flood_tokens, "flood_seconds": round(flood["seconds"], 1),
        "flood_failed": sum(not ok for _, _, ok in flood["results"]),
        "trickle_sent": len(trickle["under"]), "trickle_failed": sum(not ok for _, _, _, ok in trickle["under"]),
        "b_ttft_alone_p50": statistics.median(alone), "b_ttft_alone_p99": _pct(alone, 0.99),
        "b_ttft_flood_p50": statistics.median(under), "b_ttft_flood_p90": _pct(under, 0.9),
        "b_ttft_flood_p99": _pct(under, 0.99),
        "b_ttft_flood_max": max(under),
        "b_samples": [[round(at, 2), None if t is None else round(t, 4)] for at, t, _, _ in trickle["under"]],
        "p99_ratio": _pct(under, 0.99) / _pct(alone, 0.99),
        "a_output_tokens": a_tokens, "b_output_tokens": b_tokens,
        "a_share": a_tokens / max(1, a_tokens + b_tokens),
        "cluster_output_tok_s": (a_tokens + b_tokens) / flood["seconds"],
        "prefill_decisions": flood["decisions"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flood", type=int, default=500, help="key A's concurrent requests")
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--trickle-tokens", type=int, default=16)
    ap.add_argument("--alone", type=int, default=20, help="key B's requests alone, for its baseline TTFT")
    ap.add_argument("--up-arg", action="append", default=[], help="passed to pdserve up (repeat)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    keys = Path(tempfile.mkdtemp(prefix="pdserve-fairness-")) / "api-keys"
    keys.touch(mode=0o600)
    keys.write_text(f"{KEYS['A']}\n{KEYS['B']}\n")           # plain: older versions read it too
    with running_up("--api-key-file", str(keys), *a.up_arg, prefix="pdserve-fairness-") as base:
        from services.engine.model.hardware import cpu_kind
        result = {"cpu": cpu_kind(), "date": time.strftime("%Y-%m-%d"), **_run(base, a)}
    print(f"CPU {result['cpu']}; key A: {result['flood']} streamed requests of {result['flood_tokens']} tokens at "
          f"once; key B: 1 request/s")
    print(f"  B's TTFT alone          p50 {result['b_ttft_alone_p50']:.3f} s  p99 {result['b_ttft_alone_p99']:.3f} s")
    print(f"  B's TTFT under A's flood p50 {result['b_ttft_flood_p50']:.3f} s  p90 {result['b_ttft_flood_p90']:.3f} s  "
          f"p99 {result['b_ttft_flood_p99']:.3f} s"
          f"  ({result['p99_ratio']:.2f}x; bar 2x)")
    print(f"  A's share of output tokens {100 * result['a_share']:.1f} % (bar 80 %); cluster "
          f"{result['cluster_output_tok_s']:.1f} tok/s over {result['flood_seconds']} s")
    print(f"  failed: A {result['flood_failed']} / {result['flood']}, B {result['trickle_failed']} / "
          f"{result['trickle_sent']}; prompts computed during the flood: {result['prefill_decisions']}")
    write_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
