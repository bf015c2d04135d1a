"""The router's queue on its event loop: a request is admitted (or refused with OpenAI's
429 and `retry-after`), waits for a dispatch slot, runs, and gives its slot back. The
order among tenants and their limits are fairness.FairQueue's; the slots are sequences
the decode pool can batch, and few of them still prefilling (`limit()`), so requests
beyond them wait here, in fair order, rather than in the workers' first-come queues."""
from __future__ import annotations

import asyncio
import collections
import contextvars
import math
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from services.common.metrics import RouterMetrics
from services.common.security import ApiKey
from services.router.fairness import FairQueue, Refused, TenantPolicy, Ticket
from services.router.protocol import APIError

ANONYMOUS = "anonymous"                 # the tenant of every request where no API key is required
# The tenant of the request being handled, set where its API key is checked (HTTP's
# middleware, gRPC's handler): what the work before admission (tokenizing) is shared by.
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("tenant", default="")


def tenant_policies(keys: list[ApiKey]) -> dict[str, TenantPolicy]:
    """Each key's tenant and policy, from its options; ValueError names a bad one."""
    out = {}
    for key in keys:
        opts = dict(key.options)
        try:
            out[key.tenant] = TenantPolicy(weight=float(opts.get("weight", 1.0)),
                                           max_concurrency=int(opts.get("max_concurrency", 0)),
                                           tokens_per_minute=int(opts.get("tokens_per_minute", 0)))
        except ValueError as exc:
            raise ValueError(f"API key {key.tenant}: {exc}") from None
    return out


class Admission:
    def __init__(self, max_pending: int, policies: dict[str, TenantPolicy],
                 limit: Callable[[], tuple[int, int, int]], metrics: RouterMetrics) -> None:
        self.queue = FairQueue(max_pending, lambda tenant: policies.get(tenant, TenantPolicy()))
        self.limit = limit
        # Where another tenant can come (two keys or more), prompts at the workers are kept
        # few and slots free of a flood; a lone tenant's are bounded by the batches alone,
        # so that the prefill workers always have their next step's prompts queued.
        self.shared = len(policies) > 1
        self.metrics = metrics
        self._waiting: dict[Ticket, asyncio.Future] = {}

    def admit(self, tenant: str, cost: float, slots: int = 1) -> Ticket:
        """A place in the queue, or APIError 429 saying why and when to retry."""
        return self.admit_all(tenant, [(cost, slots)])[0]

    def admit_all(self, tenant: str, asks: list[tuple[float, int]]) -> list[Ticket]:
        """A place for each of a request's prompts ((cost, slots) each), all or none
        (FairQueue.admit_all), or APIError 429 saying why and when to retry."""
        tenant = tenant or ANONYMOUS
        try:
            tickets = self.queue.admit_all(tenant, asks)
        except Refused as r:
            self.metrics.tenant_refused.labels(tenant, r.reason).inc()
            headers = {} if r.retry_after is None else {"Retry-After": str(max(1, math.ceil(r.retry_after)))}
            raise APIError(429, r.message, type_="rate_limit_error" if r.reason == "overloaded" else "requests",
                           code=r.reason, grpc_code="RESOURCE_EXHAUSTED", headers=headers) from None
        self.metrics.tenant_admitted.labels(tenant).inc(len(tickets))
        self.metrics.tenant_queued.labels(tenant).inc(len(tickets))
        self._gauges()
        return tickets

    async def wait(self, ticket: Ticket) -> None:
        """Until `ticket` is dispatched."""
        self._pump()
        if not ticket.dispatched:
            future = self._waiting[ticket] = asyncio.get_running_loop().create_future()
            try:
                await future
            finally:
                self._waiting.pop(ticket, None)
        self.metrics.tenant_wait.labels(ticket.tenant).observe(time.monotonic() - ticket.admitted_at)

    def first_token(self, ticket: Ticket) -> None:
        """`ticket`'s first token came: another prompt may go to the workers."""
        if ticket.prefilling:
            self.queue.first_token(ticket)
            self._pump()

    def done(self, ticket: Ticket) -> None:
        """`ticket` ended (ran, failed, or its client left while it waited)."""
        (self.metrics.tenant_running if ticket.dispatched else self.metrics.tenant_queued).labels(ticket.tenant).dec()
        self.queue.done(ticket)
        self._pump()

    def _pump(self) -> None:
        limit, prefill_limit, headroom = self.limit()
        self.metrics.dispatch_limit.set(limit)
        shared = self.shared
        for ticket in self.queue.dispatch(limit, prefill_limit if shared else None, headroom if shared else 0,
                                          prioritize=shared):
            self.metrics.tenant_queued.labels(ticket.tenant).dec()
            self.metrics.tenant_running.labels(ticket.tenant).inc()
            future = self._waiting.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.pending.set(self.queue.pending)
        self.metrics.running.set(self.queue.running_slots)


class FairGate:
    """At most `slots` jobs at once (the tokenizer threads), the waiting ones let in
    round robin by tenant: a tenant with five hundred prompts to tokenize delays another's
    next by about one prompt, not five hundred."""

    def __init__(self, slots: int) -> None:
        self.free = slots
        self._waiting: collections.OrderedDict[str, collections.deque[asyncio.Future]] = collections.OrderedDict()

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        if self.free and not self._waiting:
            self.free -= 1
        else:
            future = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(tenant, collections.deque()).append(future)
            try:
                await future
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._next()                # handed a turn just as its caller left: pass it on
                raise
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        """A turn ends: the next tenant's oldest waiter takes it, or it is free."""
        while self._waiting:
            tenant, waiters = self._waiting.popitem(last=False)
            future = waiters.popleft()
            if waiters:
                self._waiting[tenant] = waiters     # to the back of the round
            if not future.done():
                future.set_result(None)
                return
        self.free += 1
