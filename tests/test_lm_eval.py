"""EleutherAI's lm-evaluation-harness against the cluster, unchanged: its
`local-completions` model with token-id prompts (`tokenized_requests=True`), batches of
8, its tokenizer taken from the server (/tokenizer_info, /tokenize), on a small task
written here: multiple-choice questions scored by log-likelihood, and one greedy
generation.

- The short run (the default suite): the multiple-choice task alone, through lm-eval's
  Python API, each choice's log-likelihood as transformers scores it in float32, as
  lm-eval's `hf` backend does.
- The slow run (its command line): both tasks, in batches and one request at a time, and
  lm-eval's own `hf` backend on the same model in float32 over the same tasks: per
  question, log-likelihoods within 1e-3, the same choice, the same greedy generation.

lm-eval runs from the environment whose python PDSERVE_LM_EVAL_PYTHON names, else from
this one if lm_eval imports here; the tests skip when neither has it. An environment of
its own:

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 transformers==5.23.0 'lm-eval[api,hf]==0.4.*'
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
LOGLIKELIHOOD_TOLERANCE = 1e-3        # the bound against lm-eval's hf backend


def _lm_eval_python() -> str:
    for python in (os.environ.get("PDSERVE_LM_EVAL_PYTHON"), sys.executable):
        if python and subprocess.run([python, "-c", "import lm_eval"], capture_output=True).returncode == 0:
            return python
    pytest.skip("lm-eval is not installed (set PDSERVE_LM_EVAL_PYTHON to a python that has it)")


def _tasks_dir() -> Path:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lm-eval-"))
    (tmp / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp / "gen.jsonl").write_text(json.dumps(GENERATION) + "\n")
    for name, text in TASKS.items():
        (tmp / f"{name}.yaml").write_text(text.format(dir=tmp))
    return tmp


def _env(tasks: Path) -> dict[str, str]:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "HF_DATASETS_CACHE": str(tasks / "datasets")}


def _samples(out: Path, names: tuple[str, ...]) -> dict[str, list[dict]]:
    """lm_eval's samples per task, in document order."""
    return {task: sorted((json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                          for line in path.read_text().splitlines()), key=lambda s: s["doc_id"]) for task in names}


def _run(python: str, tasks: Path, out: str, model: str, model_args: str, batch_size: int,
         names: tuple[str, ...] = tuple(TASKS)) -> dict[str, list[dict]]:
    """lm_eval's command line: its samples per task. The hf model's device is --device (in
    --model_args too, the command line gives it twice and the model refuses)."""
    device = ["--device", "cpu"] if model == "hf" else []
    done = subprocess.run([python, "-m", "lm_eval", "--model", model, "--model_args", model_args, *device,
                           "--batch_size", str(batch_size), "--tasks", ",".join(names),
                           "--include_path", str(tasks), "--log_samples", "--output_path", str(tasks / out)],
                          env=_env(tasks), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    if model == "local-completions":
        assert "Using tokenizer remote" in done.stderr      # from /tokenizer_info and /tokenize
    return _samples(tasks / out, names)


# lm_eval.simple_evaluate with a task manager that holds only these tasks: the command
# line first indexes lm-eval's thousands of built-in tasks, about 12 s of a short run.
EVALUATE = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import setup_logging
setup_logging("INFO")
model, model_args, tasks, names, batch_size, out = sys.argv[1:]
results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names.split(","),
                                  batch_size=int(batch_size), log_samples=True,
                                  task_manager=TaskManager(include_path=tasks, include_defaults=False))
for name, samples in results["samples"].items():
    with open(f"{out}/samples_{name}_api.jsonl", "w") as f:
        f.writelines(json.dumps(s, default=str) + "\\n" for s in samples)
