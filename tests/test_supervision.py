"""A cluster that outlives its parts, with real processes: a decode worker SIGKILLed under
streaming load (the streams it carried end with an error event and [DONE], every other
stream completes, `pdserve up` starts it again, and its shared memory is gone), and a
poisoned call sent straight to a decode worker beside good requests (refused on its own;
the batch it would have joined goes on)."""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time

import grpc
import httpx

from services.common.shm import live_segments
from services.rpc import generate_pb2, worker_pb2, worker_pb2_grpc
from tests.processes import pid_alive, start_cluster, stop_cluster

TOKENS = 40                      # long enough to be mid-stream when the worker dies


def stream(http: str, i: int, out: dict) -> None:
    """One streamed chat completion, recorded as its SSE events (JSON, or "[DONE]")."""
    events = []
    body = {"messages": [{"role": "user", "content": f"Tell story number {i} about a lighthouse."}],
            "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "stream": True}
    try:
        with httpx.stream("POST", f"{http}/v1/chat/completions", json=body, timeout=300) as r:
            out[i] = {"status": r.status_code, "events": events}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    except httpx.HTTPError as exc:
        out[i] = {"status": None, "events": events, "exception": repr(exc)}


def decoded_tokens(events: list) -> int:
    return sum(1 for e in events if isinstance(e, dict) and e.get("choices")
               and e["choices"][0].get("delta", {}).get("content"))


def test_one_dead_decode_worker_fails_only_its_own_streams_and_comes_back(model_dir):
    # Aggregated: no prefill worker to start (test_faults kills one mid-transfer).
    c = start_cluster("--mode", "aggregated", "--decode", "2")
    try:
        decodes = [w["pid"] for w in c.info["decodes"]]
        victim = decodes[0]
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=stream, args=(c.http, i, results)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while sum(decoded_tokens(r["events"]) > 5 for r in results.values()) < 6:   # every stream flowing
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.1)
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(300)
        failed = [r for r in results.values() if any(isinstance(e, dict) and "error" in e for e in r["events"])]
        done = [r for r in results.values() if r not in failed]
        assert failed and done, results                     # both workers carried streams
        for r in results.values():
            assert r["status"] == 200 and r["events"][-1] == "[DONE]", r
        for r in done:                                      # the surviving worker's streams are whole
            finish = [e["choices"][0]["finish_reason"] for e in r["events"]
                      if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")]
            assert finish == ["length"] and decoded_tokens(r["events"]) >= TOKENS - 5, r["events"][-3:]
        for r in failed:                                    # a clear error, nothing after it but [DONE]
            err = next(e for e in r["events"] if isinstance(e, dict) and "error" in e)
            assert "unavailable" in err["error"]["message"]
            assert r["events"].index(err) == len(r["events"]) - 2
        assert not pid_alive(victim) and live_segments(victim) == []
        deadline = time.monotonic() + 120                   # `up` starts it again; it serves
        while True:
            info = json.loads(open(c.proc.args[c.proc.args.index("--announce-file") + 1]).read())
            pids = [w.get("pid") for w in info["decodes"]]
            metrics = httpx.get(f"{c.http}/metrics").text
            if victim not in pids and 'pdserve_pool_workers{role="decode"} 2.0' in metrics:
                break
            assert time.monotonic() < deadline, (pids, c.log_path.read_text()[-2000:])
            time.sleep(0.5)
        assert "starting it again" in c.log_path.read_text()
        assert httpx.get(f"{c.http}/ready").status_code == 200
        ok = [httpx.post(f"{c.http}/v1/completions", timeout=120,
                         json={"prompt": f"Count to {n}:", "max_tokens": 4}).status_code for n in range(4)]
        assert ok == [200] * 4
    finally:
        stop_cluster(c)


def _decode_call(stub, request_id: str, prompt: list[int], **sampling):
    sampling = {"max_tokens": 4, "top_p": 1.0, **sampling}
    req = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, local_prefill=True,
                                   sampling=generate_pb2.SamplingParams(**sampling))
    return list(stub.Decode(req, timeout=60))


def test_a_poisoned_call_to_a_decode_worker_fails_alone(cluster, expected):
    """NaN temperature and an id past the vocabulary, sent straight to the decode worker
    while good requests stream through the router next to them: INVALID_ARGUMENT for the
    bad calls, and the good requests' output is generate's, token for token."""
    from tests.parity_cases import CASES
    good = [case for case in CASES if not case.stop][:3]
    results: dict[str, list[int]] = {}

    def run(case) -> None:
        r = httpx.post(f"{cluster.http}/v1/chat/completions", timeout=300, json={
            "messages": case.messages, "max_tokens": case.max_tokens, "temperature": 0, "return_token_ids": True})
        results[case.name] = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else [r.status_code]

    threads = [threading.Thread(target=run, args=(case,)) for case in good]
    for t in threads:
        t.start()
    with cluster.worker_channel("decode") as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        poisons = [("nan-temperature", [1, 2, 3], {"temperature": math.nan}),
                   ("inf-temperature", [1, 2, 3], {"temperature": math.inf}),
                   ("nan-top-p", [1, 2, 3], {"top_p": math.nan}),
                   ("past-vocabulary", [1, 2, 10_000_000], {"temperature": 0})]
        for name, prompt, sampling in poisons:
            try:
                _decode_call(stub, name, prompt, **sampling)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, exc.details())
            else:
                raise AssertionError(f"{name} was accepted")
    for t in threads:
        t.join(300)
    for case in good:
        assert results[case.name] == expected[case.name].token_ids, case.name
    s = cluster.wait_idle()
    assert s.info.free_blocks == s.info.num_blocks


def test_scaling_in_cancels_a_dead_workers_restart_before_draining_a_live_one(tmp_path):
    """`up --autoscale` resizes a pool down while one of its workers has died and waits
    to be started again (its announce file, kept for its ports, still there): the dead
    one is the one given up, not the live one, which used to be drained and leave the
    pool with nothing serving. Real processes stand in for the workers."""
    import subprocess

    from services.common.settings import ClusterSettings
    from services.local_cluster import LocalCluster
    from services.local_processes import Child
    cluster = LocalCluster(ClusterSettings(device="cpu"))
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        for name, proc, port in (("decode-0", live, 5001), ("decode-1", dead, 5002)):
            announce = tmp_path / f"{name}.json"
            announce.write_text(json.dumps({"pid": proc.pid, "grpc_port": port, "metrics_port": 1}))
            cluster.children.append(Child(name, proc, announce, respawn=lambda: None))
        cluster.pools = {"decode": list(cluster.children), "prefill": []}
        cluster.resize("decode", 1, victims=["127.0.0.1:5001"])      # the planner named the live one
        assert [c.name for c in cluster.pools["decode"]] == ["decode-0"] and live.poll() is None
        assert [c.name for c in cluster.draining_children] == ["decode-1"]
    finally:
        live.kill()
        live.wait()
