"""Metrics others can read, and what each request leaves behind: vLLM's metric names on
the session's real cluster (router and workers scraped, parsed with prometheus_client's
own text parser), the router's request counter by status for HTTP and gRPC, the Grafana
dashboard's queries against what the services export, and the access log's lines in
both formats."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from services.common.lifecycle import JsonFormatter
from services.common.metrics import RouterMetrics
from services.engine.core.sampling import SamplingParams
from services.router.access import AccessLog, Exchange, logfmt
from services.router.generation import Generation
from services.router.openai_api import create_app
from services.rpc import generate_pb2, generate_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
MODEL = "SmolLM2-135M-Instruct"
GENERATE = "/pdserve.v1.Generator/Generate"
ROUTER_VLLM = {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
               "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
               "vllm:request_success"}
WORKER_VLLM = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"}
VLLM_TYPES = {"vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
              "vllm:e2e_request_latency_seconds": "histogram", "vllm:prompt_tokens": "counter",
              "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
              "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
              "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries": "counter",
              "vllm:prefix_cache_hits": "counter"}


class Scrape:
    """One /metrics page, parsed."""

    def __init__(self, text: str) -> None:
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def value(self, name: str, **labels) -> float:
        """The sum of the samples named `name` whose labels include `labels`."""
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def scrape(url: str) -> Scrape:
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    return Scrape(r.text)


def scrape_all(cluster) -> dict[str, Scrape]:
    return {"router": scrape(f"{cluster.http}/metrics"),
            **{role: scrape(cluster.metrics_url(role)) for role in ("prefill", "decode")}}


def grpc_generate(cluster, **fields) -> grpc.StatusCode:
    with grpc.insecure_channel(cluster.grpc) as ch:
        try:
            list(generate_pb2_grpc.GeneratorStub(ch).Generate(generate_pb2.GenerateRequest(**fields), timeout=120))
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_vllm_metrics_and_request_counts_on_a_real_cluster(cluster):
    client = openai.OpenAI(base_url=f"{cluster.http}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    before = scrape_all(cluster)
    prompt = "A long preamble that repeats, so the prefix cache has whole blocks to find. " * 8
    usages = []
    for _ in range(2):
        usages.append(client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).usage)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=6, stream=True, stream_options={"include_usage": True})
    usages.append([c for c in stream][-1].usage)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert httpx.post(f"{cluster.http}/v1/completions", content=b"{", timeout=30,
                      headers={"content-type": "application/json"}).status_code == 400
    assert httpx.get(f"{cluster.http}/no/such/path", timeout=30).status_code == 404
    assert grpc_generate(cluster, prompt="hi", sampling=generate_pb2.SamplingParams(max_tokens=2)) \
        is grpc.StatusCode.OK
    assert grpc_generate(cluster, prompt="hi", model="no-such-model") is grpc.StatusCode.NOT_FOUND
    after = scrape_all(cluster)

    def delta(service: str, name: str, **labels) -> float:
        return after[service].value(name, **labels) - before[service].value(name, **labels)

    # vLLM's names, types and model_name label, each on the service that owns it.
    for service, names in (("router", ROUTER_VLLM), ("prefill", WORKER_VLLM), ("decode", WORKER_VLLM)):
        for name in names:
            family = after[service].families.get(name)
            assert family is not None, f"{service} does not export {name}"
            assert family.type == VLLM_TYPES[name], (name, family.type)
            assert {s.labels.get("model_name") for s in family.samples} == {model}, (service, name)
    assert {"vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
            "vllm:time_to_first_token_seconds_bucket"} <= after["router"].names()
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"} <= after["prefill"].names()

    # Tokens and requests, counted once per request; the refused ones are not generations.
    generations = len(usages) + 1                                       # and the gRPC one
    assert delta("router", "vllm:prompt_tokens_total") >= sum(u.prompt_tokens for u in usages)
    assert delta("router", "vllm:generation_tokens_total") >= sum(u.completion_tokens for u in usages)
    assert delta("router", "vllm:request_success_total") == generations
    assert delta("router", "vllm:time_to_first_token_seconds_count") == generations
    assert delta("router", "vllm:e2e_request_latency_seconds_count") == generations
    assert delta("router", "vllm:inter_token_latency_seconds_count") > 0
    assert delta("prefill", "vllm:prefix_cache_queries_total") >= sum(u.prompt_tokens for u in usages[:2])
    assert usages[1].prompt_tokens_details.cached_tokens > 0                # the same prompt again
    assert delta("prefill", "vllm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens
                                                                    for u in usages)
    for role in ("prefill", "decode"):
        usage = after[role].value("vllm:kv_cache_usage_perc")
        assert 0.0 <= usage <= 1.0, (role, usage)
        assert after[role].value("vllm:num_requests_running") >= 0

    # The router's request counter, by route and status, for both front ends.
    requests = "pdserve_requests_total"
    assert delta("router", requests, api="/v1/completions", outcome="200") == 2
    assert delta("router", requests, api="/v1/chat/completions", outcome="200") == 1
    assert delta("router", requests, api="/v1/completions", outcome="404") == 1         # unknown model
    assert delta("router", requests, api="/v1/completions", outcome="400") == 1
    assert delta("router", requests, api="other", outcome="404") == 1                   # unknown path
    assert delta("router", requests, api=GENERATE, outcome="OK") == 1
    assert delta("router", requests, api=GENERATE, outcome="NOT_FOUND") == 1


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_every_series_the_dashboard_queries_is_exported(cluster):
    """Run after the test above in the session (or after any request): histograms and
    labelled counters appear once observed."""
    httpx.post(f"{cluster.http}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    exported = set().union(*(s.names() for s in scrape_all(cluster).values()))
    queries = dashboard_queries()
    assert len(queries) >= 10
    named = {m for q in queries for m in re.findall(r"\b((?:pdserve_|vllm:)[a-zA-Z0-9_:]+)", q)}
    assert named and named <= exported, sorted(named - exported)


def test_metrics_answer_a_head_probe(cluster):
    """Load generators (aiperf) probe /metrics with HEAD before they scrape it."""
    r = httpx.head(f"{cluster.http}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain") and not r.content


def test_dashboard_panels_cover_what_operators_look_at():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("status", "first token", "inter-token", "end-to-end", "running", "kv cache", "throughput",
                  "prefix cache", "pool sizes"):
        assert topic in titles, topic
    queries = " ".join(dashboard_queries())
    for q in ("0.5", "0.99"):
        assert f"histogram_quantile({q}, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket" in queries
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)


# ---- the access log and the request counter, without a cluster ----

class FakeCluster:
    def __init__(self) -> None:
        self.metrics = RouterMetrics("m")

    def ready(self) -> bool:
        return False

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": 0, "decode": 0}

    def awaited(self) -> str:
        return "a prefill and a decode worker"

    def admit(self) -> None:
        raise AssertionError("nothing is generated here")


@pytest.fixture
def access_records(caplog):
    caplog.set_level(logging.DEBUG, logger="pdserve.access")
    return lambda: [r for r in caplog.records if r.name == "pdserve.access"]


def test_http_requests_are_counted_by_route_and_status_and_logged(access_records):
    """The middleware sees every request, refused ones too: the status that went out and
    the x-request-id it carried, on the route's own label or `other` for unknown paths."""
    cluster = FakeCluster()
    fe = SimpleNamespace(cluster=cluster, served_model_name="m", model_names=("m",), max_model_len=2048,
                         max_body_bytes=1024)
    with TestClient(create_app(fe, cluster.metrics.render)) as client:
        assert client.get("/v1/models", headers={"x-request-id": "given-1"}).status_code == 200
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["workers"] == {"prefill": 0, "decode": 0}
        assert client.post("/v1/completions", content="x", headers={"content-type": "text/plain"}).status_code == 415
        assert client.get("/v1/completions").status_code == 405
        assert client.get("/nothing/here").status_code == 404
    text = cluster.metrics.render().decode()
    for api, outcome in (("/v1/models", "200"), ("/ready", "503"), ("/v1/completions", "415"),
                         ("/v1/completions", "405"), ("other", "404")):
        assert f'pdserve_requests_total{{api="{api}",outcome="{outcome}"}} 1.0' in text, (api, outcome)
    records = access_records()
    assert [r.fields["status"] for r in records] == ["200", "503", "415", "405", "404"]
    first = records[0]
    assert first.levelno == logging.INFO and first.fields["request_id"] == "given-1"
    assert first.getMessage().startswith("request_id=given-1 method=GET path=/v1/models status=200 duration=")
    assert records[1].levelno == logging.DEBUG                      # probes stay out of the info log
    assert len(records[2].fields["request_id"]) == 32               # one the router made


