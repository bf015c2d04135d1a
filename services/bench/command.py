"""`pdserve bench` and `pdserve bench compare`: flags, settings, and one run end to end."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from services.bench.load import LoadShape
from services.bench.metrics import SLO, RequestRecord, summarize
from services.bench.workload import WORKLOADS, BenchRequest, Workload, make_workload

EPILOG = """\
examples:
  pdserve bench --workload chat --num-prompts 50 --max-concurrency 4
  pdserve bench --workload fixed --input-len 512 --output-len 64-128 --request-rate 2 --json a.json
  pdserve bench --base-url http://127.0.0.1:8001 --tokenizer /models/llama --no-ignore-eos --json b.json
  pdserve bench --no-ignore-eos --extra-body '{"generation_config": "{\\"eos_token_id\\": -1}"}'
  pdserve bench --base-url https://gateway.example --api-key KEY --header 'X-Tenant: team-a'
  pdserve bench compare a.json b.json
exit status: 0 when every request succeeded, 1 when any failed, 2 on bad flags or an
unreachable endpoint.
"""

# Body fields a request's measurement depends on: --extra-body may add or override any other.
EXTRA_BODY_FIXED = frozenset({"model", "prompt", "messages", "stream"})
# Settings that may carry credentials: sent, never written into --json.
SECRET_FIELDS = frozenset({"api_key", "headers"})
# A header's name is an HTTP token (RFC 9110).
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


@dataclass(frozen=True)
class BenchSettings:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None            # None: the first of GET /v1/models
    endpoint: str = "completions"
    tokenizer: str | None = None        # None: pdserve's default model
    workload: str = "fixed"
    input_len: str | None = None
    output_len: str | None = None
    num_prompts: int = 100
    warmup: int = 0
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    ignore_eos: bool = True
    extra_body: str | None = None       # a JSON object merged into every request body
    temperature: float = 0.0
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    request_timeout: float = 600.0
    api_key: str | None = field(default=None, repr=False)   # sent as a bearer token; never written out
    headers: tuple[str, ...] = field(default=(), repr=False)  # "Name: value", sent; never written out
    label: str | None = None
    server_metrics: tuple[str, ...] = ()    # /metrics URLs read before and after (speculative decoding)
    json: str | None = None
    plot: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.workload_spec()
        self.load_shape()
        self.extra_body_fields()
        self.request_headers()
        if self.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if self.warmup < 0:
            raise ValueError("--warmup must not be negative")
        if self.request_timeout <= 0:
            raise ValueError("--request-timeout must be positive")
        for name in ("slo_ttft_ms", "slo_itl_ms"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name[:-3].replace('_', '-')} must be positive")
        if self.plot:                   # fail before the run, not after it
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("--plot needs matplotlib: pip install 'pdserve[bench]'") from None

    def workload_spec(self) -> Workload:
        return make_workload(self.workload, self.input_len, self.output_len)

    def load_shape(self) -> LoadShape:
        return LoadShape(self.request_rate, self.max_concurrency, self.seed)

    def extra_body_fields(self) -> dict:
        if self.extra_body is None:
            return {}
        try:
            fields = json.loads(self.extra_body)
        except ValueError as exc:
            raise ValueError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise ValueError("--extra-body must be a JSON object")
        if fixed := sorted(fields.keys() & EXTRA_BODY_FIXED):
            raise ValueError(f"--extra-body may not set {', '.join(fixed)}: the benchmark sets and measures by them")
        return fields

    def request_headers(self) -> dict[str, str]:
        """--api-key as a bearer token, then each --header. Errors name the header, never
        its value: that may be a credential."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for text in self.headers:
            name, colon, value = text.partition(":")
            name, value = name.strip(), value.strip()
            if not colon or not HEADER_NAME.fullmatch(name):
                raise ValueError("--header takes 'Name: value', a name of letters, digits and -, then a colon")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"--header {name}: the value may not hold line breaks or NUL")
            if name.lower() in (n.lower() for n in headers):
                raise ValueError(f"--header {name}: given twice (Authorization also comes from --api-key)")
            headers[name] = value
        return headers

    def slo(self) -> SLO:
        return SLO(None if self.slo_ttft_ms is None else self.slo_ttft_ms / 1000,
                   None if self.slo_itl_ms is None else self.slo_itl_ms / 1000)

    def slo_note(self) -> str:
        parts = []
        if self.slo_ttft_ms is not None:
            parts.append(f"TTFT <= {self.slo_ttft_ms:g} ms")
        if self.slo_itl_ms is not None:
            parts.append(f"the request's p99 ITL <= {self.slo_itl_ms:g} ms")
        return " and ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.set_defaults(log_level="warning")    # the report is the output; library chatter is not
    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    cmp = sub.add_parser("compare", help="print runs side by side, with ratios to the first")
    cmp.add_argument("runs", nargs="+", metavar="RUN.json", help="files written by pdserve bench --json")

    d = BenchSettings
    e = p.add_argument_group("endpoint")
    e.add_argument("--base-url", default=d.base_url)
    e.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    e.add_argument("--endpoint", default=d.endpoint, choices=["completions", "chat"],
                   help="/v1/completions with a prompt string, or /v1/chat/completions with one user message")
    e.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or HF id that prompt lengths are counted with "
                        "(default: pdserve's default model, no network needed)")
    e.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (for servers that refuse unknown fields); "
                        "answers may then stop before --output-len")
    e.add_argument("--extra-body", default=None, metavar="JSON",
                   help="a JSON object merged into every request body, for a server's own options")
    e.add_argument("--temperature", type=float, default=d.temperature)
    e.add_argument("--request-timeout", type=float, default=d.request_timeout, help="seconds per request")
    e.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as Authorization: Bearer KEY (or set PDSERVE_API_KEY)")
    e.add_argument("--header", dest="headers", action="append", default=None, metavar="'NAME: VALUE'",
                   help="an HTTP header sent with every request; repeat for several. Like --api-key, "
                        "never written to --json")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", default=d.workload, choices=WORKLOADS,
                   help="fixed: --input-len/--output-len; chat: 256 in, 16-256 out; mixed: 80%% 256/128, "
                        "20%% 2048/32; shared-prefix: 1024 common + 64 unique in, 32 out")
    w.add_argument("--input-len", default=None, metavar="N|LO-HI", help="prompt tokens, N or LO-HI (fixed; default 256)")
    w.add_argument("--output-len", default=None, metavar="N|LO-HI",
                   help="output tokens, N or LO-HI (fixed: default 128; also overrides chat and shared-prefix)")
    w.add_argument("--num-prompts", type=int, default=d.num_prompts)
    w.add_argument("--warmup", type=int, default=d.warmup, help="requests sent first and not counted")
    w.add_argument("--seed", type=int, default=d.seed, help="prompts, lengths and arrivals all follow it")

    ld = p.add_argument_group("load")
    ld.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    ld.add_argument("--request-rate", type=float, default=d.request_rate,
                    help="mean requests/s, Poisson arrivals (default inf: all at once)")

    r = p.add_argument_group("results")
    r.add_argument("--slo-ttft", dest="slo_ttft_ms", type=float, default=None, metavar="MS", help="goodput SLO, ms")
    r.add_argument("--slo-itl", dest="slo_itl_ms", type=float, default=None, metavar="MS",
                   help="goodput SLO on each request's p99 inter-chunk latency, ms")
    r.add_argument("--json", default=None, metavar="OUT.json", help="config, summary and every request")
    r.add_argument("--plot", default=None, metavar="OUT.png", help="latency CDFs and throughput over time")
    r.add_argument("--label", default=None, help="this run's name in `compare` (default: the file's)")
    r.add_argument("--server-metrics", action="append", default=None, metavar="URL",
                   help="a Prometheus /metrics page read before and after the run (repeat for several, e.g. each "
                        "decode worker's): reports speculative decoding's acceptance from vLLM's counter names, "
                        "which pdserve's decode workers and vLLM both export")
    r.add_argument("--no-progress", dest="progress", action="store_false")


