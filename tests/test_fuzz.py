"""Property-based fuzzing of both public APIs against a real local cluster: the HTTP API
with schemathesis, from the router's own OpenAPI schema (plus raw bytes for bodies no
schema describes), and the gRPC Generate API with hypothesis. Every answer must be a 2xx
or a clear 4xx (gRPC: a status naming the caller's mistake), never a 5xx, INTERNAL, a
hang or a dead process; afterwards the cluster still serves and no KV block is held.

`make test` runs PDSERVE_FUZZ_EXAMPLES (default 5) examples per case, the Responses API and
schemathesis' coverage phase aside; `make test-slow` runs many more, and both. The cluster serves a 48-token context (the chat template alone takes
~30), so every valid request is quick.
"""
from __future__ import annotations

import collections
import json
import os

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.rpc import generate_pb2, generate_pb2_grpc
from tests.processes import start_cluster, stop_cluster

pytestmark = pytest.mark.fuzz

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "5"))
REPORT = os.environ.get("PDSERVE_FUZZ_REPORT")           # a JSON file for the answers counted
TALLY: collections.Counter = collections.Counter()       # (case kind, status) -> answers
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
# What a caller's mistake may be answered with; anything else (INTERNAL, UNKNOWN,
# UNAVAILABLE) is the server's failure.
CALLER_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                 grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def fuzz_cluster(model_dir):
    # Its services started by exec (--no-fork-server): that path's end-to-end check, the
    # other clusters' are forked (services/forkserver.py).
    c = start_cluster("--max-model-len", "48", "--no-fork-server")
    assert "\0-m\0services.cli\0decode\0" in open(f"/proc/{c.info['decode']['pid']}/cmdline").read()
    yield c
    counts = {f"{kind} {status}": n for (kind, status), n in sorted(TALLY.items())}
    print(f"\nfuzzing: {sum(TALLY.values())} answers at {EXAMPLES} examples per case: {counts}")
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump({"examples_per_case": EXAMPLES, "answers": counts}, f, indent=1)
    try:                                     # the cluster outlived the fuzzing, holding nothing
        r = httpx.post(f"{c.http}/v1/completions", timeout=60, json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        s = c.wait_idle()
        assert s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0
    finally:
        stop_cluster(c)


@pytest.fixture(scope="module")
def api_schema(fuzz_cluster):
    schema = schemathesis.openapi.from_url(f"{fuzz_cluster.http}/openapi.json")
    if "PDSERVE_FUZZ_EXAMPLES" not in os.environ:
        # Schemathesis' coverage phase (every field's boundaries, whatever the examples:
        # ~40 s for the chat API alone) runs under make test-slow; by default, the
        # schema's examples and PDSERVE_FUZZ_EXAMPLES fuzzed cases.
        schema.config.phases.update(phases=["examples", "fuzzing"])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")
if "PDSERVE_FUZZ_EXAMPLES" not in os.environ:
    # The Responses API's many optional fields make schemathesis' coverage phase its
    # longest case (~70 s whatever the examples): fuzzed under make test-slow (which
    # sets PDSERVE_FUZZ_EXAMPLES); by default its own tests cover it (test_api_clients).
    schema = schema.exclude(path="/v1/responses")


def _clear_4xx(response, kind: str) -> None:
    TALLY[kind, response.status_code] += 1
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error


@schema.parametrize()
@FUZZ
def test_http_api_answers_2xx_or_a_clear_4xx(case, fuzz_cluster):
    _clear_4xx(case.call(base_url=fuzz_cluster.http, timeout=120), "http schema")


# Bodies that once got a 500: an integer past Python's digit limit, an int32 overflow on
# the way to the workers, lone surrogates where no prompt check looked.
HOSTILE_BODIES = [
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "hi", "max_tokens": 2, "top_k": 2147483648}',
    b'{"prompt": "hi", "max_tokens": 2, "stop": "\\ud800"}',
    b'{"prompt": "hi", "max_tokens": 2, "stream": true, "stop": ["\\udc00"]}',
    b'{"prompt": "hi", "max_tokens": 2, "model": "\\ud800"}',
    b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"\\ud800": 1}}',
]


