"""What each response tells, with the official `openai` client where it has a say:
cached prompt tokens in `usage`, `x-request-id` in and out (gRPC metadata too), the
server's version, and /v1/models' creation time."""
import time

import grpc
import httpx
import openai

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


def test_version_and_models(cluster):
    assert httpx.get(f"{cluster.http}/version").json()["version"]
    model = _client(cluster).models.list().data[0]
    assert model.id == MODEL and 0 < model.created <= time.time() and model.owned_by == "pdserve"
