"""`pdserve bench`: its pure parts (percentiles, goodput, wall time, Poisson arrivals,
exact-length prompts from the real tokenizer, the comparison table, the plot) and runs
against a real cluster (a clean run, the chat endpoint, failures that must be counted)."""
from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from services.bench.load import LoadShape, arrival_offsets, drive
from services.bench.metrics import SLO, Distribution, RequestRecord, output_timeline, percentile, summarize
from services.bench.report import compare_table, format_summary, load_run
from services.bench.workload import (LengthRange, PromptBuilder, Workload, RequestClass, build_requests,
                                     class_counts, make_workload)
from services.cli import main
from tests.processes import ROOT, free_port


def rec(start=0.0, e2e=1.0, ttft=0.1, itl=(0.1,), output_len=2, prompt_len=10, error=None, **kw) -> RequestRecord:
    if error:
        return RequestRecord(prompt_len=prompt_len, requested_output_len=output_len, start=start, e2e=e2e, error=error)
    return RequestRecord(prompt_len=prompt_len, requested_output_len=output_len, start=start, e2e=e2e,
                         output_len=output_len, output_len_source="usage", ttft=ttft, itl=tuple(itl), **kw)


# --- metrics -----------------------------------------------------------------------

def test_percentile_matches_numpy_linear_interpolation():
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_of_nothing_has_a_count_and_no_numbers():
    assert Distribution.of([]) == Distribution(count=0)
    d = Distribution.of([1.0, 2.0, 3.0, 4.0])
    assert (d.count, d.mean, d.p50) == (4, 2.5, 2.5)


def test_wall_time_spans_first_send_to_last_completion_idle_included():
    records = [rec(start=0.0, e2e=1.0), rec(start=10.0, e2e=2.0), rec(start=5.0, e2e=0.5, error="HTTP 500: x")]
    s = summarize(records)
    assert s.wall_s == pytest.approx(12.0)              # not 3 s of busy time
    assert (s.completed, s.failed) == (2, 1)
    assert s.errors == {"HTTP 500: x": 1}
    assert s.request_throughput == pytest.approx(2 / 12)
    assert s.output_throughput == pytest.approx(4 / 12)
    assert s.e2e.count == 2 and s.e2e.mean == pytest.approx(1.5)   # failed ones are not latency samples
    assert s.goodput is None                            # no SLO given


def test_tokens_in_use_the_servers_prompt_count_when_it_sent_one():
    s = summarize([rec(prompt_len=10, server_prompt_len=40), rec(prompt_len=10)])
    assert s.input_tokens == 50 and s.output_tokens == 4
    assert s.total_throughput == pytest.approx(54 / s.wall_s)


def test_tpot_spreads_the_time_after_the_first_token_over_the_rest():
    r = rec(e2e=1.0, ttft=0.2, itl=(0.4, 0.4), output_len=5)     # two chunks after the first, five tokens
    assert r.tpot == pytest.approx(0.2)
    assert rec(output_len=1, itl=()).tpot is None
    assert rec(error="boom").tpot is None
    assert r.chunk_times() == pytest.approx([0.2, 0.6, 1.0])


def test_goodput_judges_ttft_and_each_requests_own_p99_itl():
    slo = SLO(ttft_s=0.5, itl_s=0.1)
    steady_with_one_hiccup = rec(ttft=0.2, itl=[0.01] * 200 + [0.5])   # p99 of 201 gaps is 0.01
    short_with_a_hiccup = rec(ttft=0.2, itl=[0.01, 0.01, 0.5])          # p99 of 3 gaps is 0.49
    slow_first_token = rec(ttft=0.6, itl=[0.01])
    single_token = rec(ttft=0.2, itl=(), output_len=1)                  # no gaps: nothing to judge
    failed = rec(error="HTTP 429: busy")
    assert slo.met_by(steady_with_one_hiccup) and slo.met_by(single_token)
    assert not slo.met_by(short_with_a_hiccup)
    assert not slo.met_by(slow_first_token)
    assert not slo.met_by(failed)
    records = [steady_with_one_hiccup, short_with_a_hiccup, slow_first_token, single_token, failed]
    s = summarize(records, slo)
    assert s.goodput == pytest.approx(2 / s.wall_s)
    assert summarize(records, SLO(ttft_s=0.5)).goodput == pytest.approx(3 / s.wall_s)


