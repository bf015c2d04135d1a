"""The workers this router routes to: who they are, what load it has put on them, and
which of them a request goes to.

Members come from a static list (each polled with Info) or from the Redis registry
(records with a TTL; a new epoch is a new worker). A worker that leaves closes its
channel once the requests on it have ended.

Load has two sources: what a worker last reported (Info or its registry record) and what
this router has sent it since (the counters on `Worker`). The counters change only
through `Worker`'s methods, each named for what happened to a request, so every increment
has its decrement in the same place.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Coroutine

import grpc

from services.common.grpc_server import channel
from services.common.lifecycle import cancel_and_wait
from services.common.metrics import RouterMetrics
from services.common.registry import CLOSE_TIMEOUT, RedisRegistry
from services.common.security import ClusterSecret, call_interceptors
from services.common.settings import RouterSettings
from services.engine.core.prefix_cache import cached_prefix_blocks
from services.router.generation import Generation
from services.router.latency import LatencyLedger
from services.router.policy import CostModel, DecodeLoad, PrefillLoad, pick_decode, plan_prefill
from services.router.protocol import APIError
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# How long a worker's control calls (Info, Release; Reserve gets five times this) may take.
INFO_TIMEOUT = 2.0
REFRESH_SECONDS = 1.0
# Seconds a stop waits for the calls still running in the background (releases).
CLEANUP_SECONDS = 10.0
# The most WorkerSet.stop takes: the refresh's end (its joins listener's Redis close
# within), the background calls and then their cancel, the registry's close.
STOP_SECONDS = 3 * CLOSE_TIMEOUT + CLEANUP_SECONDS + CLOSE_TIMEOUT + CLOSE_TIMEOUT
# Prefix keys the router itself just sent to a worker count as held there until the
# worker's own summary has had time to include them.
RECENT_KEYS_SECONDS = 5.0
# A decode worker that does not report its batch size (an older one) is taken to hold this.
DEFAULT_MAX_BATCH = 64
# Prompts dispatched and not yet prefilled, per prefill worker (WorkerSet.capacity).
PREFILL_LOOKAHEAD = 4
# Of each decode batch, the rows (one in this many) a flood from one tenant leaves free
# for the others (FairQueue.dispatch's headroom).
HEADROOM_SHARE = 16


@dataclass
class Worker:
    role: str
    address: str
    stub: object = None
    chan: grpc.aio.Channel | None = None
    info: worker_pb2.WorkerInfo | None = None
    name: str = ""                      # role-epoch: how responses name it (addresses stay in logs, metrics)
    epoch: str = ""                     # its last answer's; kept while `info` is cleared by a failure
    inflight: int = 0                   # requests this router has routed here, unfinished
    decoding: int = 0                   # decode: of those, the ones in its batch now (or prefilling there)
    local_tokens: int = 0               # decode: prompt tokens sent there to prefill, first token not yet back
    inflight_tokens: int = 0            # prefill: prompt tokens sent and not answered
    last_pick: float = 0.0
    suspend_seconds: float = REFRESH_SECONDS    # how long a connection failure takes it out
    suspended_until: float = 0.0
    recent_keys: dict[int, float] = field(default_factory=dict)   # prefix key -> expiry
    reported_keys: dict[int, None] = field(default_factory=dict)  # its last report's prefix keys, as a set
    answered: list[tuple[float, int]] = field(default_factory=list)  # (unix time, prompt tokens)
    # Set when it leaves without answering (frozen, cut off): calls waiting for its first
    # answer give up then (Handoff.unless_unreachable), those already streaming go on.
    unreachable: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def healthy(self) -> bool:
        return (self.info is not None and not self.info.draining
                and time.monotonic() >= self.suspended_until)

    def seen(self, info: worker_pb2.WorkerInfo) -> None:
        self.info, self.epoch, self.name = info, info.epoch, f"{self.role}-{info.epoch}"
        self.reported_keys = dict.fromkeys(info.prefix_hashes)

    @property
    def label(self) -> str:
        return f"{self.role} worker {self.name}" if self.name else f"a {self.role} worker"

    def queued_tokens(self) -> int:
        """The worker's reported queue, less what it has answered this router since the
        report was taken; never less than what this router has waiting there now."""
        since = self.info.reported_at
        self.answered = [(t, n) for t, n in self.answered if t >= since]
        return max(self.inflight_tokens, self.info.queued_prefill_tokens - sum(n for _, n in self.answered))

    def held_keys(self, now: float) -> ChainMap:
        """The prefix keys it holds, for `in` tests: reported ones and ones routed there
        lately. A view, not a copy: a report carries up to 4,096 keys, and every request
        asks this of every worker."""
        for k in [k for k, t in self.recent_keys.items() if t < now]:
            del self.recent_keys[k]
        return ChainMap(self.recent_keys, self.reported_keys)

    # ---- what happened to it: its counters change only here ----
    def request_routed(self) -> None:
        self.inflight += 1

    def request_ended(self) -> None:
        self.inflight -= 1

    def batch_joined(self) -> None:
        """Decode: a request's sequence is in its batch (or prefilling there)."""
        self.decoding += 1

    def batch_left(self) -> None:
        self.decoding -= 1

    def local_prefill_sent(self, tokens: int) -> None:
        """Decode: a prompt went there to prefill; it is in its queue until the first token."""
        self.local_tokens += tokens

    def local_prefill_answered(self, tokens: int) -> None:
        self.local_tokens -= tokens

    def prompt_planned(self, tokens: int) -> None:
        """Prefill: a prompt will go here. It counts in the queue from this decision on,
        so requests planned while this one reserves blocks see it there."""
        self.inflight_tokens += tokens

    def prompt_dropped(self, tokens: int) -> None:
        """Prefill: a planned prompt was never sent."""
        self.inflight_tokens -= tokens

    def prefill_sent(self) -> None:
        """Prefill: the planned prompt is on its way (its tokens were counted when planned)."""
        self.inflight += 1

    def prefill_answered(self, tokens: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= tokens
        self.answered.append((time.time(), tokens))

    def caches(self, keys: list[int]) -> None:
        """A prompt with these prefix keys was prefilled there: they count as held, where
        the worker keeps prefixes at all (routing and the cost model would count on hits
        that never come)."""
        if self.info is not None and not self.info.prefix_caching:
            return
        expiry = time.monotonic() + RECENT_KEYS_SECONDS
        self.recent_keys.update((k, expiry) for k in keys)

    def suspend(self) -> None:
        """Out of routing for a while: a call found it unreachable."""
        self.suspended_until = time.monotonic() + self.suspend_seconds

    def lost(self) -> None:
        """Out of routing until a refresh after the registry TTL (or the next Info poll)
        shows it alive: a killed worker's record outlives it by up to the TTL."""
        self.info = None
        self.suspend()


class WorkerSet:
    def __init__(self, settings: RouterSettings, metrics: RouterMetrics, latency: LatencyLedger,
                 cost: CostModel) -> None:
        self.settings = settings
        self.metrics = metrics
        self.latency = latency
        self.cost = cost
        self.secret = ClusterSecret.from_file(settings.cluster_secret_file)
        self.registry = (RedisRegistry(settings.redis, ttl=settings.registry_ttl, secret=self.secret)
                         if settings.redis else None)
        tls = settings.worker_tls
        self._dial = dict(credentials=tls.channel_credentials() if tls.ca else None,
                          server_name=settings.worker_tls_server_name, interceptors=call_interceptors(self.secret))
        self.decode = [Worker("decode", a) for a in settings.decode]
        self.prefill = [Worker("prefill", a) for a in settings.prefill]
        self.by_epoch: dict[str, Worker] = {}
        self._refresher: asyncio.Task | None = None
        self._cleanups: set[asyncio.Task] = set()

    # ---- membership ----
    async def start(self) -> None:
        for w in self.decode + self.prefill:
            self._connect(w)
        if self.secret is None:
            log.warning("no --cluster-secret-file: registry records are not checked and calls to workers carry "
                        "no credential")
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    def _connect(self, w: Worker) -> None:
        w.chan = channel(w.address, **self._dial)
        stub = worker_pb2_grpc.DecodeWorkerStub if w.role == "decode" else worker_pb2_grpc.PrefillWorkerStub
        w.stub = stub(w.chan)

    async def stop(self) -> None:
        if self._refresher:             # it ends its joins listener (a Redis close, bounded) as it goes
            await cancel_and_wait([self._refresher], 3 * CLOSE_TIMEOUT, "the worker refresh")
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=CLEANUP_SECONDS)
            await cancel_and_wait(self._cleanups, CLOSE_TIMEOUT, "calls to workers still running at the stop")
        for w in self.decode + self.prefill:
            if w.chan is not None:
                await w.chan.close()
        if self.registry is not None:
            await self.registry.close()

    def spawn(self, coro: Coroutine) -> None:
        """Run a call to the workers in the background (a release, a departed worker's
        close); `stop` waits for these before it closes the channels."""
        task = asyncio.create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _refresh_forever(self) -> None:
        """A refresh every period, and one at once when a worker joins (the registry's
        nudge: it starts serving without waiting up to a period for us)."""
        period = min(REFRESH_SECONDS, self.settings.registry_ttl / 3) if self.registry else REFRESH_SECONDS
        joined = asyncio.Event()
        listener = asyncio.create_task(self._listen_for_joins(joined)) if self.registry else None
        try:
            while True:
                try:
                    await asyncio.wait_for(joined.wait(), period)
                except asyncio.TimeoutError:
                    pass
                joined.clear()
                try:
                    await self.refresh()
                except Exception:
                    log.exception("worker refresh failed")
        finally:
            if listener:
                await cancel_and_wait([listener], 2 * CLOSE_TIMEOUT, "the registry's joins listener")

    async def _listen_for_joins(self, joined: asyncio.Event) -> None:
        while True:
            try:
                async for _ in self.registry.joins():
                    joined.set()
            except Exception as exc:            # Redis away: the periodic refresh goes on
                log.debug("joins channel of %s: %s", self.registry.where, exc)
            await asyncio.sleep(REFRESH_SECONDS)

    async def refresh(self) -> None:
        if self.registry is not None:
            await self._refresh_from_registry()
        else:
            await self._poll_info()
        for role, n in self.pool_sizes().items():
            self.metrics.pool_workers.labels(role).set(n)

    async def _poll_info(self) -> None:
        async def one(w: Worker) -> None:
            try:
                info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=INFO_TIMEOUT)
            except grpc.aio.AioRpcError as exc:
                if w.info is not None:
                    log.warning("%s worker %s unreachable: %s", w.role, w.address, exc.code().name)
                w.info = None
                # Calls waiting for its first answer give up and try another worker: a
                # frozen worker keeps its connection, so they would wait out their deadline.
                w.unreachable.set()
                return
            if w.info is None or w.info.epoch != info.epoch:
                log.info("%s worker %s joined (epoch %s)", w.role, w.address, info.epoch)
                w.suspended_until = 0.0             # a restart answers: route there at once
            if w.unreachable.is_set():
                w.unreachable = asyncio.Event()     # answering again: calls from now on wait on it
            w.seen(info)
        await asyncio.gather(*(one(w) for w in self.decode + self.prefill))

    async def _refresh_from_registry(self) -> None:
        """Workers are the live records: new epochs join, and a new epoch at a known
        worker's address replaces it at once (that process is gone). A worker whose record
        is missing leaves unless it still answers as itself, not draining: a Redis that
        restarted empty must not take live workers out of routing until they announce
        themselves again."""
        try:
            records = await self.registry.workers()
        except Exception as exc:                 # Redis away: keep routing to what we know
            log.warning("cannot read the registry %s: %s", self.registry.where, exc)
            return
        seen = set()
        await self._exchange_with_autoscaler()
        for info in records:
            if info.role not in ("prefill", "decode") or not info.address:
                continue
            seen.add(info.epoch)
            w = self.by_epoch.get(info.epoch)
            if w is None:
                for old in [o for o in self.by_epoch.values() if o.address == info.address and o.role == info.role]:
                    self._leave(old, "restarted")
                w = Worker(info.role, info.address, suspend_seconds=self.registry.ttl)
                self._connect(w)
                self.by_epoch[info.epoch] = w
                (self.decode if w.role == "decode" else self.prefill).append(w)
                log.info("%s worker %s joined (epoch %s)", w.role, w.address, info.epoch)
            w.seen(info)
        missing = [w for e, w in self.by_epoch.items() if e not in seen]
        answers = await asyncio.gather(*(self._gone(w) for w in missing))
        for w, gone in zip(missing, answers):
            if gone:
                self._leave(w, gone)

    async def _gone(self, w: Worker) -> str:
        """How a worker with no record is gone ("": it answers Info as the same epoch,
        not draining, so it is still here). One that does not answer is `unreachable`."""
        try:
            info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=INFO_TIMEOUT / 2)
        except grpc.aio.AioRpcError:
            w.unreachable.set()
            return "left without answering"
        if info.epoch != w.epoch or info.draining:
            return "left"
        w.seen(info)
        return ""

    def _leave(self, w: Worker, why: str) -> None:
        self.by_epoch.pop(w.epoch, None)
        (self.decode if w.role == "decode" else self.prefill).remove(w)
        log.info("%s worker %s %s (epoch %s)", w.role, w.address, why, w.epoch)
        self.spawn(self._close_when_idle(w))

    async def _exchange_with_autoscaler(self) -> None:
        """Publish this router's latency per worker; export the autoscaler's decisions."""
        try:
            await self.registry.publish_latency(self.latency.report(set(self.by_epoch)), ttl=3 * self.registry.ttl)
            status, decisions = await self.registry.autoscaler_status()
        except Exception as exc:
            log.warning("cannot exchange autoscaling data through %s: %s", self.registry.where, exc)
            return
        desired = {p.role: p.desired for p in status.pools} if status else {}
        self.metrics.autoscaler.update(desired, decisions)

    async def _close_when_idle(self, w: Worker) -> None:
        """A departed worker's channel closes once the requests on it have ended: those
        routed there and not ended (a request's releases count until they are sent), and
        the prompts planned for a prefill worker while their blocks are reserved."""
        deadline = time.monotonic() + self.settings.request_timeout
        while (w.inflight > 0 or w.inflight_tokens > 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await w.chan.close()

    def decode_at(self, epoch: str) -> Worker | None:
        """The member decode worker of that epoch, if it is still one."""
        return self.by_epoch.get(epoch) or next(
            (w for w in self.decode if w.info is not None and w.info.epoch == epoch), None)

    # ---- what the pools can take ----
    def ready(self) -> bool:
        return any(w.healthy for w in self.decode) and (self.settings.aggregated
                                                          or any(w.healthy for w in self.prefill))

    def awaited(self) -> str:
        """What `ready` waits for, in words."""
        return "a decode worker" if self.settings.aggregated else "a prefill and a decode worker"

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": sum(w.healthy for w in self.prefill), "decode": sum(w.healthy for w in self.decode)}

    def capacity(self) -> tuple[int, int, int]:
        """(sequences, prompts still prefilling, headroom) the router dispatches at once
        (admission.py): --max-running, or what the live decode workers batch and the
        prompts prefilling; a few prompts per prefill worker (or per decode worker,
        prefilling locally), enough to fill its next pass without a long queue behind
        which a newcomer would wait; and the slots kept free of a tenant past its share:
        the prompts prefilling and a sixteenth of each batch (a quarter of the sequences
        at most), so another key's request finds a row free in a decode batch."""
        decode = [w for w in self.decode if w.healthy]
        prefilling = PREFILL_LOOKAHEAD * max(1, sum(w.healthy for w in self.prefill) or len(decode))
        batches = [w.info.max_batch or DEFAULT_MAX_BATCH for w in decode]
        # The prompts prefilling count on top of the batches: the next one is ready to
        # join when a sequence ends, and no batch runs a row short meanwhile.
        running = self.settings.max_running or prefilling + sum(batches)
        headroom = min(running // 4, prefilling + sum(-(-b // HEADROOM_SHARE) for b in batches))
        return running, prefilling, headroom

    # ---- selection (the decisions are policy.py's) ----
    def route(self, gen: Generation) -> tuple[Worker, Worker | None, list[int]]:
        """(decode worker, prefill worker or None for a prefill on the decode worker, the
        prompt's keys). A decode worker's prefix cache serves only a prompt it prefills
        itself (a reservation for a remote prefill takes every block afresh), so a prompt
        that goes to a prefill worker goes to the decode worker its load alone picks."""
        decode = self.pick_decode(gen)
        prefill, _, keys = self.plan(decode, gen)
        if prefill is not None:
            decode = self.pick_decode(gen, by_cache=False, compat_hash=decode.info.compat_hash)
        decode.last_pick = time.monotonic()
        return decode, prefill, keys

    def pick_decode(self, gen: Generation, by_cache: bool = True, compat_hash: str | None = None) -> Worker:
        live = {w.address + w.info.epoch: w for w in self.decode
                if w.healthy and compat_hash in (None, w.info.compat_hash)}
        if not live:
            raise APIError(503, "no decode worker is available", type_="service_unavailable",
                           grpc_code="UNAVAILABLE")
        bs = next(iter(live.values())).info.block_size or 16
        n = len(gen.prompt_ids)
        keys = gen.prefix_keys(bs)[:(n - 1) // bs] if by_cache else []     # the last token is always computed
        now = time.monotonic()
        loads = [DecodeLoad(k, w.info.free_blocks, max(w.info.running + w.info.waiting, w.inflight), w.last_pick,
                            cached_prefix_blocks(keys, w.held_keys(now)) if keys else 0)
                 for k, w in live.items()]
        return live[pick_decode(loads, -(-(n + 1) // bs)).key]

    def plan(self, decode: Worker, gen: Generation) -> tuple[Worker | None, int, list[int]]:
        """(prefill worker or None, cached tokens, prompt keys) for this request."""
        bs = decode.info.block_size or 16
        live = {w.address + w.info.epoch: w for w in self.prefill
                if w.healthy and w.info.compat_hash == decode.info.compat_hash}
        now = time.monotonic()
        loads = [PrefillLoad(k, w.queued_tokens(), w.held_keys(now))
                 for k, w in live.items()]
        keys = gen.prefix_keys(bs)
        # What a local prefill would stall: the sequences in the decode worker's batch, not
        # requests still waiting for a remote prefill (they do not run there yet).
        plan = plan_prefill(loads, keys, len(gen.prompt_ids), bs, decode.decoding,
                            self.cost, self.settings.local_prefill_max_tokens, decode.local_tokens)
        log.debug("request %s: %s", gen.request_id, plan.reason)
        return (live[plan.prefill.key] if plan.prefill else None), plan.cached_tokens, keys