def _examples(cases: list[dict]):
    """Hypothesis' @example for each of `cases`: run every time, whatever the budget."""
    def add(test):
        for case in cases:
            test = example(**case)(test)
        return test
    return add


@FUZZ
@given(body=st.binary(max_size=2048) | st.text(max_size=512).map(str.encode),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@_examples([{"body": body, "path": "/v1/completions"} for body in HOSTILE_BODIES])
def test_http_api_answers_any_bytes_with_a_4xx(fuzz_cluster, body, path):
    r = httpx.post(f"{fuzz_cluster.http}{path}", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    _clear_4xx(r, "http bytes")
    assert 400 <= r.status_code < 500 or r.status_code == 200, (r.status_code, r.text[:300], body[:80])


floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
sampling = st.builds(
    generate_pb2.SamplingParams,
    max_tokens=st.none() | st.integers(0, 2**32 - 1), temperature=st.none() | floats, top_p=st.none() | floats,
    top_k=st.none() | st.integers(-2**31, 2**31 - 1), seed=st.none() | st.integers(0, 2**64 - 1),
    stop=st.lists(st.text(max_size=8), max_size=20), ignore_eos=st.booleans(), min_tokens=st.integers(0, 2**32 - 1))
messages = st.lists(st.builds(generate_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", "x"]),
                              content=st.text(max_size=200)), max_size=4)
inputs = st.one_of(
    st.builds(lambda p: {"prompt": p}, st.text(max_size=300)),
    st.builds(lambda m: {"chat": generate_pb2.ChatMessages(messages=m)}, messages),
    st.builds(lambda ids: {"prompt_token_ids": generate_pb2.TokenIds(ids=ids)},
              st.lists(st.integers(0, 2**32 - 1), max_size=80)),
    st.just({}))


@FUZZ
@given(inp=inputs, params=st.none() | sampling, model=st.sampled_from(["", "SmolLM2-135M-Instruct", "other"]))
def test_grpc_generate_answers_ok_or_a_caller_error(fuzz_cluster, inp, params, model):
    request = generate_pb2.GenerateRequest(model=model, **inp, **({"sampling": params} if params else {}))
    with grpc.insecure_channel(fuzz_cluster.grpc) as ch:
        try:
            for _ in generate_pb2_grpc.GeneratorStub(ch).Generate(request, timeout=120):
                pass
            TALLY["grpc", "OK"] += 1
        except grpc.RpcError as exc:
            TALLY["grpc", exc.code().name] += 1
            assert exc.code() in CALLER_ERRORS and exc.details(), (exc.code(), exc.details(), request)


GENERATE_BYTES = generate_pb2.GenerateRequest(prompt="Hi", sampling=generate_pb2.SamplingParams(
    max_tokens=2)).SerializeToString()


@FUZZ
@given(payload=st.binary(max_size=512) | st.binary(max_size=64).map(lambda tail: GENERATE_BYTES + tail))
@example(payload=GENERATE_BYTES.replace(b"Hi", b"\xffH"))            # a string field that is not UTF-8
@example(payload=b"\xff\xff\xff")                                      # no message at all
@example(payload=GENERATE_BYTES[:-1])                                  # cut short
def test_grpc_generate_answers_any_bytes_with_ok_or_a_caller_error(fuzz_cluster, payload):
    """Bytes that may be no GenerateRequest: decoding is the server's to refuse, by name."""
    with grpc.insecure_channel(fuzz_cluster.grpc) as ch:
        try:
            for _ in ch.unary_stream("/pdserve.v1.Generator/Generate")(payload, timeout=120):
                pass
            TALLY["grpc bytes", "OK"] += 1
        except grpc.RpcError as exc:
            TALLY["grpc bytes", exc.code().name] += 1
            assert exc.code() in CALLER_ERRORS and exc.details(), (exc.code(), exc.details(), payload[:80])
