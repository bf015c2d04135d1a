"""One request's way through the workers, from the choice of a decode worker to the last
token and every release; one `Handoff` per request.

    attempt k (worker id "<request id>.k"):
      pick decode worker -> plan: remote or local prefill (policy.py)
      -> remote: Reserve blocks (waits while the pool is full) -> Prefill on the chosen
         prefill worker (KV pushed into the reserved blocks, first token)
         prefill gone, full, or its transfer failed: the decode worker prefills locally
      -> Decode stream (every choice's tokens)
      -> on any exit: the reservation or the decode stream is released

A worker found dead (UNAVAILABLE) before anything was streamed is taken out of routing
and the request tries again on the others, up to ATTEMPTS times. Each attempt has an id
of its own, so a late Release of an earlier one can never reach a later one. Release is
idempotent on the worker; the releases that must outlive the request (after a cancel)
run as the worker set's background calls.
"""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from services.common.aio import Interrupted, unless
from services.common.metrics import RouterMetrics
from services.common.settings import RouterSettings
from services.engine.core.sampling import TokenLogprob
from services.router.generation import Generation, Tokens
from services.router.policy import CostModel
from services.router.protocol import APIError
from services.router.structured import STRUCTURE_CODES
from services.router.workers import INFO_TIMEOUT, Worker, WorkerSet
from services.rpc import worker_pb2
from services.worker.wire import (ERROR_CODE_KEY, ERROR_PARAM_KEY, REFUSED_UNSTARTED, logprob_from_proto,
                                  sampling_to_proto)

log = logging.getLogger(__name__)
T = TypeVar("T")

# Tries per request when a worker turns out dead before any token was streamed.
ATTEMPTS = 3
# The prefill RPC outlives the write lease by this much, so a prefill that reaches the
# router's deadline has already stopped writing.
PREFILL_RPC_MARGIN = 5.0
# How long a prefill worker may take to stop a prefill the router no longer needs: the
# step in flight and the drain of its writes (kv_export.DRAIN_SECONDS).
CANCEL_TIMEOUT = 30.0
# Prefill failures after which the decode worker prefills locally instead: the prefill
# worker is gone or full, the KV transfer failed or ran out of lease, or the two workers
# turned out not to match (a restart into another build). Each is counted.
LOCAL_FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.FAILED_PRECONDITION}


