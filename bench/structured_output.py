"""What structured output costs a decode step: the engine decoding a batch whose every
sequence follows a JSON schema, against the same batch unconstrained, in one run.

    python -m bench.structured_output --json out.json [--batches 1,8,32] [--steps 24]
                                      [--threads 1] [--dtype auto] [--rounds 3]

Each sequence's prompt is the same 64 tokens; its output is constrained by a schema
that asks for a long answer (an array of 100 to 200 objects), so every timed step is a
decode step of the whole batch. The step times are the engine's own (StepStats: pack,
forward, masks, sampling); the masks are filled on their own thread while the forward
pass runs (services/engine/engine.py), and the time filling them takes is measured
alone too, to show what is hidden. Medians of the steps, median of alternating rounds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.engine import LLMEngine
from services.engine.model.hardware import cpu_kind
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.text.model_store import ensure_default_model
from services.engine.model.runner import ModelRunner
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence
from services.engine.structured import Grammars, fill_masks
from services.engine.text.tokenizer import eos_token_ids, load_tokenizer

BLOCK = 16
SCHEMA = json.dumps({"type": "array", "minItems": 100, "maxItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                                     "name": {"type": "string", "maxLength": 40},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["id", "name", "tags"]}})


def decode_steps(runner, grammars: Grammars | None, batch: int, steps: int, eos) -> tuple[list[float], list[float]]:
    """The decode step times of `batch` sequences over `steps` steps, and (constrained)
    how long filling the batch's masks takes alone before each step."""
    blocks = BlockManager(BlockPool(batch * -(-(64 + steps + 8) // BLOCK) + 8, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(blocks.num_blocks, BLOCK))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=batch,
                                                                         max_num_batched_tokens=max(512, batch))))
    prompt = torch.randint(100, 10000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    seqs = []
    for i in range(batch):
        params = SamplingParams(max_tokens=steps + 2, temperature=0.8, seed=i, ignore_eos=True)
        seq = Sequence(f"s{i}", list(prompt), len(prompt), params, eos,
                       constraint=grammars.constraint(SCHEMA) if grammars else None)
        seqs.append(seq)
        engine.add(seq)
    times, fills = [], []
    try:
        while engine.has_work() and len(times) < steps:
            live = [s.constraint for s in seqs if s.constraint is not None and not s.constraint.terminated]
            if live:
                t0 = time.perf_counter()
                fill_masks([(c, ()) for c in live])         # reads the matchers, changes nothing
                fills.append(time.perf_counter() - t0)
            engine.step()
            s = engine.last_step
            if s is not None and s.prefill_tokens == 0 and s.decode_tokens == batch:
                times.append(s.seconds)
    finally:
        memory.close()
    return times, fills


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = ensure_default_model()
    runner = ModelRunner(model_dir, args.dtype, "cpu")
    eos = eos_token_ids(model_dir)
    tokenizer = load_tokenizer(model_dir)
    grammars = Grammars(lambda: tokenizer, runner.vocab_size, eos)
    grammars.compile(SCHEMA)                               # compiled once, as a worker caches it
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        free, constrained, fills = [], [], []
        for _ in range(args.rounds):                       # alternating, so drift hits both
            times, _ = decode_steps(runner, None, batch, args.steps, eos)
            free.append(statistics.median(times))
            times, fill = decode_steps(runner, grammars, batch, args.steps, eos)
            constrained.append(statistics.median(times))
            fills.append(1000 * statistics.median(fill))
        row = {"batch": batch, "free_step_ms": 1000 * statistics.median(free),
               "constrained_step_ms": 1000 * statistics.median(constrained),
               "mask_fill_ms": statistics.median(fills)}
        row["overhead"] = row["constrained_step_ms"] / row["free_step_ms"] - 1
        rows.append(row)
        print(f"batch {batch:3d}: unconstrained {row['free_step_ms']:7.1f} ms/step, JSON schema "
              f"{row['constrained_step_ms']:7.1f} ms/step ({row['overhead']:+.1%}); filling the masks alone "
              f"{row['mask_fill_ms']:.2f} ms", flush=True)
    out = {"cpu": cpu_kind(), "dtype": runner.dtype_name,
           "threads": args.threads, "steps": args.steps, "rounds": args.rounds, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
