"""Prometheus metrics: one registry per service instance (no process-global state)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60, 120)


class WorkerMetrics:
    def __init__(self, role: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens_computed = Counter(
            "pdserve_prompt_tokens_computed", "Prompt tokens this worker ran through the model", registry=r)
        self.generated_tokens = Counter("pdserve_generated_tokens", "Tokens sampled by this worker", registry=r)
        self.kv_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes moved through the transport",
                                ["direction", "backend"], registry=r)
        self.kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "Time spent in KV writes per request",
                                             ["backend"], buckets=LATENCY_BUCKETS, registry=r)
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
        self.step_seconds = Histogram("pdserve_engine_step_seconds", "Engine step time", ["kind"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.role = role

    def serve(self, host: str, port: int) -> int:
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_requests", "Requests by API and outcome", ["api", "outcome"], registry=r)
        self.decisions = Counter("pdserve_disaggregation_decisions", "Requests by prefill decision",
                                 ["decision"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("pdserve_queue_time_seconds", "Time waiting for KV blocks",
                                    buckets=LATENCY_BUCKETS, registry=r)
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
        self.autoscaler = AutoscalerExport()
        r.register(self.autoscaler)

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