def settings_from_args(a: argparse.Namespace) -> BenchSettings:
    names = BenchSettings.__dataclass_fields__
    given = {k: v for k, v in vars(a).items() if k in names}
    return BenchSettings(**{**given, "headers": tuple(a.headers or ()),
                            "server_metrics": tuple(a.server_metrics or ())})


def _load_tokenizer(name: str | None):
    from services.engine.text.model_store import ensure_default_model
    from services.engine.text.tokenizer import load_tokenizer
    if name is None:
        return load_tokenizer(ensure_default_model())
    try:
        return load_tokenizer(name)
    except OSError as exc:          # no such folder, or a hub id with no hub to ask
        raise ValueError(f"--tokenizer {name}: {exc}") from None


async def _measure(s: BenchSettings, requests: list[BenchRequest], warm: list[BenchRequest], count_tokens):
    """The model, the warm-up's and the run's records, and the run's speculative decoding
    as --server-metrics counted it (None without)."""
    import httpx

    from services.bench.client import Endpoint, first_model, normalize_base_url, send
    from services.bench.load import drive
    from services.bench.report import Progress

    slots = s.max_concurrency or max(len(requests), len(warm))
    limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
    timeout = httpx.Timeout(s.request_timeout, connect=30.0, pool=None)
    base = normalize_base_url(s.base_url)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=s.request_headers()) as client:
        model = s.model or await first_model(client, base)
        endpoint = Endpoint(base, model, s.endpoint, s.ignore_eos, s.temperature, s.request_timeout,
                            s.extra_body_fields())

        def call(req: BenchRequest, t0: float):
            return send(client, endpoint, req, t0, count_tokens)

        warm_records: list[RequestRecord] = []
        if warm:
            progress = Progress(len(warm), "warm-up", enabled=s.progress)
            warm_records = await drive(warm, call, LoadShape(max_concurrency=s.max_concurrency), progress)
            progress.close()
        before = await _server_counts(client, s.server_metrics)
        progress = Progress(len(requests), "bench", enabled=s.progress)
        records = await drive(requests, call, s.load_shape(), progress)
        progress.close()
        after = await _server_counts(client, s.server_metrics)
    from services.bench.server_metrics import acceptance
    return model, warm_records, records, (acceptance(before, after) if s.server_metrics else None)


