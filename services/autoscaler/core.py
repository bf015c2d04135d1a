"""The autoscaling policy: what each pool looks like now in, desired replicas out.

Pure: no I/O, no global state, the clock is injected. The service (service.py), the
replay simulator (replay.py) and the tests drive the same `Planner`.

One tick, for each pool on its own (prefill, then decode):
  1. Membership. A registered worker younger than `warmup` is *warming*: it counts as
     capacity on its way, but its load and latency samples are ignored (a cold worker's
     first requests are slow and say nothing about the pool). Replicas the actuator was
     asked for that have not registered yet are *pending*.
  2. A replica count other than the one the planner last set was changed by someone
     else: it is adopted, not fought, and held for `manual_hold` (bounds still apply).
  3. Pressure: the largest of the pool's signals over its target, 1.0 = at target.
     prefill: TTFT p90 / SLO, busy fraction / target, queued prefill tokens per worker / target;
     decode: ITL p90 / SLO, KV-block utilisation / target, sequences per worker / target.
     Latency percentiles cover the last `window` seconds, but never reach back past the
     last change of the set of warm workers (samples of a smaller pool would speak for
     a load the larger one no longer has).
  4. Above 1: scale out to ceil(n x pressure) workers (at least one more, at most
     double), only once nothing is pending or warming (no stacking on capacity that is
     still coming) and `scale_out_cooldown` has passed since the pool last changed.
     Calm (pressure below `scale_in_below`) for `scale_in_after` seconds: cancel pending
     workers first (falling demand, or `pending_timeout` passed, cancels capacity that
     never came up; waiting for it would block scale-in forever); otherwise, with
     nothing pending or warming and `scale_in_cooldown` passed, remove one worker if,
     spread over n-1 workers, the load signals stay calm and the latency p90 stays under
     `latency_headroom` x SLO (so the removal cannot itself trigger a scale-out: no
     flapping between two sizes). Latency is projected as if it grew with load alone;
     it has a floor, so the projection errs on the side of keeping the worker.
  5. Bounds [min, max] clamp the result.
Then the shared budget: slots held = sum of cost x (replicas + draining workers, which
keep their GPU until they exit). Increases only spend free slots, one worker at a time
to the pool furthest from its SLO; when a pool is starved and moving one worker from
the other pool lowers the larger of the two pressures, that worker is drained
(`rebalance`) and the starved pool grows once the slot is actually free: the budget is
never exceeded, not even between the two steps.
"""
from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from services.common.histograms import EMPTY, Histogram, merge, quantile


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


ROLES = (Role.PREFILL, Role.DECODE)


class Reason(str, enum.Enum):
    HOLD = "hold"                       # within the band
    SCALE_OUT_SLO = "scale_out_slo"     # a latency p90 above its SLO
    SCALE_OUT_LOAD = "scale_out_load"   # a load signal above its target
    SCALE_IN = "scale_in"               # calm long enough, and n-1 workers stay calm
    CANCEL_PENDING = "cancel_pending"   # demand fell, or they never came up
    SETTLING = "settling"               # workers pending or warming: none added, none removed
    COOLDOWN = "cooldown"               # the pool changed too recently
    MANUAL = "manual"                   # replicas changed outside the autoscaler: adopted, held
    BOUNDS = "bounds"                   # moved into [min, max]
    BUDGET = "budget"                   # an increase cut short by the shared budget
    REBALANCE = "rebalance"             # one worker given up for a pool further from its SLO
    NO_SIGNAL = "no_signal"             # no warm worker to judge the pool by


@dataclass(frozen=True)
class WorkerSample:
    """One registered worker as seen this tick."""
    epoch: str
    address: str
    started_at: float                   # on the planner's clock
    queued_prefill_tokens: int = 0      # prefill
    kv_blocks_used: int = 0             # decode
    kv_blocks_total: int = 0
    running: int = 0                    # decode: sequences running or waiting
    latency: Histogram = EMPTY          # samples new since the last tick: TTFT (prefill) or ITL (decode)
    busy: float | None = None           # prefill: share of the last tick spent computing; None: unknown

    def load(self, role: Role) -> int:
        return self.queued_prefill_tokens if role is Role.PREFILL else self.running


@dataclass(frozen=True)
class PoolObservation:
    role: Role
    current: int                        # replicas the pool is set to now, whoever set them
    workers: tuple[WorkerSample, ...] = ()   # registered
    draining: int = 0                   # removed, still finishing requests (and holding a slot)


