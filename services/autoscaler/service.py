"""The autoscaler's loop: `pdserve autoscaler`, or a thread of `pdserve up --autoscale`.

Every --autoscale-interval seconds:
  read   live bounds (<ns>:autoscaler:bounds), the workers' records and the routers'
         latency reports from the registry; each pool's size from the actuator
  decide the Planner (core.py), on latency samples new since the last tick
  act    decreases first, then increases (a rebalance never holds both slots at once);
         a decrease names its victims: the least loaded, then the youngest workers
  tell   the status and the decision counts to the registry (routers export them on
         their /metrics), the log (every change, with its reason), and this process's
         own /metrics and /healthz when --metrics-port is given

Bounds and the budget can be edited while it runs, e.g.
    redis-cli HSET pdserve:autoscaler:bounds max_decode 6 budget 8
Fields: min_prefill, max_prefill, min_decode, max_decode, budget ("" or "none": no
budget), prefill_cost, decode_cost. A field that does not parse, or bounds that do not
fit together, are logged and the command-line values used instead.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from services.autoscaler.actuators import Actuator, actuator_class
from services.autoscaler.core import ROLES, Decision, Limits, Planner, PoolBounds, PoolObservation, Role, \
    WorkerSample, choose_victims
from services.common.histograms import EMPTY, LATENCY_BOUNDS, BusyFraction, CumulativeDeltas, merge
from services.common.registry import RedisRegistry
from services.common.security import ClusterSecret
from services.autoscaler.settings import AutoscalerSettings
from services.rpc import autoscaler_pb2

log = logging.getLogger(__name__)


def limits_with_overrides(base: Limits, fields: dict[str, str]) -> tuple[Limits, str | None]:
    """The command line's limits with the live overrides applied, or the base limits and
    why the overrides were refused."""
    if not fields:
        return base, None
    try:
        def num(key: str, default: int) -> int:
            return int(fields[key]) if key in fields else default
        budget = base.budget
        if "budget" in fields:
            budget = None if fields["budget"].strip().lower() in ("", "none") else int(fields["budget"])
        return Limits(PoolBounds(num("min_prefill", base.prefill.min), num("max_prefill", base.prefill.max)),
                      PoolBounds(num("min_decode", base.decode.min), num("max_decode", base.decode.max)),
                      budget, num("prefill_cost", base.prefill_cost), num("decode_cost", base.decode_cost)), None
    except ValueError as exc:
        return base, f"live bounds {fields} refused: {exc}"


@dataclass(frozen=True)
class Change:
    """One line of the timeline: a pool's replicas were set."""
    at: float                           # unix seconds
    decision: Decision


