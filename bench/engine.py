"""Engine micro-benchmark: one decode step at several batch sizes, and one prefill,
through pdserve's engine and through plain transformers forward calls with a
`DynamicCache`, same model, dtype and thread count, side by side in one run.

    python -m bench.engine --json out.json [--batches 1,8,32] [--context 256]
                                    [--prefill 512] [--threads 1] [--dtype bfloat16]
                                    [--attention auto|native|torch] [--verify 12]

The prefill is also given as a share of the GEMM rate of `--threads` cores in the
dtype (a prefill-sized linear layer on the CPU's best path, torch's or pdserve's own
matmul: bench.vllm_serve.gemm_rate), measured in each round: the prompt's matmul FLOPs
(linear layers, causal attention, the last token's vocabulary projection) over its time.

Decode: every sequence has `--context` tokens of KV already cached (random values: the
cost does not depend on them); one step feeds one token per sequence. The transformers
side appends to its DynamicCache as `generate` does, then crops back, so each timed
step sees the same context. With `--verify R`, also a speculative verify step at each
batch size: R tokens per sequence at consecutive positions (R - 1 drafts and the last
token), every row's logits returned, as the engine packs a verify chunk; the
transformers side feeds the R tokens as one input per sequence. Medians over --repeats
steps after warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.shapes import head_dim, prefill_flops

BLOCK = 16


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def _hf_model(model_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                attn_implementation="sdpa").eval()


def pdserve_decode_ms(runner, batch: int, context: int, repeats: int, rows: int = 1) -> float:
    """A decode step, or with `rows` > 1 a verify step: `rows` decode rows per sequence
    at positions context .. context + rows - 1 over its blocks, every row sampled (the
    engine's `pack` of verify chunks)."""
    from services.engine.model.runner import ForwardBatch
    per_seq = -(-(context + rows) // BLOCK)
    pool = KVPoolMemory.allocate(runner.layout(batch * per_seq, BLOCK))
    pool.tensor.normal_()
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch) for _ in range(rows)]
    step = ForwardBatch(decode_tokens=torch.randint(100, 10000, (batch * rows,)).tolist(),
                        decode_positions=[context + r for _ in range(batch) for r in range(rows)],
                        decode_tables=tables, sample_rows=list(range(batch * rows)))
    try:
        return median_ms(lambda: runner.execute(pool, step), repeats)
    finally:
        pool.close()


@torch.inference_mode()
def hf_decode_ms(model, batch: int, context: int, repeats: int, rows: int = 1) -> float:
    from transformers import DynamicCache
    cfg = model.config
    heads = cfg.num_key_value_heads
    dim = head_dim(cfg)
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(batch, heads, context, dim, dtype=model.dtype)
        cache.update(k, torch.randn_like(k), layer)
    ids = torch.randint(100, 10000, (batch, rows))
    pos = torch.arange(context, context + rows).expand(batch, rows)

    def step():
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        cache.crop(-rows)                 # back to `context` tokens
    return median_ms(step, repeats)


def pdserve_prefill_ms(runner, tokens: int, repeats: int) -> float:
    blocks = -(-tokens // BLOCK)
    pool = KVPoolMemory.allocate(runner.layout(blocks, BLOCK))
    ids = torch.randint(100, 10000, (tokens,)).tolist()
    try:
        return median_ms(lambda: runner.prefill(pool, ids, list(range(blocks))), repeats, warmup=1)
    finally:
        pool.close()


@torch.inference_mode()
def hf_prefill_ms(model, tokens: int, repeats: int) -> float:
    from transformers import DynamicCache
    ids = torch.randint(100, 10000, (1, tokens))

    def run():
        out = model(input_ids=ids, past_key_values=DynamicCache(config=model.config), use_cache=True,
                    logits_to_keep=1)
        return out.logits
    return median_ms(run, repeats, warmup=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto", help="auto: what `--dtype auto` picks on this CPU")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median round is reported")
    ap.add_argument("--model", default=None)
    ap.add_argument("--attention", default="auto", help="pdserve's decode attention: auto, native or torch")
    ap.add_argument("--verify", type=int, default=0, help="also a verify step of this many tokens a sequence")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from services.engine.model.hardware import cpu_kind
    from services.engine.text.model_store import resolve_model
    from services.engine.model.runner import ModelRunner

    torch.set_num_threads(a.threads)
    model_dir = resolve_model(a.model)
    runner = ModelRunner(model_dir, a.dtype, "cpu", attention=a.attention)
    a.dtype = runner.dtype_name
    print(f"{runner.describe()}; CPU {cpu_kind()}, {a.threads} thread(s)")
    hf = _hf_model(model_dir, a.dtype)
    batches = [int(b) for b in a.batches.split(",")]
    rows: dict[str, dict] = {}
    # the prefill against the GEMM rate of this dtype on as many cores, each round's
    from bench.vllm_serve import gemm_rate
    rates: list[float] = []
    for _ in range(a.rounds):            # alternate engines so drift hits both alike
        for b in batches:
            r = rows.setdefault(f"decode_b{b}", {"pdserve_ms": [], "transformers_ms": []})
            r["pdserve_ms"].append(pdserve_decode_ms(runner, b, a.context, a.repeats))
            r["transformers_ms"].append(hf_decode_ms(hf, b, a.context, a.repeats))
            if a.verify:
                r = rows.setdefault(f"verify_b{b}x{a.verify}", {"pdserve_ms": [], "transformers_ms": []})
                r["pdserve_ms"].append(pdserve_decode_ms(runner, b, a.context, a.repeats, a.verify))
                r["transformers_ms"].append(hf_decode_ms(hf, b, a.context, a.repeats, a.verify))
        r = rows.setdefault(f"prefill_{a.prefill}", {"pdserve_ms": [], "transformers_ms": []})
        r["pdserve_ms"].append(pdserve_prefill_ms(runner, a.prefill, max(3, a.repeats // 5)))
        r["transformers_ms"].append(hf_prefill_ms(hf, a.prefill, max(3, a.repeats // 5)))
        rates.append(gemm_rate(getattr(torch, runner.dtype_name)) * a.threads)
    flops = prefill_flops(runner.config, a.prefill)
    shares = [flops / (ms / 1e3) / rate for ms, rate in zip(rows[f"prefill_{a.prefill}"]["pdserve_ms"], rates)]
    share, rate = statistics.median(shares), statistics.median(rates)
    print(f"{'case':<14} {'pdserve ms':>11} {'transformers ms':>16} {'ratio':>7}")
    out = {"config": {**vars(a), "cpu": cpu_kind(), "engine": runner.describe()}, "results": {},
           "gemm_gflops": [r / 1e9 for r in rates], "prefill_gemm_share": shares}
    for name, r in rows.items():
        p, h = statistics.median(r["pdserve_ms"]), statistics.median(r["transformers_ms"])
        out["results"][name] = {"pdserve_ms": p, "transformers_ms": h, "ratio": p / h, "rounds": r}
        print(f"{name:<14} {p:>11.2f} {h:>16.2f} {p / h:>7.2f}")
    print(f"prefill of {a.prefill} tokens: {flops / 1e9:.1f} GFLOP of matmuls, {100 * share:.0f} % of the GEMM "
          f"rate of {a.threads} core(s) ({rate / 1e9:.0f} GFLOP/s, {runner.dtype_name}, [512, 576] x [576, 1536] on "
          f"the best path; medians of {a.rounds} rounds, each its own rate: "
          f"{', '.join(f'{100 * x:.0f} %' for x in shares)})")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
