"""What each response tells, with the official `openai` client where it has a say:
cached prompt tokens in `usage`, `x-request-id` in and out (gRPC metadata too), the
server's version, /v1/models' creation time, and vLLM's /tokenize and /detokenize."""
import json
import time

import grpc
import httpx
import openai
import pytest

from services.router.frontend import MAX_CHARS_PER_TOKEN
from services.rpc import generate_pb2, generate_pb2_grpc

MODEL = "SmolLM2-135M-Instruct"


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", max_retries=0)


def test_usage_names_the_prompt_tokens_served_from_the_prefix_cache(cluster):
    client = _client(cluster)
    prompt = "The same long preamble, word for word, every time. " * 12
    counts = []
    for _ in range(2):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        counts.append(r.usage.prompt_tokens_details.cached_tokens)
    assert counts[1] > 0 and counts[1] % 16 == 0 and counts[1] <= r.usage.prompt_tokens, counts
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    last = [c for c in stream][-1]
    assert last.usage is not None and last.usage.prompt_tokens_details.cached_tokens >= 0


def test_only_prompts_of_the_same_cache_salt_share_cached_blocks(cluster):
    """vLLM's cache_salt: a prompt cached under one salt is found again under it, by the
    gRPC API too, and not under another salt or none."""
    client = _client(cluster)
    prompt = f"A preamble only this test sends, {time.time_ns()}, word for word. " * 8

    def cached(**salt) -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                      extra_body=salt or None)
        return r.usage.prompt_tokens_details.cached_tokens
    assert cached(cache_salt="team-a") == 0
    assert cached(cache_salt="team-a") > 0
    assert cached(cache_salt="team-b") == 0 and cached() == 0
    request = generate_pb2.GenerateRequest(prompt=prompt, sampling=generate_pb2.SamplingParams(
        max_tokens=1, temperature=0, cache_salt="team-a"))
    with grpc.insecure_channel(cluster.grpc.removeprefix("http://")) as ch:
        assert list(generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=60))[-1].finish_reason
    empty = httpx.post(f"{cluster.http}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""},
                       timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt", empty.text


def test_a_request_id_comes_back_or_one_is_made(cluster):
    client = _client(cluster)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_headers={"x-request-id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"
    made = httpx.post(f"{cluster.http}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert len(made.headers["x-request-id"]) == 32
    refused = httpx.post(f"{cluster.http}/v1/completions", json={"prompt": "hi", "max_tokens": "x"},
                         headers={"x-request-id": "bad id with spaces"}, timeout=60)
    assert refused.status_code == 400 and refused.headers["x-request-id"] != "bad id with spaces"
    with grpc.insecure_channel(cluster.grpc) as ch:
        replies = generate_pb2_grpc.GeneratorStub(ch).Generate(
            generate_pb2.GenerateRequest(prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=1)),
            metadata=(("x-request-id", "grpc-7"),), timeout=60)
        list(replies)
        assert dict(replies.trailing_metadata())["x-request-id"] == "grpc-7"
        # The request's own id, in every message and the trailer; without one, the
        # router's for the request, the same in both, n > 1 too.
        for req, expected in ((generate_pb2.GenerateRequest(prompt="hi", request_id="mine-1"), "mine-1"),
                              (generate_pb2.GenerateRequest(prompt="hi", n=2), None)):
            req.sampling.max_tokens = 2
            replies = generate_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=60)
            ids = {m.request_id for m in replies}
            trailer = dict(replies.trailing_metadata())["x-request-id"]
            assert ids == {trailer} and trailer == (expected or trailer) and not trailer.endswith("-0"), (ids, trailer)


def test_version_and_models(cluster):
    assert httpx.get(f"{cluster.http}/version").json()["version"]
    model = _client(cluster).models.list().data[0]
    assert model.id == MODEL and 0 < model.created <= time.time() and model.owned_by == "pdserve"
    assert _client(cluster).models.retrieve(MODEL) == model
    with pytest.raises(openai.NotFoundError):
        _client(cluster).models.retrieve("gpt-17")
    # What load balancers and vLLM's users probe: HEAD, and vLLM's /ping.
    for method, path in (("HEAD", "/health"), ("HEAD", "/v1/models"), ("GET", "/ping"), ("POST", "/ping")):
        assert httpx.request(method, f"{cluster.http}{path}", timeout=10).status_code == 200, (method, path)


def test_a_model_served_under_two_names(tools_router):
    """--served-model-name MODEL smol, as vLLM takes it: /v1/models lists both, a request
    may name either and its answer names the first; any other name is a 404 that lists
    them."""
    client = openai.OpenAI(base_url=f"{tools_router}/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL, "smol"]
    assert client.models.retrieve("smol").id == "smol"
    answer = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert answer.model == MODEL
    with pytest.raises(openai.NotFoundError, match="Served: `SmolLM2-135M-Instruct`, `smol`"):
        client.completions.create(model="smol2", prompt="Hi", max_tokens=1)


def _post(cluster, path: str, body: dict) -> httpx.Response:
    """JSON with \\u escapes, so a lone surrogate can be sent as JSON allows."""
    return httpx.post(f"{cluster.http}{path}", content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


def test_tokenize_gives_the_ids_the_completion_routes_compute(cluster):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = _post(cluster, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True})
    tokenized = _post(cluster, "/tokenize", {"model": MODEL, "messages": messages}).json()
    max_model_len = httpx.get(f"{cluster.http}/v1/models").json()["data"][0]["max_model_len"]
    assert tokenized == {"count": len(chat.json()["prompt_token_ids"]), "max_model_len": max_model_len,
                         "tokens": chat.json()["prompt_token_ids"]}
    bare = _post(cluster, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert bare == tokenized["tokens"][:len(bare)] and len(bare) < tokenized["count"]

    prompt = "Déjà vu, 🙂 twice:  spaces\nand lines"
    completion = _post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "return_token_ids": True})
    ids = _post(cluster, "/tokenize", {"prompt": prompt, "add_special_tokens": True}).json()["tokens"]
    assert ids == completion.json()["prompt_token_ids"]
    assert _post(cluster, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": prompt}
    assert _post(cluster, "/detokenize", {"tokens": tokenized["tokens"]}).json()["prompt"].startswith("<|im_start|>")
    assert _post(cluster, "/tokenize", {"prompt": ""}).json()["tokens"] == []


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, None),
    ("/tokenize", {}, 400, None),
    ("/tokenize", {"messages": []}, 400, None),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "a"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, 400, "tokens.0"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_tokenizer_routes_refuse_what_the_completion_routes_refuse(cluster, path, body, status, param):
    r = _post(cluster, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_tokenizer_routes_take_only_json_bodies_within_the_limits(cluster):
    r = httpx.post(f"{cluster.http}/tokenize", content=b"prompt=a", timeout=60,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 415
    max_model_len = httpx.get(f"{cluster.http}/v1/models").json()["data"][0]["max_model_len"]
    huge = _post(cluster, "/tokenize", {"prompt": "x" * (max_model_len * MAX_CHARS_PER_TOKEN + 1)})
    assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
    paths = httpx.get(f"{cluster.http}/openapi.json").json()["paths"]
    ids = [op["operationId"] for item in paths.values() for op in item.values()]
    assert len(ids) == len(set(ids)), sorted(ids)          # client generators key operations by it
    assert {"get", "head"} <= set(paths["/health"]) and {"get", "post"} <= set(paths["/ping"])
    for path, model in [("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")]:
        schema = paths[path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{model}"}


def test_invocations_serve_a_chat_or_a_completion_by_the_body(cluster):
    """SageMaker's /invocations, as vLLM serves it: `messages` is a chat request, `prompt`
    a completion, each answered as its own route answers it; anything else is a 400."""
    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0}
    completion = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0}
    with httpx.Client(base_url=cluster.http, timeout=60) as http:
        for body, path, text in ((chat, "/v1/chat/completions", lambda c: c["message"]["content"]),
                                 (completion, "/v1/completions", lambda c: c["text"])):
            via, direct = http.post("/invocations", json=body), http.post(path, json=body)
            assert via.status_code == direct.status_code == 200, via.text
            assert via.json()["object"] == direct.json()["object"]
            assert text(via.json()["choices"][0]) == text(direct.json()["choices"][0])
        refused = http.post("/invocations", json={"input": "hi"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_invocation"
        assert http.post("/invocations", json={**chat, "max_tokens": -1}).status_code == 400
