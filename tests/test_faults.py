"""Fault tests with real processes: a worker killed mid-handoff, a dropped transfer, a
lapsed lease and a replayed handle from before a restart. In every case the client gets
a clear error or a correct answer (local prefill on the decode worker, counted as a
fallback) within the lease, nothing hangs, and both block pools return to full."""
from __future__ import annotations

import json
import re
import threading
import time

import grpc
import httpx
import pytest

from services.common.shm import live_segments
from services.rpc import worker_pb2, worker_pb2_grpc
from tests.processes import Services, free_port, spawn_service, terminate, wait_ready, worker_stats

LONG = [{"role": "user", "content": "Summarise: " + "the tide comes in and the tide goes out. " * 120}]
OTHER_LONG = [{"role": "user", "content": "Summarise: " + "the wind rises and the wind falls again. " * 120}]


@pytest.fixture(scope="module")
def svc(model_dir):
    s = Services().start_all()
    yield s
    s.stop()


def chat(svc, messages, **kw):
    body = {"messages": messages, "temperature": 0, "return_token_ids": True, "max_tokens": 8, **kw}
    return httpx.post(f"{svc.http}/v1/chat/completions", json=body, timeout=120)


def route(r) -> dict:
    return dict(p.split("=", 1) for p in r.headers["x-pdserve-route"].split(";"))


def assert_pools_full(svc):
    d = svc.wait_idle()
    assert d.info.free_blocks == d.info.num_blocks and d.active_handoffs == 0
    p = svc.stats("prefill")
    assert p.info.free_blocks == p.info.num_blocks


def wait_prefill_busy(svc, timeout=30):
    deadline = time.monotonic() + timeout
    while svc.stats("prefill").info.waiting == 0:
        assert time.monotonic() < deadline, "prefill never started"
        time.sleep(0.02)


def test_killing_the_prefill_worker_mid_transfer_falls_back_to_local_prefill(svc):
    # A prompt the prefill worker has not seen: one it has cached would be done at once.
    result = {}
    t = threading.Thread(target=lambda: result.update(r=chat(svc, OTHER_LONG)))
    t0 = time.monotonic()
    t.start()
    wait_prefill_busy(svc)
    time.sleep(0.3)                                   # layers are being written now
    svc.kill("prefill")
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert route(r)["decision"] == "local_fallback"
    assert time.monotonic() - t0 < 60
    assert svc.stats("decode").prompt_tokens_computed > 0      # the fallback ran on the decode worker
    metrics = httpx.get(f"{svc.http}/metrics").text
    assert 'pdserve_disaggregation_decisions_total{decision="local_fallback"}' in metrics
    d = svc.wait_idle()
    assert d.info.free_blocks == d.info.num_blocks and d.active_handoffs == 0
    svc.start_worker("prefill")
    svc.wait_routable()
    ref = chat(svc, OTHER_LONG)                       # the same prompt through a new prefill worker
    assert ref.status_code == 200 and route(ref)["decision"] == "remote"
    assert r.json()["choices"][0]["token_ids"] == ref.json()["choices"][0]["token_ids"]
    assert_pools_full(svc)


@pytest.mark.slow          # the fallback itself: the prefill worker killed mid-transfer, above
def test_dropped_transfers_fall_back_and_answers_stay_correct(svc):
    prompts = [[{"role": "user", "content": f"Give me fact number {i} about owls."}] for i in range(6)]
    refs = [chat(svc, p).json()["choices"][0]["token_ids"] for p in prompts]
    svc.kill("prefill", sig=15)
    svc.start_worker("prefill", "--fault-drop-transfers", "0.5")
    svc.wait_routable()
    decisions = []
    for p, ref in zip(prompts, refs):
        r = chat(svc, p)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref
        decisions.append(route(r)["decision"])
    assert "local_fallback" in decisions and "remote" in decisions
    assert_pools_full(svc)
    svc.kill("prefill", sig=15)
    svc.start_worker("prefill")
    svc.wait_routable()


def test_a_lapsed_lease_returns_the_blocks(svc):
    with svc.channel("decode") as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        total = stub.Info(worker_pb2.InfoRequest()).num_blocks
        h = stub.Reserve(worker_pb2.ReserveRequest(request_id="orphan", num_prompt_tokens=100, lease_seconds=0.5))
        assert stub.Info(worker_pb2.InfoRequest()).free_blocks == total - len(h.block_ids)
        deadline = time.monotonic() + 10                 # lease 0.5 s + 2 s grace
        while stub.Info(worker_pb2.InfoRequest()).free_blocks != total:
            assert time.monotonic() < deadline, "expired reservation was not reclaimed"
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(worker_pb2.DecodeRequest(request_id="orphan", epoch=h.epoch,
                                                      prompt_token_ids=[1] * 100, first_token_id=5,
                                                      sampling=_sampling())))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def _sampling(max_tokens: int = 4):
    from services.rpc import generate_pb2
    return generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, top_p=1.0)


