"""Bad input gets a precise 4xx with an OpenAI-style error object (gRPC: a precise
status), and the server keeps serving afterwards."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from services.rpc import generate_pb2, generate_pb2_grpc

MSG = [{"role": "user", "content": "hi"}]
LONG = "hello " * 9000          # well past the 8,192-token context


def _post(cluster, path, content=None, json=None, headers=None):
    return httpx.post(f"{cluster.http}{path}", content=content, json=json, timeout=60,
                      headers=headers or {"content-type": "application/json"})


BAD_CHAT = {
    "malformed_json": b'{"messages": [',
    "not_an_object": b"[1, 2, 3]",
    "invalid_utf8": b'{"messages": [{"role": "user", "content": "\xff\xfe bad"}]}',
    "messages_missing": {"max_tokens": 5},
    "messages_empty": {"messages": []},
    "messages_wrong_type": {"messages": "hello"},
    "role_unknown": {"messages": [{"role": "wizard", "content": "hi"}]},
    "content_wrong_type": {"messages": [{"role": "user", "content": 42}]},
    "max_tokens_string": {"messages": MSG, "max_tokens": "ten"},
    "max_tokens_bool": {"messages": MSG, "max_tokens": True},
    "max_tokens_zero": {"messages": MSG, "max_tokens": 0},
    "max_tokens_negative": {"messages": MSG, "max_tokens": -5},
    "max_tokens_absurd": {"messages": MSG, "max_tokens": 10**12},
    "temperature_negative": {"messages": MSG, "temperature": -0.5},
    "temperature_string": {"messages": MSG, "temperature": "hot"},
    "top_p_zero": {"messages": MSG, "top_p": 0},
    "top_p_above_one": {"messages": MSG, "top_p": 1.5},
    "top_k_negative": {"messages": MSG, "top_k": -3},
    "stream_wrong_type": {"messages": MSG, "stream": "yes"},
    "n_absurd": {"messages": MSG, "n": 1000},
    "n_zero": {"messages": MSG, "n": 0},
    "unknown_field": {"messages": MSG, "frobnicate": 1},
    "unknown_field_in_a_message": {"messages": [{"role": "user", "content": "hi", "mood": "grumpy"}]},
    "best_of_above_n": {"messages": MSG, "best_of": 3},
    "top_logprobs_absurd": {"messages": MSG, "logprobs": True, "top_logprobs": 50},
    "top_logprobs_without_logprobs": {"messages": MSG, "top_logprobs": 2},
    "logit_bias_past_the_vocabulary": {"messages": MSG, "logit_bias": {"99999999": 5}},
    "logit_bias_not_a_token": {"messages": MSG, "logit_bias": {"cat": 5}},
    "logit_bias_absurd": {"messages": MSG, "logit_bias": {"5": 1000}},
    "presence_penalty_absurd": {"messages": MSG, "presence_penalty": 3},
    "repetition_penalty_zero": {"messages": MSG, "repetition_penalty": 0},
    "min_p_above_one": {"messages": MSG, "min_p": 1.5},
    "stop_token_ids_past_the_vocabulary": {"messages": MSG, "stop_token_ids": [10**9]},
    "schema_that_is_no_schema": {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
    "json_schema_missing": {"messages": MSG, "response_format": {"type": "json_schema"}},
    "tool_choice_without_tools": {"messages": MSG, "tool_choice": "required"},
    "tools_on_a_template_without_them": {"messages": MSG, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    "prompt_too_long": {"messages": [{"role": "user", "content": LONG}]},
    "prompt_plus_max_tokens_too_long": {"messages": [{"role": "user", "content": "hello " * 4000}],
                                        "max_tokens": 5000},
    "nested_10000_deep": b'{"messages": ' + b"[" * 10000 + b"]" * 10000 + b"}",
    "lone_surrogate": b'{"messages": [{"role": "user", "content": "half a pair: \\ud800 here"}]}',
    "text_far_past_the_context": {"messages": [{"role": "user", "content": "x" * 2_000_000}]},
}


@pytest.mark.parametrize("name", list(BAD_CHAT))
def test_bad_chat_request_gets_400_and_server_keeps_serving(cluster, name):
    body = BAD_CHAT[name]
    r = _post(cluster, "/v1/chat/completions", **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if name.startswith(("unknown_field", "tools_on")):
        assert err["code"] == "unsupported_parameter" and err["param"], err
    ok = _post(cluster, "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_context_overflow_names_the_limit(cluster):
    r = _post(cluster, "/v1/chat/completions", json=BAD_CHAT["prompt_too_long"])
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "8192" in err["message"]


def test_a_compressed_body_is_415_not_bad_utf8(cluster):
    import gzip
    r = _post(cluster, "/v1/chat/completions", content=gzip.compress(b'{"messages": [{"role": "user", "content": "hi"}]}'),
              headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415 and "gzip" in r.json()["error"]["message"], r.text


def test_oversized_body_is_refused(cluster):
    r = _post(cluster, "/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "'
              + b"a" * (9 * 1024 * 1024) + b'"}]}')
    assert r.status_code == 400 and r.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": [999999]}, {"prompt": ["a", 1]}, {"prompt": 5},
                                  {"prompt": "hi", "max_tokens": 0}])
def test_bad_completion_request_gets_400(cluster, body):
    r = _post(cluster, "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]


def test_unknown_model_is_404_model_not_found(cluster):
    r = _post(cluster, "/v1/chat/completions", json={"model": "gpt-17", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MSG, max_tokens=-1)


def test_models_health_ready(cluster):
    assert httpx.get(f"{cluster.http}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{cluster.http}/ready")           # `up` announced only once the router saw both workers
    assert ready.status_code == 200 and ready.json()["workers"] == {"prefill": 1, "decode": 1}
    models = httpx.get(f"{cluster.http}/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["SmolLM2-135M-Instruct"]


def _grpc_generate(cluster, req):
    with grpc.insecure_channel(cluster.grpc) as ch:
        return list(generate_pb2_grpc.GeneratorStub(ch).Generate(req, timeout=60))


GRPC_BAD = {
    "no_input": (generate_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    "empty_prompt": (generate_pb2.GenerateRequest(prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
    "negative_temperature": (generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT),
    "top_p_zero": (generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT),
    "max_tokens_zero": (generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=0)), grpc.StatusCode.INVALID_ARGUMENT),
    "too_long": (generate_pb2.GenerateRequest(prompt=LONG), grpc.StatusCode.INVALID_ARGUMENT),
    "bad_token_id": (generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=[10**8])),
                     grpc.StatusCode.INVALID_ARGUMENT),
    "unknown_model": (generate_pb2.GenerateRequest(model="other", prompt="hi"), grpc.StatusCode.NOT_FOUND),
    "stop_past_the_cap": (generate_pb2.GenerateRequest(prompt="hi", sampling=generate_pb2.SamplingParams(
        stop=[f"s{i}" for i in range(17)])), grpc.StatusCode.INVALID_ARGUMENT),
    "stop_past_the_cap_with_empty_ones": (generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(stop=["", ""] + [f"s{i}" for i in range(15)])),
        grpc.StatusCode.INVALID_ARGUMENT),
    "schema_nested_past_the_recursion_limit": (generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(json_schema="[" * 200_000)),
        grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("name", list(GRPC_BAD))
def test_grpc_bad_request_gets_precise_status(cluster, name):
    req, code = GRPC_BAD[name]
    with pytest.raises(grpc.RpcError) as e:
        _grpc_generate(cluster, req)
    assert e.value.code() == code and e.value.details()
    ok = _grpc_generate(cluster, generate_pb2.GenerateRequest(
        prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=2)))
    assert ok[-1].finish_reason in ("stop", "length")


def test_grpc_errors_carry_what_http_headers_and_bodies_say(cluster):
    """A refused call's trailing metadata names the request (x-request-id) and the
    error's code (as HTTP's body does: here invalid_json_schema); a caller's request id
    that metadata cannot carry (a newline) is answered under the router's own instead of
    failing the whole call after it ran."""
    bad = generate_pb2.GenerateRequest(prompt="hi", request_id="mine",
                                       sampling=generate_pb2.SamplingParams(json_schema="[" * 200_000))
    with pytest.raises(grpc.RpcError) as e:
        _grpc_generate(cluster, bad)
    trailing = dict(e.value.trailing_metadata())
    assert trailing["x-request-id"] == "mine" and trailing["pdserve-error-code"] == "invalid_json_schema"
    assert "Recursion" not in e.value.details()
    odd = _grpc_generate(cluster, generate_pb2.GenerateRequest(
        prompt="hi", request_id="bad\nid", sampling=generate_pb2.SamplingParams(max_tokens=2)))
    assert odd[-1].request_id == "bad\nid" and odd[-1].finish_reason in ("stop", "length")


def test_grpc_streamed_usage_counts_the_tokens_sent_so_far(cluster):
    """Each message's usage counts its choice's tokens the caller has been sent, not
    those made and still queued behind them."""
    messages = _grpc_generate(cluster, generate_pb2.GenerateRequest(
        prompt="Count:", n=2, sampling=generate_pb2.SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)))
    sent = [0, 0]
    for m in messages:
        sent[m.index] += len(m.token_ids)
        assert m.usage.completion_tokens == sent[m.index]
    assert sent == [24, 24]


def test_a_lone_surrogate_is_named_without_tokenizer_internals(cluster):
    r = _post(cluster, "/v1/chat/completions", content=BAD_CHAT["lone_surrogate"])
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_unicode" and "U+D800" in err["message"], err
    assert "tokeniz" not in err["message"].lower() and "Traceback" not in err["message"]


def test_a_huge_prompt_stalls_nobody(cluster):
    """An 8 MB prompt is refused by size before any tokenizing, and one just under the
    size check is tokenized off the event loop: /ready answers at once meanwhile."""
    import threading
    import time
    results = {}

    def big(name, chars):
        t0 = time.monotonic()
        r = _post(cluster, "/v1/completions", json={"prompt": "lorem ipsum " * (chars // 12), "max_tokens": 1})
        results[name] = (r.status_code, r.json()["error"].get("code") if r.status_code >= 400 else None,
                         time.monotonic() - t0)

    threads = [threading.Thread(target=big, args=("8MB", 8_000_000)),
               threading.Thread(target=big, args=("500KB", 500_000))]
    for t in threads:
        t.start()
    waits = []
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        assert httpx.get(f"{cluster.http}/ready", timeout=10).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.02)
    for t in threads:
        t.join()
    print(f"\n8 MB prompt answered in {results['8MB'][2]:.2f} s, 500 KB in {results['500KB'][2]:.2f} s; "
          f"{len(waits)} /ready calls meanwhile, slowest {max(waits) * 1000:.0f} ms")
    assert results["8MB"][:2] == (400, "context_length_exceeded") and results["8MB"][2] < 5, results
    assert results["500KB"][:2] == (400, "context_length_exceeded"), results      # ~85,000 tokens
    assert max(waits) < 0.5, waits


def _raw_chat(fields: str) -> bytes:
    """A chat body with `fields` spliced in as JSON text, for what json.dumps cannot write."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + fields + "}").encode()


