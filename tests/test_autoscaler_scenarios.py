"""The autoscaling policy (services/autoscaler/core.py) in scenarios an SRE relies on,
over simulated time with the default Policy and 15 s ticks: a worker replaced under a
latency-bound pool, workers that never finish warming, budgets of unequal costs, two
starved pools, a burst on one tick, and (through the service) an actuator call that
fails after it was applied, and live bounds refused. Every worker, warm or warming,
takes an equal share of the traffic here (test_autoscaler_core.py's world gives it to
the warm ones)."""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

from services.autoscaler.core import ROLES, Limits, Policy, PoolBounds, PoolObservation, Reason, Role
from services.common.histograms import histogram
from tests.test_autoscaler_core import Clock, World as WarmWorld, changes

P, D = Role.PREFILL, Role.DECODE
TICK = 15.0


class World(WarmWorld):
    """test_autoscaler_core's world at the default Policy and 15 s ticks, where every
    worker takes an equal share of a pool's traffic: `latency` (over the SLO) as one
    worker would show it, and `load`, queued prompt tokens (prefill) or running
    sequences (decode), all told."""

    def __init__(self, limits: Limits | None = None, prefill: int = 1, decode: int = 1,
                 start_delay: float = 30.0) -> None:
        super().__init__(Policy(), limits or Limits(PoolBounds(1, 8), PoolBounds(1, 8)), prefill, decode,
                         start_delay, drain_time=30.0, tick=TICK)
        self.t0 = self.clock.t
        for role in ROLES:
            self.pools[role].workers = [replace(w, started_at=w.started_at - 1000) for w in self.pools[role].workers]
            self.pools[role].latency = self.pools[role].load = 0.0

    def register(self, role: Role, started_at: float) -> None:
        self._register(role, started_at)

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
        self.before_tick = hook
        super().run(seconds)

    def changes(self, role: Role) -> list[tuple[int, int, str]]:
        return [(current, desired, reason.value) for current, desired, reason in changes(self.log, role)]


class Registry:
    """The registry the autoscaler service reads: `sizes` (prefill, decode) workers an
    hour old, each record with `fields`, and `live` bounds."""
    where = "fake"

    def __init__(self, clock: Clock, sizes: tuple[int, int], live: dict | None = None, **fields) -> None:
        self.clock, self.sizes, self.live, self.fields = clock, sizes, live if live is not None else {}, fields

    async def bounds_overrides(self):
        return dict(self.live)

    async def latency_reports(self):
        return []

    async def publish_autoscaler(self, status, ttl):
        pass

    async def workers(self):
        from services.rpc import worker_pb2
        return [worker_pb2.WorkerInfo(role=role, epoch=f"{role}{i}", address=f"10.0.{r}.{i}:1",
                                      started_at=self.clock.t - 3600, num_blocks=100,
                                      **{k: v for k, v in self.fields.items()
                                         if role == "prefill" or k != "queued_prefill_tokens"})
                for r, (role, n) in enumerate(zip(("prefill", "decode"), self.sizes)) for i in range(n)]


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
        world.pools[P].load = (1.3 if int(world.clock.t - world.t0) % 600 == 0 else 0.2) * 8192
    w.run(3 * 3600, burst)
    assert w.changes(P) == []


def test_an_actuator_call_that_fails_after_it_applied_is_not_taken_for_a_manual_edit():
    """A Kubernetes PATCH applied whose answer came too late raised out of the tick: the
    other pool's change of that tick was lost, and the next tick read the autoscaler's
    own change as a manual edit, held for manual_hold."""
    from services.autoscaler.actuators import PoolSize
    from services.autoscaler.service import Autoscaler
    from services.autoscaler.settings import AutoscalerSettings
    clock = Clock()
    registry = Registry(clock, (1, 3), free_blocks=100, queued_prefill_tokens=30000)

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
    scaler = Autoscaler(settings, registry, LateAnswers(), clock=clock)

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
    clock, live = Clock(), {"max_decode": "8"}
    registry = Registry(clock, (1, 7), live, free_blocks=50)

    class Pools:
        name = "kubernetes"

        def observe(self, role, registered):
            return PoolSize({P: 1, D: 7}[role])

        def scale(self, role, n, victims):
            raise AssertionError(f"scaled {role.value} to {n}")
    settings = AutoscalerSettings(redis=None, policy=Policy(), limits=Limits(PoolBounds(1, 4), PoolBounds(1, 4)))
    scaler = Autoscaler(settings, registry, Pools(), clock=clock)

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


def test_the_planners_timers_never_step_and_a_fast_clocked_host_does_not_keep_its_worker_warming():
    """The planner runs on time.monotonic (a wall clock stepped 15 min forward cancelled
    pending capacity at once); a worker's start, reported on its host's clock, is taken
    no later than when the autoscaler first saw it (a host an hour ahead kept its worker
    warming, out of every signal, for that hour)."""
    import time

    from services.autoscaler.service import Autoscaler
    from services.autoscaler.settings import AutoscalerSettings
    from services.rpc import worker_pb2
    settings = AutoscalerSettings(redis=None, policy=Policy(), limits=Limits(PoolBounds(1, 4), PoolBounds(1, 4)))
    assert Autoscaler(settings, None, None).planner.clock is time.monotonic
    wall, mono = Clock(), Clock()
    mono.t = 50.0
    scaler = Autoscaler(settings, None, None, clock=wall)
    scaler.planner.clock = mono
    ahead = worker_pb2.WorkerInfo(epoch="ahead", started_at=wall.t + 3600)
    steady = worker_pb2.WorkerInfo(epoch="steady", started_at=wall.t - 1000)
    assert scaler._started([ahead, steady]) == {"ahead": 50.0, "steady": 50.0 - 1000}
    wall.t += 200
    mono.t += 200
    assert scaler._started([ahead, steady])["ahead"] == 50.0           # 200 s old now, warm after warmup
