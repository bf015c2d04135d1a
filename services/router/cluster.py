"""The router's view of the workers and the life of one generation across them.

    admit (bounded) -> pick decode worker -> plan: remote or local prefill (policy.py)
      -> remote: Reserve blocks (waits while the pool is full) -> Prefill on the chosen
         prefill worker (KV pushed into the reserved blocks, first token)
      -> Decode stream (tokens) -> detokenize, stop strings, schema guard (output.py) -> caller
      -> on any exit: the reservation or the decode stream is released

Workers come from a static list (each polled with Info) or from the Redis registry
(records with a TTL; a new epoch is a new worker). If the prefill fails before
writing, the decode worker prefills locally; that fallback is logged and counted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import ChainMap
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from services.common.grpc_server import channel
from services.common.metrics import RouterMetrics
from services.common.registry import RedisRegistry
from services.common.security import ClusterSecret, call_interceptors
from services.common.settings import RouterSettings
from services.worker.wire import logprob_from_proto, sampling_to_proto
from services.engine.prefix_cache import cached_prefix_blocks
from services.engine.sampling import TokenLogprob
from services.router.generation import Delta, Generation, Tokens
from services.router.latency import LatencyLedger
from services.router.output import OutputProcessor
from services.router.policy import CostModel, DecodeLoad, PrefillLoad, pick_decode, plan_prefill
from services.router.protocol import APIError
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT = 2.0
REFRESH_SECONDS = 1.0
# Prefix keys the router itself just sent to a prefill worker count as held there until
# the worker's own summary has had time to include them.
RECENT_KEYS_SECONDS = 5.0
# Tries per request when a worker turns out dead before any token was streamed.
ATTEMPTS = 3
# The prefill RPC outlives the write lease by this much, so a prefill that reaches the
# router's deadline has already stopped writing.
PREFILL_RPC_MARGIN = 5.0
# Prefill failures after which the decode worker prefills locally instead: the prefill
# worker is gone or full, or the KV transfer failed or ran out of lease. Each is counted.
LOCAL_FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}
# A decode worker that does not report its batch size (an older one) is taken to hold this.
DEFAULT_MAX_BATCH = 64
# Prompts dispatched and not yet prefilled, per prefill worker (Cluster.capacity).
PREFILL_LOOKAHEAD = 4


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


class Cluster:
    def __init__(self, settings: RouterSettings, tokenizer, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.secret = ClusterSecret.from_file(settings.cluster_secret_file)
        self.registry = (RedisRegistry(settings.redis, ttl=settings.registry_ttl, secret=self.secret)
                         if settings.redis else None)
        tls = settings.worker_tls
        self._dial = dict(credentials=tls.channel_credentials() if tls.ca else None,
                          server_name=settings.worker_tls_server_name, interceptors=call_interceptors(self.secret))
        self.decode = [Worker("decode", a) for a in settings.decode]
        self.prefill = [Worker("prefill", a) for a in settings.prefill]
        self.by_epoch: dict[str, Worker] = {}
        self.cost = CostModel()
        self.latency = LatencyLedger()
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
        if self._refresher:
            self._refresher.cancel()
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=10)
        for w in self.decode + self.prefill:
            if w.chan is not None:
                await w.chan.close()
        if self.registry is not None:
            await self.registry.close()

    async def _refresh_forever(self) -> None:
        period = min(REFRESH_SECONDS, self.settings.registry_ttl / 3) if self.registry else REFRESH_SECONDS
        while True:
            await asyncio.sleep(period)
            try:
                await self.refresh()
            except Exception:
                log.exception("worker refresh failed")

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
                return
            if w.info is None or w.info.epoch != info.epoch:
                log.info("%s worker %s joined (epoch %s)", w.role, w.address, info.epoch)
                w.suspended_until = 0.0             # a restart answers: route there at once
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
        answers = await asyncio.gather(*(self._still_there(w) for w in missing))
        for w, there in zip(missing, answers):
            if not there:
                self._leave(w, "left")

    async def _still_there(self, w: Worker) -> bool:
        """Whether a worker with no record answers Info as the same epoch, not draining."""
        try:
            info = await w.stub.Info(worker_pb2.InfoRequest(), timeout=INFO_TIMEOUT / 2)
        except grpc.aio.AioRpcError:
            return False
        if info.epoch != w.epoch or info.draining:
            return False
        w.seen(info)
        return True

    def _leave(self, w: Worker, why: str) -> None:
        self.by_epoch.pop(w.epoch, None)
        (self.decode if w.role == "decode" else self.prefill).remove(w)
        log.info("%s worker %s %s (epoch %s)", w.role, w.address, why, w.epoch)
        self._spawn(self._close_when_idle(w))

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
        """A departed worker's channel closes once the requests on it have ended."""
        deadline = time.monotonic() + self.settings.request_timeout
        while w.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await w.chan.close()

    def ready(self) -> bool:
        return any(w.healthy for w in self.decode) and (self.settings.aggregated
                                                          or any(w.healthy for w in self.prefill))

    def awaited(self) -> str:
        """What `ready` waits for, in words."""
        return "a decode worker" if self.settings.aggregated else "a prefill and a decode worker"

    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.decode + self.prefill if w.healthy]
        return min(lens) if lens else None

    def pool_sizes(self) -> dict[str, int]:
        return {"prefill": sum(w.healthy for w in self.prefill), "decode": sum(w.healthy for w in self.decode)}

    # ---- selection ----
    def _pick_decode(self, gen: Generation) -> Worker:
        live = {w.address + w.info.epoch: w for w in self.decode if w.healthy}
        if not live:
            raise APIError(503, "no decode worker is available", type_="service_unavailable",
                           grpc_code="UNAVAILABLE")
        bs = next(iter(live.values())).info.block_size or 16
        n = len(gen.prompt_ids)
        keys = gen.prefix_keys(bs)[:(n - 1) // bs]         # the last token is always computed
        now = time.monotonic()
        loads = [DecodeLoad(k, w.info.free_blocks, max(w.info.running + w.info.waiting, w.inflight), w.last_pick,
                            cached_prefix_blocks(keys, w.held_keys(now)) if keys else 0)
                 for k, w in live.items()]
        chosen = live[pick_decode(loads, -(-(n + 1) // bs)).key]
        chosen.last_pick = now
        return chosen

    def _plan(self, decode: Worker, gen: Generation):
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

    def capacity(self) -> tuple[int, int]:
        """(sequences, prompts still prefilling) the router dispatches at once
        (admission.py): --max-running, or what the live decode workers batch and the
        prompts prefilling; and a few prompts per prefill worker (or per decode worker,
        prefilling locally), enough to fill its next pass without a long queue behind
        which a newcomer would wait."""
        decode = [w for w in self.decode if w.healthy]
        prefilling = PREFILL_LOOKAHEAD * max(1, sum(w.healthy for w in self.prefill) or len(decode))
        # The prompts prefilling count on top of the batches: the next one is ready to
        # join when a sequence ends, and no batch runs a row short meanwhile.
        running = self.settings.max_running or prefilling + sum(w.info.max_batch or DEFAULT_MAX_BATCH
                                                               for w in decode)
        return running, prefilling

    # ---- one generation ----
    async def generate(self, gens: list[Generation]) -> AsyncIterator[Delta]:
        """Yields text deltas of every choice (`gens`: one per choice, the first leading:
        its prompt, workers and route are the request's); raises APIError on failure.
        Closing the iterator early (client gone) cancels the request on every worker."""
        leader = gens[0]
        output = OutputProcessor(self.tokenizer, gens, lambda index: self._spawn(self._end_choice(leader, index)))
        async with aclosing(self._tokens(leader, len(gens))) as tokens:
            async for index, token_ids, finish, logprobs in tokens:
                delta = await output.feed(index, token_ids, finish, logprobs)
                if delta is None:
                    continue
                yield delta
                if output.finished:
                    return

    async def _end_choice(self, leader: Generation, index: int) -> None:
        decode = self.by_epoch.get(leader.decode_epoch) or next(
            (w for w in self.decode if w.info is not None and w.info.epoch == leader.decode_epoch), None)
        if decode is None:
            return
        request_id = leader.worker_id if index == 0 else f"{leader.worker_id}#{index}"
        await self._release(decode, worker_pb2.KVHandle(request_id=request_id, epoch=leader.decode_epoch),
                            "stop string")

    async def _tokens(self, gen: Generation, n: int) -> AsyncIterator[Tokens]:
        """Tokens from the workers, for `n` choices of `gen`'s prompt. A worker found dead
        before anything was streamed is taken out of routing and the request is tried
        again on the others."""
        for attempt in range(1, ATTEMPTS + 1):
            streamed = False
            try:
                async with aclosing(self._attempt(gen, n, attempt)) as tokens:
                    async for item in tokens:
                        streamed = True
                        yield item
                return
            except APIError as exc:
                if streamed or exc.grpc_code != "UNAVAILABLE" or attempt == ATTEMPTS or not self.ready():
                    raise
                log.warning("request %s: %s; trying again on another worker", gen.request_id, exc.message)
                self.metrics.retries.inc()

    async def _attempt(self, gen: Generation, n: int, attempt: int) -> AsyncIterator[Tokens]:
        """One try through the workers, under an id of its own: a late Release of an
        earlier try can never reach this one. Cleanup rule: whenever a reservation
        exists and the decode stream did not finish, a Release is sent, but only once no
        prefill can still be writing into the reserved blocks. Release is idempotent on
        the worker."""
        gen.worker_id = f"{gen.request_id}.{attempt}"
        gen.prefill_worker, gen.prefill_epoch, gen.transport, gen.transport_fallback = "", "", "", False
        gen.kv_bytes = gen.cached_tokens = 0
        decode = self._pick_decode(gen)
        gen.decode_worker, gen.decode_epoch = decode.name, decode.info.epoch
        self.metrics.routed.labels("decode", decode.address).inc()
        decode.inflight += 1
        handle, writer, finished, claimed, local_tokens = None, None, False, None, 0
        ended: set[int] = set()
        try:
            prefill, _, keys = self._plan(decode, gen)
            first = first_logprob = None
            if prefill is not None:
                # The prompt counts in the prefill worker's queue from this decision on:
                # requests planned while this one reserves blocks must see it there.
                claimed = prefill
                prefill.inflight_tokens += len(gen.prompt_ids)
                handle = await self._reserve(decode, gen)
                writer, claimed = self._start_prefill(prefill, handle, gen), None
                first, first_logprob = await self._await_prefill(prefill, decode, handle, writer, gen, keys)
            if first is None:
                handle = None                   # released by _await_prefill, or never taken
                gen.decision = "local_fallback" if prefill is not None else "local"
                req = self._decode_request(gen, first_token=0, local=True, epoch="", n=n)
                local_tokens = len(gen.prompt_ids)      # in the decode worker's queue until its first token
                decode.local_tokens += local_tokens
                expiry = time.monotonic() + RECENT_KEYS_SECONDS     # its prefix is cached there from now on
                decode.recent_keys.update((k, expiry) for k in keys)
            else:
                gen.decision = "remote"
                req = self._decode_request(gen, first_token=first, local=False, epoch=handle.epoch, n=n)
            self.metrics.decisions.labels(gen.decision).inc()
            decode.decoding += 1
            try:
                async with aclosing(self._decode_stream(decode, req, n, gen)) as stream:
                    async for index, token_ids, finish, logprobs in stream:
                        decode.local_tokens -= local_tokens
                        local_tokens = 0
                        if first is not None:
                            # The prefill's token goes out once the decode worker has the
                            # sequence in its batch (its first, empty, message): the second
                            # token then follows one step later, not up to two.
                            yield 0, [first], "", [first_logprob] if first_logprob else None
                            first = None
                        if not token_ids and not finish:
                            continue
                        if finish:
                            ended.add(index)
                            finished = len(ended) == n
                        yield index, token_ids, finish, logprobs
            finally:
                decode.decoding -= 1
                decode.local_tokens -= local_tokens
        finally:
            decode.inflight -= 1
            if claimed is not None:                 # planned there, never sent
                claimed.inflight_tokens -= len(gen.prompt_ids)
            if handle is not None and not finished:
                self._spawn(self._release_after(writer, decode, handle, "request ended early"))

    def _decode_request(self, gen: Generation, first_token: int, local: bool, epoch: str, n: int):
        return worker_pb2.DecodeRequest(
            request_id=gen.worker_id, epoch=epoch, prompt_token_ids=gen.prompt_ids, first_token_id=first_token,
            sampling=sampling_to_proto(gen.params), kv_bytes=gen.kv_bytes,
            local_prefill=local, transport=gen.transport, n=n)

    async def _reserve(self, decode: Worker, gen: Generation) -> worker_pb2.KVHandle:
        """Reserve prompt blocks; while the pool is full, wait (this is the queue)."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.request_timeout
        delay = 0.01
        req = worker_pb2.ReserveRequest(request_id=gen.worker_id, num_prompt_tokens=len(gen.prompt_ids),
                                        lease_seconds=self.settings.prefill_timeout)
        while True:
            call = asyncio.ensure_future(decode.stub.Reserve(req, timeout=INFO_TIMEOUT * 5))
            try:
                handle = await asyncio.shield(call)
                self.metrics.queue_time.observe(time.monotonic() - t0)
                return handle
            except asyncio.CancelledError:
                # The worker may have reserved already: release whatever the call returns.
                self._spawn(self._release_reserved(call, decode))
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() + delay < deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                raise _worker_error(decode, exc) from None

    def _start_prefill(self, prefill: Worker, handle, gen: Generation) -> asyncio.Future:
        gen.prefill_worker, gen.prefill_epoch = prefill.name, prefill.info.epoch
        self.metrics.routed.labels("prefill", prefill.address).inc()
        n = len(gen.prompt_ids)
        prefill.inflight += 1                 # its tokens were counted when it was planned
        call = asyncio.ensure_future(prefill.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=gen.worker_id, prompt_token_ids=gen.prompt_ids,
                                      sampling=sampling_to_proto(gen.params), handle=handle),
            timeout=self.settings.prefill_timeout + PREFILL_RPC_MARGIN))

        def done(_) -> None:
            prefill.inflight -= 1
            prefill.inflight_tokens -= n
            prefill.answered.append((time.time(), n))
        call.add_done_callback(done)
        return call

    async def _await_prefill(self, prefill: Worker, decode: Worker, handle, call: asyncio.Future,
                             gen: Generation, keys: list[int]) -> tuple[int | None, TokenLogprob | None]:
        """The first token and its logprob (when asked for), or None when the decode worker
        should prefill locally. The call is shielded: a cancelled request lets the prefill
        end before its blocks go."""
        try:
            resp = await asyncio.shield(call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in LOCAL_FALLBACK_CODES:
                raise _worker_error(prefill, exc) from None     # _tokens releases the handle
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                prefill.suspended_until = time.monotonic() + prefill.suspend_seconds
            await self._release(decode, handle, f"prefill failed: {exc.code().name}")
            log.warning("request %s: prefill worker %s failed (%s: %s); prefilling on the decode worker",
                        gen.request_id, prefill.address, exc.code().name, exc.details())
            return None, None
        gen.kv_bytes = resp.kv_bytes
        gen.transport = resp.transport
        gen.transport_fallback = resp.transport_fallback
        gen.cached_tokens = resp.cached_tokens
        n = len(gen.prompt_ids)
        self.cost.observe(n - resp.cached_tokens, resp.prefill_seconds, resp.transfer_seconds,
                          time.monotonic() - gen.started, n)
        expiry = time.monotonic() + RECENT_KEYS_SECONDS
        prefill.recent_keys.update((k, expiry) for k in keys)
        self.metrics.kv_bytes.labels(resp.transport).inc(resp.kv_bytes)
        self.metrics.cached_tokens.inc(resp.cached_tokens)
        logprob = logprob_from_proto(resp.first_logprob) if resp.HasField("first_logprob") else None
        if resp.prompt_logprobs:
            gen.prompt_logprobs = [logprob_from_proto(lp) for lp in resp.prompt_logprobs]
        return resp.first_token_id, logprob

    async def _decode_stream(self, decode: Worker, req, n: int, gen: Generation) -> AsyncIterator[Tokens]:
        """Every choice's tokens, until all `n` have finished."""
        call = decode.stub.Decode(req, timeout=self.settings.request_timeout)
        running = set(range(n))
        try:
            async for chunk in call:
                if chunk.prompt_logprobs:               # a prompt computed there
                    gen.prompt_logprobs = [logprob_from_proto(lp) for lp in chunk.prompt_logprobs]
                if chunk.cached_tokens:
                    gen.cached_tokens = chunk.cached_tokens
                    self.metrics.cached_tokens.inc(chunk.cached_tokens)
                yield (chunk.index, list(chunk.token_ids), chunk.finish_reason,
                       [logprob_from_proto(lp) for lp in chunk.logprobs] if chunk.logprobs else None)
                if chunk.finish_reason:
                    running.discard(chunk.index)
                    if not running:
                        return
            raise APIError(502, "decode worker closed the stream early", type_="server_error",
                           grpc_code="UNAVAILABLE")
        except grpc.aio.AioRpcError as exc:
            raise _worker_error(decode, exc) from None
        finally:
            call.cancel()                     # no-op when finished; frees the blocks otherwise

    async def _release(self, decode: Worker, handle, reason: str) -> None:
        try:
            await decode.stub.Release(worker_pb2.ReleaseRequest(request_id=handle.request_id, epoch=handle.epoch,
                                                                reason=reason), timeout=INFO_TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            # The lease expires the blocks if the worker is alive but unreachable now.
            log.warning("release of %s on %s failed: %s", handle.request_id, decode.address, exc.code().name)

    async def _release_after(self, writer: asyncio.Future | None, decode: Worker, handle, reason: str) -> None:
        if writer is not None:
            try:
                await writer
            except BaseException:
                pass
        await self._release(decode, handle, reason)

    async def _release_reserved(self, call: asyncio.Future, decode: Worker) -> None:
        try:
            handle = await call
        except BaseException:
            return
        await self._release(decode, handle, "request ended while reserving")

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)


def _worker_error(worker: Worker, exc: grpc.aio.AioRpcError) -> APIError:
    """The caller's error for a failed worker call. It names the worker by id; its address
    and gRPC's connection details (which carry addresses) go to the log only."""
    code = exc.code()
    log.warning("%s worker %s (%s): %s: %s", worker.role, worker.address, worker.name, code.name, exc.details())
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        # Out of routing until a refresh after the registry TTL (or the next Info poll)
        # shows it alive: a killed worker's record outlives it by up to the TTL.
        worker.info = None
        worker.suspended_until = time.monotonic() + worker.suspend_seconds
        return APIError(503, f"{worker.label} is unavailable", type_="service_unavailable", grpc_code="UNAVAILABLE")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"{worker.label} timed out", type_="timeout", grpc_code="DEADLINE_EXCEEDED")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, exc.details() or "invalid request")
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return APIError(502, f"{worker.label} refused the router's credential (is --cluster-secret-file the same "
                             "on both?)", type_="server_error", grpc_code="INTERNAL")
    return APIError(502, f"{worker.label} failed: {code.name}: {exc.details()}", type_="server_error",
                    grpc_code="INTERNAL")