@dataclass(frozen=True)
class PoolBounds:
    """Fewest and most workers of a pool; the defaults are --min-* and --max-*'s."""
    min: int = 1
    max: int = 4

    def __post_init__(self) -> None:
        if self.min < 1:
            raise ValueError("a pool needs at least one worker (min >= 1)")
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")


@dataclass(frozen=True)
class Limits:
    """What an operator may change while the autoscaler runs."""
    prefill: PoolBounds = PoolBounds()
    decode: PoolBounds = PoolBounds()
    budget: int | None = None           # total slots (workers, or GPUs with costs); None: none
    prefill_cost: int = 1               # slots one worker holds (its GPUs)
    decode_cost: int = 1

    def __post_init__(self) -> None:
        if self.prefill_cost < 1 or self.decode_cost < 1:
            raise ValueError("a worker costs at least one slot")
        floor = self.prefill.min * self.prefill_cost + self.decode.min * self.decode_cost
        if self.budget is not None and self.budget < floor:
            raise ValueError(f"the budget ({self.budget}) is below the pools' minimums ({floor})")

    def bounds(self, role: Role) -> PoolBounds:
        return self.prefill if role is Role.PREFILL else self.decode

    def cost(self, role: Role) -> int:
        return self.prefill_cost if role is Role.PREFILL else self.decode_cost


