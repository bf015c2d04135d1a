"""Speculative decoding replayed: a workload's recorded greedy outputs run through the
real speculator (services/engine/core/speculation.py) with a step cost line, so a
proposer or a cut can be weighed in seconds, the same drafts every time, without the
machine's noise. What a greedy output is does not depend on speculation, so a recorded
output says exactly which drafted tokens a verify step would keep.

    # record (a server running: `pdserve up`), code-edit prompts as bench.vllm_serve sends them
    python -m bench.spec_replay record --url http://127.0.0.1:8000 --out build/code-edit-outputs.jsonl
    # replay: speculation off against each method, four streams at a time
    python -m bench.spec_replay replay build/code-edit-outputs.jsonl --streams 4 --json build/replay.json

The cost of a step is `--step-ms` plus `--row-ms` a row (a verified draft token is a row);
measure them on the machine in question (`python -m bench.engine --verify N` times steps
of N rows). The prompts' own prefill is left out: it costs the same with speculation on
and off. The oracle cuts every draft where it will fail: the most any cut of the same
drafts could give.
"""
from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from services.engine.core.sampling import SamplingParams
from services.engine.core.sequence import Sequence
from services.engine.core.speculation import SpeculativeConfig, Speculator


def record(url: str, out: Path, num_prompts: int, concurrency: int, model: str | None) -> int:
    """Each code-edit prompt's greedy answer through the chat API, with its token ids."""
    import httpx

    from bench.code_edit import build
    from services.engine.text.model_store import resolve_model
    from services.engine.text.tokenizer import load_tokenizer
    rows = build(load_tokenizer(resolve_model(model, None)), num_prompts)
    name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]

    def ask(row: dict) -> dict:
        body = {"model": name, "messages": [{"role": "user", "content": row["prompt"]}], "temperature": 0,
                "max_tokens": row["output_tokens"], "ignore_eos": True, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).raise_for_status().json()
        return {"prompt_ids": r["prompt_token_ids"], "output_ids": r["choices"][0]["token_ids"]}
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(ask, rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(a) + "\n" for a in answers))
    print(f"{len(answers)} answers, {sum(len(a['output_ids']) for a in answers)} output tokens -> {out}")
    return 0


@dataclass
class _Stream:
    seq: Sequence
    output: list[int]                   # the recorded answer
    made: int = 0                       # of its tokens, in seq.token_ids


@dataclass
class Replayed:
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    rows: int = 0
    drafted: int = 0
    accepted: int = 0
    per_verify: list[float] = field(default_factory=list)

    def report(self) -> dict:
        return {"tok_s": round(self.tokens / self.seconds, 1), "steps": self.steps, "rows": self.rows,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "tokens_per_verify_step": round(statistics.mean(self.per_verify), 2) if self.per_verify else None}


def replay(answers: list[dict], streams: int, config: SpeculativeConfig | None, step_ms: float, row_ms: float,
           oracle: bool = False) -> Replayed:
    """Answers `streams` at a time (a closed loop, the next one starting as one ends),
    each step's drafts from the speculator (none without a config), its cost from the line."""
    spec = Speculator(config) if config is not None else None
    queue, running, out = list(answers), [], Replayed()
    n = 0
    while queue or running:
        while queue and len(running) < streams:
            a = queue.pop(0)
            n += 1
            ids = list(a["prompt_ids"]) + a["output_ids"][:1]     # the first token comes with the prefill
            running.append(_Stream(Sequence(f"r{n}", ids, len(a["prompt_ids"]), SamplingParams(len(a["output_ids"]), temperature=0.0),
                                            frozenset()), a["output_ids"], 1))
        candidates = [(s.seq, len(s.output) - s.made) for s in running]
        drafts = spec.drafts([(seq, most - 1) for seq, most in candidates]) if spec is not None else {}
        rows, step_tokens = 0, 0
        for s in running:
            draft = list(drafts.get(s.seq, ()))
            truth = s.output[s.made:]
            kept = 0
            while kept < len(draft) and kept < len(truth) - 1 and draft[kept] == truth[kept]:
                kept += 1
            if oracle and draft:
                draft = draft[:kept]
            rows += 1 + len(draft)
            if draft:
                spec.accepted(s.seq, len(draft), kept)
                out.drafted += len(draft)
                out.accepted += kept
                out.per_verify.append(kept + 1)
            took = truth[:kept + 1]
            s.seq.token_ids.extend(took)
            s.made += len(took)
            step_tokens += len(took)
        seconds = (step_ms + row_ms * rows) / 1000
        if spec is not None:
            spec.observe(rows, seconds)
        out.seconds += seconds
        out.tokens += step_tokens
        out.steps += 1
        out.rows += rows
        for s in [s for s in running if s.made >= len(s.output)]:
            running.remove(s)
            if spec is not None:
                spec.finished(s.seq)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="record greedy answers of the code-edit prompts from a running server")
    r.add_argument("--url", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--num-prompts", type=int, default=32)
    r.add_argument("--concurrency", type=int, default=4)
    r.add_argument("--model", default=None, help="tokenizer of this model folder (default: the served default)")
    y = sub.add_parser("replay", help="replay recorded answers through the speculator")
    y.add_argument("answers", type=Path)
    y.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    y.add_argument("--methods", default="ngram,suffix")
    y.add_argument("--step-ms", type=float, default=16.0)
    y.add_argument("--row-ms", type=float, default=1.41)
    y.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.command == "record":
        return record(args.url, args.out, args.num_prompts, args.concurrency, args.model)
    answers = [json.loads(line) for line in args.answers.read_text().splitlines() if line.strip()]
    results = {}
    print(f"{len(answers)} answers, step {args.step_ms} ms + {args.row_ms} ms a row")
    for streams in args.streams:
        off = replay(answers, streams, None, args.step_ms, args.row_ms)
        results[f"off@{streams}"] = off.report()
        print(f"streams {streams}: off {off.report()['tok_s']} tok/s")
        for method in args.methods.split(","):
            for oracle in (False, True):
                got = replay(answers, streams, SpeculativeConfig(method=method), args.step_ms, args.row_ms, oracle)
                name = f"{method}{'-oracle' if oracle else ''}@{streams}"
                results[name] = {**got.report(), "vs_off": round(got.tokens / got.seconds / (off.tokens / off.seconds), 3)}
                print(f"  {name:18} {results[name]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"step_ms": args.step_ms, "row_ms": args.row_ms, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
