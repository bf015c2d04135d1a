"""The autoscaling policy (services/autoscaler/core.py) in scenarios an SRE relies on,
over simulated time with the default Policy and 15 s ticks: a worker replaced under a
latency-bound pool, workers that never finish warming, budgets of unequal costs, two
starved pools, a burst on one tick, and (through the service) an actuator call that
fails after it was applied, and live bounds refused. Every worker, warm or warming,
takes an equal share of the traffic here (test_autoscaler_core.py's world gives it to
the warm ones)."""
from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field, replace

from services.autoscaler.core import (ROLES, Limits, Planner, Policy, PoolBounds, PoolObservation, Reason, Role,
                                      WorkerSample, choose_victims)
from services.common.histograms import histogram

P, D = Role.PREFILL, Role.DECODE
TICK = 15.0


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Pool:
    workers: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    draining: list = field(default_factory=list)
    current: int = 0
    latency: float = 0.0        # latency over its SLO that one worker would show
    load: float = 0.0           # queued prompt tokens (prefill) or running sequences (decode), all told


class World:
    def __init__(self, limits: Limits | None = None, prefill: int = 1, decode: int = 1,
                 start_delay: float = 30.0) -> None:
        self.clock, self.policy = Clock(), Policy()
        self.planner = Planner(self.policy, self.clock)
        self.limits = limits or Limits(PoolBounds(1, 8), PoolBounds(1, 8))
        self.start_delay = start_delay
        self.epochs = itertools.count()
        self.pools = {P: Pool(), D: Pool()}
        for role, n in ((P, prefill), (D, decode)):
            for _ in range(n):
                self.register(role, self.clock.t - self.policy.warmup - 1000)
            self.pools[role].current = n
        self.log: list[dict] = []

    def register(self, role: Role, started_at: float) -> None:
        n = next(self.epochs)
        self.pools[role].workers.append(WorkerSample(f"{role.value}-{n}", f"10.0.0.{n}:7001", started_at))

    def observe(self, role: Role) -> PoolObservation:
        pool = self.pools[role]
        slo = self.policy.slo_ttft if role is P else self.policy.slo_itl
        n = max(len(pool.workers), 1)
        out = []
        for w in pool.workers:
            h = histogram([slo * pool.latency / n] * 50) if pool.latency else histogram([])
            load = int(pool.load / n)
            out.append(replace(w, latency=h, **({"queued_prefill_tokens": load} if role is P else {"running": load})))
        return PoolObservation(role, pool.current, tuple(out), len(pool.draining))

    def run(self, seconds: float, hook=None) -> None:
        for _ in range(int(seconds / TICK)):
            self.clock.t += TICK
            for role, pool in self.pools.items():
                for asked in [a for a in pool.pending if self.clock.t - a >= self.start_delay]:
                    pool.pending.remove(asked)
                    self.register(role, self.clock.t)
                pool.draining = [t for t in pool.draining if t > self.clock.t]
            if hook is not None:
                hook(self)
            decisions = self.planner.tick({r: self.observe(r) for r in ROLES}, self.limits)
            for decrease in (True, False):
                for role in ROLES:
                    self.apply(role, decisions[role].desired, decrease)
            self.log.append(decisions)

    def apply(self, role: Role, desired: int, decrease: bool) -> None:
        pool = self.pools[role]
        if decrease and desired < pool.current:
            for _ in range(pool.current - desired):
                if pool.pending:
                    pool.pending.pop()
                    continue
                victim = choose_victims(role, pool.workers, 1)[0]
                pool.workers = [w for w in pool.workers if w.address != victim]
                pool.draining.append(self.clock.t + 30)
        elif not decrease and desired > pool.current:
            pool.pending += [self.clock.t] * (desired - pool.current)
        else:
            return
        pool.current = desired
        self.planner.applied(role, desired)

    def changes(self, role: Role) -> list[tuple[int, int, str]]:
        return [(d[role].current, d[role].desired, d[role].reason.value) for d in self.log if d[role].changed]