# Edges a hostile client found: each once answered 500 (or 200 with a guess). Path, body,
# the field the error must name, and a piece of its message.
HOSTILE = {
    "max_tokens_of_5000_digits": ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
                                  "max_tokens", "5000 digits"),
    "token_id_of_5000_digits": ("/detokenize", b'{"tokens": [1, ' + b"9" * 5000 + b"]}", "tokens.1", "5000 digits"),
    "top_k_past_int32": ("/v1/chat/completions", {"messages": MSG, "top_k": 2**31}, "top_k", "2147483647"),
    "top_k_past_int64": ("/v1/completions", {"prompt": "hi", "top_k": 2**64}, "top_k", "2147483647"),
    "seed_past_64_bits": ("/v1/chat/completions", {"messages": MSG, "seed": 2**64}, "seed", "64-bit"),
    "seed_below_int64": ("/v1/completions", {"prompt": "hi", "seed": -2**63 - 1}, "seed", "64-bit"),
    "temperature_past_float32": ("/v1/chat/completions", {"messages": MSG, "temperature": 1e300}, "temperature",
                                 "1e+300"),
    "stop_lone_surrogate": ("/v1/chat/completions", _raw_chat(r'"stop": "\ud800"'), "stop", "U+D800"),
    "stop_list_lone_surrogate": ("/v1/completions", br'{"prompt": "hi", "stop": ["a", "\udfff"]}', "stop.1",
                                 "U+DFFF"),
    "stop_lone_surrogate_streamed": ("/v1/chat/completions", _raw_chat(r'"stream": true, "stop": "\ud800"'), "stop",
                                     "U+D800"),
    "model_lone_surrogate": ("/v1/chat/completions", _raw_chat(r'"model": "x\ud800"'), "model", "U+D800"),
    "model_lone_surrogate_tokenize": ("/tokenize", br'{"model": "\ud800", "prompt": "hi"}', "model", "U+D800"),
    "user_lone_surrogate": ("/v1/chat/completions", _raw_chat(r'"user": "\ud800"'), "user", "U+D800"),
    "message_name_lone_surrogate": ("/v1/chat/completions",
                                    br'{"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}',
                                    "messages.0.name", "U+D800"),
    "logit_bias_key_lone_surrogate": ("/v1/chat/completions", _raw_chat(r'"logit_bias": {"\ud800": 1}'),
                                      "logit_bias", "U+D800"),
    "schema_key_lone_surrogate": ("/v1/chat/completions", _raw_chat(
        r'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
        r'{"type": "object", "properties": {"\ud800": {"type": "string"}}}}}'),
        "response_format.json_schema.schema.properties", "U+D800"),
    "logit_bias_key_not_ascii_digits": ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"\u0665": 1}},
                                        "logit_bias", "decimal digits"),
    "stop_past_the_cap": ("/v1/chat/completions", {"messages": MSG, "stop": [f"s{i}" for i in range(17)]}, "stop",
                          "16"),
    "temperature_true": ("/v1/chat/completions", {"messages": MSG, "temperature": True}, "temperature", "number"),
    "top_p_true": ("/v1/completions", {"prompt": "hi", "top_p": True}, "top_p", "number"),
    "min_p_false": ("/v1/chat/completions", {"messages": MSG, "min_p": False}, "min_p", "number"),
    "presence_penalty_true": ("/v1/chat/completions", {"messages": MSG, "presence_penalty": True}, "presence_penalty",
                              "number"),
    "logit_bias_value_true": ("/v1/chat/completions", {"messages": MSG, "logit_bias": {"5": True}}, "logit_bias.5",
                              "number"),
    "temperature_numeric_string": ("/v1/chat/completions", {"messages": MSG, "temperature": "0.5"}, "temperature",
                                   "number"),
    "priority_not_zero": ("/v1/completions", {"prompt": "hi", "priority": -1}, "priority", "not enabled"),
    # Named as the request spells them, not by pydantic's names for a union's members.
    "image_part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        "messages.0.content", "part 1 is of type 'image_url'"),
    "tool_choice_allowed_tools": ("/v1/chat/completions", {"messages": MSG, "tool_choice": {
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}}, "tool_choice.allowed_tools",
        "Unrecognized"),
    "stream_options_without_stream": ("/v1/chat/completions", {"messages": MSG, "stream_options": {
        "include_usage": True}}, "stream_options", "only allowed when stream is true"),
    "store_true": ("/v1/chat/completions", {"messages": MSG, "store": True}, "store", "keeps no completions"),
    "audio_output": ("/v1/chat/completions", {"messages": MSG, "audio": {"voice": "alloy", "format": "wav"}},
                     "audio", "not supported"),
    "audio_modality": ("/v1/chat/completions", {"messages": MSG, "modalities": ["text", "audio"]},
                       "modalities.1", "'text'"),
    "an_earlier_answers_audio": ("/v1/chat/completions", {"messages": [
        {"role": "assistant", "content": "hi", "audio": {"id": "audio_1"}}, *MSG]}, "messages.0.audio",
        "not supported"),
    "suffix": ("/v1/completions", {"prompt": "def f(", "suffix": "return 1"}, "suffix", "not supported"),
    "completion_past_the_context": ("/v1/completions", {"prompt": LONG}, "prompt", "8192"),
    "completion_and_max_tokens_past_the_context": ("/v1/completions", {"prompt": "hello " * 4000,
                                                                       "max_tokens": 5000}, "prompt", "8192"),
    "second_prompt_past_the_context": ("/v1/completions", {"prompt": ["hi", LONG]}, "prompt.1", "8192"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_field_gets_400_naming_it_and_server_keeps_serving(cluster, name):
    path, body, param, fragment = HOSTILE[name]
    r = _post(cluster, path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and fragment in err["message"], err
    ok = _post(cluster, "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2, "stop": ["\U0001F600"],
                                                       "temperature": 1, "top_k": 2**31 - 1, "priority": 0})
    assert ok.status_code == 200, ok.text


def test_a_valid_surrogate_pair_is_one_character(cluster):
    """An escaped pair (how ensure_ascii JSON writes an emoji) is no lone surrogate."""
    pair = r"\ud83d\ude00"
    r = _post(cluster, "/v1/chat/completions", content=_raw_chat(f'"stop": ["{pair}"], "user": "{pair}"'))
    assert r.status_code == 200, r.text


def _grpc_raw(cluster, payload: bytes):
    """Generate with `payload` sent as the request's bytes, whatever they are."""
    with grpc.insecure_channel(cluster.grpc) as ch:
        return list(ch.unary_stream("/pdserve.v1.Generator/Generate")(payload, timeout=60))


GOOD_GRPC = generate_pb2.GenerateRequest(prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=2))


