"""The autoscaling policy (services/autoscaler/core.py) on its own: no processes, a fake
clock, and a small fake world that starts, warms and drains workers.

The table covers each way NVIDIA Dynamo's planner is reported to go wrong, plus the
basics: no scale-down while new workers are pending, rebalancing past the GPU budget,
flapping between two sizes, over-scaling on cold-start samples, fighting manual edits.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import pytest

from services.autoscaler.core import (ROLES, Limits, Planner, Policy, PoolBounds, PoolObservation, Reason, Role,
                                      WorkerSample, choose_victims)
from services.common.histograms import LATENCY_BOUNDS, CumulativeDeltas, histogram, quantile

P, D = Role.PREFILL, Role.DECODE
TICK = 5.0
POLICY = Policy(slo_ttft=1.0, slo_itl=0.1, window=30, min_samples=5, warmup=20, scale_out_cooldown=10,
                scale_in_cooldown=60, scale_in_after=60, pending_timeout=300, manual_hold=120)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Pool:
    workers: list[WorkerSample] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)     # when each was asked for
    draining: list[float] = field(default_factory=list)    # when each will have exited
    current: int = 0
    demand: float = 0.0         # pressure one warm worker would feel
    cold_factor: float = 1.0    # how much slower a warming worker's requests are


class World:
    """Workers register `start_delay` after they are asked for (never, if `can_start`
    is False for the pool), warm up, report latency samples proportional to the
    demand spread over the warm workers, and take `drain_time` to exit when removed."""

    def __init__(self, policy: Policy = POLICY, limits: Limits | None = None, prefill: int = 1, decode: int = 1,
                 start_delay: float = 10.0, drain_time: float = 10.0, tick: float = TICK) -> None:
        self.clock = Clock()
        self.tick = tick
        self.before_tick = None         # called with the world before each tick's observations
        self.policy = policy
        self.planner = Planner(policy, self.clock)
        self.limits = limits or Limits(PoolBounds(1, 4), PoolBounds(1, 4))
        self.start_delay, self.drain_time = start_delay, drain_time
        self.can_start = {P: True, D: True}
        self.epochs = itertools.count()
        self.pools = {P: Pool(), D: Pool()}
        for role, n in ((P, prefill), (D, decode)):
            for _ in range(n):
                self._register(role, started_at=self.clock.t - policy.warmup - 1)
            self.pools[role].current = n
        self.log: list[dict] = []

    def _register(self, role: Role, started_at: float) -> None:
        n = next(self.epochs)
        self.pools[role].workers.append(WorkerSample(f"{role.value}-{n}", f"10.0.0.{n}:7001", started_at))

    def size(self, role: Role) -> int:
        return len(self.pools[role].workers)

    def observe(self, role: Role) -> PoolObservation:
        pool = self.pools[role]
        warm = [w for w in pool.workers if self.clock.t - w.started_at >= self.policy.warmup]
        slo = self.policy.slo_ttft if role is P else self.policy.slo_itl
        samples = []
        for w in pool.workers:
            cold = self.clock.t - w.started_at < self.policy.warmup
            share = pool.demand / max(len(warm), 1)
            value = slo * share * (pool.cold_factor if cold else 1.0)
            samples.append(replace(w, latency=histogram([value] * 10) if pool.demand else histogram([])))
        return PoolObservation(role, pool.current, tuple(samples), len(pool.draining))

    def step(self) -> dict:
        self.clock.t += self.tick
        for role, pool in self.pools.items():
            for asked in [a for a in pool.pending if self.can_start[role] and self.clock.t - a >= self.start_delay]:
                pool.pending.remove(asked)
                self._register(role, started_at=self.clock.t)
            pool.draining = [t for t in pool.draining if t > self.clock.t]
        if self.before_tick is not None:
            self.before_tick(self)
        decisions = self.planner.tick({r: self.observe(r) for r in ROLES}, self.limits)
        for role in (P, D):                         # decreases are applied before increases
            self._apply(role, decisions[role].desired, decrease=True)
        for role in (P, D):
            self._apply(role, decisions[role].desired, decrease=False)
        held = sum(self.limits.cost(r) * (self.pools[r].current + len(self.pools[r].draining)) for r in ROLES)
        row = {"t": self.clock.t, "decisions": decisions, "held": held,
               **{r: (self.pools[r].current, self.size(r), len(self.pools[r].pending)) for r in ROLES}}
        self.log.append(row)
        return decisions

    def _apply(self, role: Role, desired: int, decrease: bool) -> None:
        pool = self.pools[role]
        if decrease and desired < pool.current:
            for _ in range(pool.current - desired):
                if pool.pending:                            # capacity not up yet goes first
                    pool.pending.pop()
                    continue
                victim = choose_victims(role, pool.workers, 1)[0]
                pool.workers = [w for w in pool.workers if w.address != victim]
                pool.draining.append(self.clock.t + self.drain_time)
        elif not decrease and desired > pool.current:
            pool.pending += [self.clock.t] * (desired - pool.current)
        else:
            return
        pool.current = desired
        self.planner.applied(role, desired)

    def run(self, seconds: float) -> list[dict]:
        start = len(self.log)
        for _ in range(int(seconds / self.tick)):
            self.step()
        return self.log[start:]


def changes(rows: list[dict], role: Role) -> list[tuple[int, int, Reason]]:
    return [(r["decisions"][role].current, r["decisions"][role].desired, r["decisions"][role].reason)
            for r in rows if r["decisions"][role].changed]


def reasons(rows: list[dict], role: Role) -> set[Reason]:
    return {r["decisions"][role].reason for r in rows}


# ---- the failure modes, one scenario each ----

def no_scale_down_while_pending(w: World):
    """Decode has two workers; the ones added for a burst can never start (no GPU free).
    No serving worker is drained while they are pending, nothing is stacked on them,
    and when the load stops the pending capacity is cancelled instead of being waited
    for forever; only then does the pool scale in."""
    w.can_start[D] = False
    w.pools[D].demand = 3.2
    rows = w.run(30)
    ((before, after, reason),) = changes(rows, D)
    assert (before, reason) == (2, Reason.SCALE_OUT_SLO) and after > 2
    first = next(i for i, r in enumerate(rows) if r["decisions"][D].changed) + 1
    assert reasons(rows[first:], D) == {Reason.SETTLING}        # nothing stacked on the pending ones
    w.pools[D].demand = 0.0
    rows = w.run(200)
    assert changes(rows, D) == [(after, 2, Reason.CANCEL_PENDING), (2, 1, Reason.SCALE_IN)]
    assert w.pools[D].current == 1 and not w.pools[D].pending and w.size(D) == 1


def pending_that_never_starts_times_out(w: World):
    """Under steady load a pending worker that never registers is cancelled after
    pending_timeout, so the pool is not frozen in `settling`."""
    w.can_start[D] = False
    w.pools[D].demand = 1.6
    rows = w.run(w.policy.pending_timeout + 20)
    assert (2, 1, Reason.CANCEL_PENDING) in changes(rows, D)
    assert all(r["decisions"][D].reason is not Reason.SCALE_IN for r in rows)


def rebalance_never_exceeds_the_budget(w: World):
    """Budget 3 slots, prefill 1 + decode 2. Prefill is 3x over its SLO, decode calm
    enough to give one up: decode drains one worker, and prefill grows only once that
    worker has exited. Slots held never exceed the budget at any tick."""
    w.pools[P].demand = 3.0
    w.pools[D].demand = 0.9                  # x0.45 on two workers, x0.9 on one
    rows = w.run(120)
    assert changes(rows, D) == [(2, 1, Reason.REBALANCE)]
    assert changes(rows, P)[0] == (1, 2, Reason.SCALE_OUT_SLO)
    assert Reason.BUDGET in reasons(rows, P)
    rebalanced = next(r["t"] for r in rows if r["decisions"][D].reason is Reason.REBALANCE)
    grown = next(r["t"] for r in rows if r["decisions"][P].changed)
    assert grown >= rebalanced + w.drain_time
    assert max(r["held"] for r in rows) <= 3


def budget_goes_to_the_pool_furthest_from_its_slo(w: World):
    """Both pools over their SLO, one free slot: the one further over gets it."""
    w.pools[P].demand, w.pools[D].demand = 1.5, 4.0
    rows = w.run(2 * TICK)                  # the first tick has no latency window yet
    assert rows[-1]["decisions"][D].desired == 2 and rows[-1]["decisions"][P].reason is Reason.BUDGET
    assert max(r["held"] for r in rows) <= 3


def no_flapping_between_two_sizes(w: World):
    """Demand that needs 2 workers and looks calm on 2 (x0.5 each) must not make the pool
    shrink to 1 (about x1, over the latency headroom) and grow back. Demand noise
    around the band changes nothing either."""
    w.pools[D].demand = 1.2
    rows = w.run(60)
    assert changes(rows, D) == [(1, 2, Reason.SCALE_OUT_SLO)]
    for demand in [0.95, 1.1, 1.0, 1.05] * 10:
        w.pools[D].demand = demand
        rows += w.run(TICK * 3)
    assert len(changes(rows, D)) == 1 and w.pools[D].current == 2


def cold_start_samples_do_not_over_scale(w: World):
    """The new worker's first requests are 10x slower. They are ignored while it warms,
    nothing more is added meanwhile, and once warm the pool is judged on its new size
    only: one scale-out, not a cascade."""
    w.pools[P].demand = 1.5
    w.pools[P].cold_factor = 10.0
    rows = w.run(120)
    assert changes(rows, P) == [(1, 2, Reason.SCALE_OUT_SLO)]
    assert w.pools[P].current == 2
    settling = [r for r in rows if r["decisions"][P].reason is Reason.SETTLING]
    assert settling and all(not r["decisions"][P].changed for r in settling)


def manual_edits_are_observed_not_fought(w: World):
    """An operator sets decode to 3 on an idle pool. The planner adopts it, holds it for
    manual_hold, and only then goes back to its own policy (calm -> scale in, one at a time)."""
    w.run(10)
    w.pools[D].current = 3
    w.pools[D].pending += [w.clock.t] * 2
    rows = w.run(w.policy.manual_hold - TICK)
    assert reasons(rows, D) == {Reason.MANUAL} and not changes(rows, D)
    assert w.pools[D].current == 3
    rows = w.run(300)
    assert changes(rows, D) and all(c[1] == c[0] - 1 for c in changes(rows, D))
    assert w.pools[D].current == 1


def bounds_edited_live_apply_at_once(w: World):
    w.pools[D].demand = 3.0
    w.run(60)
    assert w.pools[D].current >= 3
    w.limits = Limits(PoolBounds(1, 4), PoolBounds(1, 2))
    rows = w.run(TICK)
    assert rows[0]["decisions"][D].reason is Reason.BOUNDS and w.pools[D].current == 2
    w.limits = Limits(PoolBounds(2, 4), PoolBounds(1, 2))
    rows = w.run(TICK)
    assert rows[0]["decisions"][P].reason is Reason.BOUNDS and w.pools[P].current == 2


def pools_scale_on_their_own_signal(w: World):
    """Decode-heavy demand grows decode only; prompt-heavy grows prefill only."""
    w.pools[D].demand = 1.7
    rows = w.run(60)
    assert changes(rows, D) == [(1, 2, Reason.SCALE_OUT_SLO)] and not changes(rows, P)
    w.pools[D].demand, w.pools[P].demand = 0.0, 2.5
    rows = w.run(120)
    assert changes(rows, P) == [(1, 2, Reason.SCALE_OUT_SLO), (2, 3, Reason.SCALE_OUT_SLO)]   # at most doubling


def idle_pools_return_to_min_one_worker_at_a_time(w: World):
    w.pools[P].demand = w.pools[D].demand = 3.5
    w.run(120)
    assert w.pools[P].current == 4 and w.pools[D].current == 4
    w.pools[P].demand = w.pools[D].demand = 0.0
    rows = w.run(600)
    for role in ROLES:
        assert [c[:2] for c in changes(rows, role)] == [(4, 3), (3, 2), (2, 1)]
        assert {c[2] for c in changes(rows, role)} == {Reason.SCALE_IN}
        times = [r["t"] for r in rows if r["decisions"][role].changed]
        assert all(b - a >= w.policy.scale_in_cooldown for a, b in zip(times, times[1:]))


SCENARIOS = {
    "no_scale_down_while_pending": (no_scale_down_while_pending, {"decode": 2}),
    "pending_that_never_starts_times_out": (pending_that_never_starts_times_out, {}),
    "rebalance_never_exceeds_the_budget": (rebalance_never_exceeds_the_budget,
                                           {"limits": Limits(PoolBounds(1, 3), PoolBounds(1, 3), budget=3),
                                            "decode": 2}),
    "budget_goes_to_the_pool_furthest_from_its_slo": (budget_goes_to_the_pool_furthest_from_its_slo,
                                                      {"limits": Limits(PoolBounds(1, 3), PoolBounds(1, 3),
                                                                        budget=3)}),
    "no_flapping_between_two_sizes": (no_flapping_between_two_sizes, {}),
    "cold_start_samples_do_not_over_scale": (cold_start_samples_do_not_over_scale, {}),
    "manual_edits_are_observed_not_fought": (manual_edits_are_observed_not_fought, {}),
    "bounds_edited_live_apply_at_once": (bounds_edited_live_apply_at_once, {}),
    "pools_scale_on_their_own_signal": (pools_scale_on_their_own_signal, {}),
    "idle_pools_return_to_min_one_worker_at_a_time": (idle_pools_return_to_min_one_worker_at_a_time, {}),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario(name):
    scenario, kwargs = SCENARIOS[name]
    scenario(World(**kwargs))


# ---- single ticks ----

def tick(planner: Planner, **pools: PoolObservation):
    """The second of two ticks seeing the same pools: the first only learns who is warm."""
    base = {r: PoolObservation(r, 1, (WorkerSample(f"{r.value}-0", "a", 0.0),)) for r in ROLES}
    base.update({Role(k): v for k, v in pools.items()})
    limits = Limits(PoolBounds(1, 8), PoolBounds(1, 8))
    planner.tick(base, limits)
    planner.clock.t += TICK
    return planner.tick(base, limits)


LOAD_CASES = [
    # role, worker fields, expected reason
    (P, {"queued_prefill_tokens": 20000}, Reason.SCALE_OUT_LOAD),
    (P, {"queued_prefill_tokens": 100}, Reason.HOLD),
    (D, {"kv_blocks_used": 95, "kv_blocks_total": 100}, Reason.SCALE_OUT_LOAD),
    (D, {"running": 50}, Reason.SCALE_OUT_LOAD),
    (D, {"running": 10, "kv_blocks_used": 30, "kv_blocks_total": 100}, Reason.HOLD),
]


@pytest.mark.parametrize("role,fields,reason", LOAD_CASES)
def test_load_signals_without_latency_samples(role, fields, reason):
    clock = Clock()
    planner = Planner(replace(POLICY, target_prefill_queue_tokens=8192, target_running=32), clock)
    obs = PoolObservation(role, 1, (WorkerSample("w", "a", 0.0, **fields),))
    d = tick(planner, **{role.value: obs})[role]
    assert d.reason is reason, d
    assert d.desired == (2 if reason is Reason.SCALE_OUT_LOAD else 1)


def test_scale_out_is_proportional_and_at_most_doubles():
    clock = Clock()
    planner = Planner(POLICY, clock)
    workers = tuple(WorkerSample(f"d{i}", f"a{i}", 0.0, latency=histogram([0.25] * 10)) for i in range(3))
    d = tick(planner, decode=PoolObservation(D, 3, workers))[D]
    assert (d.reason, d.desired) == (Reason.SCALE_OUT_SLO, 6)       # x2.5 wants 8; doubling caps at 6


def test_too_few_latency_samples_are_no_signal():
    planner = Planner(POLICY, Clock())
    workers = (WorkerSample("d", "a", 0.0, latency=histogram([5.0] * (POLICY.min_samples - 1))),)
    assert tick(planner, decode=PoolObservation(D, 1, workers))[D].reason is Reason.HOLD


def test_no_warm_worker_is_no_signal_and_changes_nothing():
    clock = Clock()
    planner = Planner(POLICY, clock)
    young = (WorkerSample("p", "a", clock.t - 1, queued_prefill_tokens=10**6),)
    d = tick(planner, prefill=PoolObservation(P, 1, young))[P]
    assert (d.reason, d.desired) == (Reason.SETTLING, 1)
    d = tick(planner, prefill=PoolObservation(P, 1, ()))[P]
    assert (d.reason, d.desired) == (Reason.SETTLING, 1)


def test_victims_are_the_least_loaded_then_the_youngest():
    ws = [WorkerSample("a", "busy", 0.0, running=9), WorkerSample("b", "idle-old", 0.0),
          WorkerSample("c", "idle-young", 50.0)]
    assert choose_victims(D, ws, 2) == ["idle-young", "idle-old"]


@pytest.mark.parametrize("kwargs", [{"slo_itl": 0}, {"scale_in_below": 1.2}, {"warmup": -1}, {"window": 0}])
def test_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        Policy(**kwargs)


@pytest.mark.parametrize("make", [lambda: PoolBounds(0, 2), lambda: PoolBounds(3, 2),
                                  lambda: Limits(PoolBounds(2, 4), PoolBounds(2, 4), budget=3),
                                  lambda: Limits(decode_cost=0)])
def test_limits_reject_nonsense(make):
    with pytest.raises(ValueError):
        make()


# ---- latency histograms ----

def test_quantile_interpolates_within_buckets():
    samples = [0.01 * i for i in range(1, 101)]
    assert quantile(histogram(samples), 0.9) == pytest.approx(0.9, rel=0.15)
    assert quantile(histogram([]), 0.9) is None
    assert quantile(histogram([10 ** 6]), 0.5) == LATENCY_BOUNDS[-1]


def test_cumulative_deltas_handle_new_and_restarted_sources():
    deltas = CumulativeDeltas()
    total = lambda out: {k: sum(v) for k, v in out.items()}     # noqa: E731
    assert total(deltas.feed("r1", {"w1": histogram([0.1] * 5)})) == {"w1": 0}     # a new router: its past is unknown
    deltas.end_tick()
    assert total(deltas.feed("r1", {"w1": histogram([0.1] * 8), "w2": histogram([0.1] * 2)})) == {"w1": 3, "w2": 2}
    deltas.end_tick()
    assert total(deltas.feed("r1", {"w1": histogram([0.1] * 1)})) == {"w1": 1}     # the router restarted
    deltas.end_tick()
    deltas.end_tick()                                       # r1 sent nothing: forgotten
    assert total(deltas.feed("r1", {"w1": histogram([0.1] * 4)})) == {"w1": 0}


@pytest.mark.parametrize("itl,running,reason", [
    (0.040, 2, Reason.SCALE_IN),        # a latency floor (x0.4 of SLO): x0.8 on one worker is fine
    (0.045, 2, Reason.HOLD),            # x0.9 on one worker: over the headroom
    (0.030, 12, Reason.HOLD),           # load x0.375 per worker -> x0.75 on one: not calm
])
def test_scale_in_projects_latency_and_load_onto_one_worker_fewer(itl, running, reason):
    planner = Planner(replace(POLICY, scale_in_after=0, scale_in_cooldown=0, target_running=16), Clock())
    workers = tuple(WorkerSample(f"d{i}", f"a{i}", 0.0, running=running, latency=histogram([itl] * 10))
                    for i in range(2))
    d = tick(planner, decode=PoolObservation(D, 2, workers))[D]
    assert d.reason is reason, d


def test_prefill_busy_share_is_averaged_over_the_window():
    """One tick of a burst (short prompts all at once) does not scale prefill out; a
    share over target that lasts does."""
    clock = Clock()
    planner = Planner(replace(POLICY, target_prefill_busy=0.75, window=30), clock)
    limits = Limits(PoolBounds(1, 4), PoolBounds(1, 4))

    def step(busy: float):
        clock.t += TICK
        pools = {P: PoolObservation(P, 1, (WorkerSample("p", "a", 0.0, busy=busy),)),
                 D: PoolObservation(D, 1, (WorkerSample("d", "b", 0.0),))}
        return planner.tick(pools, limits)[P]

    for busy in (0.1, 0.1, 0.1, 0.1, 1.0):
        d = step(busy)
    assert d.reason is Reason.HOLD, d
    for _ in range(6):
        d = step(1.0)
        if d.changed:
            break
    assert d.reason is Reason.SCALE_OUT_LOAD and "busy" in d.detail, d