class Handoff:
    """`n` choices of `gen`'s prompt (the request's leading record: its route is filled in
    here) through the workers."""

    def __init__(self, gen: Generation, n: int, workers: WorkerSet, settings: RouterSettings,
                 metrics: RouterMetrics, cost: CostModel, end_ids: frozenset[int] = frozenset()) -> None:
        """`end_ids`: the model's end-of-sequence tokens: a first token among them (or
        the request's stop tokens) is not sent ahead of the decode stream (`_may_end`)."""
        self.gen = gen
        self.end_ids = end_ids
        self.n = n
        self.workers = workers
        self.settings = settings
        self.metrics = metrics
        self.cost = cost
        # The current attempt's reservation, the prefill writing into it, and whether the
        # decode stream finished every choice (then nothing is left to release).
        self._handle: worker_pb2.KVHandle | None = None
        self._writer: asyncio.Future | None = None
        self._writer_worker: Worker | None = None   # the prefill worker `_writer` calls
        self._finished = False
        # The first token, once sent to the client ahead of the decode stream (n = 1):
        # a later attempt continues from it rather than sampling another.
        self._sent_first: int | None = None
        self._decoded = False               # anything of the decode stream sent

    async def tokens(self) -> AsyncIterator[Tokens]:
        """Tokens from the workers, for every choice. Closing the iterator early (client
        gone) cancels the request on every worker."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                async with aclosing(self._attempt(attempt)) as tokens:
                    async for item in tokens:
                        yield item
                return
            except APIError as exc:
                if (self._decoded or exc.grpc_code != "UNAVAILABLE" or attempt == ATTEMPTS
                        or not self.workers.ready()):
                    raise
                log.warning("request %s: %s; trying again on another worker", self.gen.request_id, exc.message)
                self.metrics.retries.inc()

    def end_choice(self, index: int) -> None:
        """One choice ended here (a stop string) while the others go on: end it on its worker."""
        self.workers.spawn(self._end_choice(index))

    async def _attempt(self, attempt: int) -> AsyncIterator[Tokens]:
        """One try, under an id of its own. Cleanup rule: whenever a reservation exists and
        the decode stream did not finish, a Release is sent, but only once no prefill can
        still be writing into the reserved blocks."""
        gen = self.gen
        gen.worker_id = f"{gen.request_id}.{attempt}"
        gen.prefill_worker, gen.prefill_epoch, gen.transport, gen.transport_fallback = "", "", "", False
        gen.kv_bytes = gen.cached_tokens = 0
        decode, prefill, keys = self.workers.route(gen)
        gen.decode_worker, gen.decode_epoch = decode.name, decode.info.epoch
        self.metrics.routed.labels("decode", decode.address).inc()
        decode.request_routed()
        self._handle, self._writer, self._finished = None, None, False
        try:
            first = first_logprob = None
            if prefill is not None:
                first, first_logprob = await self._prefill_remotely(prefill, decode, keys)
            ahead = first                             # the token to send ahead of the decode stream
            if first is None:
                self._handle = None                   # released by _await_prefill, or never taken
                gen.decision = "local_fallback" if prefill is not None else "local"
                req = self._decode_request(first_token=self._sent_first or 0, local=True, epoch="")
            else:
                gen.decision = "remote"
                if self._sent_first is None and self.n == 1 and not self._may_end(first):
                    # Sent now, not when the decode batch takes the sequence: that can be
                    # a whole decode step away, and the token is already final.
                    self._sent_first = first
                    yield 0, [first], "", [first_logprob] if first_logprob else None
                if self._sent_first is not None:      # sent, now or by an earlier attempt:
                    first, ahead = self._sent_first, None   # the decode stream follows it
                req = self._decode_request(first_token=first, local=False, epoch=self._handle.epoch)
            async with aclosing(self._decode(decode, req, keys, ahead, first_logprob)) as tokens:
                async for item in tokens:
                    yield item
        finally:
            if self._handle is not None and not self._finished:
                # The request counts on the worker until its release is sent: a departed
                # worker's channel stays open for it (WorkerSet._close_when_idle).
                self.workers.spawn(self._release_after(self._writer, decode, self._handle, "request ended early",
                                                       then=decode.request_ended, prefill=self._writer_worker))
            else:
                decode.request_ended()

    async def _prefill_remotely(self, prefill: Worker, decode: Worker,
                                keys: list[int]) -> tuple[int | None, TokenLogprob | None]:
        """Reserve on the decode worker, prefill into the reservation: the first token and
        its logprob, or None when the decode worker should prefill locally."""
        n = len(self.gen.prompt_ids)
        prefill.prompt_planned(n)
        started = time.monotonic()
        try:
            self._handle = await self._reserve(decode)
            # The wait for blocks can be long: the prefill worker may be gone by now.
            self._writer = self._start_prefill(prefill) if prefill.info is not None else None
            self._writer_worker = prefill
        except BaseException:
            prefill.prompt_dropped(n)               # planned there, never sent
            raise
        if self._writer is None:
            prefill.prompt_dropped(n)
            await self._release(decode, self._handle, "prefill worker lost")
            log.warning("request %s: prefill worker %s was lost while its blocks were reserved; prefilling on the "
                        "decode worker", self.gen.request_id, prefill.address)
            return None, None
        return await self._await_prefill(prefill, decode, self._writer, keys, started)

    async def _decode(self, decode: Worker, req: worker_pb2.DecodeRequest, keys: list[int],
                      first: int | None, first_logprob: TokenLogprob | None) -> AsyncIterator[Tokens]:
        """The decode worker's stream, with the prefill's first token (if not sent yet)
        ahead of it; meanwhile the sequence counts in that worker's batch, and a prompt it
        prefills itself in its queue until the first token."""
        gen = self.gen
        local_tokens = 0
        if req.local_prefill:
            local_tokens = len(gen.prompt_ids)      # in the decode worker's queue until its first token
            decode.local_prefill_sent(local_tokens)
            decode.caches(keys)                     # its prefix is cached there from now on
        self.metrics.decisions.labels(gen.decision).inc()
        decode.batch_joined()
        ended: set[int] = set()
        try:
            async with aclosing(self._decode_stream(decode, req)) as stream:
                async for index, token_ids, finish, logprobs in stream:
                    decode.local_prefill_answered(local_tokens)
                    local_tokens = 0
                    if first is not None:
                        # n > 1: the prefill's token goes out once the decode worker has
                        # the sequence in its batch (its first, empty, message), with the
                        # other choices' first tokens one step behind. A token that ended
                        # the output goes out with that end, as one delta (its text is
                        # then a stop token's, and the stop's reason its id).
                        self._decoded = True
                        lps = [first_logprob] if first_logprob else None
                        if index == 0 and finish and not token_ids:
                            ended.add(0)
                            self._finished = len(ended) == self.n
                            yield 0, [first], finish, lps
                            first = None
                            continue
                        yield 0, [first], "", lps
                        first = None
                    if not token_ids and not finish:
                        continue
                    if finish:
                        ended.add(index)
                        self._finished = len(ended) == self.n
                    self._decoded = True
                    yield index, token_ids, finish, logprobs
        finally:
            decode.batch_left()
            decode.local_prefill_answered(local_tokens)

    def _may_end(self, token: int) -> bool:
        """Whether the prefill's first token may end the output (a stop token, or an end
        of sequence not ignored, with no min_tokens to wait for): it goes out with the
        decode stream's first message then, which says whether it did."""
        p = self.gen.params
        return p.min_tokens <= 1 and (token in p.stop_token_ids or (token in self.end_ids and not p.ignore_eos))

    def _decode_request(self, first_token: int, local: bool, epoch: str) -> worker_pb2.DecodeRequest:
        gen = self.gen
        return worker_pb2.DecodeRequest(
            request_id=gen.worker_id, epoch=epoch, prompt_token_ids=gen.prompt_ids, first_token_id=first_token,
            sampling=sampling_to_proto(gen.params), kv_bytes=gen.kv_bytes,
            local_prefill=local, transport=gen.transport, n=self.n,
            first_token_given=local and self._sent_first is not None, priority=gen.priority)

    async def _reserve(self, decode: Worker) -> worker_pb2.KVHandle:
        """Reserve prompt blocks; while the pool is full, wait (this is the queue)."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.request_timeout
        delay = 0.01
        req = worker_pb2.ReserveRequest(request_id=self.gen.worker_id, num_prompt_tokens=len(self.gen.prompt_ids),
                                        lease_seconds=self.settings.prefill_timeout)
        while True:
            call = asyncio.ensure_future(decode.stub.Reserve(req, timeout=INFO_TIMEOUT * 5))
            try:
                handle = await unless_unreachable(decode, asyncio.shield(call))
                self.metrics.queue_time.observe(time.monotonic() - t0)
                return handle
            except (asyncio.CancelledError, APIError):
                # The worker may have reserved already: release whatever the call returns.
                self.workers.spawn(self._release_reserved(call, decode))
                raise
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() + delay < deadline:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The worker may yet make the reservation: released by its id, not left to the lease.
                    self.workers.spawn(self._release(decode, worker_pb2.KVHandle(
                        request_id=self.gen.worker_id, epoch=decode.epoch), "reserve timed out"))
                raise worker_error(decode, exc, self.gen) from None

    def _start_prefill(self, prefill: Worker) -> asyncio.Future:
        gen = self.gen
        gen.prefill_worker, gen.prefill_epoch = prefill.name, prefill.info.epoch
        self.metrics.routed.labels("prefill", prefill.address).inc()
        n = len(gen.prompt_ids)
        call = asyncio.ensure_future(prefill.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=gen.worker_id, prompt_token_ids=gen.prompt_ids,
                                      sampling=sampling_to_proto(gen.params), handle=self._handle,
                                      priority=gen.priority),
            timeout=self.settings.prefill_timeout + PREFILL_RPC_MARGIN))
        prefill.prefill_sent()
        call.add_done_callback(lambda _: prefill.prefill_answered(n))
        return call

    async def _await_prefill(self, prefill: Worker, decode: Worker, call: asyncio.Future, keys: list[int],
                             started: float) -> tuple[int | None, TokenLogprob | None]:
        """The first token and its logprob (when asked for), or None when the decode worker
        should prefill locally. The call is shielded: a cancelled request lets the prefill
        end before its blocks go."""
        gen = self.gen
        try:
            resp = await asyncio.shield(call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in LOCAL_FALLBACK_CODES:
                raise worker_error(prefill, exc, self.gen) from None     # _attempt releases the handle
            log.warning("request %s: prefill worker %s failed (%s: %s); prefilling on the decode worker",
                        gen.request_id, prefill.address, exc.code().name, exc.details())
            if exc.code() is grpc.StatusCode.UNAVAILABLE:
                prefill.suspend()
                if not _refused_unstarted(exc) and await _answers(prefill):
                    # The call's connection failed, not the worker: it may still be writing
                    # into the blocks (it stops when their lease ends), so they are left to
                    # the lease, and the decode worker prefills under an id of its own.
                    log.warning("request %s: prefill worker %s still answers; its blocks wait out their lease",
                                gen.request_id, prefill.address)
                    gen.worker_id = f"{gen.worker_id}-local"
                    return None, None
            await self._release(decode, self._handle, f"prefill failed: {exc.code().name}")
            return None, None
        gen.kv_bytes = resp.kv_bytes
        gen.transport = resp.transport
        gen.transport_fallback = resp.transport_fallback
        gen.cached_tokens = resp.cached_tokens
        n = len(gen.prompt_ids)
        # From the plan on: a wait in the router's queue came before, whichever way it went.
        self.cost.observe(n - resp.cached_tokens, resp.prefill_seconds, resp.transfer_seconds,
                          time.monotonic() - started - resp.prefill_seconds, n, resp.seconds_per_token)
        for term, value in self.cost.terms().items():
            self.metrics.cost_model.labels(term).set(value)
        prefill.caches(keys)
        self.metrics.kv_bytes.labels(resp.transport).inc(resp.kv_bytes)
        self.metrics.cached_tokens.inc(resp.cached_tokens)
        logprob = logprob_from_proto(resp.first_logprob) if resp.HasField("first_logprob") else None
        if resp.prompt_logprobs:
            gen.prompt_logprobs = [logprob_from_proto(lp) for lp in resp.prompt_logprobs]
        return resp.first_token_id, logprob

    async def _decode_stream(self, decode: Worker, req: worker_pb2.DecodeRequest) -> AsyncIterator[Tokens]:
        """Every choice's tokens, until all `n` have finished."""
        gen = self.gen
        call = decode.stub.Decode(req, timeout=self.settings.request_timeout)
        running = set(range(self.n))
        messages = call.__aiter__()
        try:
            # Its first answer is waited for only while the worker is reachable; once it
            # has answered, the stream goes on as it is (what it sent may be out).
            chunk = await unless_unreachable(decode, anext(messages, None))
            while chunk is not None:
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
                chunk = await anext(messages, None)
            raise APIError(502, "decode worker closed the stream early", type_="server_error",
                           grpc_code="UNAVAILABLE")
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION:
                # The worker holds no reservation of this attempt's (restarted as another
                # epoch, or the lease ran out): nothing of it was decoded, so another
                # attempt may go anywhere.
                log.warning("decode worker %s (%s): %s", decode.address, decode.name, exc.details())
                raise APIError(503, f"{decode.label} no longer holds this request's blocks",
                               type_="service_unavailable", grpc_code="UNAVAILABLE") from None
            raise worker_error(decode, exc, self.gen) from None
        finally:
            call.cancel()                     # no-op when finished; frees the blocks otherwise

    # ---- releases ----
    async def _end_choice(self, index: int) -> None:
        gen = self.gen
        decode = self.workers.decode_at(gen.decode_epoch)
        if decode is None:
            return
        request_id = gen.worker_id if index == 0 else f"{gen.worker_id}#{index}"
        await self._release(decode, worker_pb2.KVHandle(request_id=request_id, epoch=gen.decode_epoch),
                            "stop string")

    async def _release_after(self, writer: asyncio.Future | None, decode: Worker, handle: worker_pb2.KVHandle,
                             reason: str, then: Callable[[], None] = lambda: None,
                             prefill: Worker | None = None) -> None:
        """Release once `writer` (the prefill writing into the blocks) has ended, or its
        worker (`prefill`) has stopped it: a request that ends while its prompt is still
        being prefilled frees the prefill worker and the blocks at once, not when the
        prompt is done; `then` after it, whatever happens."""
        try:
            if writer is not None and not writer.done() and prefill is not None \
                    and await _stopped(prefill, handle.request_id):
                writer.cancel()
            elif writer is not None:
                try:
                    await writer
                except BaseException:
                    pass
            await self._release(decode, handle, reason)
        finally:
            then()

    async def _release_reserved(self, call: asyncio.Future, decode: Worker) -> None:
        try:
            handle = await call
        except BaseException:
            return
        await self._release(decode, handle, "request ended while reserving")

    @staticmethod
    async def _release(decode: Worker, handle: worker_pb2.KVHandle, reason: str) -> None:
        try:
            await decode.stub.Release(worker_pb2.ReleaseRequest(request_id=handle.request_id, epoch=handle.epoch,
                                                                reason=reason), timeout=INFO_TIMEOUT)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
            # The lease expires the blocks if the worker is alive but unreachable now.
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log.warning("release of %s on %s failed: %s", handle.request_id, decode.address, why)