class Autoscaler:
    def __init__(self, settings: AutoscalerSettings, registry: RedisRegistry, actuator: Actuator,
                 clock: Callable[[], float] = time.time, announce: Callable[[Change], None] | None = None) -> None:
        self.settings = settings
        self.announce = announce or (lambda change: log.info("autoscaler: %s", change.decision))
        self.registry = registry
        self.actuator = actuator
        self.clock = clock
        # The planner's timers (cooldowns, holds, pending capacity) run on a clock that
        # never steps; a test's own clock stands for both.
        self.planner = Planner(settings.policy, time.monotonic if clock is time.time else clock)
        self._first_seen: dict[str, float] = {}     # worker epoch -> when this autoscaler first saw it
        self.deltas = CumulativeDeltas()
        self.busy = BusyFraction()
        self.timeline: list[Change] = []
        self.metrics = AutoscalerMetrics()
        self.last_tick = 0.0
        self._refused: str | None = None
        self._good_limits = settings.limits
        self._reasons: dict[Role, str] = {}

    async def run(self, stop: asyncio.Event | threading.Event) -> None:
        log.info("autoscaler: %s actuator, a tick every %g s", self.actuator.name, self.settings.interval)
        while not stop.is_set():
            due = time.monotonic() + self.settings.interval
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaler tick failed; trying again next tick")
            while not stop.is_set() and time.monotonic() < due:
                await asyncio.sleep(min(0.5, due - time.monotonic()))

    async def tick(self) -> dict[Role, Decision]:
        limits, refused = limits_with_overrides(self.settings.limits, await self.registry.bounds_overrides())
        if refused:
            limits = self._good_limits          # keep the last accepted overrides, not the command line
        self._good_limits = limits
        if refused != self._refused:
            (log.warning if refused else log.info)(refused or "live bounds accepted")
            self._refused = refused
        observations = await self._observe()
        decisions = self.planner.tick(observations, limits)
        for d in sorted(decisions.values(), key=lambda d: d.desired - d.current):      # decreases first
            if d.changed:
                self._act(d, observations[d.role])
            elif self._reasons.get(d.role) != d.reason.value:
                log.debug("autoscaler: %s", d)
            self._reasons[d.role] = d.reason.value
        await self._publish(decisions)
        self.metrics.record(decisions)
        self.last_tick = time.monotonic()
        return decisions

    def _act(self, d: Decision, obs: PoolObservation) -> None:
        victims = choose_victims(d.role, obs.workers, d.current - d.desired) if d.desired < d.current else []
        try:
            if self.actuator.scale(d.role, d.desired, victims):
                self.planner.applied(d.role, d.desired)
        except Exception:
            # it may have been applied all the same: whatever is observed next is not a manual edit
            log.exception("autoscaler: setting %s to %d failed", d.role.value, d.desired)
            self.planner.forget(d.role)
            return
        change = Change(self.clock(), d)
        self.timeline.append(change)
        self.announce(change)

    async def _observe(self) -> dict[Role, PoolObservation]:
        workers = await self.registry.workers()
        latency = self._new_latency(await self.registry.latency_reports())
        out = {}
        self.busy.forget_except({w.epoch for w in workers})
        started = self._started(workers)
        for role in ROLES:
            mine = [w for w in workers if w.role == role.value]
            samples = tuple(WorkerSample(w.epoch, w.address, started[w.epoch], w.queued_prefill_tokens,
                                         w.num_blocks - w.free_blocks, w.num_blocks, w.running + w.waiting,
                                         latency.get((role, w.epoch), EMPTY),
                                         self.busy.update(w.epoch, w.reported_at, w.busy_seconds)
                                         if role is Role.PREFILL else None) for w in mine)
            size = self.actuator.observe(role, len(mine))
            out[role] = PoolObservation(role, size.replicas, samples, size.draining)
        return out

    def _started(self, workers) -> dict[str, float]:
        """Each worker's start on the planner's clock: its own report of it (its host's
        wall clock), but never later than when this autoscaler first saw it, so a host
        whose clock runs ahead does not keep its worker warming for ever."""
        wall, now = self.clock(), self.planner.clock()
        seen = {w.epoch: self._first_seen.get(w.epoch, now) for w in workers}
        self._first_seen = seen
        return {w.epoch: min(now - max(0.0, wall - w.started_at), seen[w.epoch]) for w in workers}

    def _new_latency(self, reports: list[autoscaler_pb2.LatencyReport]) -> dict[tuple[Role, str], tuple]:
        """Samples new since the last tick per (pool, worker epoch), over every router."""
        out: dict[tuple[Role, str], tuple] = {}
        for report in reports:
            if tuple(report.bounds) != LATENCY_BOUNDS:
                log.warning("router %s reports latency in other buckets; ignored", report.router_id)
                continue
            series = {(role, w.epoch): w.counts for role, ws in ((Role.PREFILL, report.ttft), (Role.DECODE, report.itl))
                      for w in ws}
            for key, new in self.deltas.feed(report.router_id, series).items():
                out[key] = merge(out.get(key, EMPTY), new)
        self.deltas.end_tick()
        return out

    async def _publish(self, decisions: dict[Role, Decision]) -> None:
        status = autoscaler_pb2.AutoscalerStatus(updated_at=time.time(), actuator=self.actuator.name, pools=[
            autoscaler_pb2.PoolStatus(role=d.role.value, desired=d.desired, current=d.current, ready=d.ready,
                                      warming=d.warming, pending=d.pending, draining=d.draining,
                                      reason=d.reason.value, detail=d.detail,
                                      pressure=-1.0 if d.pressure is None else d.pressure)
            for d in decisions.values()])
        try:
            await self.registry.publish_autoscaler(status, ttl=3 * self.settings.interval + 10)
        except Exception as exc:
            log.warning("cannot publish the autoscaler's status to %s: %s", self.registry.where, exc)

    def healthy(self) -> bool:
        return time.monotonic() - self.last_tick < 3 * self.settings.interval + 30