def test_output_timeline_puts_every_output_token_in_a_bin():
    records = [rec(start=0.0, e2e=1.0, ttft=0.1, itl=(0.4, 0.4), output_len=6),
               rec(start=2.0, e2e=1.0, ttft=0.5, itl=(), output_len=1)]
    timeline = output_timeline(records, 0.5)
    assert sum(rate * 0.5 for _, rate in timeline) == pytest.approx(7)
    assert [t for t, _ in timeline] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
    assert timeline[5][1] == pytest.approx(2.0)          # the single token at 2.5 s


# --- load --------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_start_at_zero_and_have_the_asked_mean():
    a = arrival_offsets(20000, 4.0, seed=7)
    assert a == arrival_offsets(20000, 4.0, seed=7)
    assert a != arrival_offsets(20000, 4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    cv = float(np.std(gaps)) / float(np.mean(gaps))     # exponential gaps: std == mean
    assert cv == pytest.approx(1.0, abs=0.05)
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(ValueError):
        LoadShape(request_rate=0)
    with pytest.raises(ValueError):
        LoadShape(max_concurrency=0)


def test_drive_keeps_the_concurrency_cap_and_returns_records_in_order():
    in_flight = peak = 0

    async def send(i, t0):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01 * (i % 3))
        in_flight -= 1
        return rec(prompt_len=i)

    done = []
    records = asyncio.run(drive(list(range(12)), send, LoadShape(max_concurrency=3), done.append))
    assert peak == 3
    assert [r.prompt_len for r in records] == list(range(12)) and len(done) == 12


def test_drive_releases_requests_on_the_poisson_schedule():
    import time

    sent = []

    async def send(i, t0):
        sent.append(time.perf_counter() - t0)
        return rec()

    shape = LoadShape(request_rate=20.0, seed=3)
    asyncio.run(drive(list(range(8)), send, shape))
    for at, planned in zip(sent, arrival_offsets(8, 20.0, seed=3)):
        assert planned <= at < planned + 0.25          # never early; late only by scheduling noise


# --- workload ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def builder(model_dir):
    from services.engine.text.tokenizer import load_tokenizer
    return PromptBuilder(load_tokenizer(model_dir))