async def _stopped(prefill: Worker, request_id: str) -> bool:
    """Whether `prefill` has stopped the request's prefill (nothing of it can still be
    written): False where it cannot say (gone, or an older worker)."""
    try:
        answer = await prefill.stub.Cancel(worker_pb2.CancelRequest(request_id=request_id), timeout=CANCEL_TIMEOUT)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError) as exc:
        why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        log.info("cancelling the prefill of %s on %s failed (%s): its blocks wait for it", request_id,
                 prefill.address, why)
        return False
    return answer.stopped


async def unless_unreachable(worker: Worker, answer: Awaitable[T]) -> T:
    """`answer` (a call to `worker`), unless the router finds the worker gone without an
    answer first (frozen, cut off: its connection stays open, so the call would wait as
    long as it does). Then UNAVAILABLE: nothing of the attempt has reached the client,
    so the request tries another worker."""
    try:
        return await unless(answer, worker.unreachable.wait())
    except Interrupted:
        log.warning("%s worker %s (%s) stopped answering; trying another", worker.role, worker.address, worker.name)
        raise APIError(503, f"{worker.label} is unavailable", type_="service_unavailable",
                       grpc_code="UNAVAILABLE") from None


def _refused_unstarted(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the worker itself refused the call before starting it (a draining
    prefill worker's UNAVAILABLE says so): it wrote nothing."""
    return any(k == ERROR_CODE_KEY and v == REFUSED_UNSTARTED for k, v in exc.trailing_metadata() or ())


async def _answers(worker: Worker) -> bool:
    """Whether the worker's process answers Info now (alive, whatever the call that failed)."""
    try:
        await worker.stub.Info(worker_pb2.InfoRequest(), timeout=INFO_TIMEOUT / 2)
    except (grpc.aio.AioRpcError, grpc.aio.UsageError):
        return False
    return True


def worker_error(worker: Worker, exc: grpc.aio.AioRpcError, gen: Generation) -> APIError:
    """The caller's error for a failed worker call. It names the worker by id; its address
    and gRPC's connection details (which carry addresses) go to the log only. A structure
    the worker could not compile is named by the field that asked for it."""
    code = exc.code()
    log.warning("%s worker %s (%s): %s: %s", worker.role, worker.address, worker.name, code.name, exc.details())
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        worker.lost()
        return APIError(503, f"{worker.label} is unavailable", type_="service_unavailable", grpc_code="UNAVAILABLE")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"{worker.label} timed out", type_="timeout", grpc_code="DEADLINE_EXCEEDED")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        told = dict(exc.trailing_metadata() or ())
        code_ = told.get(ERROR_CODE_KEY)
        return APIError(400, exc.details() or "invalid request", code=code_,
                        param=gen.structure_param if code_ in STRUCTURE_CODES else told.get(ERROR_PARAM_KEY))
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return APIError(502, f"{worker.label} refused the router's credential (is --cluster-secret-file the same "
                             "on both?)", type_="server_error", grpc_code="INTERNAL")
    return APIError(502, f"{worker.label} failed: {code.name}: {exc.details()}", type_="server_error",
                    grpc_code="INTERNAL")
