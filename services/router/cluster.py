"""The life of one generation across the workers (the workers themselves, their load and
the choice among them are workers.py's).

    admit (bounded) -> pick decode worker -> plan: remote or local prefill (policy.py)
      -> remote: Reserve blocks (waits while the pool is full) -> Prefill on the chosen
         prefill worker (KV pushed into the reserved blocks, first token)
      -> Decode stream (tokens) -> detokenize, stop strings, schema guard (output.py) -> caller
      -> on any exit: the reservation or the decode stream is released

If the prefill fails before writing, the decode worker prefills locally; that fallback is
logged and counted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator

import grpc

from services.common.metrics import RouterMetrics
from services.common.settings import RouterSettings
from services.engine.sampling import TokenLogprob
from services.router.generation import Delta, Generation, Tokens
from services.router.latency import LatencyLedger
from services.router.output import OutputProcessor
from services.router.policy import CostModel
from services.router.protocol import APIError
from services.router.workers import INFO_TIMEOUT, RECENT_KEYS_SECONDS, Worker, WorkerSet
from services.rpc import worker_pb2
from services.worker.wire import logprob_from_proto, sampling_to_proto

log = logging.getLogger(__name__)

# Tries per request when a worker turns out dead before any token was streamed.
ATTEMPTS = 3
# The prefill RPC outlives the write lease by this much, so a prefill that reaches the
# router's deadline has already stopped writing.
PREFILL_RPC_MARGIN = 5.0
# Prefill failures after which the decode worker prefills locally instead: the prefill
# worker is gone or full, or the KV transfer failed or ran out of lease. Each is counted.
LOCAL_FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}

class Cluster:
    def __init__(self, settings: RouterSettings, tokenizer, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.cost = CostModel()
        self.latency = LatencyLedger()
        self.workers = WorkerSet(settings, metrics, self.latency, self.cost)

    async def start(self) -> None:
        await self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()

    # ---- what the front ends ask ----
    def ready(self) -> bool:
        return self.workers.ready()

    def awaited(self) -> str:
        """What `ready` waits for, in words."""
        return self.workers.awaited()

    def pool_sizes(self) -> dict[str, int]:
        return self.workers.pool_sizes()

    def capacity(self) -> tuple[int, int]:
        """(sequences, prompts still prefilling) the router dispatches at once (admission.py)."""
        return self.workers.capacity()

    # ---- one generation ----
    async def generate(self, gens: list[Generation]) -> AsyncIterator[Delta]:
        """Yields text deltas of every choice (`gens`: one per choice, the first leading:
        its prompt, workers and route are the request's); raises APIError on failure.
        Closing the iterator early (client gone) cancels the request on every worker."""
        leader = gens[0]
        output = OutputProcessor(self.tokenizer, gens, lambda index: self.workers.spawn(self._end_choice(leader, index)))
        async with aclosing(self._tokens(leader, len(gens))) as tokens:
            async for index, token_ids, finish, logprobs in tokens:
                delta = await output.feed(index, token_ids, finish, logprobs)
                if delta is None:
                    continue
                yield delta
                if output.finished:
                    return

    async def _end_choice(self, leader: Generation, index: int) -> None:
        decode = self.workers.decode_at(leader.decode_epoch)
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
                if streamed or exc.grpc_code != "UNAVAILABLE" or attempt == ATTEMPTS or not self.workers.ready():
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
        decode = self.workers.pick_decode(gen)
        gen.decode_worker, gen.decode_epoch = decode.name, decode.info.epoch
        self.metrics.routed.labels("decode", decode.address).inc()
        decode.inflight += 1
        handle, writer, finished, claimed, local_tokens = None, None, False, None, 0
        ended: set[int] = set()
        try:
            prefill, _, keys = self.workers.plan(decode, gen)
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
                self.workers.spawn(self._release_after(writer, decode, handle, "request ended early"))

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
                self.workers.spawn(self._release_reserved(call, decode))
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