def test_length_ranges_parse_and_refuse_nonsense():
    assert LengthRange.parse("256") == LengthRange(256, 256)
    assert LengthRange.parse("16-256") == LengthRange(16, 256)
    for bad in ("0", "20-10", "ten", "-5", "1-2-3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_presets_have_the_documented_shapes():
    chat = make_workload("chat")
    assert chat.classes == (RequestClass(1.0, LengthRange(256, 256), LengthRange(16, 256)),)
    mixed = make_workload("mixed")
    assert [(c.weight, c.input_len.lo, c.output_len.lo) for c in mixed.classes] == [(0.8, 256, 128), (0.2, 2048, 32)]
    prefix = make_workload("shared-prefix", output_len="8")
    assert prefix.classes == (RequestClass(1.0, LengthRange(64, 64), LengthRange(8, 8), prefix_len=1024),)
    assert make_workload("shared-prefix").classes[0].output_len == LengthRange(32, 32)
    assert make_workload("fixed", "32", "4-8").classes == (RequestClass(1.0, LengthRange(32, 32), LengthRange(4, 8)),)
    for name, kw in (("mixed", {"output_len": "5"}), ("chat", {"input_len": "5"}), ("nope", {})):
        with pytest.raises(ValueError):
            make_workload(name, **kw)


def test_class_counts_split_exactly():
    assert class_counts([0.8, 0.2], 10) == [8, 2]
    assert class_counts([0.8, 0.2], 7) == [6, 1]
    assert class_counts([1, 1, 1], 5) == [2, 2, 1]
    assert sum(class_counts([0.3, 0.3, 0.4], 1001)) == 1001


@pytest.mark.parametrize("n", [1, 2, 7, 32, 300, 2048])
def test_prompts_re_encode_to_exactly_n_tokens(builder, n):
    rng = random.Random(n)
    for _ in range(3):
        assert builder.count(builder.text(n, rng)) == n


def test_workloads_are_seeded_reproducible_and_exact(builder):
    w = make_workload("fixed", "20-40", "4-8")
    a = build_requests(w, builder, 12, seed=5)
    assert a == build_requests(w, builder, 12, seed=5)
    assert [r.prompt for r in a] != [r.prompt for r in build_requests(w, builder, 12, seed=6)]
    assert len({r.prompt for r in a}) == 12
    for r in a:
        assert 20 <= r.prompt_len <= 40 and 4 <= r.output_len <= 8
        assert builder.count(r.prompt) == r.prompt_len
    warm = build_requests(w, builder, 3, seed=5, stream="warmup")
    assert not {r.prompt for r in warm} & {r.prompt for r in a}


def test_mixed_workload_has_exact_proportions(builder):
    small = Workload("mixed-small", (RequestClass(0.8, LengthRange(16, 16), LengthRange(8, 8)),
                                     RequestClass(0.2, LengthRange(64, 64), LengthRange(2, 2))))
    reqs = build_requests(small, builder, 10, seed=0)
    assert sorted((r.prompt_len, r.output_len) for r in reqs) == [(16, 8)] * 8 + [(64, 2)] * 2
    assert [r.prompt_len for r in reqs] != sorted(r.prompt_len for r in reqs)     # shuffled, not in blocks


def test_shared_prefix_requests_share_the_prefix_tokens_and_nothing_more(builder):
    reqs = build_requests(make_workload("shared-prefix", output_len="4"), builder, 4, seed=2)
    warm = build_requests(make_workload("shared-prefix", output_len="4"), builder, 1, seed=2, stream="warmup")
    ids = [builder.encode(r.prompt) for r in reqs + warm]
    assert all(len(x) == 1088 for x in ids) and all(r.prompt_len == 1088 for r in reqs)
    assert all(x[:1024] == ids[0][:1024] for x in ids)
    assert len({tuple(x[1024:]) for x in ids}) == len(ids)


# --- report ------------------------------------------------------------------------

def summary_dict(req_s, ttft_p50, failed=0):
    s = summarize([rec(start=0.0, e2e=1 / req_s, ttft=ttft_p50)] + [rec(error="x")] * failed)
    from dataclasses import asdict
    return asdict(s)


def test_compare_table_shows_each_run_with_its_ratio_to_the_first():
    table = compare_table([("base", summary_dict(2.0, 0.1)), ("new", summary_dict(4.0, 0.05, failed=1))])
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()}
    assert lines["metric"].split() == ["metric", "base", "new"]
    assert lines["TTFT p50 (ms)"].split()[-3:] == ["100.0", "50.0", "(0.50x)"]
    assert lines["failed"].split()[-3:] == ["0", "1", "(-)"]        # no ratio against zero
    assert lines["goodput req/s"].split()[-2:] == ["-", "-"]         # not measured: said so
    with pytest.raises(ValueError):
        compare_table([])


def test_summary_text_lists_failures_and_goodput():
    s = summarize([rec(ttft=0.2), rec(error="HTTP 429: queue full"), rec(error="HTTP 429: queue full")],
                  SLO(ttft_s=0.5))
    text = format_summary(s, "title", "TTFT <= 500 ms")
    assert "1 succeeded, 2 failed" in text and "2 x HTTP 429: queue full" in text
    assert "goodput" in text and "TTFT <= 500 ms" in text


def test_load_run_refuses_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"results": []}))
    with pytest.raises(ValueError, match="not a `pdserve bench --json` file"):
        load_run(path)


