"""The router's view of the workers and the life of one generation across them.

    admit (bounded) -> pick decode worker -> Reserve blocks (waits while the pool is full)
      -> pick prefill worker -> Prefill (KV pushed into the reserved blocks, first token)
      -> Decode stream (tokens) -> detokenize, stop strings -> caller
      -> on any exit: the reservation or the decode stream is released

If no prefill worker is reachable, or the prefill fails before writing, the decode
worker prefills locally; that fallback is logged and counted, never silent.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from services.common.grpc_server import channel
from services.common.metrics import RouterMetrics
from services.common.settings import RouterSettings
from services.common.wire import sampling_to_proto
from services.engine.sampling import SamplingParams
from services.engine.tokenizer import IncrementalDetokenizer, StopMatcher
from services.router.protocol import APIError
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT = 2.0
REFRESH_SECONDS = 1.0
# The prefill RPC outlives the write lease by this much, so a prefill that reaches the
# router's deadline has already stopped writing.
PREFILL_RPC_MARGIN = 5.0
# Prefill failures after which the decode worker prefills locally instead: the prefill
# worker is gone or full, or the KV transfer failed or ran out of lease. Each is counted.
LOCAL_FALLBACK_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        grpc.StatusCode.ABORTED, grpc.StatusCode.DEADLINE_EXCEEDED}


@dataclass
class Worker:
    role: str
    address: str
    stub: object = None
    chan: grpc.aio.Channel | None = None
    info: worker_pb2.WorkerInfo | None = None
    inflight: int = 0

    @property
    def healthy(self) -> bool:
        return self.info is not None


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Generation:
    """One request's record: what was decided and what happened."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decision: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    transport: str = ""
    transport_fallback: bool = False
    kv_bytes: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    started: float = field(default_factory=time.monotonic)


