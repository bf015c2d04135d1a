"""Speculative decoding through the whole disaggregated cluster (router -> prefill
process -> KV -> decode process drafting and verifying), float32 greedy: every parity
prompt and a prompt that asks for a passage back (where drafts are accepted many at a
time) come back as `model.generate` makes them, through the `openai` client streamed
and not, one at a time and sixteen in flight, and through gRPC; the decode worker
counts its drafts under vLLM's metric names and every KV block comes back.
The ngram proposer, sixteen in flight, by default; one at a time, and the suffix and
draft-model proposers, under `make test-slow`. The prompts' KV crosses through NIXL."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from services.bench.server_metrics import acceptance, parse
from tests.parity_cases import CASES, Case, Expected, grpc_generate
from tests.processes import start_cluster, stop_cluster

PASSAGE = ("def area(width, height):\n    return width * height\n\n\n"
           "def perimeter(width, height):\n    return 2 * (width + height)\n")
COPY = Case("copy", [{"role": "user", "content": f"Repeat this code exactly:\n\n{PASSAGE}"}], max_tokens=48)


@pytest.fixture(scope="module", params=["ngram", pytest.param("suffix", marks=pytest.mark.slow),
                                        pytest.param("draft", marks=pytest.mark.slow)])
def spec_cluster(request, model_dir):
    config = {"method": request.param, "num_speculative_tokens": 4}
    if request.param == "draft":            # the model drafting for itself: a test of the plumbing, not a speed-up
        config.update(model=str(model_dir), adaptive=False)
    # KV through NIXL: the transport parity test's NIXL cluster runs under make test-slow.
    # Async scheduling, as a decode worker on a GPU has it by default: steps that draft
    # read the step in flight first, verify steps are read before the next is planned.
    c = start_cluster("--speculative-config", json.dumps(config), "--kv-transport", "nixl",
                      "--async-scheduling", "on")
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def references(expected, model_dir) -> dict[str, Expected]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from services.engine.text.tokenizer import encode_chat
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = encode_chat(tok, COPY.messages)
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=COPY.max_tokens, do_sample=False)[0, len(ids):]
    toks = out.tolist()
    finish = "stop" if toks[-1] == tok.eos_token_id else "length"
    return {**expected, "copy": Expected(ids, toks, tok.decode(toks, skip_special_tokens=True), finish)}


def ask(client, case: Case, stream: bool):
    """(token ids, text, finish reason, completion tokens) of one greedy chat completion."""
    kw = dict(model="SmolLM2-135M-Instruct", messages=case.messages, max_tokens=case.max_tokens, temperature=0,
              stop=case.stop, extra_body={"return_token_ids": True})
    if not stream:
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        return c.model_extra["token_ids"], c.message.content, c.finish_reason, r.usage.completion_tokens
    ids, text, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            ids += (c.model_extra or {}).get("token_ids") or []
            finish = c.finish_reason or finish
    return ids, "".join(text), finish, usage.completion_tokens


def check(got, exp: Expected, name: str) -> None:
    ids, text, finish, completion = got
    assert ids == exp.token_ids, name
    assert text == exp.text, name
    assert finish == exp.finish_reason, name
    assert completion == len(exp.token_ids), name       # a stop string inside a drafted delta ends it there


@pytest.mark.slow               # the sixteen below stream half their requests
def test_one_at_a_time_streamed_and_not(spec_cluster, references):
    """The passage back streamed and not, and a stop string inside a drafted delta; the
    other prompts run in the sixteen below."""
    client = openai.OpenAI(base_url=f"{spec_cluster.http}/v1", api_key="none", timeout=120, max_retries=0)
    stop = next(c for c in CASES if c.stop)
    for case, stream in ((COPY, True), (COPY, False), (stop, True)):
        check(ask(client, case, stream=stream), references[case.name], f"{case.name}, streamed: {stream}")


@pytest.mark.slow               # batches of drafting sequences: tests/test_engine_speculation.py by default
def test_sixteen_in_flight(spec_cluster, references):
    cases = ([COPY, *CASES] * 3)[:16]
    client = openai.OpenAI(base_url=f"{spec_cluster.http}/v1", api_key="none", timeout=300, max_retries=0)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda ic: ask(client, ic[1], stream=ic[0] % 2 == 1), enumerate(cases)))
    for case, got in zip(cases, results):
        check(got, references[case.name], case.name)


def test_grpc_and_what_the_decode_worker_counts(spec_cluster, references):
    for case in (COPY, next(c for c in CASES if c.stop)):
        exp = references[case.name]
        replies = grpc_generate(spec_cluster.grpc, case)
        assert [t for r in replies for t in r.token_ids] == exp.token_ids, case.name
        assert "".join(r.text for r in replies) == exp.text
        assert replies[-1].usage.completion_tokens == len(exp.token_ids)
    stats = spec_cluster.wait_idle()
    assert stats.info.free_blocks == stats.info.num_blocks
    metrics = httpx.get(spec_cluster.metrics_url("decode")).text
    values = {}
    for line in metrics.splitlines():
        if line.startswith("vllm:spec_decode") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0) + float(value)
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < values["vllm:spec_decode_num_accepted_tokens_total"] <= values["vllm:spec_decode_num_draft_tokens_total"]
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == \
        values["vllm:spec_decode_num_accepted_tokens_total"]
    # `pdserve bench --server-metrics` reads the same page
    seen = acceptance({}, parse(metrics))
    assert seen.drafts == values["vllm:spec_decode_num_drafts_total"]
    assert seen.accepted_tokens == values["vllm:spec_decode_num_accepted_tokens_total"]
    assert 0 < seen.rate <= 1 and 1 < seen.mean_length <= 5 and len(seen.per_position) == 4
    assert seen.per_position == sorted(seen.per_position, reverse=True)    # a later draft needs the ones before
    crossed = dict(re.findall(r'^pdserve_kv_transfer_bytes_total\{backend="(\w+)",direction="received"\} (\S+)$',
                              metrics, re.M))
    assert float(crossed["nixl"]) > 0 and float(crossed.get("shm", 0)) == 0, crossed
