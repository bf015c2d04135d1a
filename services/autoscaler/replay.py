"""Replay a load trace through the autoscaling policy and a simple capacity model, and
plot each pool's replicas against the load that drives it.

    python -m services.autoscaler.replay --trace run.json --out replay.png

The trace is a `pdserve bench --json` file (or one from services/autoscaler/traces.py):
each request's start time, prompt length and output length. Nothing else of it is used:
latencies come from the model below, so a trace recorded on one machine replays on
another pool of workers. The policy is the real Planner (core.py), ticking on the
simulated clock; the model is deliberately small, and every number in it is a flag:

  prefill  each worker works through a FIFO queue at --prefill-tokens-per-s (busy while
           it has one)
  decode   each worker runs up to --max-batch sequences within --kv-tokens of KV; a step
           emits one token per sequence and takes --step-ms + --step-ms-per-seq x batch
  cold     a worker younger than --cold-seconds is --cold-factor times slower
  router   a request goes to the prefill worker with the fewest queued tokens, then to
           the decode worker with the fewest sequences (draining workers get none)
  workers  register --start-seconds after they are asked for; a removed worker takes no
           new work and leaves once what it holds is done (decode: its waiting sequences
           move to the others, as the router's retry does)
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from services.autoscaler.core import (ROLES, Decision, Limits, Planner, Policy, PoolBounds, PoolObservation, Role,
                                      WorkerSample, choose_victims)
from services.common.histograms import EMPTY, NUM_BUCKETS, bucket_of, merge, quantile

BLOCK = 16                              # tokens per KV block, for the utilisation the workers report


@dataclass(frozen=True)
class Capacity:
    prefill_tokens_per_s: float = 8000.0
    step_ms: float = 15.0
    step_ms_per_seq: float = 0.5
    max_batch: int = 64
    kv_tokens: int = 131072
    cold_seconds: float = 20.0
    cold_factor: float = 3.0
    start_seconds: float = 30.0


@dataclass
class Request:
    arrival: float
    prompt: int
    output: int
    done: int = 0                       # prefill: prompt tokens computed; decode: tokens generated


@dataclass
class Worker:
    role: Role
    epoch: str
    started_at: float
    queue: deque = field(default_factory=deque)         # prefill: waiting prompts; decode: waiting sequences
    running: list = field(default_factory=list)         # decode
    carry: float = 0.0                                  # decode: time banked toward the next step
    samples: Counter = field(default_factory=Counter)   # latency bucket -> count since the last tick
    busy: float = 0.0                                   # prefill: seconds computing since the last tick
    draining: bool = False

    @property
    def address(self) -> str:
        return f"sim:{self.epoch}"

    def queued_tokens(self) -> int:
        return sum(r.prompt - r.done for r in self.queue)

    def kv_used(self) -> int:
        return sum(r.prompt + r.output for r in self.running)

    def idle(self) -> bool:
        return not self.queue and not self.running


@dataclass
class Row:
    """One tick of the replay."""
    t: float
    replicas: dict[Role, int]
    ready: dict[Role, int]
    prompt_tokens_per_s: float
    sequences: int
    ttft_p90: float | None
    itl_p90: float | None
    decisions: dict[Role, Decision]


class Simulation:
    def __init__(self, requests: list[Request], policy: Policy, limits: Limits, capacity: Capacity,
                 tick: float, dt: float = 0.05) -> None:
        self.requests = deque(sorted(requests, key=lambda r: r.arrival))
        self.policy, self.limits, self.cap = policy, limits, capacity
        self.tick_s, self.dt = tick, dt
        self.now = 0.0
        self.planner = Planner(policy, lambda: self.now)
        self.epochs = itertools.count()
        self.workers: dict[Role, list[Worker]] = {r: [] for r in ROLES}
        self.pending: dict[Role, list[float]] = {r: [] for r in ROLES}     # when each registers
        for role in ROLES:
            for _ in range(limits.bounds(role).min):
                self.workers[role].append(Worker(role, f"{role.value}-{next(self.epochs)}", -policy.warmup))
        self.rows: list[Row] = []
        self.ttft_all: Counter = Counter()
        self.itl_all: Counter = Counter()
        self._arrived_tokens = 0

    def serving(self, role: Role) -> list[Worker]:
        return [w for w in self.workers[role] if not w.draining]

    def slowdown(self, w: Worker) -> float:
        return self.cap.cold_factor if self.now - w.started_at < self.cap.cold_seconds else 1.0

    # ---- the model ----
    def _arrivals(self) -> None:
        while self.requests and self.requests[0].arrival <= self.now:
            r = self.requests.popleft()
            self._arrived_tokens += r.prompt
            min(self.serving(Role.PREFILL), key=Worker.queued_tokens).queue.append(r)

    def _prefill(self, w: Worker) -> None:
        budget = self.dt * self.cap.prefill_tokens_per_s / self.slowdown(w)
        if w.queue:
            w.busy += self.dt
        while w.queue and budget > 0:
            r = w.queue[0]
            used = min(budget, r.prompt - r.done)
            r.done += used
            budget -= used
            if r.done >= r.prompt:
                w.queue.popleft()
                ttft = self.now - r.arrival
                w.samples[bucket_of(ttft)] += 1
                self.ttft_all[bucket_of(ttft)] += 1
                r.done = 1                                  # the first token came with the prefill
                min(self.serving(Role.DECODE), key=lambda d: len(d.running) + len(d.queue)).queue.append(r)

    def _decode(self, w: Worker) -> None:
        while w.queue and len(w.running) < self.cap.max_batch and \
                w.kv_used() + w.queue[0].prompt + w.queue[0].output <= self.cap.kv_tokens:
            w.running.append(w.queue.popleft())
        if not w.running:
            w.carry = 0.0
            return
        w.carry += self.dt
        while w.running:
            step = (self.cap.step_ms + self.cap.step_ms_per_seq * len(w.running)) / 1000 * self.slowdown(w)
            if w.carry < step:
                break
            w.carry -= step
            w.samples[bucket_of(step)] += len(w.running)
            self.itl_all[bucket_of(step)] += len(w.running)
            for r in w.running:
                r.done += 1
            w.running = [r for r in w.running if r.done < r.output]

    def _lifecycle(self) -> None:
        for role in ROLES:
            for at in [a for a in self.pending[role] if a <= self.now]:
                self.pending[role].remove(at)
                self.workers[role].append(Worker(role, f"{role.value}-{next(self.epochs)}", self.now))
            for w in [w for w in self.workers[role] if w.draining]:
                if role is Role.DECODE and w.queue:         # not admitted yet: the router retries elsewhere
                    while w.queue:
                        min(self.serving(role), key=lambda d: len(d.running) + len(d.queue)).queue.append(
                            w.queue.popleft())
                if w.idle():
                    self.workers[role].remove(w)

    # ---- the autoscaler ----
    def _observe(self, role: Role) -> PoolObservation:
        samples = []
        for w in self.serving(role):
            hist = tuple(w.samples.get(i, 0) for i in range(NUM_BUCKETS))
            w.samples.clear()
            used = w.kv_used() if role is Role.DECODE else 0
            busy = w.busy / self.tick_s if role is Role.PREFILL else None
            w.busy = 0.0
            samples.append(WorkerSample(w.epoch, w.address, w.started_at, w.queued_tokens() if role is Role.PREFILL
                                        else 0, math.ceil(used / BLOCK), self.cap.kv_tokens // BLOCK,
                                        len(w.running) + len(w.queue), hist, busy))
        draining = sum(w.draining for w in self.workers[role])
        return PoolObservation(role, len(samples) + len(self.pending[role]), tuple(samples), draining)

    def _tick(self) -> None:
        observations = {r: self._observe(r) for r in ROLES}
        window = {r: functools.reduce(merge, (w.latency for w in observations[r].workers), EMPTY) for r in ROLES}
        decisions = self.planner.tick(observations, self.limits)
        for d in sorted(decisions.values(), key=lambda d: d.desired - d.current):
            if d.changed:
                self._apply(d, observations[d.role])
        sequences = sum(len(w.running) + len(w.queue) for w in self.workers[Role.DECODE])
        self.rows.append(Row(self.now, {r: decisions[r].desired for r in ROLES},
                             {r: decisions[r].ready for r in ROLES}, self._arrived_tokens / self.tick_s, sequences,
                             quantile(window[Role.PREFILL], 0.9), quantile(window[Role.DECODE], 0.9), decisions))
        self._arrived_tokens = 0

    def _apply(self, d: Decision, obs: PoolObservation) -> None:
        if d.desired > d.current:
            self.pending[d.role] += [self.now + self.cap.start_seconds] * (d.desired - d.current)
        else:
            cancel = min(len(self.pending[d.role]), d.current - d.desired)
            del self.pending[d.role][len(self.pending[d.role]) - cancel:]
            for address in choose_victims(d.role, obs.workers, d.current - d.desired - cancel):
                next(w for w in self.workers[d.role] if w.address == address).draining = True
        self.planner.applied(d.role, d.desired)

    def run(self) -> list[Row]:
        end = (self.requests[-1].arrival if self.requests else 0) + 300
        next_tick = self.tick_s
        steps = int(end / self.dt)
        for i in range(1, steps + 1):
            self.now = i * self.dt
            self._arrivals()
            for w in self.workers[Role.PREFILL]:
                self._prefill(w)
            for w in self.workers[Role.DECODE]:
                self._decode(w)
            self._lifecycle()
            if self.now + 1e-9 >= next_tick:
                self._tick()
                next_tick += self.tick_s
        return self.rows


def load_trace(path: str | Path) -> list[Request]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "requests" not in doc:
        raise ValueError(f"{path}: not a `pdserve bench --json` file")
    return [Request(float(r["start"]), int(r["prompt_len"]), max(1, int(r.get("output_len") or
                                                                       r["requested_output_len"])))
            for r in doc["requests"] if r.get("error") is None]


def plot(rows: list[Row], path: str | Path, title: str, policy: Policy) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r.t / 60 for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    for ax, role, load, label, color in (
            (axes[0], Role.PREFILL, [r.prompt_tokens_per_s for r in rows], "prompt tokens/s arriving", "tab:blue"),
            (axes[1], Role.DECODE, [r.sequences for r in rows], "sequences in decode", "tab:orange")):
        ax.step(t, [r.replicas[role] for r in rows], where="post", color="black", label=f"{role.value} replicas")
        ax.step(t, [r.ready[role] for r in rows], where="post", color="gray", linestyle=":", label="ready (warm)")
        ax.set_ylabel(f"{role.value} workers")
        ax.set_ylim(0, max(r.replicas[role] for r in rows) + 1)
        ax.grid(alpha=0.3)
        twin = ax.twinx()
        twin.fill_between(t, load, step="post", alpha=0.25, color=color, label=label)
        twin.set_ylabel(label, color=color)
        lines, labels = ax.get_legend_handles_labels()
        lines2, labels2 = twin.get_legend_handles_labels()
        ax.legend(lines + lines2, labels + labels2, loc="upper left", fontsize=8)
    ax = axes[2]
    ax.plot(t, [r.ttft_p90 / policy.slo_ttft if r.ttft_p90 else math.nan for r in rows], label="TTFT p90 / SLO",
            color="tab:blue")
    ax.plot(t, [r.itl_p90 / policy.slo_itl if r.itl_p90 else math.nan for r in rows], label="ITL p90 / SLO",
            color="tab:orange")
    ax.axhline(1.0, color="red", linewidth=0.8, linestyle="--", label="SLO")
    ax.set_yscale("log")
    ax.set_ylabel("latency over SLO (per tick)")
    ax.set_xlabel("minutes")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(sim: Simulation) -> str:
    lines = []
    for row in sim.rows:
        for d in row.decisions.values():
            if d.changed:
                lines.append(f"  {row.t:7.0f} s  {d}")
    worker_s = {r: sum(row.replicas[r] for row in sim.rows) * sim.tick_s for r in ROLES}
    ttft, itl = quantile(tuple(sim.ttft_all.get(i, 0) for i in range(NUM_BUCKETS)), 0.9), \
        quantile(tuple(sim.itl_all.get(i, 0) for i in range(NUM_BUCKETS)), 0.9)
    lines.append(f"  TTFT p90 {ttft * 1000:.0f} ms (SLO {sim.policy.slo_ttft * 1000:.0f}), ITL p90 {itl * 1000:.0f} ms "
                 f"(SLO {sim.policy.slo_itl * 1000:.0f}); worker-minutes: prefill {worker_s[Role.PREFILL] / 60:.0f}, "
                 f"decode {worker_s[Role.DECODE] / 60:.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    c, p = Capacity(), Policy(slo_ttft=2.0, slo_itl=0.05, window=30, warmup=30, scale_out_cooldown=30,
                              scale_in_cooldown=60, scale_in_after=60, pending_timeout=600, manual_hold=60)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True, metavar="RUN.json", help="a `pdserve bench --json` file")
    parser.add_argument("--out", required=True, metavar="PLOT.png")
    parser.add_argument("--tick", type=float, default=10.0, help="seconds between autoscaler decisions")
    parser.add_argument("--slo-ttft", type=float, default=p.slo_ttft * 1000, metavar="MS")
    parser.add_argument("--slo-itl", type=float, default=p.slo_itl * 1000, metavar="MS")
    parser.add_argument("--max-prefill", type=int, default=6)
    parser.add_argument("--max-decode", type=int, default=6)
    parser.add_argument("--budget", type=int, default=None)
    for name in Capacity.__dataclass_fields__:
        parser.add_argument("--" + name.replace("_", "-"), type=type(getattr(c, name)), default=getattr(c, name))
    a = parser.parse_args(argv)
    policy = Policy(**{**p.__dict__, "slo_ttft": a.slo_ttft / 1000, "slo_itl": a.slo_itl / 1000})
    capacity = Capacity(**{name: getattr(a, name) for name in Capacity.__dataclass_fields__})
    limits = Limits(PoolBounds(1, a.max_prefill), PoolBounds(1, a.max_decode), a.budget)
    requests = load_trace(a.trace)
    sim = Simulation(requests, policy, limits, capacity, a.tick)
    sim.run()
    title = (f"{Path(a.trace).name}: {len(requests)} requests replayed; SLO TTFT {a.slo_ttft:g} ms, "
             f"ITL {a.slo_itl:g} ms; decisions every {a.tick:g} s")
    plot(sim.rows, a.out, title, policy)
    print(f"{title}\n{summary(sim)}\n  plot: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
