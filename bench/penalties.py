"""What the penalties cost a decode step, as the history grows.

    python -m bench.penalties --rows 32 --prompt 2000 --json build/penalties.json

`sampler.choose` over a batch of rows that all ask for repetition and frequency
penalties, each row's history one token longer every step, as in decoding. Side by
side, each the median of --steps steps after a warm-up: the history kept on the device
from step to step (sampler.TokenHistory: a step copies the tokens added since the one
before), and the history copied afresh every step (no TokenHistory given). Both on
--device (cpu by default, one torch thread), with the default model's vocabulary size.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _run(rows: int, prompt: int, steps: int, vocab: int, device: str, kept: bool) -> float:
    import torch

    from services.engine.core.sampling import SamplingParams
    from services.engine.model.sampler import History, TokenHistory, choose
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    params = [SamplingParams(max_tokens=steps + 8, temperature=0.0, repetition_penalty=1.1,
                             frequency_penalty=0.2)] * rows
    logits = torch.randn(rows, vocab, generator=g).to(device)
    histories = [TokenHistory() if kept else None for _ in range(rows)]
    times = []
    for step in range(steps + 5):
        for r in ids:
            r.append(step % vocab)
        started = time.perf_counter()
        tokens = choose(logits, params, [step + 1] * rows, frozenset(),
                        [History(r, prompt, (), h) for r, h in zip(ids, histories)]).tokens
        tokens.tolist()                                  # the step's tokens read, as the engine does
        times.append(time.perf_counter() - started)
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompt", type=int, default=2000, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--vocab", type=int, default=49152, help="the default model's vocabulary size")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import torch

    from services.engine.model.hardware import cpu_kind
    torch.set_num_threads(1)
    kept = _run(a.rows, a.prompt, a.steps, a.vocab, a.device, kept=True)
    afresh = _run(a.rows, a.prompt, a.steps, a.vocab, a.device, kept=False)
    print(f"CPU {cpu_kind()}, device {a.device}, {a.rows} rows of {a.prompt}+ tokens, vocabulary {a.vocab}")
    print(f"  history kept on the device: {kept:8.2f} ms a step")
    print(f"  history copied afresh:      {afresh:8.2f} ms a step  ({afresh / kept:.1f}x)")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(a).items()}, "cpu": cpu_kind(),
                                      "kept_ms": kept, "afresh_ms": afresh}, indent=1))


if __name__ == "__main__":
    main()
