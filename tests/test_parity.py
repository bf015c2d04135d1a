"""Correctness bar: in float32 with greedy sampling, tokens produced through the whole
cluster (router -> prefill process -> KV over shared memory -> decode process) equal
`transformers`' own `model.generate`, token for token, through raw HTTP, the official
`openai` client (streaming and not), and gRPC; also with 8 requests in flight at once."""
from __future__ import annotations

import asyncio
import httpx
import openai
import pytest
import torch

from tests.parity_cases import CASES, chat_body, grpc_generate

# Raw HTTP, the official client and gRPC take some cases each by default (a stop string,
# a long prompt, non-ASCII text among them), together every case and all of them with
# eight in flight; every case each under `make test-slow`.
SOME = {"long", "non_ascii", "stop_string"}


def some_cases(names: set[str]) -> list:
    return [c if c.name in names else pytest.param(c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("case", some_cases(SOME | {"hits_max_tokens"}), ids=lambda c: c.name)
def test_http_matches_generate(cluster, expected, case):
    r = httpx.post(f"{cluster.http}/v1/chat/completions", json=chat_body(case), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    exp = expected[case.name]
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == exp.prompt_ids
    assert choice["token_ids"] == exp.token_ids
    assert choice["message"]["content"] == exp.text
    assert choice["finish_reason"] == exp.finish_reason
    cached = body["usage"].pop("prompt_tokens_details")["cached_tokens"]      # earlier tests may share a prefix
    assert body["usage"] == {"prompt_tokens": len(exp.prompt_ids), "completion_tokens": len(exp.token_ids),
                             "total_tokens": len(exp.prompt_ids) + len(exp.token_ids)}
    assert 0 <= cached < len(exp.prompt_ids) and cached % 16 == 0


@pytest.mark.parametrize("case", some_cases({"short", "multi_turn", "stop_string"}), ids=lambda c: c.name)
def test_openai_client_matches_generate(cluster, expected, case):
    client = openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", timeout=120, max_retries=0)
    exp = expected[case.name]
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=case.messages, max_tokens=case.max_tokens, temperature=0,
              stop=case.stop, extra_body={"return_token_ids": True})
    resp = client.chat.completions.create(**kw)
    assert resp.choices[0].message.content == exp.text
    assert resp.choices[0].model_extra["token_ids"] == exp.token_ids
    assert resp.choices[0].finish_reason == exp.finish_reason

    text, ids, finish, usage = [], [], None, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text.append(c.delta.content or "")
            ids.extend((c.model_extra or {}).get("token_ids") or [])
            finish = c.finish_reason or finish
    assert "".join(text) == exp.text
    assert ids == exp.token_ids
    assert finish == exp.finish_reason
    assert usage.completion_tokens == len(exp.token_ids) and usage.prompt_tokens == len(exp.prompt_ids)


@pytest.mark.parametrize("case", some_cases(SOME), ids=lambda c: c.name)
def test_grpc_matches_generate(cluster, expected, case):
    exp = expected[case.name]
    replies = grpc_generate(cluster.grpc, case)
    assert [t for r in replies for t in r.token_ids] == exp.token_ids
    assert "".join(r.text for r in replies) == exp.text
    assert replies[-1].finish_reason == exp.finish_reason
    assert replies[-1].usage.prompt_tokens == len(exp.prompt_ids)


def test_eight_requests_in_flight_match_generate(cluster, expected):
    cases = CASES + CASES[:2]

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{cluster.http}/v1", api_key="none", timeout=300, max_retries=0)
        calls = [client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=c.messages,
                                                max_tokens=c.max_tokens, temperature=0, stop=c.stop,
                                                extra_body={"return_token_ids": True}) for c in cases]
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    assert len(cases) == 8
    for case, resp in zip(cases, results):
        assert resp.choices[0].model_extra["token_ids"] == expected[case.name].token_ids, case.name
        assert resp.choices[0].message.content == expected[case.name].text


def test_completions_endpoint_matches_generate(cluster, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = "The three primary colours are"
    ids = tok.encode(prompt)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    r = httpx.post(f"{cluster.http}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref
    assert r.json()["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
