"""How the router shares the cluster among tenants (API keys): pure policy, no I/O.

A request is admitted (or refused with the reason and when to retry), waits in the
queue, is dispatched to the workers when a slot is free, and is done. Dispatch order is
start-time fair queuing over tenants: a request's start tag is the later of the virtual
time and its tenant's previous finish tag, its finish tag that start plus its cost over
the tenant's weight, and the smallest start tag goes next. A tenant with a thousand
requests queued therefore delays another tenant's next request by about one request,
not a thousand, while a lone tenant is served first come, first served.

Limits per tenant, each optional: a weight (its share when several wait), a cap on its
requests admitted at once, and a token rate (prompt plus max_tokens per minute, counted
at admission as OpenAI counts it). The queue as a whole is bounded: once full, a tenant
is admitted only while it holds less than its weighted share of the bound, so a flood
from one key cannot take every place from the others.

Dispatch may keep a headroom of slots (and one prompt's place) free: only a tenant
running less than the share it would have were one more tenant to arrive takes them. A
flood then never fills every slot, and another key's request starts at once instead of
after one of the flood's ends. Where tenants share the cluster, a dispatched ticket of a
tenant beyond that share also gets a later priority at the workers (1, the others 0), so
another tenant's prompt is computed before the flood's prompts queued there.
"""
from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class TenantPolicy:
    weight: float = 1.0
    max_concurrency: int = 0            # requests admitted at once (queued or running); 0: no cap
    tokens_per_minute: int = 0          # prompt + max_tokens admitted per minute; 0: no limit

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a positive number, not {self.weight}")
        if self.max_concurrency < 0 or self.tokens_per_minute < 0:
            raise ValueError("max_concurrency and tokens_per_minute must be 0 (none) or more")


