"""Decode worker: holds the paged KV pool, accepts handoffs, runs continuous batching.

A request's life here, as queues:
  Reserve   -> blocks taken from the pool, handoff RESERVED with a write lease
  (the prefill worker writes the prompt's KV straight into those blocks)
  Decode    -> handoff COMPLETE -> DECODING; the sequence joins the scheduler's ready
               queue, then the running batch at the next step, and streams tokens
  finish / cancel / failure -> blocks back to the pool, handoff RELEASED
  no Decode before the lease ends -> handoff EXPIRED, blocks back to the pool

One engine thread owns the model; it takes `self._lock` only while scheduling and
post-processing, never during a forward pass. Aborts are queued and applied between
steps, so no block is freed while a forward pass may still write into it.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from typing import Callable

import grpc

from kv_transfer.base import open_transports
from kv_transfer.handoff import HandoffError, HandoffState, HandoffTable
from kv_transfer.memory import KVPoolMemory, sweep_stale_segments
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.common.worker_main import EngineStatus, WorkerParts
from services.common.wire import sampling_from_proto
from services.engine.block_pool import BlockPool, NoFreeBlocks
from services.engine.runner import ModelRunner
from services.engine.sampler import sample
from services.engine.scheduler import Scheduler, Sequence, StepPlan
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class DecodeEngine:
    """The engine thread and the state it owns; no gRPC in here."""

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos_token_ids: frozenset[int],
                 metrics: WorkerMetrics) -> None:
        self.settings = settings
        self.runner = runner
        self.eos = eos_token_ids
        self.metrics = metrics
        self.epoch = uuid.uuid4().hex[:12]
        num_blocks = settings.kv_cache_tokens // settings.block_size
        if num_blocks * settings.block_size < runner.max_model_len:
            # A sequence that can never fit would wait (or preempt itself) forever.
            raise ValueError(f"--kv-cache-tokens {settings.kv_cache_tokens} cannot hold one full context of "
                             f"{runner.max_model_len} tokens")
        self.layout = runner.layout(num_blocks, settings.block_size)
        self.compat_hash = runner.compat_hash(self.layout)
        sweep_stale_segments()
        self.transports = open_transports(settings.kv_transport, settings.transport_options())
        self.memory = self._allocate_pool(settings, str(runner.device))
        self.offers = [worker_pb2.TransportOffer(backend=name, meta=t.register(self.memory, self.compat_hash))
                       for name, t in self.transports.items()]
        log.info("decode worker offers KV transports: %s", ", ".join(self.transports))
        self.pool = BlockPool(num_blocks, settings.block_size)
        self.scheduler = Scheduler(self.pool, settings.max_batch, settings.prefill_chunk_tokens)
        self.handoffs = HandoffTable(self.epoch)
        self.prompt_tokens_computed = 0
        self.kv_bytes_received = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[list[int], str], None]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="decode-engine", daemon=True)
        metrics.blocks_total.set(num_blocks)

    def _allocate_pool(self, settings: WorkerSettings, device: str) -> KVPoolMemory:
        """In shared memory when `shm` is offered; if /dev/shm is too small and other
        backends remain (auto), drop `shm` loudly instead of failing to start."""
        if "shm" not in self.transports:
            return KVPoolMemory.allocate(self.layout, device=device)
        try:
            return KVPoolMemory.allocate(self.layout, shared=True, device=device)
        except MemoryError as exc:
            if len(self.transports) == 1:
                raise ValueError(f"--kv-transport shm: {exc}") from None
            log.warning("not offering shm: %s", exc)
            self.transports.pop("shm").shutdown()
            return KVPoolMemory.allocate(self.layout, device=device)

    # ---- called from RPC handlers (any thread) ----
    def reserve(self, request_id: str, num_tokens: int, lease_seconds: float):
        if num_tokens > self.runner.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed the model's context of {self.runner.max_model_len}")
        with self._lock:
            blocks = self.pool.allocate(self.pool.blocks_for(num_tokens))
            try:
                return self.handoffs.reserve(request_id, blocks, num_tokens, lease_seconds)
            except HandoffError:
                self.pool.free(blocks)
                raise

    def release(self, request_id: str, epoch: str, reason: str) -> bool:
        with self._lock:
            h = self.handoffs.get(request_id, epoch)
            if h.state is HandoffState.DECODING:
                self._aborts.put(request_id)
                self._wake.set()
                return True
            self.handoffs.pop(request_id, HandoffState.FAILED if reason else HandoffState.RELEASED)
            self.pool.free(h.block_ids)
        self.metrics.handoffs.labels("released_before_decode").inc()
        log.info("request %s: reservation released (%s)", request_id, reason or "no reason given")
        return True

    def admit(self, seq: Sequence, epoch: str | None, sink, kv_bytes: int, backend: str) -> str | None:
        """Start decoding `seq`; `sink(token_ids, finish_reason)` receives its output from
        the engine thread. With an epoch the prompt KV came through a handoff."""
        with self._lock:
            if epoch is not None:
                h = self.handoffs.get(seq.request_id, epoch)
                if len(seq.token_ids) - 1 != h.num_tokens:
                    raise HandoffError(f"handle covers {h.num_tokens} tokens, request has {len(seq.token_ids) - 1}")
                self.handoffs.advance(h, HandoffState.COMPLETE)
                self.handoffs.advance(h, HandoffState.DECODING)
                seq.block_ids = list(h.block_ids)
                self.kv_bytes_received += kv_bytes
                self.metrics.kv_bytes.labels("received", backend).inc(kv_bytes)
                reason = self.scheduler.add_prefilled(seq)
                if reason:
                    self.handoffs.pop(seq.request_id, HandoffState.RELEASED)
                    self.metrics.handoffs.labels("released").inc()
                    return reason
            else:
                self.scheduler.add_waiting(seq)
            self._sinks[seq.request_id] = sink
        self._wake.set()
        return None

    def abort(self, request_id: str) -> None:
        self._aborts.put(request_id)
        self._wake.set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        for t in self.transports.values():
            t.shutdown()
        self.memory.close()

    # ---- engine thread ----
    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                self._apply_aborts()
                for h in self.handoffs.expire():
                    self.pool.free(h.block_ids)
                    self.metrics.handoffs.labels("expired").inc()
                plan = self.scheduler.schedule()
                self._update_gauges()
            if not plan:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                self.step(plan)
            except Exception:                       # a failed step must not kill the worker
                log.exception("engine step failed; aborting its sequences")
                with self._lock:
                    for seq in ([plan.prefill] if plan.prefill else []) + plan.decode:
                        self._end(seq.request_id, "error")

    def step(self, plan: StepPlan) -> None:
        if plan.prefill is not None:
            self._prefill(plan.prefill, plan.prefill_len)
        if plan.decode:
            self._decode(plan.decode)

    def _prefill(self, seq: Sequence, n: int) -> None:
        t0 = time.perf_counter()
        todo = seq.tokens_to_prefill()
        tokens = todo[:n]
        logits = self.runner.prefill(self.memory, tokens, seq.block_ids, start=seq.num_computed)
        first = None
        if seq.num_generated == 0 and n == len(todo):          # the prompt's last chunk
            first = sample(logits[None], [seq.params], [0], self.eos)[0]
        self.prompt_tokens_computed += len(tokens)
        self.metrics.prompt_tokens_computed.inc(len(tokens))
        self.metrics.step_seconds.labels("prefill").observe(time.perf_counter() - t0)
        with self._lock:
            reason = self.scheduler.on_prefilled(seq, len(tokens), first)
            if first is not None:
                self._emit(seq, [first], reason)

    def _decode(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        logits = self.runner.decode(self.memory, [s.last_token for s in seqs],
                                    [len(s.token_ids) - 1 for s in seqs], [s.block_ids for s in seqs])
        tokens = sample(logits, [s.params for s in seqs], [s.num_generated for s in seqs], self.eos)
        self.metrics.step_seconds.labels("decode").observe(time.perf_counter() - t0)
        self.metrics.generated_tokens.inc(len(tokens))
        with self._lock:
            for seq, reason in self.scheduler.on_decoded(seqs, tokens):
                self._emit(seq, [seq.last_token], reason)

    def _emit(self, seq: Sequence, token_ids: list[int], reason: str | None) -> None:
        sink = self._sinks.get(seq.request_id)
        if sink is not None:
            sink(token_ids, reason or "")
        if reason:
            self._retire(seq.request_id, reason)

    def _apply_aborts(self) -> None:
        while True:
            try:
                request_id = self._aborts.get_nowait()
            except queue.Empty:
                return
            self._end(request_id, "abort")

    def _end(self, request_id: str, reason: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is None and request_id not in self._sinks:
            return
        sink = self._sinks.get(request_id)
        if sink is not None and reason == "error":
            sink([], "error")
        self._retire(request_id, reason)

    def _retire(self, request_id: str, reason: str) -> None:
        self._sinks.pop(request_id, None)
        if self.handoffs.pop(request_id, HandoffState.RELEASED) is not None:
            self.metrics.handoffs.labels("released").inc()
        self.metrics.requests.labels(reason).inc()

    def _update_gauges(self) -> None:
        self.metrics.blocks_free.set(self.pool.num_free)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting) + len(self.scheduler.ready))

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(info=self.info(), prompt_tokens_computed=self.prompt_tokens_computed,
                                      kv_bytes_received=self.kv_bytes_received, active_handoffs=len(self.handoffs))

    def busy(self) -> bool:
        """Anything accepted and not yet finished: sequences or reservations."""
        sch = self.scheduler
        return bool(sch.running or sch.ready or sch.waiting or sch.prefilling or len(self.handoffs))

    def info(self) -> worker_pb2.WorkerInfo:
        with self._lock:
            return worker_pb2.WorkerInfo(
                role="decode", epoch=self.epoch, compat_hash=self.compat_hash,
                model_name=self.runner.model_dir.name, block_size=self.layout.block_size,
                num_blocks=self.pool.num_blocks, free_blocks=self.pool.num_free,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting) + len(self.scheduler.ready),
                max_model_len=self.runner.max_model_len, kv_transports=list(self.transports))


class DecodeService(EngineStatus, worker_pb2_grpc.DecodeWorkerServicer):

    async def Reserve(self, request, context):
        e = self.engine
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        try:
            h = e.reserve(request.request_id, request.num_prompt_tokens, request.lease_seconds or 30.0)
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"no free KV blocks: {exc}")
        except (ValueError, HandoffError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.KVHandle(
            request_id=h.request_id, epoch=e.epoch, block_ids=h.block_ids, num_tokens=h.num_tokens,
            write_deadline=h.write_deadline, offers=e.offers, compat_hash=e.compat_hash)

    async def Release(self, request, context):
        try:
            released = self.engine.release(request.request_id, request.epoch, request.reason)
        except HandoffError:
            released = False
        return worker_pb2.ReleaseResponse(released=released)

    async def Decode(self, request, context):
        e = self.engine
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()

        def sink(token_ids: list[int], reason: str) -> None:
            loop.call_soon_threadsafe(out.put_nowait, (token_ids, reason))

        prompt = list(request.prompt_token_ids)
        if self.draining and request.local_prefill:      # new work; a handoff in flight is finished
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this decode worker is draining")
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        tokens = prompt if request.local_prefill else prompt + [request.first_token_id]
        seq = Sequence(request.request_id, tokens, len(prompt), params, e.eos)
        try:
            reason = e.admit(seq, None if request.local_prefill else request.epoch, sink, request.kv_bytes,
                             request.transport)
        except HandoffError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if reason:
            yield worker_pb2.DecodeChunk(finish_reason=reason)
            return
        finished = False
        try:
            while True:
                token_ids, reason = await out.get()
                if reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL, "decode step failed")
                finished = bool(reason)
                yield worker_pb2.DecodeChunk(token_ids=token_ids, finish_reason=reason)
                if finished:
                    return
        finally:
            if not finished:                    # client went away or the RPC was cancelled
                e.abort(request.request_id)


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics):
    engine = DecodeEngine(settings, runner, eos, metrics)
    engine.start()
    return WorkerParts("pdserve.v1.DecodeWorker",
                       DecodeService(engine), worker_pb2_grpc.add_DecodeWorkerServicer_to_server, engine.stop)