@pytest.mark.slow       # a dead decode worker's streams: test_supervision.py's check runs by default
def test_killing_the_decode_worker_mid_stream_ends_the_stream_and_its_old_handles(svc):
    """The stream it carried ends with an error event; while it is down requests fail
    fast; restarted at the same address it serves within 2 s; and a reservation made
    before the restart is refused everywhere (its epoch is gone)."""
    with svc.channel("decode") as ch:
        old = worker_pb2_grpc.DecodeWorkerStub(ch).Reserve(
            worker_pb2.ReserveRequest(request_id="stale", num_prompt_tokens=40, lease_seconds=60))
    body = {"messages": LONG[:1], "max_tokens": 2000, "ignore_eos": True, "stream": True, "temperature": 0}
    lines = []
    t0 = time.monotonic()
    with httpx.stream("POST", f"{svc.http}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 12:
                decode_pid = svc.info["decode"]["pid"]
                svc.kill("decode")
    assert time.monotonic() - t0 < 60
    assert [x for x in lines if x][-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "error" in events[-1] and events[-1]["error"]["message"]
    p = svc.stats("prefill")
    assert p.info.free_blocks == p.info.num_blocks
    # While it is down, requests fail fast and clearly, and the router's channel to it
    # keeps failing to connect (gRPC's default backoff grew to 7-10 s here).
    down = time.monotonic()
    while time.monotonic() - down < 5:
        assert chat(svc, [{"role": "user", "content": "hello"}], max_tokens=1).status_code == 503
        time.sleep(0.25)
    # Restarted at the same address, as up or a supervisor does: whole again within 2 s of
    # its serving. The dead worker's shared memory is swept by its successor.
    svc.start_worker("decode")
    serving = time.monotonic()
    assert not live_segments(decode_pid)
    while (r := chat(svc, [{"role": "user", "content": "hello"}], max_tokens=1)).status_code != 200:
        assert r.status_code == 503, r.text
        time.sleep(0.05)
    assert time.monotonic() - serving < 2.0
    _old_handle_is_refused(svc, old)
    svc.wait_routable()
    assert_pools_full(svc)


def _old_handle_is_refused(svc, old: worker_pb2.KVHandle) -> None:
    """A handle from before the decode worker's restart: its Decode and Release are
    refused, and a prefill worker handed it cannot reach the old memory (a clear error,
    no write)."""
    with svc.channel("decode") as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        info = stub.Info(worker_pb2.InfoRequest())
        assert info.epoch != old.epoch
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Decode(worker_pb2.DecodeRequest(request_id="stale", epoch=old.epoch,
                                                      prompt_token_ids=[1] * 40, first_token_id=5,
                                                      sampling=_sampling())))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in e.value.details()
        assert not stub.Release(worker_pb2.ReleaseRequest(request_id="stale", epoch=old.epoch)).released
    with svc.channel("prefill") as ch:
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
                request_id="stale", prompt_token_ids=[1] * 40, sampling=_sampling(), handle=old), timeout=30)
        assert e.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION)


def test_a_decode_worker_lost_after_the_first_token_went_out_is_continued_from_it(svc):
    """A remote prefill's first token goes to the client at once, before a decode worker
    takes the sequence. When that worker is then lost (here one that answers every
    Decode UNAVAILABLE), the request goes on on another decode worker from the token
    already sent: the client's tokens are those of a healthy route, none twice, and every
    block on all three workers goes back. A decode worker also continues a prompt from a
    given first token itself (the retry's local prefill)."""
    prompts = [[{"role": "user", "content": f"Name {i} birds that live near the sea."}] for i in range(2, 8)]
    answers = [chat(svc, p).json() for p in prompts]
    refs = [a["choices"][0]["token_ids"] for a in answers]
    faulty_port = free_port()
    faulty, _ = spawn_service(svc.tmp, "decode-faulty", "decode", [
        *svc.common, "--port", str(faulty_port), "--kv-cache-tokens", "8192", "--fault-refuse-decodes", "1000"])
    router = None
    try:
        router, info = spawn_service(svc.tmp, "router-two-decode", "router", [
            "--http-port", "0", "--grpc-port", "0", "--log-level", "warning", "--cluster-secret-file",
            svc.secret_file, "--local-prefill-max-tokens", "0", "--decode", f"127.0.0.1:{faulty_port}",
            "--decode", svc.addr("decode"), "--prefill", svc.addr("prefill")])
        http = f"http://127.0.0.1:{info['http_port']}"
        wait_ready(http, {"prefill": 1, "decode": 2})
        retries = 0.0
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            # Each its own salt: the healthy decode worker keeps every finished answer's
            # blocks (the chat template's among them), and prefix-aware routing would send
            # each prompt to it, never to the faulty one.
            body = {"messages": p, "temperature": 0, "return_token_ids": True, "max_tokens": 8,
                    "cache_salt": f"prompt-{i}"}
            r = httpx.post(f"{http}/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref
            assert route(r)["decision"] == "remote"
            retries = float(re.search(r"^pdserve_request_retries_total ([0-9.]+)$",
                                      httpx.get(f"{http}/metrics").text, re.M)[1])
            if retries >= 2:
                break
        assert retries >= 2, "no request was routed to the refusing decode worker"
        faulty_stats = worker_stats(f"127.0.0.1:{faulty_port}", "decode", svc.secret_file)
        assert faulty_stats.info.free_blocks == faulty_stats.info.num_blocks
        assert faulty_stats.active_handoffs == 0
    finally:
        for proc in (router, faulty):
            if proc is not None:
                terminate(proc)
    # The worker side of a local retry: the prompt and the given first token computed
    # there, decoding on from the second token.
    ids = answers[0]["prompt_token_ids"]
    with svc.channel("decode") as ch:
        chunks = list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(worker_pb2.DecodeRequest(
            request_id="given-first", prompt_token_ids=ids, first_token_id=refs[0][0], local_prefill=True,
            first_token_given=True, sampling=_sampling(max_tokens=8)), timeout=120))
    assert [t for c in chunks for t in c.token_ids] == refs[0][1:]
    assert chunks[-1].finish_reason == "length"
    assert_pools_full(svc)

