"""EleutherAI's lm-evaluation-harness against the cluster, unchanged: its
`local-completions` model with token-id prompts (`tokenized_requests=True`), batches of
8, its tokenizer taken from the server (/tokenizer_info, /tokenize), on a small task
written here: multiple-choice questions scored by log-likelihood, and one greedy
generation.

lm-eval pins its own dependencies, so it lives in a virtual environment of its own:
PDSERVE_LM_EVAL_PYTHON names that environment's python (or lm_eval imports here). The
test skips when neither has it:

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 'lm-eval[api]==0.4.*'
    PDSERVE_LM_EVAL_PYTHON=/tmp/lmeval/bin/python .venv/bin/python -m pytest -m slow tests/test_lm_eval.py
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["Six", "Eight", "Ten"], "answer": 1},
    {"question": "Which colour is the sky on a clear day?", "choices": ["Green", "Red", "Blue"], "answer": 2},
]
GENERATION = {"prompt": "Q: What is the capital of Italy?\nA:", "target": " Rome"}
TASKS = {
    "pdserve_mc": """task: pdserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "pdserve_gen": """task: pdserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {dir}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def _lm_eval_python() -> str | None:
    for python in (os.environ.get("PDSERVE_LM_EVAL_PYTHON"), sys.executable):
        if python and subprocess.run([python, "-c", "import lm_eval"], capture_output=True).returncode == 0:
            return python
    return None


def _run(python: str, http: str, tasks: Path, out: Path, batch_size: int) -> dict[str, list[dict]]:
    """lm_eval's samples per task."""
    args = f"model={MODEL},base_url={http}/v1/completions,tokenized_requests=True,max_length=2048,num_concurrent=1"
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--batch_size", str(batch_size), "--tasks", "pdserve_mc,pdserve_gen",
                           "--include_path", str(tasks), "--log_samples",
                           "--output_path", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Using tokenizer remote" in done.stderr          # from /tokenizer_info and /tokenize
    return {task: [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                   for line in path.read_text().splitlines()] for task in TASKS}


@pytest.mark.slow
def test_lm_eval_local_completions_batched_and_tokenized(cluster):
    python = _lm_eval_python()
    if python is None:
        pytest.skip("lm-eval is not installed (set PDSERVE_LM_EVAL_PYTHON to a python that has it)")
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lm-eval-"))
    (tmp / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp / "gen.jsonl").write_text(json.dumps(GENERATION) + "\n")
    for name, text in TASKS.items():
        (tmp / f"{name}.yaml").write_text(text.format(dir=tmp))
    batched = _run(python, cluster.http, tmp, tmp / "batched", 8)
    alone = _run(python, cluster.http, tmp, tmp / "alone", 1)

    def scores(samples: list[dict]) -> list[list[float]]:
        return [[float(r[0][0]) for r in s["resps"]] for s in sorted(samples, key=lambda s: s["doc_id"])]
    got = scores(batched["pdserve_mc"])
    assert len(got) == len(QUESTIONS) and all(len(s) == 3 and all(math.isfinite(x) and x < 0 for x in s) for s in got)
    for one, other in zip(got, scores(alone["pdserve_mc"])):
        assert one == pytest.approx(other, abs=1e-4)              # a batch scores as prompts sent alone
    # A continuation's log-likelihood (lm-eval puts a space before it), as the server
    # scores it with echo and logprobs.
    q = QUESTIONS[0]
    context = f"Question: {q['question']}\nAnswer:"
    ids = httpx.post(f"{cluster.http}/tokenize", json={"prompt": context, "add_special_tokens": False}).json()["tokens"]
    whole = httpx.post(f"{cluster.http}/tokenize", json={"prompt": f"{context} {q['choices'][0]}",
                                                          "add_special_tokens": False}).json()["tokens"]
    scored = httpx.post(f"{cluster.http}/v1/completions", timeout=60, json={
        "prompt": [whole], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}).json()
    want = sum(scored["choices"][0]["logprobs"]["token_logprobs"][len(ids):-1])
    assert got[0][0] == pytest.approx(want, abs=1e-4)
    (generated,) = batched["pdserve_gen"]
    direct = httpx.post(f"{cluster.http}/v1/completions", timeout=60, json={
        "prompt": GENERATION["prompt"], "max_tokens": 8, "temperature": 0, "stop": ["\n"]}).json()
    assert generated["resps"][0][0] == direct["choices"][0]["text"] == alone["pdserve_gen"][0]["resps"][0][0]
    print("lm-eval:", json.dumps({"loglikelihoods": got, "generation": generated["resps"][0][0],
                                  "acc": sum(max(range(3), key=s.__getitem__) == q["answer"]
                                             for s, q in zip(got, QUESTIONS)) / len(QUESTIONS)}))
