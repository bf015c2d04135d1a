"""Prometheus metrics: one registry per service instance (no process-global state).

Each service exports pdserve's own `pdserve_*` series and, beside them, the `vllm:*`
series that dashboards, autoscalers and routers built for vLLM read (same names, types
and `model_name` label). A request's latencies and tokens are counted once, where the
client sees them: on the router. Engine state (batch, queue, KV blocks, prefix cache)
is exported by each worker.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

# Buckets per quantity, upper bounds in seconds. Where vLLM has a list for the same
# quantity these hold every one of its bounds (a query written against vLLM's `le`
# values finds them here), with finer ones added where this serves faster.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
# A decode step of a small model on a GPU takes a few milliseconds: vLLM's list starts at 10.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Waiting for KV blocks: one Reserve call when the pool has room, up to the request timeout.
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0, 600.0)
# One forward pass: a decode step of a few sequences up to a full token budget of prefill.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# Writes still running after a prompt's last layer: well under a millisecond through
# shared memory, up to seconds for a long prompt over a slow network.
KV_TRANSFER_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 5.0, 10.0)
# How a generation that ran to its end finished (OpenAI's finish_reason).
FINISH_REASONS = ("stop", "length")


# Speculative decoding's totals under vLLM's names (key in Speculator.stats, name, help).
SPEC_COUNTERS = (
    ("drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)


class WorkerMetrics:
    def __init__(self, role: str, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens_computed = Counter(
            "pdserve_prompt_tokens_computed", "Prompt tokens this worker ran through the model", registry=r)
        self.generated_tokens = Counter("pdserve_generated_tokens", "Tokens sampled by this worker", registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved through the transport",
                                ["direction", "backend"], registry=r)
        self.kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "Time spent in KV writes per request",
                                             ["backend"], buckets=KV_TRANSFER_BUCKETS, registry=r)
        self.transport_fallbacks = Counter("pdserve_kv_transport_fallbacks",
                                           "A preferred KV transport failed to pair; the next was used",
                                           ["failed", "used"], registry=r)
        self.handoffs = Counter("pdserve_kv_handoffs", "KV handoffs by final state", ["outcome"], registry=r)
        self.requests = Counter("pdserve_worker_requests", "Requests finished by reason", ["reason"], registry=r)
        self.prefix_cache_tokens = Counter("pdserve_prefix_cache_tokens",
                                           "Prompt tokens found in (hit) or missing from (miss) the prefix cache",
                                           ["result"], registry=r)
        self.blocks_total = Gauge("pdserve_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.blocks_free = Gauge("pdserve_kv_blocks_free", "KV blocks free", registry=r)
        self.running = Gauge("pdserve_running_sequences", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("pdserve_waiting_sequences", "Sequences waiting to run", registry=r)
        self.preemptions = Counter("pdserve_preemptions", "Sequences preempted for lack of blocks", registry=r)
        self.paused_passes = Counter("pdserve_prefill_paused_passes",
                                     "Steps of more urgent prompts run inside a prefill pass paused between layers",
                                     registry=r)
        self.step_seconds = Histogram("pdserve_engine_step_seconds", "Engine step time", ["kind"],
                                      buckets=STEP_BUCKETS, registry=r)
        self.role = role
        # vLLM's names for the same engine state, one series per served model.
        m = ["model_name"]
        self.requests_running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                      m, registry=r).labels(model_name)
        self.requests_waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                      m, registry=r).labels(model_name)
        self.kv_cache_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                    m, registry=r).labels(model_name)
        self.prefix_cache_queries = Counter("vllm:prefix_cache_queries",
                                            "Prefix cache queries, in terms of number of queried tokens.",
                                            m, registry=r).labels(model_name)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits",
                                         "Prefix cache hits, in terms of number of cached tokens.",
                                         m, registry=r).labels(model_name)
        self.model_name = model_name

    def export_speculation(self, totals: Callable[[], object]) -> None:
        """Speculative decoding's running totals (`totals()`: Speculator.stats, with
        drafts, draft_tokens, accepted_tokens and accepted_per_pos), exported as vLLM's
        spec_decode counters, read when /metrics is scraped."""
        self.registry.register(SpecExport(totals, self.model_name))

    def set_blocks(self, free: int, total: int) -> None:
        """Blocks an allocation can get (evictable cached ones count as free, as in vLLM)."""
        self.blocks_total.set(total)
        self.blocks_free.set(free)
        self.kv_cache_usage.set(1 - free / total if total else 0.0)

    def observe_prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One prompt's prefix-cache lookup: of its `prompt_tokens`, `cached_tokens` hit."""
        self.prefix_cache_tokens.labels("hit").inc(cached_tokens)
        self.prefix_cache_tokens.labels("miss").inc(prompt_tokens - cached_tokens)
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def set_queue(self, running: int, waiting: int) -> None:
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)

    def serve(self, host: str, port: int) -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests",
                                "Finished HTTP and gRPC calls by API route and status (HTTP code or gRPC status name)",
                                ["api", "outcome"], registry=r)
        self.decisions = Counter("pdserve_disaggregation_decisions", "Requests by prefill decision",
                                 ["decision"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve_queue_time_seconds", "Time waiting for KV blocks",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Tokens streamed to clients", registry=r)
        self.kv_bytes = Counter("pdserve_router_kv_bytes", "KV bytes moved per request, as reported",
                                ["backend"], registry=r)
        self.pending = Gauge("pdserve_pending_requests", "Requests admitted and not finished", registry=r)
        self.cached_tokens = Counter("pdserve_prefix_cached_tokens",
                                     "Prompt tokens served from a prefill worker's prefix cache", registry=r)
        self.routed = Counter("pdserve_routed_requests", "Requests sent to each worker", ["role", "worker"],
                              registry=r)
        self.retries = Counter("pdserve_request_retries",
                               "Requests tried again after a worker was found dead before streaming", registry=r)
        self.pool_workers = Gauge("pdserve_pool_workers", "Ready workers per pool", ["role"], registry=r)
        # Per tenant: an API key's name in the key file, or a hash of it (never the key).
        t = ["tenant"]
        self.tenant_admitted = Counter("pdserve_tenant_requests_admitted", "Requests admitted, per tenant", t,
                                       registry=r)
        self.tenant_refused = Counter("pdserve_tenant_requests_refused",
                                      "Requests refused with 429, per tenant and reason (overloaded, "
                                      "rate_limit_exceeded)", t + ["reason"], registry=r)
        self.tenant_queued = Gauge("pdserve_tenant_queued_requests", "Requests waiting to be dispatched, per tenant",
                                   t, registry=r)
        self.tenant_running = Gauge("pdserve_tenant_running_requests", "Requests dispatched to the workers and not "
                                    "finished, per tenant", t, registry=r)
        self.tenant_wait = Histogram("pdserve_tenant_queue_wait_seconds", "Time from admission to dispatch, per "
                                     "tenant", t, buckets=QUEUE_BUCKETS, registry=r)
        self.running = Gauge("pdserve_running_requests", "Requests dispatched to the workers and not finished",
                             registry=r)
        self.dispatch_limit = Gauge("pdserve_dispatch_limit", "Sequences the router dispatches to the workers at "
                                    "once (--max-running, or the decode pool's batch capacity)", registry=r)
        self.cost_model = Gauge("pdserve_prefill_cost_model", "The routing cost model's terms (policy.CostModel): "
                                "prefill seconds a prompt token, the remote path's seconds beyond the prompt's "
                                "own compute (reservation, calls, the prefill worker's queue), transfer-tail "
                                "seconds a prompt token", ["term"], registry=r)
        self.autoscaler = AutoscalerExport()
        r.register(self.autoscaler)
        # vLLM's names for what its API server counts, one series per served model.
        m = ["model_name"]
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                   m, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                  m, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                                  m, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                          m, registry=r).labels(model_name)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                              m, registry=r).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       m + ["finished_reason"], registry=r)
        self.model_name = model_name
        for reason in FINISH_REASONS:                   # present at 0, as vLLM's are
            self.request_success.labels(model_name, reason)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm_itl.observe(seconds)

    def request_ended(self, seconds: float, prompt_tokens: int, completion_tokens: int,
                      finish_reason: str | None) -> None:
        """Every admitted request, however it ended; `finish_reason` only for one that
        ran to its end (not for an error, a timeout or a client gone)."""
        self.e2e.observe(seconds)
        self.vllm_e2e.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)
        self.vllm_prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.vllm_generation_tokens.inc(completion_tokens)
        if finish_reason:
            self.request_success.labels(self.model_name, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SpecExport:
    """Speculative decoding's totals as vLLM's spec_decode counters, every draft position
    from the start; read at each scrape from the engine's own counts, so the engine
    thread does nothing for them."""

    def __init__(self, totals: Callable[[], object], model_name: str) -> None:
        self.totals, self.model_name = totals, model_name

    def collect(self):
        t = self.totals()
        families = []
        for key, name, text in SPEC_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], getattr(t, key))
            families.append(family)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens per draft position.", labels=["model_name", "position"])
        for pos, n in enumerate(list(t.accepted_per_pos)):
            per_pos.add_metric([self.model_name, str(pos)], n)
        return families + [per_pos]


class AutoscalerExport:
    """The autoscaler's desired replicas and decision counts, as last read from wherever
    it publishes them (the registry): exported as they are, since the autoscaler may run
    in another process. No autoscaler (its status expired): no desired-replicas series."""

    def __init__(self) -> None:
        self.desired: dict[str, int] = {}
        self.decisions: dict[tuple[str, str], int] = {}

    def update(self, desired: dict[str, int], decisions: dict[tuple[str, str], int]) -> None:
        self.desired, self.decisions = dict(desired), dict(decisions)

    def collect(self):
        desired = GaugeMetricFamily("pdserve_autoscaler_desired_replicas",
                                    "Replicas the autoscaler wants per pool", labels=["role"])
        for role, n in sorted(self.desired.items()):
            desired.add_metric([role], n)
        decisions = CounterMetricFamily("pdserve_autoscaler_decisions",
                                        "Autoscaler decisions (one per pool per tick) by reason",
                                        labels=["role", "reason"])
        for (role, reason), n in sorted(self.decisions.items()):
            decisions.add_metric([role, reason], n)
        return [desired, decisions]