def generation() -> Generation:
    gen = Generation("cmpl-1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4), decision="remote",
                     decode_worker="decode-a", prefill_worker="prefill-b", transport="shm", kv_bytes=4096,
                     completion_tokens=3, cached_tokens=0, finish_reason="length")
    gen.first_token_at = gen.started + 0.25
    return gen


def test_an_access_line_in_json_carries_its_fields_as_keys(access_records):
    metrics = RouterMetrics("m")
    exchange = Exchange("POST", "/v1/completions", "/v1/completions", status="200", request_id="r-1",
                        generations=[generation()])
    AccessLog(metrics).finished(exchange)
    (record,) = access_records()
    line = JsonFormatter("router").format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["service"] == "router" and out["logger"] == "pdserve.access" and out["level"] == "INFO"
    assert (out["request_id"], out["method"], out["path"], out["status"]) == ("r-1", "POST", "/v1/completions", "200")
    assert (out["prompt_tokens"], out["completion_tokens"], out["ttft"]) == (5, 3, 0.25)
    assert out["route"] == generation().route() and out["finish_reason"] == "length"
    assert out["response_id"] == "cmpl-1" and out["message"] == record.getMessage()
    assert 'route="decision=remote;decode=decode-a;prefill=prefill-b;' in out["message"]
    assert out["time"].endswith("+00:00")
    assert 'pdserve_requests_total{api="/v1/completions",outcome="200"} 1.0' in metrics.render().decode()


