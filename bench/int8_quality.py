"""What `--quantization int8` costs in output quality: greedy continuations of real chat
prompts through pdserve's engine in float32 (the reference), in the dtype `--dtype auto`
picks here, and in that dtype with int8 weights, side by side in one run.

    python -m bench.int8_quality --json build/int8-quality.json [--tokens 64]

For each of the dtype's and int8's runs against float32's:
  same output   prompts whose whole greedy continuation equals float32's
  agreement     the share of positions, following float32's own continuation (teacher
                forced), where the run's top token is float32's
  logprob drift the mean |log p - log p_ref| of float32's chosen token at those positions
  first split   the mean position where the free-running continuation first differs
So int8's figures can be read against the loss bfloat16 alone already brings.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from services.engine.model.kv_cache import KVPoolMemory

BLOCK = 16
PROMPTS = (
    "What is the capital of France, and what is it known for?",
    "Write a haiku about the ocean at night.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clean Python code.",
    "Translate 'Where is the train station?' into Spanish and German.",
    "What is 17 times 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me a recipe for a simple tomato soup.",
    "What are the main differences between TCP and UDP?",
    "Write a short, friendly email declining a meeting invitation.",
    "Why do cats purr?",
    "Describe how a hash table works to a beginner.",
)


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


@torch.inference_mode()
def continuation(runner, prompt: list[int], tokens: int, forced: list[int] | None = None):
    """Greedy continuation of `prompt` (or, with `forced`, that continuation fed back
    teacher-forced); returns the tokens taken and each step's log-softmax."""
    blocks = -(-(len(prompt) + tokens) // BLOCK)
    pool = KVPoolMemory.allocate(runner.layout(blocks, BLOCK))
    table = list(range(blocks))
    try:
        logits = runner.prefill(pool, prompt, table)
        out, logprobs = [], []
        for i in range(tokens):
            lp = torch.log_softmax(logits.float().view(-1), dim=-1)
            logprobs.append(lp)
            out.append(int(lp.argmax()) if forced is None else forced[i])
            if i + 1 < tokens:
                logits = runner.decode(pool, [out[-1]], [len(prompt) + i], [table])[0]
        return out, logprobs
    finally:
        pool.close()


def teacher_forced(runner, reference: dict, prompts: list[list[int]]) -> tuple[list[bool], list[float]]:
    """Fed each reference continuation: per position, whether `runner`'s top token is
    the reference's, and |log p - log p_ref| of the reference's token."""
    agree, drift = [], []
    for ids in prompts:
        ref_out, ref_lp = reference[tuple(ids)]
        _, lps = continuation(runner, ids, len(ref_out), forced=ref_out)
        for tok, lp, rlp in zip(ref_out, lps, ref_lp):
            agree.append(int(lp.argmax()) == tok)
            drift.append(abs(float(lp[tok]) - float(rlp[tok])))
    return agree, drift


def compare(runner, reference: dict, prompts: list[list[int]], tokens: int) -> dict:
    same, split = 0, []
    for ids in prompts:
        ref_out, _ = reference[tuple(ids)]
        free, _ = continuation(runner, ids, tokens)
        same += free == ref_out
        split.append(next((i for i, (a, b) in enumerate(zip(free, ref_out)) if a != b), tokens))
    agree, drift = teacher_forced(runner, reference, prompts)
    return {"same_output": same / len(prompts), "agreement": sum(agree) / len(agree),
            "logprob_drift": statistics.fmean(drift), "first_split": statistics.fmean(split)}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.int8_quality", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from services.engine.model.hardware import cpu_kind
    from services.engine.text.model_store import resolve_model
    from services.engine.model.runner import ModelRunner
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [_chat_ids(tokenizer, p) for p in PROMPTS]
    reference_runner = ModelRunner(model_dir, "float32", "cpu")
    reference = {tuple(ids): continuation(reference_runner, ids, args.tokens) for ids in prompts}
    del reference_runner
    auto = ModelRunner(model_dir, "auto", "cpu")
    rows = {auto.dtype_name: compare(auto, reference, prompts, args.tokens)}
    del auto
    int8 = ModelRunner(model_dir, "auto", "cpu", quantization="int8")
    rows[f"{int8.dtype_name} + int8"] = compare(int8, reference, prompts, args.tokens)
    print(f"{len(prompts)} chat prompts, {args.tokens} greedy tokens each, against float32; {model_dir.name} on "
          f"{cpu_kind()}")
    print("| run | same output | top-1 agreement | logprob drift | first split at |\n|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {100 * r['same_output']:.0f} % | {100 * r['agreement']:.1f} % | "
              f"{r['logprob_drift']:.3f} | {r['first_split']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_kind(), "model": model_dir.name, "tokens": args.tokens, "prompts": list(PROMPTS),
                       "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