def test_plot_writes_a_png(tmp_path):
    from services.bench.plot import plot_run
    records = [rec(start=i * 0.1, e2e=0.5, ttft=0.1, itl=(0.1, 0.1, 0.1, 0.1), output_len=5) for i in range(10)]
    plot_run(tmp_path / "run.png", records + [rec(error="x")], "synthetic")
    data = (tmp_path / "run.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bad_flags_exit_2_before_anything_is_sent(capsys):
    assert main(["bench", "--workload", "mixed", "--output-len", "5"]) == 2
    assert "fixes its output lengths" in capsys.readouterr().err
    assert main(["bench", "--max-concurrency", "0"]) == 2


def test_extra_body_is_merged_into_every_request_and_checked_up_front(capsys):
    from services.bench.client import Endpoint
    from services.bench.command import BenchSettings
    from services.bench.workload import BenchRequest
    extra = '{"generation_config": "{\\"eos_token_id\\": -1}", "temperature": 0.5}'
    s = BenchSettings(ignore_eos=False, extra_body=extra, endpoint="chat")
    endpoint = Endpoint("http://x", "m", "chat", s.ignore_eos, s.temperature, extra=s.extra_body_fields())
    body = endpoint.body(BenchRequest(prompt="hi", prompt_len=1, output_len=8))
    assert body["generation_config"] == '{"eos_token_id": -1}' and body["temperature"] == 0.5
    assert "ignore_eos" not in body and body["messages"] == [{"role": "user", "content": "hi"}]
    assert main(["bench", "--extra-body", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err
    assert main(["bench", "--extra-body", "{nope"]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert main(["bench", "--extra-body", '{"stream": false}']) == 2
    assert "may not set stream" in capsys.readouterr().err


class _HeaderRecorder:
    """A stand-in OpenAI server on a free port that answers every completion with one
    token and keeps each request's headers."""

    def __init__(self) -> None:
        import http.server
        import threading
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                seen.append(dict(self.headers))
                self._send(b'{"data": [{"id": "m"}]}', "application/json")

            def do_POST(self):
                seen.append(dict(self.headers))
                self.rfile.read(int(self.headers["Content-Length"]))
                self._send(_sse('{"choices": [{"text": "a", "finish_reason": "length"}], '
                                '"usage": {"completion_tokens": 1, "prompt_tokens": 8}}', "[DONE]"),
                           "text/event-stream")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_headers_go_with_every_request_and_never_into_the_results(tmp_path, capsys):
    server = _HeaderRecorder()
    out = tmp_path / "run.json"
    try:
        code = main(["bench", "--base-url", server.url, "--num-prompts", "2", "--input-len", "8", "--output-len",
                     "1", "--no-progress", "--json", str(out), "--api-key", "sk-secret-key",
                     "--header", "X-Tenant: tenant-secret", "--header", "x-trace:  on "])
    finally:
        server.close()
    assert code == 0, capsys.readouterr()
    assert len(server.seen) == 3                            # the model lookup and both requests
    for headers in server.seen:
        assert {k.lower(): v for k, v in headers.items()}.items() >= {
            "authorization": "Bearer sk-secret-key", "x-tenant": "tenant-secret", "x-trace": "on"}.items()
    written = out.read_text()
    assert "secret" not in written and "x-trace" not in written.lower()
    for bad, says in [("X-Tenant", "takes 'Name: value'"), ("Bad Name: v", "takes 'Name: value'"),
                      ("Authorization: Bearer other", "given twice")]:
        assert main(["bench", "--api-key", "k", "--header", bad]) == 2
        err = capsys.readouterr().err
        assert says in err and "other" not in err


def _sse(*chunks: str) -> bytes:
    return "".join(f"data: {c}\n\n" for c in chunks).encode()


@pytest.mark.parametrize("tail, error", [
    (("[DONE]",), None),
    ((), None),                                             # transformers serve ends here, no [DONE]
])
def test_a_stream_is_complete_at_done_or_when_it_closes_after_a_finish_reason(tail, error):
    import httpx

    from services.bench.client import Endpoint, send
    from services.bench.workload import BenchRequest
    body = _sse('{"choices": [{"delta": {"role": "assistant"}}]}', '{"choices": [{"delta": {"content": "a"}}]}',
                '{"choices": [{"delta": {"content": "b"}, "finish_reason": "length"}], '
                '"usage": {"completion_tokens": 2, "prompt_tokens": 3}}', *tail)

    async def run(content: bytes):
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send(client, Endpoint("http://x", "m", "chat"), BenchRequest("p", 1, 2), 0.0, len)

    r = asyncio.run(run(body))
    assert r.error is error and (r.output_len, r.server_prompt_len, len(r.itl)) == (2, 3, 1)
    cut = asyncio.run(run(_sse('{"choices": [{"delta": {"content": "a"}}]}')))   # closed mid-answer
    assert cut.error == "stream ended without [DONE] or a finish_reason"


# --- against a real cluster ---------------------------------------------------------

def test_bench_against_the_cluster_writes_a_sane_run(cluster, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "--base-url", cluster.http, "--input-len", "32",
         "--output-len", "8", "--num-prompts", "6", "--max-concurrency", "2", "--warmup", "1",
         "--slo-ttft", "60000", "--json", str(out), "--plot", str(png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6 succeeded, 0 failed" in proc.stdout
    assert "[bench]" in proc.stderr                       # the progress line
    doc = load_run(out)
    assert doc["config"]["model"] == "SmolLM2-135M-Instruct" and doc["config"]["max_concurrency"] == 2
    assert doc["warmup"] == {"requests": 1, "failed": 0, "errors": []}
    reqs = doc["requests"]
    assert len(reqs) == 6 and all(r["error"] is None for r in reqs)
    for r in reqs:
        assert (r["prompt_len"], r["server_prompt_len"]) == (32, 32)
        assert (r["output_len"], r["output_len_source"]) == (8, "usage")   # ignore_eos: never shorter
        assert 0 < r["ttft"] < r["e2e"]
        assert 1 <= len(r["itl"]) <= 7 and all(gap >= 0 for gap in r["itl"])
        assert r["ttft"] + sum(r["itl"]) <= r["e2e"] + 1e-6
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["output_tokens"]) == (6, 0, 48)
    assert s["wall_s"] >= max(r["e2e"] for r in reqs)
    assert s["wall_s"] >= sum(r["e2e"] for r in reqs) / 2 - 1e-6        # never more than 2 in flight
    assert s["output_throughput"] == pytest.approx(48 / s["wall_s"])
    assert s["goodput"] == pytest.approx(s["request_throughput"])      # a 60 s TTFT SLO: all meet it
    assert s["itl"]["count"] == sum(len(r["itl"]) for r in reqs)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bench_over_the_chat_endpoint_counts_the_templated_prompt(cluster, tmp_path, capsys):
    out = tmp_path / "chat.json"
    code = main(["bench", "--base-url", cluster.http, "--endpoint", "chat", "--input-len", "16",
                 "--output-len", "4", "--num-prompts", "2", "--max-concurrency", "2", "--no-progress",
                 "--json", str(out), "--label", "chat"])
    assert code == 0, capsys.readouterr()
    reqs = load_run(out)["requests"]
    assert all(r["output_len"] == 4 and r["server_prompt_len"] > r["prompt_len"] == 16 for r in reqs)

    assert main(["bench", "compare", str(out), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chat: fixed (16 in / 4 out)" in printed
    assert "(1.00x)" in printed


def test_failed_requests_are_counted_never_dropped(cluster, tmp_path, capsys):
    out = tmp_path / "bad.json"
    code = main(["bench", "--base-url", cluster.http, "--model", "no-such-model", "--input-len", "8",
                 "--output-len", "2", "--num-prompts", "3", "--no-progress", "--json", str(out)])
    assert code == 1
    doc = load_run(out)
    assert (doc["summary"]["completed"], doc["summary"]["failed"]) == (0, 3)
    assert all(r["error"].startswith("HTTP 404") for r in doc["requests"])
    assert "3 failed" in capsys.readouterr().out


def test_an_unreachable_endpoint_fails_every_request_or_stops_at_model_lookup(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}"                 # nothing listens there
    assert main(["bench", "--base-url", url, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
                 "--no-progress"]) == 2
    assert "pass --model" in capsys.readouterr().err
    out = tmp_path / "down.json"
    assert main(["bench", "--base-url", url, "--model", "m", "--num-prompts", "2", "--input-len", "8",
                 "--output-len", "2", "--no-progress", "--json", str(out)]) == 1
    reqs = load_run(out)["requests"]
    assert len(reqs) == 2 and all(r["error"].startswith("ConnectError") for r in reqs)