def test_logfmt_keeps_one_record_on_one_line():
    assert logfmt({"a": 1, "b": "x y", "c": "", "d": "line\nbreak", "e": 'q"'}) == \
        'a=1 b="x y" c="" d="line\\nbreak" e="q\\""'


def test_json_log_format_covers_every_record_of_the_process():
    """In a fresh process (pytest's own handlers hold the root logger here): every
    logger's records, exceptions included, come out one JSON object per line."""
    code = ("import logging\n"
            "from services.common.lifecycle import setup_logging\n"
            "setup_logging('info', 'decode', 'json')\n"
            "logging.getLogger('uvicorn.error').info('started')\n"
            "logging.getLogger('pdserve.access').info('x', extra={'fields': {'status': '200'}})\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    logging.getLogger('a.b').exception('boom')\n"
            "logging.getLogger('a.b').debug('hidden')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(r["logger"], r["message"]) for r in lines] == [("uvicorn.error", "started"), ("pdserve.access", "x"),
                                                            ("a.b", "boom")]
    assert all(r["service"] == "decode" for r in lines)
    assert lines[1]["status"] == "200" and "ZeroDivisionError" in lines[2]["exception"]


def test_sigusr1_writes_every_threads_stack_and_the_process_runs_on():
    """`kill -USR1` on a service: each thread's stack on stderr (a hang names its place),
    and the process goes on to its own end."""
    code = ("import os, signal, threading, time\n"
            "from services.common.lifecycle import setup_logging\n"
            "setup_logging('info', 'router')\n"
            "there = threading.Event()\n"
            "def parked():\n    there.set()\n    time.sleep(30)\n"
            "threading.Thread(target=parked, daemon=True).start()\n"
            "there.wait()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\n"
            "print('ran on')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "ran on\n", out.stderr
    assert "Current thread" in out.stderr and 'in parked' in out.stderr, out.stderr


def test_a_stuck_stop_exits_with_every_threads_stack():
    """A stop past its bound (lifecycle.stop_within): the stacks on stderr, the stuck one
    named, and exit status 1 at once, not a hang until the supervisor's SIGKILL; a stop
    within it, in a process that goes on (a Ray actor's service), leaves no watch behind."""
    code = ("import time\n"
            "from services.common.lifecycle import stop_within\n"
            "def stuck():\n    time.sleep(60)\n"
            "with stop_within(0.5, process_ends=False):\n    pass\n"
            "time.sleep(1)\n"
            "print('went on')\n"
            "with stop_within(0.5, process_ends=True):\n    stuck()\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == "went on\n" and time.monotonic() - t0 < 30, out
    assert "Timeout (0:00:00.500000)!" in out.stderr and "in stuck" in out.stderr, out.stderr


def test_a_stop_leaves_what_will_not_end_and_names_it(caplog):
    """lifecycle.cancel_and_wait and within: a task that swallows its cancellation, or a
    part that runs past its bound, is waited for no longer than the bound and logged by
    name (with its stack), and the stop goes on."""
    import asyncio
    from services.common.lifecycle import cancel_and_wait, within

    async def stubborn():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:              # swallowed once: a cleanup that carries on
            await asyncio.sleep(30)

    async def main():
        task = asyncio.create_task(stubborn(), name="stubborn")
        await asyncio.sleep(0)
        t0 = time.monotonic()
        await cancel_and_wait([task], 0.2, "a test's stop")
        assert not task.done() and time.monotonic() - t0 < 5
        assert await within(asyncio.sleep(0), 1, "a quick part")
        assert not await within(asyncio.sleep(30), 0.1, "a slow part")
        task.cancel()                               # the second cancel ends it
    with caplog.at_level(logging.WARNING, logger="services.common.lifecycle"):
        asyncio.run(main())
    said = caplog.text
    assert "a test's stop: stubborn still running 0.2 s after it was cancelled" in said and "in stubborn" in said
    assert "a slow part: still running after 0.1 s" in said and "quick part" not in said
