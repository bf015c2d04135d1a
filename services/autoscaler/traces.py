"""Synthetic load traces in `pdserve bench --json` format, for the replay simulator.

    python -m services.autoscaler.traces prompt-heavy --out prompt-heavy.json
    python -m services.autoscaler.traces output-heavy --out output-heavy.json

Arrivals are a Poisson process whose rate follows a piecewise-linear profile (quiet,
ramp, plateau, burst, fall, quiet over 20 minutes), drawn by thinning; lengths are
uniform in the shape's ranges. Seeded, so a trace is the same every time. The file
holds what a trace needs, every request's start, prompt and output length, in the
records `pdserve bench` writes; it was never run against a server, so its latencies are
empty and `config.synthesized` says so.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from services.bench.metrics import RequestRecord
from services.bench.report import FORMAT

# (seconds, requests per second): the rate is linear between the points
PROFILE = ((0, 0.2), (120, 0.2), (300, 1.0), (540, 1.0), (600, 1.6), (720, 1.6), (840, 0.4), (1080, 0.1),
           (1200, 0.1))


@dataclass(frozen=True)
class Shape:
    prompt: tuple[int, int]             # tokens, inclusive range
    output: tuple[int, int]
    rate_scale: float                   # multiplies PROFILE's rates


SHAPES = {
    "prompt-heavy": Shape(prompt=(2048, 4096), output=(8, 32), rate_scale=4.0),
    "output-heavy": Shape(prompt=(64, 256), output=(512, 1024), rate_scale=2.0),
}


def rate_at(t: float, scale: float) -> float:
    for (t0, r0), (t1, r1) in zip(PROFILE, PROFILE[1:]):
        if t0 <= t <= t1:
            return scale * (r0 + (r1 - r0) * (t - t0) / (t1 - t0))
    return 0.0


def synthesize(name: str, seed: int = 0) -> dict:
    shape = SHAPES[name]
    rng = random.Random(f"{seed}/{name}")
    peak = shape.rate_scale * max(r for _, r in PROFILE)
    t, end, records = 0.0, PROFILE[-1][0], []
    while True:
        t += rng.expovariate(peak)
        if t >= end:
            break
        if rng.random() * peak > rate_at(t, shape.rate_scale):      # thinning
            continue
        out = rng.randint(*shape.output)
        records.append(RequestRecord(prompt_len=rng.randint(*shape.prompt), requested_output_len=out,
                                     start=round(t, 3), e2e=0.0, output_len=out, output_len_source="synthesized"))
    config = {"synthesized": name, "generator": "services.autoscaler.traces", "seed": seed,
              "profile": PROFILE, "shape": asdict(shape)}
    return {"format": FORMAT, "config": config, "summary": {}, "warmup": {},
            "requests": [asdict(r) for r in records]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--out", required=True, metavar="TRACE.json")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    doc = synthesize(a.shape, a.seed)
    Path(a.out).write_text(json.dumps(doc) + "\n")
    print(f"{a.out}: {len(doc['requests'])} requests over {PROFILE[-1][0]} s ({a.shape})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
