"""One client never sees, breaks or frees another's request. A client's own id (gRPC
`request_id`, HTTP `x-request-id`) is echoed back and never reaches a worker: two
clients that send the same id at once each get their own answer, equal to
`model.generate` in float32 greedy, and every KV block comes back. A decode worker sent
a duplicate id straight (no router between) refuses the second call alone."""
from __future__ import annotations

import asyncio
import threading

import grpc
import httpx
import pytest

from services.rpc import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.parity_cases import CASES

# Pairs of different prompts, so one stream carrying the other's tokens shows.
PAIRS = [(CASES[i], CASES[(i + 1) % len(CASES)]) for i in range(len(CASES))]
# The same without the long prompt, whose prefill adds seconds and no other path (the
# session cluster prefills every prompt on its prefill worker).
SHORT = [case for case in CASES if case.name != "long"]
SHORT_PAIRS = [(SHORT[i], SHORT[(i + 1) % len(SHORT)]) for i in range(len(SHORT))]


def _grpc_request(case, request_id: str, n: int = 1) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        chat=generate_pb2.ChatMessages(messages=[generate_pb2.ChatMessage(**m) for m in case.messages]),
        sampling=generate_pb2.SamplingParams(max_tokens=case.max_tokens, temperature=0, stop=case.stop or []),
        request_id=request_id, n=n)


async def _grpc_generate(stub, case, request_id: str, n: int = 1) -> dict[int, list[int]]:
    """Each choice's tokens; the echoed id is checked on every message."""
    tokens: dict[int, list[int]] = {i: [] for i in range(n)}
    async for reply in stub.Generate(_grpc_request(case, request_id, n), timeout=300):
        assert reply.request_id == request_id
        tokens[reply.index].extend(reply.token_ids)
    return tokens


async def _colliding_grpc_pairs(target: str, pairs, n: int = 1) -> list[tuple[str, dict[int, list[int]]]]:
    """Every pair at once; within a pair, both calls carry the same id, the second a
    moment after the first (it lands while the first is decoding)."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = generate_pb2_grpc.GeneratorStub(ch)

        async def pair(k: int, first, second):
            rid = f"dup-{k % 2}"            # ids repeat across pairs too
            a = asyncio.ensure_future(_grpc_generate(stub, first, rid, n))
            await asyncio.sleep(0.2)
            b = await _grpc_generate(stub, second, rid, n)
            return [(first.name, await a), (second.name, b)]

        results = await asyncio.gather(*(pair(k, a, b) for k, (a, b) in enumerate(pairs)))
    return [item for both in results for item in both]


def _check(results, expected) -> None:
    for name, choices in results:
        for index, toks in choices.items():
            assert toks == expected[name].token_ids, (name, index)


def test_grpc_clients_with_the_same_request_id_each_get_their_own_tokens(cluster, expected):
    """Four pairs at once (the hundred pairs, the long prompt among them, are the slow
    test's)."""
    results = asyncio.run(_colliding_grpc_pairs(cluster.grpc, SHORT_PAIRS[:4]))
    assert len(results) == 8
    _check(results, expected)
    results = asyncio.run(_colliding_grpc_pairs(cluster.grpc, SHORT_PAIRS[:2], n=2))     # forked choices too
    _check(results, expected)
    s = cluster.wait_idle()
    assert s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0


@pytest.mark.slow          # the router names HTTP and gRPC requests alike: gRPC above, by default
def test_http_clients_with_the_same_x_request_id_each_get_their_own_tokens(cluster, expected):
    results: dict[int, httpx.Response] = {}

    def run(k: int, case) -> None:
        body = {"messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0,
                "return_token_ids": True, **({"stop": case.stop} if case.stop else {})}
        results[k] = httpx.post(f"{cluster.http}/v1/chat/completions", json=body, timeout=300,
                                headers={"x-request-id": "same-for-all"})

    cases = [case for pair in SHORT_PAIRS[:3] for case in pair]
    threads = [threading.Thread(target=run, args=(k, case)) for k, case in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    ids = set()
    for k, case in enumerate(cases):
        r = results[k]
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-for-all"
        assert r.json()["choices"][0]["token_ids"] == expected[case.name].token_ids, case.name
        ids.add(r.json()["id"])
    assert len(ids) == len(cases)                   # the router's own ids differ
    s = cluster.wait_idle()
    assert s.info.free_blocks == s.info.num_blocks


def _local_decode(stub, request_id: str, prompt: list[int], max_tokens: int):
    req = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, local_prefill=True,
                                   sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                        top_p=1))
    return stub.Decode(req, timeout=120)


def test_a_decode_worker_refuses_an_id_it_is_decoding_already(cluster, expected):
    """Sent straight to the decode worker (local prefill, as the router's callers never
    can): the second call with a live id fails alone with FAILED_PRECONDITION, the first
    streams on with its own tokens, and the pool is whole afterwards."""
    exp = expected["short"]
    with cluster.worker_channel("decode") as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        first = _local_decode(stub, "twin", exp.prompt_ids, len(exp.token_ids))
        tokens = list(next(first).token_ids)            # the first is in the batch now
        with pytest.raises(grpc.RpcError) as caught:
            list(_local_decode(stub, "twin", expected["long"].prompt_ids, 8))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "already" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:    # nor may a reservation shadow it
            stub.Reserve(worker_pb2.ReserveRequest(request_id="twin", num_prompt_tokens=4, lease_seconds=5),
                         timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        tokens += [t for chunk in first for t in chunk.token_ids]
    assert tokens == exp.token_ids
    s = cluster.wait_idle()
    assert s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0


@pytest.mark.slow
def test_a_hundred_colliding_pairs_over_grpc_and_no_block_leaks(cluster, expected):
    """The issue's bar: 100 pairs of concurrent gRPC calls with colliding ids, in waves
    of 8 pairs; every stream carries only its own tokens, and 0 blocks leak."""
    pairs = [PAIRS[k % len(PAIRS)] for k in range(100)]
    for start in range(0, len(pairs), 8):
        _check(asyncio.run(_colliding_grpc_pairs(cluster.grpc, pairs[start:start + 8])), expected)
    s = cluster.wait_idle()
    assert s.info.free_blocks == s.info.num_blocks and s.active_handoffs == 0