class Refused(Exception):
    """Not admitted: `reason` is "overloaded" (the queue is full) or "rate_limit_exceeded"
    (a cap or rate of the tenant's); retry after `retry_after` seconds (None: a retry
    cannot succeed, the request is larger than the tenant's rate allows)."""

    def __init__(self, reason: str, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


@dataclass(eq=False)
class Ticket:
    tenant: str
    cost: float
    slots: int                          # sequences it runs: its choices (n)
    start: float = 0.0                  # its start tag
    admitted_at: float = 0.0
    dispatched: bool = False
    prefilling: bool = False            # dispatched, no token yet: its prompt is being computed
    priority: int = 0                   # its prompt's turn at the workers: lower first


@dataclass
class _Tenant:
    policy: TenantPolicy
    finish: float = 0.0                 # the finish tag of its last admitted request
    admitted: int = 0                   # queued or running
    running: int = 0                    # slots of its dispatched tickets
    prefilling: int = 0                 # its dispatched tickets without a first token
    tokens: float = 0.0                 # its token bucket
    refilled: float = 0.0
    # Its queued tickets by (start tag, arrival): in that order already, as a tenant's
    # start tags never fall (each is at least the one before's finish).
    queue: deque[tuple[float, int, Ticket]] = field(default_factory=deque)


@dataclass
class FairQueue:
    """Admission, fair order and dispatch under a limit of running slots. Not thread
    safe: one event loop drives it."""
    max_pending: int
    policies: Callable[[str], TenantPolicy] = lambda tenant: TenantPolicy()
    clock: Callable[[], float] = time.monotonic
    running_slots: int = 0
    prefilling: int = 0                 # dispatched tickets without a first token
    queued: int = 0                     # tickets waiting
    _tenants: dict[str, _Tenant] = field(default_factory=dict)
    _seq: itertools.count = field(default_factory=itertools.count)
    _vtime: float = 0.0

    @property
    def pending(self) -> int:
        """Requests admitted and not done: queued or running."""
        return sum(t.admitted for t in self._tenants.values())

    def admit(self, tenant: str, cost: float, slots: int = 1) -> Ticket:
        """A ticket in the queue, or Refused."""
        return self.admit_all(tenant, [(cost, slots)])[0]

    def admit_all(self, tenant: str, asks: list[tuple[float, int]]) -> list[Ticket]:
        """A ticket for each of a request's prompts ((cost, slots) each), or Refused for
        them all: the request is checked against the tenant's limits as a whole, so a
        refusal takes nothing from its bucket nor its place in the fair order, and a
        retry after `retry_after` finds room for all of it."""
        t = self._tenants.get(tenant)
        if t is None:
            policy = self.policies(tenant)
            t = self._tenants[tenant] = _Tenant(policy, tokens=policy.tokens_per_minute, refilled=self.clock())
        self._check(tenant, t, sum(cost for cost, _ in asks), len(asks))
        tickets = []
        for cost, slots in asks:
            start = max(self._vtime, t.finish)
            t.finish = start + cost / t.policy.weight
            t.admitted += 1
            if t.policy.tokens_per_minute:
                t.tokens -= cost
            ticket = Ticket(tenant, cost, slots, start, self.clock())
            t.queue.append((start, next(self._seq), ticket))
            self.queued += 1
            tickets.append(ticket)
        return tickets

    def _check(self, tenant: str, t: _Tenant, cost: float, count: int) -> None:
        """Whether `count` requests (a request's prompts) of `cost` tokens in all fit the
        tenant's limits and the queue's bound; Refused if not."""
        p = t.policy
        if p.max_concurrency and count > p.max_concurrency:
            raise Refused("rate_limit_exceeded", f"this request has {count} prompts, more than this key's limit of "
                                                 f"{p.max_concurrency} requests at once", None)
        if p.max_concurrency and t.admitted + count > p.max_concurrency:
            raise Refused("rate_limit_exceeded", f"this key has {t.admitted} requests in flight, its limit; retry "
                                                 "when one ends", 1.0)
        if p.tokens_per_minute:
            now = self.clock()
            rate = p.tokens_per_minute / 60.0
            t.tokens = min(p.tokens_per_minute, t.tokens + (now - t.refilled) * rate)
            t.refilled = now
            if cost > p.tokens_per_minute:
                raise Refused("rate_limit_exceeded", f"this request counts {cost:.0f} tokens (prompt and max_tokens), "
                                                     f"more than this key's {p.tokens_per_minute} tokens per minute",
                              None)
            if cost > t.tokens:
                raise Refused("rate_limit_exceeded", f"this key's limit of {p.tokens_per_minute} tokens per minute "
                                                     f"is reached (this request counts {cost:.0f})",
                              (cost - t.tokens) / rate)
        pending = self.pending
        if pending + count - 1 >= self.max_pending and t.admitted + count - 1 >= self._share(tenant):
            raise Refused("overloaded", f"the server is at capacity ({pending} requests in flight); retry later", 1.0)

    def _share(self, tenant: str) -> float:
        """The tenant's weighted share of the queue's bound among the tenants holding
        places in it (itself included)."""
        holders = [name for name, t in self._tenants.items() if t.admitted or name == tenant]
        total = sum(self._tenants[name].policy.weight for name in holders)
        return self.max_pending * self._tenants[tenant].policy.weight / total

    def dispatch(self, limit: int, prefill_limit: int | None = None, headroom: int = 0,
                 prioritize: bool = False) -> list[Ticket]:
        """The tickets to run now, in fair order, while running slots stay within `limit`
        and tickets still waiting for their first token within `prefill_limit` (one ticket
        always runs when nothing does, however many slots it takes). The second bound
        keeps the prompts queued at the workers few: a newcomer's prompt waits behind
        those, whatever its tenant. The last `headroom` slots, and the last prompt's place,
        go only to a tenant under its share (`_under_share`), whose ticket may pass others
        queued before it. With `prioritize`, such a ticket (its tenant under the share,
        none of its prompts prefilling) gets priority 0 at the workers, the others 1: at a
        flood's start, while the flood still runs within its share, its prompts are
        already queued at the prefill worker, and another tenant's first one must not
        wait behind them."""
        out = []
        if not self.queued:
            return out
        kept = prefill_limit if prefill_limit is None or not headroom else max(1, prefill_limit - 1)
        # Built once: the tenants' weights do not change here, their running counts do
        # and the predicates read them as they go.
        under = self._under_share(limit)
        while self.queued:
            t, entry = min(((t, t.queue[0]) for t in self._tenants.values() if t.queue), key=lambda p: p[1][:2])
            if not self._fits(entry[2], limit - headroom, kept):
                passing = self._first_under(under, limit, prefill_limit) \
                    if headroom and self._fits(None, limit, prefill_limit) else None
                if passing is None:
                    break
                t, entry = passing
            t.queue.remove(entry)
            self.queued -= 1
            start, _, ticket = entry
            if prioritize:
                ticket.priority = 0 if under(ticket.tenant, ticket.slots) else 1
            self._vtime = max(self._vtime, start)
            ticket.dispatched = ticket.prefilling = True
            self.running_slots += ticket.slots
            t.running += ticket.slots
            t.prefilling += 1
            self.prefilling += 1
            out.append(ticket)
        return out

    def _fits(self, ticket: Ticket | None, limit: int, prefill_limit: int | None) -> bool:
        """Whether `ticket` (None: one slot) may run within these bounds."""
        return not self.running_slots or (self.running_slots + (ticket.slots if ticket else 1) <= limit
                                          and (prefill_limit is None or self.prefilling < prefill_limit))

    def _under_share(self, limit: int) -> Callable[[str, int], bool]:
        """Whether a tenant would still run within the share of `limit` it would have
        were one more tenant (of its weight) to arrive, with `slots` more, and has no
        prompt of its own prefilling: a flood is never under it, a newcomer beside one is."""
        total = sum(t.policy.weight for t in self._tenants.values() if t.admitted)

        def under(tenant: str, slots: int) -> bool:
            t = self._tenants[tenant]
            w = t.policy.weight
            return not t.prefilling and t.running + slots <= limit * w / (total + w)
        return under

    def _first_under(self, under: Callable[[str, int], bool], limit: int, prefill_limit: int | None
                     ) -> tuple[_Tenant, tuple[float, int, Ticket]] | None:
        """The first ticket, in fair order, of a tenant `under` its share that fits within
        the bounds: (its tenant, its queue entry), or None. A tenant past its share is
        passed over whole, so a flood's backlog is never scanned."""
        best = None
        for name, t in self._tenants.items():
            if not t.queue or not under(name, 1):
                continue
            entry = next((e for e in t.queue if under(name, e[2].slots) and self._fits(e[2], limit, prefill_limit)),
                         None)
            if entry is not None and (best is None or entry[:2] < best[1][:2]):
                best = (t, entry)
        return best

    def first_token(self, ticket: Ticket) -> None:
        """A dispatched ticket's first token came: its prompt is done."""
        if ticket.prefilling:
            ticket.prefilling = False
            self.prefilling -= 1
            self._tenants[ticket.tenant].prefilling -= 1

    def done(self, ticket: Ticket) -> None:
        """A ticket ended, run or not (a client gone while queued)."""
        t = self._tenants[ticket.tenant]
        t.admitted -= 1
        self.first_token(ticket)
        if ticket.dispatched:
            self.running_slots -= ticket.slots
            t.running -= ticket.slots
        else:
            for entry in t.queue:
                if entry[2] is ticket:
                    t.queue.remove(entry)
                    self.queued -= 1
                    break
        if not t.admitted and not t.policy.tokens_per_minute and t.finish <= self._vtime:
            del self._tenants[ticket.tenant]    # nothing of it left to remember