"""


def _evaluate(python: str, tasks: Path, out: str, model: str, model_args: str, batch_size: int,
              names: tuple[str, ...]) -> dict[str, list[dict]]:
    """lm_eval's Python API: its samples per task."""
    (tasks / out).mkdir()
    done = subprocess.run([python, "-c", EVALUATE, model, model_args, str(tasks), ",".join(names), str(batch_size),
                           str(tasks / out)], env=_env(tasks), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    if model == "local-completions":
        assert "Using tokenizer remote" in done.stderr      # from /tokenizer_info and /tokenize
    return _samples(tasks / out, names)


def _completions(http: str) -> str:
    return f"model={MODEL},base_url={http}/v1/completions,tokenized_requests=True,max_length=2048,num_concurrent=1"


def _scores(samples: list[dict]) -> list[list[float]]:
    """Each question's choices' log-likelihoods."""
    return [[float(r[0][0]) for r in s["resps"]] for s in samples]


def _choice(scores: list[float]) -> int:
    return max(range(len(scores)), key=scores.__getitem__)


def _transformers_scores(model_dir: Path) -> list[list[float]]:
    """Each choice's log-likelihood after its question, as lm-eval's hf backend computes
    it: the continuation is " choice" (its target delimiter), tokenized with the context
    and split where the context's tokens end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for q in QUESTIONS:
        context = f"Question: {q['question']}\nAnswer:"
        n = len(tok.encode(context, add_special_tokens=False))
        row = []
        for choice in q["choices"]:
            ids = tok.encode(f"{context} {choice}", add_special_tokens=False)
            with torch.inference_mode():
                logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            row.append(sum(logits[i - 1, ids[i]].item() for i in range(n, len(ids))))
        out.append(row)
    return out


def test_lm_eval_scores_a_token_id_batch_as_transformers_does(cluster, model_dir):
    """lm-eval's `local-completions`, defaults unchanged, batch size 8: every choice's
    log-likelihood within 1e-3 of transformers' in float32, and the same answers."""
    python = _lm_eval_python()
    tasks = _tasks_dir()
    got = _scores(_evaluate(python, tasks, "short", "local-completions", _completions(cluster.http), 8,
                            ("pdserve_mc",))["pdserve_mc"])
    want = _transformers_scores(model_dir)
    for ours, theirs in zip(got, want, strict=True):
        assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_TOLERANCE)
        assert _choice(ours) == _choice(theirs)


@pytest.mark.slow
def test_lm_eval_local_completions_batched_and_tokenized(cluster, model_dir):
    python = _lm_eval_python()
    tasks = _tasks_dir()
    batched = _run(python, tasks, "batched", "local-completions", _completions(cluster.http), 8)
    alone = _run(python, tasks, "alone", "local-completions", _completions(cluster.http), 1)
    hf = _run(python, tasks, "hf", "hf", f"pretrained={model_dir},dtype=float32", 1)

    got = _scores(batched["pdserve_mc"])
    assert len(got) == len(QUESTIONS) and all(len(s) == 3 and all(math.isfinite(x) and x < 0 for x in s) for s in got)
    for one, other in zip(got, _scores(alone["pdserve_mc"]), strict=True):
        assert one == pytest.approx(other, abs=1e-4)              # a batch scores as prompts sent alone
    want = _scores(hf["pdserve_mc"])
    for ours, theirs in zip(got, want, strict=True):              # per question, as lm-eval's hf backend
        assert ours == pytest.approx(theirs, abs=LOGLIKELIHOOD_TOLERANCE)
        assert _choice(ours) == _choice(theirs)
    # A continuation's log-likelihood (lm-eval puts a space before it), as the server
    # scores it with echo and logprobs.
    q = QUESTIONS[0]
    context = f"Question: {q['question']}\nAnswer:"
    ids = httpx.post(f"{cluster.http}/tokenize", json={"prompt": context, "add_special_tokens": False}).json()["tokens"]
    whole = httpx.post(f"{cluster.http}/tokenize", json={"prompt": f"{context} {q['choices'][0]}",
                                                          "add_special_tokens": False}).json()["tokens"]
    scored = httpx.post(f"{cluster.http}/v1/completions", timeout=60, json={
        "prompt": [whole], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}).json()
    want_first = sum(scored["choices"][0]["logprobs"]["token_logprobs"][len(ids):-1])
    assert got[0][0] == pytest.approx(want_first, abs=1e-4)
    (generated,) = batched["pdserve_gen"]
    direct = httpx.post(f"{cluster.http}/v1/completions", timeout=60, json={
        "prompt": GENERATION["prompt"], "max_tokens": 8, "temperature": 0, "stop": ["\n"]}).json()
    text = generated["resps"][0][0]
    assert text == direct["choices"][0]["text"] == alone["pdserve_gen"][0]["resps"][0][0]
    assert text == hf["pdserve_gen"][0]["resps"][0][0]            # the same greedy generation
    print("lm-eval:", json.dumps({
        "loglikelihoods": got, "hf": want, "generation": text, "hf_generation": hf["pdserve_gen"][0]["resps"][0][0],
        "max_abs_difference": max(abs(a - b) for ours, theirs in zip(got, want) for a, b in zip(ours, theirs)),
        "acc": sum(_choice(s) == q["answer"] for s, q in zip(got, QUESTIONS)) / len(QUESTIONS)}))