async def _server_counts(client, urls: tuple[str, ...]) -> dict[str, float]:
    import httpx

    from services.bench.client import EndpointError
    from services.bench.server_metrics import scrape
    try:
        return await scrape(client, list(urls)) if urls else {}
    except httpx.HTTPError as exc:
        raise EndpointError(f"--server-metrics: {exc}") from None


def bench(s: BenchSettings) -> int:
    from services.bench.client import EndpointError
    from services.bench.report import format_summary, run_document
    from services.bench.workload import PromptBuilder, build_requests

    tokenizer = _load_tokenizer(s.tokenizer)
    builder = PromptBuilder(tokenizer)
    workload = s.workload_spec()
    requests = build_requests(workload, builder, s.num_prompts, s.seed)
    warm = build_requests(workload, builder, s.warmup, s.seed, stream="warmup") if s.warmup else []
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        model, warm_records, records, speculation = asyncio.run(_measure(s, requests, warm, builder.count))
    except EndpointError as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\npdserve bench: interrupted, nothing reported", file=sys.stderr)
        return 130
    if s.endpoint == "completions":
        _warn_on_prompt_count_mismatch(records, s.tokenizer or _default_model_name())
    warm_failed = sum(not r.ok for r in warm_records)
    if warm_failed:
        print(f"pdserve bench: {warm_failed} of {len(warm_records)} warm-up requests failed", file=sys.stderr)

    summary = summarize(records, s.slo())
    title = f"pdserve bench: {workload}, {s.num_prompts} prompts, {s.load_shape()} -> {s.base_url} " \
            f"({model}, {s.endpoint})"
    print(format_summary(summary, title, s.slo_note()))
    if speculation is not None:
        print(speculation.describe())
    if s.json:
        settings = {k: v for k, v in asdict(s).items() if k not in SECRET_FIELDS}
        config = {**settings, "model": model, "tokenizer": str(s.tokenizer or _default_model_name()),
                  "request_rate": "inf" if math.isinf(s.request_rate) else s.request_rate,
                  "workload_description": str(workload), "load_description": str(s.load_shape()),
                  "slo_description": s.slo_note(), "started_at": started_at}
        warmup = {"requests": len(warm_records), "failed": warm_failed,
                  "errors": sorted({r.error for r in warm_records if r.error})}
        doc = run_document(config, summary, records, warmup)
        if speculation is not None:
            doc["speculation"] = {**asdict(speculation), "rate": speculation.rate,
                                  "mean_length": speculation.mean_length}
        Path(s.json).write_text(json.dumps(doc, indent=1) + "\n")
    if s.plot:
        from services.bench.plot import plot_run
        plot_run(s.plot, records, title)
    return 0 if summary.failed == 0 else 1


def _warn_on_prompt_count_mismatch(records: list[RequestRecord], tokenizer: str) -> None:
    """A server that counts a prompt differently (beyond one BOS) runs another tokenizer."""
    off = [r for r in records if r.server_prompt_len is not None
           and not 0 <= r.server_prompt_len - r.prompt_len <= 1]
    if off:
        print(f"pdserve bench: the server counted {off[0].server_prompt_len} tokens in a {off[0].prompt_len}-token "
              f"prompt ({len(off)} requests differ): prompts were measured with {tokenizer}'s tokenizer, "
              "pass --tokenizer with the served model's", file=sys.stderr)


def _default_model_name() -> str:
    from services.engine.text.model_store import DEFAULT_MODEL_NAME
    return DEFAULT_MODEL_NAME


def compare(paths: list[str]) -> int:
    from services.bench.report import compare_table, describe_run, load_run, run_name
    docs = [(path, load_run(path)) for path in paths]
    names = [run_name(path, doc) for path, doc in docs]
    for name, (_, doc) in zip(names, docs):
        print(describe_run(name, doc))
    print()
    print(compare_table([(name, doc["summary"]) for name, (_, doc) in zip(names, docs)]))
    return 0


def run(a: argparse.Namespace) -> int:
    if a.bench_command == "compare":
        return compare(a.runs)
    return bench(settings_from_args(a))