def test_a_replaced_worker_does_not_cut_a_latency_bound_pool():
    """Two decode workers each at 0.55x the ITL SLO (one alone would be at 1.1x): calm,
    held. One restarts as a new epoch (OOM, rollout): the latency window empties with
    the warm set, and scale-in was judged on load alone, cutting the pool to one worker
    and ITL over its SLO until the next scale-out."""
    w = World(decode=2, start_delay=60)
    w.pools[D].latency, w.pools[D].load = 1.1, 8
    w.run(900)
    assert w.changes(D) == []
    w.pools[D].workers = w.pools[D].workers[:1]
    w.register(D, w.clock.t)
    w.run(900)
    assert w.changes(D) == []


def test_workers_that_never_finish_warming_do_not_freeze_the_pool():
    """An overloaded prefill pool with a worker that crash-loops (a new epoch every 45 s,
    always warming): it scaled out never again, settling forever."""
    w = World(prefill=2)
    w.pools[P].load = 2 * 8192 * 2.5
    w.pools[P].current = 3
    w.register(P, w.clock.t)

    def crash_loop(world: World) -> None:
        pool = world.pools[P]
        young = [x for x in pool.workers if world.clock.t - x.started_at < 60]
        if young and world.clock.t - young[0].started_at >= 40:
            pool.workers.remove(young[0])
            world.register(P, world.clock.t)
    w.run(1800, crash_loop)
    assert any(reason == "scale_out_load" for _, _, reason in w.changes(P))


def test_a_budget_of_unequal_costs_does_not_drain_one_pool_for_the_other_forever():
    """Budget 4, a prefill worker costing 2, decode 1: prefill over its SLO, decode calm
    on two workers. Draining one decode worker frees 1 slot, prefill needs 2: the slot
    went back to decode, which was drained again every 5 min, for ever."""
    w = World(Limits(PoolBounds(1, 4), PoolBounds(1, 4), budget=4, prefill_cost=2, decode_cost=1), decode=2)
    w.pools[P].latency, w.pools[D].latency = 3.0, 1.1
    w.run(3 * 3600)
    assert w.changes(D) == []


def test_of_two_starved_pools_the_one_further_over_its_slo_is_rebalanced_for():
    """Budget full, prefill at 1.05x, decode at 3x: only prefill (first) was ever
    considered, and decode stayed at 3x its SLO."""
    w = World(Limits(PoolBounds(1, 4), PoolBounds(1, 4), budget=4), prefill=2, decode=2)
    w.pools[P].latency, w.pools[D].latency = 2 * 1.05, 2 * 3.0
    w.run(3600)
    assert (2, 1, "rebalance") in w.changes(P) and w.pools[D].current == 3


def test_a_burst_on_one_tick_does_not_scale_out():
    """Queued prompt tokens are a snapshot: a burst once every 10 min, seen on one tick,
    scaled prefill out, and five minutes later back in, every time."""
    w = World()

    def burst(world: World) -> None:
        world.pools[P].load = (1.3 if int(world.clock.t - 1_700_000_000) % 600 == 0 else 0.2) * 8192
    w.run(3 * 3600, burst)
    assert w.changes(P) == []