UNDECODABLE = {             # bytes that are no GenerateRequest, and a piece of the error
    "invalid_utf8_in_a_string": (GOOD_GRPC.SerializeToString().replace(b"hi", b"\xff\xfe"), "bad UTF-8"),
    "corrupt": (b"\xff\xff\xff", "corrupt"),
    "truncated": (GOOD_GRPC.SerializeToString()[:-1], "GenerateRequest"),
}


@pytest.mark.parametrize("name", list(UNDECODABLE))
def test_grpc_undecodable_request_is_invalid_argument(cluster, name):
    payload, fragment = UNDECODABLE[name]
    with pytest.raises(grpc.RpcError) as e:
        _grpc_raw(cluster, payload)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in e.value.details(), e.value.details()
    assert _grpc_raw(cluster, GOOD_GRPC.SerializeToString())


@pytest.mark.parametrize("role,method", [("decode", "/pdserve.v1.DecodeWorker/Decode"),
                                         ("decode", "/pdserve.v1.DecodeWorker/Reserve"),
                                         ("prefill", "/pdserve.v1.PrefillWorker/Prefill")])
def test_worker_undecodable_request_is_invalid_argument(cluster, role, method):
    """The workers share the router's gRPC server code: a corrupt message from a caller
    holding the cluster credential is its mistake, named, and the worker serves on."""
    truncated = b"\x0a\x05ab"                   # field 1: five bytes promised, two sent
    with cluster.worker_channel(role) as ch:
        with pytest.raises(grpc.RpcError) as e:
            if method.endswith("/Decode"):
                list(ch.unary_stream(method)(truncated, timeout=30))
            else:
                ch.unary_unary(method)(truncated, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "corrupt" in e.value.details(), e.value.details()
    assert cluster.stats(role).info.max_model_len > 0
    assert _grpc_raw(cluster, GOOD_GRPC.SerializeToString())


def test_grpc_requests_are_held_to_the_http_bodys_size_and_ids_to_the_context_first(cluster):
    """A Generate message is taken up to the HTTP body's 8 MiB (the cluster's own calls
    take 64 MiB: KV handles); token ids past the context are refused before they are
    walked (40 MB of them held the router's event loop for 5 s)."""
    huge = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=[1000] * 5_000_000),
                                        sampling=generate_pb2.SamplingParams(max_tokens=2))
    assert huge.ByteSize() > 8 * 2**20
    with pytest.raises(grpc.RpcError) as e:
        _grpc_generate(cluster, huge)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    long = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=[1000] * 1_000_000),
                                        sampling=generate_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as e:
        _grpc_generate(cluster, long)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length" in e.value.details()


def test_grpc_200000_stop_strings_are_refused(cluster):
    """The HTTP API's cap on stop strings holds over gRPC."""
    req = generate_pb2.GenerateRequest(prompt="hi", sampling=generate_pb2.SamplingParams(
        max_tokens=2, stop=[f"stop {i}" for i in range(200_000)]))
    with pytest.raises(grpc.RpcError) as e:
        _grpc_generate(cluster, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 16 stop" in e.value.details()
    ok = _grpc_generate(cluster, generate_pb2.GenerateRequest(prompt="hi", sampling=generate_pb2.SamplingParams(
        max_tokens=2, stop=[f"s{i}" for i in range(16)], top_k=2**31 - 1)))
    assert ok[-1].finish_reason in ("stop", "length")