@dataclass(frozen=True)
class Policy:
    """Targets and timings. Seconds throughout; defaults suit production pools."""
    slo_ttft: float = 2.0
    slo_itl: float = 0.1
    target_prefill_queue_tokens: int = 8192     # per prefill worker
    target_prefill_busy: float = 0.75           # share of time a prefill worker computes
    target_kv_utilisation: float = 0.8          # of a decode worker's KV blocks
    target_running: int = 32                    # sequences per decode worker
    scale_in_below: float = 0.6                 # pressure that counts as calm
    latency_headroom: float = 0.85              # a scale-in must leave latency p90 under this x SLO
    rebalance_margin: float = 0.1               # a move must lower the larger pressure by this much
    window: float = 60.0                        # latency percentiles over this long
    min_samples: int = 10                       # fewer latency samples are no signal
    warmup: float = 60.0                        # a worker this young is warming
    scale_out_cooldown: float = 30.0
    scale_in_cooldown: float = 300.0            # since the pool last changed
    scale_in_after: float = 180.0               # calm this long before removing capacity
    pending_timeout: float = 900.0              # pending this long: cancelled
    manual_hold: float = 300.0                  # an outside change is left alone this long

    def __post_init__(self) -> None:
        for name in ("slo_ttft", "slo_itl", "target_kv_utilisation", "target_prefill_busy", "window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.target_prefill_queue_tokens < 1 or self.target_running < 1 or self.min_samples < 1:
            raise ValueError("targets and min_samples must be at least 1")
        if not 0 < self.scale_in_below < 1 or not 0 < self.latency_headroom < 1:
            raise ValueError("scale_in_below and latency_headroom must be in (0, 1): below target")
        for name in ("rebalance_margin", "warmup", "scale_out_cooldown", "scale_in_cooldown", "scale_in_after",
                     "pending_timeout", "manual_hold"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")


@dataclass(frozen=True)
class Decision:
    role: Role
    current: int
    desired: int
    reason: Reason
    detail: str                         # for a person: the numbers behind the reason
    pressure: float | None = None       # None: no warm worker to judge by
    ready: int = 0
    warming: int = 0
    pending: int = 0
    draining: int = 0

    @property
    def changed(self) -> bool:
        return self.desired != self.current

    def __str__(self) -> str:
        arrow = f"{self.current} -> {self.desired}" if self.changed else f"{self.current}"
        return f"{self.role.value} {arrow} ({self.reason.value}: {self.detail})"


@dataclass
class _PoolMemory:
    expected: int | None = None         # what the actuator should show: last set or adopted
    changed_at: float = -math.inf       # last change, ours or someone else's
    manual_until: float = -math.inf
    calm_since: float | None = None
    hot_ticks: int = 0                  # consecutive ticks over target
    pending_since: float | None = None
    warm: frozenset[str] = frozenset()
    membership_at: float = -math.inf    # when `warm` last changed
    samples: deque = field(default_factory=deque)   # (tick time, Histogram)
    busy: deque = field(default_factory=deque)      # (tick time, mean busy share of the warm workers)


@dataclass(frozen=True)
class _View:
    """One pool this tick, as the policy sees it."""
    role: Role
    current: int
    ready: int
    warming: int
    pending: int
    draining: int
    pressure: float | None
    kind: str                           # of the largest signal: "slo" or "load"
    text: str
    latency: float                      # the latency signal's ratio to its SLO (0: none)
    load: float                         # the largest load signal's ratio to its target

    def after_scale_in(self) -> tuple[float, float]:
        """(latency, load) ratios spread over one worker fewer."""
        factor = self.ready / (self.ready - 1)
        return self.latency * factor, self.load * factor

    def decide(self, desired: int, reason: Reason, detail: str) -> Decision:
        return Decision(self.role, self.current, desired, reason, detail, self.pressure, self.ready, self.warming,
                        self.pending, self.draining)


def choose_victims(role: Role, workers: Sequence[WorkerSample], k: int) -> list[str]:
    """Addresses to drain, best first: the least loaded, then the youngest."""
    ranked = sorted(workers, key=lambda w: (w.load(role), -w.started_at))
    return [w.address for w in ranked[:k]]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


class Planner:
    def __init__(self, policy: Policy, clock: Callable[[], float]) -> None:
        self.policy = policy
        self.clock = clock
        self._pools = {r: _PoolMemory() for r in ROLES}

    def applied(self, role: Role, replicas: int) -> None:
        """The actuator was set to `replicas` (report-only actuators never call this)."""
        mem = self._pools[role]
        mem.expected = replicas
        mem.changed_at = self.clock()

    def forget(self, role: Role) -> None:
        """The actuator's state is unknown (a call failed): adopt the next observation silently."""
        self._pools[role].expected = None
        self._pools[role].changed_at = self.clock()

    def tick(self, pools: Mapping[Role, PoolObservation], limits: Limits) -> dict[Role, Decision]:
        now = self.clock()
        decisions = {r: self._plan(pools[r], limits.bounds(r), now) for r in ROLES}
        if limits.budget is not None:
            decisions = self._fit_budget(decisions, limits, now)
        return decisions

    # ---- one pool ----
    def _signals(self, obs: PoolObservation, warm: list[WorkerSample], now: float) -> list[tuple[str, float, str]]:
        """(kind, ratio to target, text) for each signal there is."""
        p, mem = self.policy, self._pools[obs.role]
        epochs = frozenset(w.epoch for w in warm)
        if epochs != mem.warm:
            mem.warm, mem.membership_at = epochs, now
            mem.calm_since = None           # calm measured on another set of workers says nothing
        new = EMPTY
        for w in warm:
            new = merge(new, w.latency)
        if sum(new):
            mem.samples.append((now, new))
        busy = [w.busy for w in warm if w.busy is not None]
        if busy:
            mem.busy.append((now, sum(busy) / len(busy)))
        for series in (mem.samples, mem.busy):
            while series and series[0][0] <= now - p.window:
                series.popleft()
        window = EMPTY
        for t, h in mem.samples:
            if t > mem.membership_at:
                window = merge(window, h)
        # a share of one tick is jumpy (a burst of short prompts fills a second): averaged over the window
        shares = [b for t, b in mem.busy if t >= mem.membership_at]
        out = []
        n = len(warm)
        p90 = quantile(window, 0.9) if sum(window) >= p.min_samples else None
        if obs.role is Role.PREFILL:
            if p90 is not None:
                out.append(("slo", p90 / p.slo_ttft, f"TTFT p90 {_ms(p90)} vs SLO {_ms(p.slo_ttft)}"))
            if shares:
                share = sum(shares) / len(shares)
                out.append(("load", share / p.target_prefill_busy,
                            f"prefill workers {share:.0%} busy vs {p.target_prefill_busy:.0%}"))
            queued = sum(w.queued_prefill_tokens for w in warm) / n
            out.append(("load", queued / p.target_prefill_queue_tokens,
                        f"{queued:.0f} queued prefill tokens per worker vs {p.target_prefill_queue_tokens}"))
        else:
            if p90 is not None:
                out.append(("slo", p90 / p.slo_itl, f"ITL p90 {_ms(p90)} vs SLO {_ms(p.slo_itl)}"))
            total = sum(w.kv_blocks_total for w in warm)
            if total:
                used = sum(w.kv_blocks_used for w in warm) / total
                out.append(("load", used / p.target_kv_utilisation,
                            f"KV blocks {used:.0%} used vs {p.target_kv_utilisation:.0%}"))
            running = sum(w.running for w in warm) / n
            out.append(("load", running / p.target_running,
                        f"{running:.1f} sequences per worker vs {p.target_running}"))
        return out

    def _plan(self, obs: PoolObservation, bounds: PoolBounds, now: float) -> Decision:
        p, mem = self.policy, self._pools[obs.role]
        warm = [w for w in obs.workers if now - w.started_at >= p.warmup]
        current = obs.current
        if mem.expected is not None and current != mem.expected:
            mem.manual_until, mem.changed_at, mem.calm_since = now + p.manual_hold, now, None
        mem.expected = current
        signals = self._signals(obs, warm, now) if warm else []
        kind, pressure, text = max(signals, key=lambda s: s[1]) if signals else ("", None, "")
        v = _View(obs.role, current, len(warm), len(obs.workers) - len(warm), max(0, current - len(obs.workers)),
                  obs.draining, pressure, kind, text, max((r for k, r, _ in signals if k == "slo"), default=0.0),
                  max((r for k, r, _ in signals if k == "load"), default=0.0))
        mem.pending_since = (mem.pending_since or now) if v.pending else None
        calm = pressure is not None and pressure < p.scale_in_below
        mem.calm_since = (mem.calm_since if mem.calm_since is not None else now) if calm else None
        mem.hot_ticks = mem.hot_ticks + 1 if pressure is not None and pressure > 1 else 0
        d = self._policy_decision(v, mem, now)
        clamped = min(max(d.desired, bounds.min), bounds.max)
        if clamped != d.desired:
            d = replace(d, desired=clamped, reason=Reason.BOUNDS,
                        detail=f"bounds [{bounds.min}, {bounds.max}] (policy said {d.desired}: {d.reason.value})")
        return d

    def _policy_decision(self, v: _View, mem: _PoolMemory, now: float) -> Decision:
        p = self.policy
        calm_long = mem.calm_since is not None and now - mem.calm_since >= p.scale_in_after
        if now < mem.manual_until:
            return v.decide(v.current, Reason.MANUAL, f"set to {v.current} outside the autoscaler; "
                                                      f"left alone for {mem.manual_until - now:.0f} s more")
        if v.pending and now - mem.pending_since >= p.pending_timeout:
            return v.decide(v.current - v.pending, Reason.CANCEL_PENDING,
                            f"{v.pending} worker(s) did not come up within {p.pending_timeout:.0f} s")
        if v.pressure is None:
            return v.decide(v.current, Reason.SETTLING if v.pending or v.warming else Reason.NO_SIGNAL,
                            f"no warm worker yet ({v.pending} pending, {v.warming} warming)")
        if v.pressure > 1:
            return self._scale_out(v, mem, now)
        if calm_long and v.pending:
            return v.decide(v.current - v.pending, Reason.CANCEL_PENDING,
                            f"demand fell ({v.text}) before {v.pending} pending worker(s) came up")
        if calm_long and v.warming:
            return v.decide(v.current, Reason.SETTLING, f"calm ({v.text}), {v.warming} warming")
        # (more registered than the pool is set to: those are on their way out already)
        if calm_long and 2 <= v.ready <= v.current:
            latency, load = v.after_scale_in()
            if latency >= p.latency_headroom or load >= p.scale_in_below:
                return v.decide(v.current, Reason.HOLD, f"calm ({v.text}), but {v.ready - 1} worker(s) would be "
                                                        f"at latency x{latency:.2f}, load x{load:.2f}")
            if now - mem.changed_at < p.scale_in_cooldown:
                return v.decide(v.current, Reason.COOLDOWN,
                                f"calm ({v.text}), but the pool changed {now - mem.changed_at:.0f} s ago")
            return v.decide(v.current - 1, Reason.SCALE_IN,
                            f"calm for {now - mem.calm_since:.0f} s ({v.text}); {v.ready - 1} worker(s) would "
                            f"be at latency x{latency:.2f}, load x{load:.2f}")
        return v.decide(v.current, Reason.HOLD, f"x{v.pressure:.2f}: {v.text}")

    def _scale_out(self, v: _View, mem: _PoolMemory, now: float) -> Decision:
        p = self.policy
        target = min(max(v.ready + 1, math.ceil(v.ready * v.pressure)), 2 * v.ready)
        adding = target - v.ready - v.warming - v.pending     # capacity still coming counts
        if adding <= 0:
            return v.decide(v.current, Reason.SETTLING, f"x{v.pressure:.2f} ({v.text}), but {v.pending} pending "
                                                        f"and {v.warming} warming: none added until they serve")
        if v.kind == "load" and mem.hot_ticks < 2:      # one snapshot is not a trend
            return v.decide(v.current, Reason.HOLD, f"x{v.pressure:.2f} ({v.text}) for one tick")
        if now - mem.changed_at < p.scale_out_cooldown:
            return v.decide(v.current, Reason.COOLDOWN, f"x{v.pressure:.2f} ({v.text}), but the pool changed "
                                                        f"{now - mem.changed_at:.0f} s ago")
        reason = Reason.SCALE_OUT_SLO if v.kind == "slo" else Reason.SCALE_OUT_LOAD
        return v.decide(v.current + adding, reason, f"x{v.pressure:.2f}: {v.text}")

    # ---- the shared budget ----
    def _fit_budget(self, decisions: dict[Role, Decision], limits: Limits, now: float) -> dict[Role, Decision]:
        held = sum(limits.cost(r) * (d.current + d.draining) for r, d in decisions.items())
        free = limits.budget - held
        asks = {r: d.desired - d.current for r, d in decisions.items() if d.desired > d.current}
        grants = dict.fromkeys(asks, 0)

        def urgency(r: Role) -> float:
            d = decisions[r]
            if d.pressure is None or d.ready == 0:
                return math.inf                 # a min bound to meet
            return d.pressure * d.ready / (d.ready + grants[r])

        while True:
            open_ = [r for r in asks if grants[r] < asks[r] and limits.cost(r) <= free]
            if not open_:
                break
            r = max(open_, key=urgency)
            grants[r] += 1
            free -= limits.cost(r)
        out = dict(decisions)
        for r, ask in asks.items():
            if grants[r] < ask:
                d = decisions[r]
                out[r] = replace(d, desired=d.current + grants[r], reason=Reason.BUDGET,
                                 detail=f"wanted {d.desired} ({d.reason.value}: {d.detail}); budget "
                                        f"{limits.budget} allows {d.current + grants[r]}")
        if free < 0 and not any(d.draining or d.desired < d.current for d in decisions.values()):
            return self._over_budget(out, limits, held)
        starved = [r for r in asks if grants[r] < asks[r] and decisions[r].reason in
                   (Reason.SCALE_OUT_SLO, Reason.SCALE_OUT_LOAD)]
        if starved and not any(d.draining for d in decisions.values()):
            needy = max(starved, key=lambda r: decisions[r].pressure)
            if limits.cost(needy) <= free + limits.cost(next(r for r in ROLES if r is not needy)):
                out = self._rebalance(out, needy, limits, now)
        return out

    @staticmethod
    def _over_budget(out: dict[Role, Decision], limits: Limits, held: int) -> dict[Role, Decision]:
        """More slots held than the budget (lowered while it runs): one worker of the
        calmer pool above its minimum goes, one a tick, each once the last has drained."""
        above = [r for r in ROLES if out[r].current > limits.bounds(r).min and out[r].reason is not Reason.MANUAL]
        if not above:
            return out
        r = min(above, key=lambda r: out[r].pressure if out[r].pressure is not None else 0.0)
        d = out[r]
        out[r] = replace(d, desired=d.current - 1, reason=Reason.BUDGET,
                         detail=f"{held} slots held, over the budget of {limits.budget}: the calmer pool gives one")
        return out

    def _rebalance(self, out: dict[Role, Decision], needy: Role, limits: Limits, now: float) -> dict[Role, Decision]:
        """Drain one worker of the other pool when that lowers the larger pressure; the
        needy pool grows on a later tick, once the slot is free."""
        donor = next(r for r in ROLES if r is not needy)
        d, n = out[donor], out[needy]
        if (d.changed or d.reason is Reason.MANUAL or d.pending or d.warming or d.pressure is None
                or d.ready < 2 or d.current <= limits.bounds(donor).min
                or now - self._pools[donor].changed_at < self.policy.scale_in_cooldown):
            return out
        before = max(n.pressure, d.pressure)
        after = max(n.pressure * n.ready / (n.ready + 1), d.pressure * d.ready / (d.ready - 1))
        if after * (1 + self.policy.rebalance_margin) >= before:
            return out
        out[donor] = replace(d, desired=d.current - 1, reason=Reason.REBALANCE,
                             detail=f"one worker's slot goes to {needy.value} (x{n.pressure:.2f} vs x{d.pressure:.2f}; "
                                    f"largest after the move x{after:.2f})")
        return out