class Cluster:
    def __init__(self, settings: RouterSettings, tokenizer, metrics: RouterMetrics) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.decode = [Worker("decode", a) for a in settings.decode]
        self.prefill = [Worker("prefill", a) for a in settings.prefill]
        self.pending = 0
        self._refresher: asyncio.Task | None = None
        self._cleanups: set[asyncio.Task] = set()

    # ---- membership ----
    async def start(self) -> None:
        for w in self.decode + self.prefill:
            w.chan = channel(w.address)
            stub = worker_pb2_grpc.DecodeWorkerStub if w.role == "decode" else worker_pb2_grpc.PrefillWorkerStub
            w.stub = stub(w.chan)
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher:
            self._refresher.cancel()
        if self._cleanups:
            await asyncio.wait(self._cleanups, timeout=10)
        for w in self.decode + self.prefill:
            if w.chan is not None:
                await w.chan.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_SECONDS)
            try:
                await self.refresh()
            except Exception:
                log.exception("worker refresh failed")

    async def refresh(self) -> None:
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
            w.info = info
        await asyncio.gather(*(one(w) for w in self.decode + self.prefill))

    def ready(self) -> bool:
        return any(w.healthy for w in self.decode) and any(w.healthy for w in self.prefill)

    def max_model_len(self) -> int | None:
        lens = [w.info.max_model_len for w in self.decode + self.prefill if w.healthy]
        return min(lens) if lens else None

    # ---- selection ----
    def _pick_decode(self) -> Worker:
        live = [w for w in self.decode if w.healthy]
        if not live:
            raise APIError(503, "no decode worker is available", type_="service_unavailable",
                           grpc_code="UNAVAILABLE")
        return max(live, key=lambda w: (w.info.free_blocks - 4 * w.inflight, -w.inflight))

    def _pick_prefill(self, decode: Worker) -> Worker | None:
        live = [w for w in self.prefill if w.healthy and w.info.compat_hash == decode.info.compat_hash]
        return min(live, key=lambda w: (w.inflight, w.info.waiting)) if live else None

    # ---- admission ----
    def admit(self) -> None:
        if self.pending >= self.settings.max_pending:
            raise APIError(429, f"the server is at capacity ({self.pending} requests in flight); retry later",
                           type_="rate_limit_error", code="overloaded", grpc_code="RESOURCE_EXHAUSTED",
                           headers={"Retry-After": "1"})
        self.pending += 1
        self.metrics.pending.set(self.pending)

    def done(self) -> None:
        self.pending -= 1
        self.metrics.pending.set(self.pending)

    # ---- one generation ----
    async def generate(self, gen: Generation) -> AsyncIterator[Delta]:
        """Yields text deltas; raises APIError on failure. Closing the iterator early
        (client gone) cancels the request on every worker involved."""
        detok = IncrementalDetokenizer(self.tokenizer, gen.prompt_ids)
        stops = StopMatcher(gen.params.stop)
        async with aclosing(self._tokens(gen)) as tokens:
            async for token_ids, finish in tokens:
                gen.completion_tokens += len(token_ids)
                text, hit = stops.feed(detok.push(token_ids))
                if hit:
                    gen.finish_reason = "stop"
                    yield Delta(text, token_ids, "stop")
                    return
                if finish:
                    text += stops.feed(detok.flush())[0] + stops.flush()
                    gen.finish_reason = finish
                yield Delta(text, token_ids, finish or None)
                if finish:
                    return

    async def _tokens(self, gen: Generation) -> AsyncIterator[tuple[list[int], str]]:
        """The worker-side pipeline. Cleanup rule: whenever a reservation exists and the
        decode stream did not finish, a Release is sent, but only once no prefill can
        still be writing into the reserved blocks. Release is idempotent on the worker."""
        decode = self._pick_decode()
        gen.decode_worker = decode.address
        decode.inflight += 1
        handle, writer, finished = None, None, False
        try:
            prefill = self._pick_prefill(decode)
            first = None
            if prefill is not None:
                handle = await self._reserve(decode, gen)
                writer = self._start_prefill(prefill, handle, gen)
                first = await self._await_prefill(prefill, decode, handle, writer, gen)
            else:
                log.warning("request %s: no prefill worker available, prefilling on the decode worker",
                            gen.request_id)
            if first is None:
                handle = None                   # released by _await_prefill, or never taken
                gen.decision = "local_fallback" if prefill is not None else "local"
                req = self._decode_request(gen, first_token=0, local=True, epoch="")
            else:
                gen.decision = "remote"
                yield [first], ""
                req = self._decode_request(gen, first_token=first, local=False, epoch=handle.epoch)
            self.metrics.decisions.labels(gen.decision).inc()
            async with aclosing(self._decode_stream(decode, req)) as stream:
                async for token_ids, finish in stream:
                    finished = bool(finish)
                    yield token_ids, finish
        finally:
            decode.inflight -= 1
            if handle is not None and not finished:
                self._spawn(self._release_after(writer, decode, handle, "request ended early"))

    def _decode_request(self, gen: Generation, first_token: int, local: bool, epoch: str):
        return worker_pb2.DecodeRequest(
            request_id=gen.request_id, epoch=epoch, prompt_token_ids=gen.prompt_ids, first_token_id=first_token,
            sampling=sampling_to_proto(gen.params), max_tokens=gen.params.max_tokens, kv_bytes=gen.kv_bytes,
            local_prefill=local, transport=gen.transport)

    async def _reserve(self, decode: Worker, gen: Generation) -> worker_pb2.KVHandle:
        """Reserve prompt blocks; while the pool is full, wait (this is the queue)."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.request_timeout
        delay = 0.01
        req = worker_pb2.ReserveRequest(request_id=gen.request_id, num_prompt_tokens=len(gen.prompt_ids),
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
        gen.prefill_worker = prefill.address
        prefill.inflight += 1
        call = asyncio.ensure_future(prefill.stub.Prefill(
            worker_pb2.PrefillRequest(request_id=gen.request_id, prompt_token_ids=gen.prompt_ids,
                                      sampling=sampling_to_proto(gen.params), handle=handle),
            timeout=self.settings.prefill_timeout + PREFILL_RPC_MARGIN))
        call.add_done_callback(lambda _: setattr(prefill, "inflight", prefill.inflight - 1))
        return call

    async def _await_prefill(self, prefill: Worker, decode: Worker, handle, call: asyncio.Future,
                             gen: Generation) -> int | None:
        """The first token, or None when the decode worker should prefill locally. The
        call is shielded: a cancelled request lets the prefill end before its blocks go."""
        try:
            resp = await asyncio.shield(call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in LOCAL_FALLBACK_CODES:
                raise _worker_error(prefill, exc) from None     # _tokens releases the handle
            await self._release(decode, handle, f"prefill failed: {exc.code().name}")
            log.warning("request %s: prefill worker %s failed (%s: %s); prefilling on the decode worker",
                        gen.request_id, prefill.address, exc.code().name, exc.details())
            return None
        gen.kv_bytes = resp.kv_bytes
        gen.transport = resp.transport
        gen.transport_fallback = resp.transport_fallback
        self.metrics.kv_bytes.labels(resp.transport).inc(resp.kv_bytes)
        return resp.first_token_id

    async def _decode_stream(self, decode: Worker, req) -> AsyncIterator[tuple[list[int], str]]:
        call = decode.stub.Decode(req, timeout=self.settings.request_timeout)
        try:
            async for chunk in call:
                yield list(chunk.token_ids), chunk.finish_reason
                if chunk.finish_reason:
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
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        worker.info = None                  # out of routing until the next refresh sees it
        return APIError(503, f"{worker.role} worker {worker.address} is unavailable: {exc.details()}",
                        type_="service_unavailable", grpc_code="UNAVAILABLE")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"{worker.role} worker {worker.address} timed out: {exc.details()}",
                        type_="timeout", grpc_code="DEADLINE_EXCEEDED")
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, exc.details() or "invalid request")
    return APIError(502, f"{worker.role} worker {worker.address} failed: {code.name}: {exc.details()}",
                    type_="server_error", grpc_code="INTERNAL")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