class AutoscalerMetrics:
    """This process's own view, for /metrics when it runs on its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge("pdserve_autoscaler_desired_replicas", "Replicas the autoscaler wants per pool",
                             ["role"], registry=r)
        self.current = Gauge("pdserve_autoscaler_current_replicas", "Replicas the pool was set to when observed",
                             ["role"], registry=r)
        self.workers = Gauge("pdserve_autoscaler_workers", "Workers per pool by state", ["role", "state"],
                             registry=r)
        self.pressure = Gauge("pdserve_autoscaler_pressure", "Largest signal over its target (1 = at target)",
                              ["role"], registry=r)
        self.decisions = Counter("pdserve_autoscaler_decisions", "Decisions (one per pool per tick) by reason",
                                 ["role", "reason"], registry=r)

    def record(self, decisions: dict[Role, Decision]) -> None:
        for d in decisions.values():
            role = d.role.value
            self.desired.labels(role).set(d.desired)
            self.current.labels(role).set(d.current)
            for state in ("ready", "warming", "pending", "draining"):
                self.workers.labels(role, state).set(getattr(d, state))
            self.pressure.labels(role).set(-1 if d.pressure is None else d.pressure)
            self.decisions.labels(role, d.reason.value).inc()


def serve_metrics(autoscaler: Autoscaler, host: str, port: int) -> ThreadingHTTPServer:
    """/metrics, and /healthz: 200 while ticks keep coming (the liveness probe)."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                code, body = 200, generate_latest(autoscaler.metrics.registry)
            elif self.path == "/healthz":
                code, body = (200, b"ok\n") if autoscaler.healthy() else (503, b"no tick lately\n")
            else:
                code, body = 404, b"not found\n"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="autoscaler-metrics").start()
    return server


def build_actuator(settings: AutoscalerSettings) -> Actuator:
    cls = actuator_class(settings.actuator)
    if settings.actuator == "kubernetes":
        from services.autoscaler.actuators.kubernetes import api_client
        return cls(settings.namespace, {Role.PREFILL: settings.prefill_deployment,
                                        Role.DECODE: settings.decode_deployment}, api_client(settings.kubeconfig))
    return cls()


async def serve(settings: AutoscalerSettings) -> None:
    """`pdserve autoscaler`: until SIGTERM or SIGINT."""
    from services.common.lifecycle import stop_event_on_signals
    registry = RedisRegistry(settings.redis, secret=ClusterSecret.from_file(settings.cluster_secret_file))
    autoscaler = Autoscaler(settings, registry, build_actuator(settings))
    server = None
    if settings.metrics_port is not None:
        server = serve_metrics(autoscaler, settings.host, settings.metrics_port)
        autoscaler.last_tick = time.monotonic()         # healthy until the first tick is due
    stop = stop_event_on_signals(asyncio.get_running_loop())
    task = asyncio.create_task(autoscaler.run(stop))
    await stop.wait()
    task.cancel()
    if server is not None:
        server.shutdown()
    await registry.close()