def test_an_actuator_call_that_fails_after_it_applied_is_not_taken_for_a_manual_edit():
    """A Kubernetes PATCH applied whose answer came too late raised out of the tick: the
    other pool's change of that tick was lost, and the next tick read the autoscaler's
    own change as a manual edit, held for manual_hold."""
    from services.autoscaler.actuators import PoolSize
    from services.autoscaler.service import Autoscaler
    from services.autoscaler.settings import AutoscalerSettings
    from services.rpc import worker_pb2
    clock = Clock()

    class Registry:
        where = "fake"

        async def bounds_overrides(self):
            return {}

        async def latency_reports(self):
            return []

        async def publish_autoscaler(self, status, ttl):
            pass

        async def workers(self):
            return [worker_pb2.WorkerInfo(role=role, epoch=f"{role}{i}", address=f"10.0.{r}.{i}:1",
                                          started_at=clock.t - 3600, num_blocks=100, free_blocks=100,
                                          queued_prefill_tokens=30000 if role == "prefill" else 0)
                    for r, (role, n) in enumerate((("prefill", 1), ("decode", 3))) for i in range(n)]

    class LateAnswers:
        name = "kubernetes"

        def __init__(self) -> None:
            self.replicas = {P: 1, D: 3}

        def observe(self, role, registered):
            return PoolSize(self.replicas[role])

        def scale(self, role, n, victims):
            self.replicas[role] = n                 # applied ...
            if role is D:
                raise TimeoutError("read timed out")      # ... the answer too late
            return True
    settings = AutoscalerSettings(redis=None, policy=Policy(scale_in_after=0, scale_in_cooldown=0),
                                  limits=Limits(PoolBounds(1, 4), PoolBounds(1, 4)))
    scaler = Autoscaler(settings, Registry(), LateAnswers(), clock=clock)

    async def ticks():
        out = []
        for _ in range(3):
            clock.t += TICK
            out.append(await scaler.tick())
        return out
    decisions = asyncio.run(ticks())
    assert Counter(d[D].reason for d in decisions)[Reason.MANUAL] == 0
    assert any(d[P].desired == 2 for d in decisions)


def test_refused_live_bounds_keep_the_last_accepted_ones_not_the_command_lines():
    """Live max_decode 8 holds a busy decode pool at 7; a mistyped field then refuses
    the whole set: the pool kept the command line's max of 4 and lost three workers at
    once. The last accepted set stays in force instead."""
    from services.autoscaler.actuators import PoolSize
    from services.autoscaler.service import Autoscaler
    from services.autoscaler.settings import AutoscalerSettings
    from services.rpc import worker_pb2
    clock, live = Clock(), {"max_decode": "8"}

    class Registry:
        where = "fake"

        async def bounds_overrides(self):
            return dict(live)

        async def latency_reports(self):
            return []

        async def publish_autoscaler(self, status, ttl):
            pass

        async def workers(self):
            return [worker_pb2.WorkerInfo(role=role, epoch=f"{role}{i}", address=f"10.0.{r}.{i}:1",
                                          started_at=clock.t - 3600, num_blocks=100, free_blocks=50)
                    for r, (role, n) in enumerate((("prefill", 1), ("decode", 7))) for i in range(n)]

    class Pools:
        name = "kubernetes"

        def observe(self, role, registered):
            return PoolSize({P: 1, D: 7}[role])

        def scale(self, role, n, victims):
            raise AssertionError(f"scaled {role.value} to {n}")
    settings = AutoscalerSettings(redis=None, policy=Policy(), limits=Limits(PoolBounds(1, 4), PoolBounds(1, 4)))
    scaler = Autoscaler(settings, Registry(), Pools(), clock=clock)

    async def ticks():
        clock.t += TICK
        await scaler.tick()
        live["min_prefill"] = "6"                    # above max_prefill: the set is refused
        clock.t += TICK
        return await scaler.tick()
    assert asyncio.run(ticks())[D].desired == 7


def test_a_budget_lowered_below_what_is_held_is_met_a_worker_at_a_time():
    """Budget 8 with 4 + 4 workers held, lowered to 4 while it runs: the slots held
    stayed 8 for good. The calmer pool gives a worker a tick, each once the last drained."""
    w = World(Limits(PoolBounds(1, 8), PoolBounds(1, 8), budget=8), prefill=4, decode=4)
    w.pools[P].latency, w.pools[D].latency = 4 * 0.7, 4 * 0.3
    w.run(300)
    w.limits = replace(w.limits, budget=4)
    w.run(1800)
    assert w.pools[P].current + w.pools[D].current <= 4
    assert any(reason == "budget" for role in ROLES for _, _, reason in w.changes(role))
