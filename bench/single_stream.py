"""TTFT and decode speed of one streamed request at a time, through a running server's
HTTP API, against plain transformers `generate` on the same prompt in this process.

    python -m bench.single_stream --url http://127.0.0.1:8000 --prompt-tokens 512 \
        --max-tokens 128 --runs 5 --json out.json

TTFT is timed at the first chunk that carries text; decode tokens/s counts the tokens
after the first over the time after the first. Medians over --runs.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import httpx


def exact_prompt(tokenizer, n: int, seed: int) -> list[int]:
    """A prompt of exactly n token ids made of ordinary words (seeded)."""
    rng = random.Random(seed)
    words = "river stone light garden window music letter morning paper story city bridge".split()
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(" " + " ".join(rng.choice(words) for _ in range(64)), add_special_tokens=False)
    return ids[:n]


def stream_once(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    n = usage["completion_tokens"]
    return {"ttft_s": first - t0, "decode_tok_s": (n - 1) / (last - first) if n > 1 else 0.0,
            "e2e_s": last - t0, "completion_tokens": n}


def kv_bytes_per_request(url: str, model: str, prompt: list[int]) -> int:
    r = httpx.post(f"{url}/v1/completions", timeout=600,
                   json={"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    route = dict(p.split("=", 1) for p in r.headers.get("x-pdserve-route", "").split(";") if "=" in p)
    return int(route.get("kv_bytes", 0))


def transformers_baseline(model_dir, dtype: str, prompt: list[int], max_tokens: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        ttft = time.perf_counter() - t0
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t1 = time.perf_counter()
        for _ in range(max_tokens - 1):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode = (max_tokens - 1) / (time.perf_counter() - t1)
    return {"ttft_s": ttft, "decode_tok_s": decode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the baseline (match the server's)")
    ap.add_argument("--baseline-threads", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from services.engine.text.model_store import default_model_dir
    from services.engine.text.tokenizer import load_tokenizer
    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    model = httpx.get(f"{a.url}/v1/models").json()["data"][0]["id"]
    prompt = exact_prompt(tok, a.prompt_tokens, seed=0)
    stream_once(a.url, model, prompt, 4)                         # warm-up
    runs = [stream_once(a.url, model, prompt, a.max_tokens) for _ in range(a.runs)]
    result = {
        "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens, "runs": runs,
        "pdserve": {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "decode_tok_s", "e2e_s")},
        "kv_bytes_per_request": kv_bytes_per_request(a.url, model, prompt),
    }
    print(f"pdserve  ({a.prompt_tokens}-token prompt, {a.max_tokens} out, median of {a.runs}): "
          f"TTFT {result['pdserve']['ttft_s'] * 1000:.1f} ms, decode {result['pdserve']['decode_tok_s']:.1f} tok/s, "
          f"KV moved {result['kv_bytes_per_request'] / 2**20:.2f} MiB per request")
    if not a.no_baseline:
        base = [transformers_baseline(model_dir, a.dtype, prompt, a.max_tokens, a.baseline_threads)
                for _ in range(3)]
        result["transformers"] = {k: statistics.median(b[k] for b in base) for k in ("ttft_s", "decode_tok_s")}
        result["ratio_ttft"] = result["pdserve"]["ttft_s"] / result["transformers"]["ttft_s"]
        result["ratio_decode"] = result["pdserve"]["decode_tok_s"] / result["transformers"]["decode_tok_s"]
        print(f"transformers in-process ({a.dtype}, {a.baseline_threads} thread, DynamicCache, median of 3): "
              f"TTFT {result['transformers']['ttft_s'] * 1000:.1f} ms, "
              f"decode {result['transformers']['decode_tok_s']:.1f} tok/s")
        print(f"ratio pdserve/transformers: TTFT {result['ratio_ttft']:.2f}x, decode {result['ratio_decode']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
