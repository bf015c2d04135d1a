"""Prefill worker: computes prompts in batches and pushes each one's KV into its decode
worker's reserved blocks.

A request's life here:
  Prefill RPC -> connect to the decode worker's KV memory (compat hash checked, cached)
             -> the engine queue (FIFO): queued prompts share forward passes under the
                token budget, long ones in chunks; a prompt's leading blocks already in
                the prefix cache are reused, not recomputed
             -> after each layer of a step, every prompt in it has the blocks that step
                wrote (and, with its first chunk, its cached prefix) written into its
                own reserved decode blocks, so transfer overlaps compute
             -> the prompt's last chunk samples the first token -> its writes end ->
                reply; its full blocks stay cached for later prompts

Writes stop at each handle's write deadline: past it the decode worker may have given
the blocks to someone else, so that request fails (and only that one) instead of
writing. Blocks stay held until every write that reads them has ended.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from kv_transfer.backends import open_transports, pair
from kv_transfer.base import IncompatiblePeer, KVTransport, PeerHandle, TransferError, wait_for
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool, NoFreeBlocks
from services.engine.engine import EngineLoop, EngineOutput, LLMEngine, StepStats
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.engine.core.scheduler import Scheduler, Sequence, StepPlan
from services.rpc import worker_pb2, worker_pb2_grpc
from services.worker.main import EngineStatus, WorkerParts, grammars_for, prepare, refuse, scheduler_config
from services.worker.wire import (check_request_id, check_tokens, logprob_to_proto, prompt_logprobs_to_proto,
                                  sampling_from_proto)

log = logging.getLogger(__name__)

# After a failure, how long posted writes may take to end before the link is given up.
DRAIN_SECONDS = 5.0
# Smoothing of the measured compute time per prompt token (reported to the router).
COST_ALPHA = 0.2


class LeaseExpired(TransferError):
    """The decode worker's write deadline passed before the KV was written."""


class PrefillCancelled(TransferError):
    """The caller went away before its prefill finished."""


@dataclass
class Export:
    """Where one request's KV goes, and the writes posted so far."""
    transport: KVTransport
    peer: PeerHandle
    dst: list[int]                      # the decode worker's reserved blocks
    deadline: float                     # monotonic
    xfers: list[int] = field(default_factory=list)
    pushed_blocks: int = 0              # leading blocks complete at the destination
    failure: TransferError | None = None


class PrefillWorker:
    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int],
                 metrics: WorkerMetrics) -> None:
        self.runner = runner
        self.eos = eos
        self.metrics = metrics
        self.epoch = uuid.uuid4().hex[:12]
        config = scheduler_config(settings, runner.device.type)
        bs = settings.block_size
        # Room for a full context and a full step being computed (twice over, for the
        # blocks still being read by writes) plus the prefix cache.
        working = 2 * -(-max(runner.max_model_len, config.max_num_batched_tokens) // bs)
        num_blocks = working + settings.prefix_cache_tokens // bs
        self.layout = runner.layout(num_blocks, bs)
        self.compat_hash = runner.compat_hash(self.layout)
        self.memory = KVPoolMemory.allocate(self.layout, device=str(runner.device))
        self.blocks = BlockManager(BlockPool(num_blocks, bs), prefix_caching=settings.prefix_cache_tokens > 0)
        self.transports = open_transports(settings.kv_transport, settings.transport_options(),
                                          drop_rate=settings.fault_drop_transfers, device=str(runner.device))
        for t in self.transports.values():
            t.register(self.memory, self.compat_hash)
        self.engine = LLMEngine(runner, self.memory, Scheduler(self.blocks, config), layer_hook=self._push_layer)
        self.grammars = grammars_for(runner, eos)
        self.loop = EngineLoop(self.engine, tick=self._tick, on_step=self._on_step, name="prefill-engine")
        self._exports: dict[str, Export] = {}          # by engine request id
        self._ids = itertools.count()
        self._pair_lock = threading.Lock()
        self.queued = 0
        self.queued_tokens = 0
        self.kv_bytes_sent = 0
        self.seconds_per_token = 0.0
        metrics.set_blocks(num_blocks, num_blocks)

    def _pair(self, handle) -> tuple[KVTransport, PeerHandle, bool]:
        if handle.compat_hash != self.compat_hash:
            raise IncompatiblePeer(f"decode worker KV layout {handle.compat_hash} differs from ours "
                                   f"{self.compat_hash} (model, dtype, quantization, block size or protocol): "
                                   "refusing to pair")
        with self._pair_lock:
            return pair([(o.backend, o.meta) for o in handle.offers], self.transports, self.compat_hash,
                        lambda failed, used: self.metrics.transport_fallbacks.labels(failed, used or "none").inc())

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        handle = req.handle
        check_request_id(req.request_id)
        tokens = check_tokens(req.prompt_token_ids, self.runner.vocab_size)
        if len(tokens) > self.runner.max_model_len:
            raise ValueError(f"{len(tokens)} prompt tokens exceed the model's context of {self.runner.max_model_len}")
        if handle.num_tokens != len(tokens) or len(handle.block_ids) != self.blocks.blocks_for(len(tokens)):
            raise TransferError("handle does not match the prompt length")
        params = sampling_from_proto(req.sampling)
        constraint = await asyncio.to_thread(prepare, params, self.runner.vocab_size, self.grammars)
        # The lease is wall-clock (it crosses processes); waits below use the monotonic clock.
        deadline = time.monotonic() + (handle.write_deadline - time.time())
        transport, peer, fell_back = await asyncio.to_thread(self._pair, handle)
        export = Export(transport, peer, list(handle.block_ids), deadline)
        seq = Sequence(f"{req.request_id}#{next(self._ids)}", list(tokens), len(tokens), params, self.eos,
                       constraint=constraint)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()

        def sink(output: EngineOutput) -> None:
            loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(output))

        self._exports[seq.request_id] = export
        self._enqueue(len(tokens))
        t0 = time.perf_counter()
        self.loop.submit(seq, sink)
        ok = False
        try:
            first = await asyncio.shield(ended)
            if export.failure is not None:
                raise export.failure
            if not first.token_ids:
                raise TransferError(f"the prefill ended without a token ({first.finish_reason})")
            after_compute = time.perf_counter()
            await asyncio.shield(asyncio.to_thread(wait_for, transport, export.xfers, deadline))
            ok = True
        finally:
            if not ok:
                export.failure = export.failure or PrefillCancelled("the request ended before its prefill")
                self.loop.abort(seq.request_id)
            settle = asyncio.ensure_future(self._settle(seq.request_id, export, ended, drain=not ok, n=len(tokens)))
            await asyncio.shield(settle)
        done = time.perf_counter()
        computed = len(tokens) - seq.num_cached
        kv_bytes = self.layout.block_bytes_per_layer * len(export.dst) * self.layout.num_layers
        self.kv_bytes_sent += kv_bytes
        self.metrics.observe_prefix(len(tokens), seq.num_cached)
        self.metrics.kv_bytes.labels("sent", transport.name).inc(kv_bytes)
        self.metrics.kv_transfer_seconds.labels(transport.name).observe(done - after_compute)
        self.metrics.requests.labels("prefilled").inc()
        self.metrics.generated_tokens.inc()
        # What this prompt cost the engine, not the time it queued: the router's cost
        # model prices queued tokens separately.
        compute = computed * self.seconds_per_token if self.seconds_per_token else after_compute - t0
        return worker_pb2.PrefillResponse(first_token_id=first.token_ids[0], kv_bytes=kv_bytes,
                                          prefill_seconds=compute + (done - after_compute),
                                          transfer_seconds=done - after_compute, transport=transport.name,
                                          transport_fallback=fell_back, cached_tokens=seq.num_cached,
                                          first_logprob=logprob_to_proto(first.logprobs[0]) if first.logprobs else None,
                                          prompt_logprobs=prompt_logprobs_to_proto(first.prompt_logprobs))

    async def _settle(self, request_id: str, export: Export, ended: asyncio.Future, drain: bool, n: int) -> None:
        """After a request ends either way: once the engine is done with it, let writes
        already posted end (or give up on the link) before its blocks can be reused."""
        try:
            await ended
            if drain:
                await asyncio.to_thread(self._drain, export)
        finally:
            self._exports.pop(request_id, None)
            self.loop.release(request_id)
            self._dequeue(n)

    def _drain(self, export: Export) -> None:
        try:
            wait_for(export.transport, export.xfers, min(export.deadline, time.monotonic() + DRAIN_SECONDS))
        except TransferError:
            export.transport.close(export.peer)          # a failed link: the next request reconnects

    def _enqueue(self, n: int) -> None:
        self.queued += 1
        self.queued_tokens += n
        self.metrics.waiting.set(self.queued)

    def _dequeue(self, n: int) -> None:
        self.queued -= 1
        self.queued_tokens -= n
        self.metrics.waiting.set(self.queued)

    # ---- engine thread ----
    def _push_layer(self, layer: int, plan: StepPlan) -> None:
        """Layer `layer` of this step is written: post its writes, request by request.
        A chunk pushes only the blocks it completes (the prompt's last chunk, its last
        partial block too), so no destination block is written twice: two writes to one
        block would have no order between them. A request whose lease ran out or whose
        write failed, however it failed, stops writing and is aborted (its KV at the
        decode worker is incomplete); the others go on."""
        last_layer = layer == self.layout.num_layers - 1
        bs = self.layout.block_size
        for c in plan.chunks:
            export = self._exports.get(c.seq.request_id)
            if export is None or export.failure is not None:
                continue
            end = c.start + c.num_tokens
            first, stop = export.pushed_blocks, (-(-end // bs) if end >= c.seq.prompt_len else end // bs)
            try:
                if time.monotonic() >= export.deadline:
                    raise LeaseExpired(f"write deadline passed at layer {layer}")
                if stop > first:
                    export.xfers.append(export.transport.write(export.peer, c.seq.block_ids[first:stop],
                                                               export.dst[first:stop], range(layer, layer + 1)))
            except Exception as exc:            # noqa: BLE001 - any failed post leaves the KV incomplete
                export.failure = exc if isinstance(exc, TransferError) else TransferError(
                    f"posting layer {layer}'s write failed: {type(exc).__name__}: {exc}")
                log.warning("request %s: %s", c.seq.request_id, export.failure)
                self.loop.abort(c.seq.request_id)
                continue
            if last_layer:
                export.pushed_blocks = stop

    def _tick(self) -> None:
        sch = self.engine.scheduler
        self.metrics.set_queue(len(sch.running), sch.num_waiting)
        self.metrics.set_blocks(self.blocks.num_available, self.blocks.num_blocks)

    def _on_step(self, stats: StepStats) -> None:
        self.metrics.step_seconds.labels("prefill").observe(stats.seconds)
        self.metrics.prompt_tokens_computed.inc(stats.prefill_tokens + stats.decode_tokens)
        tokens = stats.prefill_tokens + stats.decode_tokens
        if tokens:
            cost = stats.seconds / tokens
            self.seconds_per_token = cost if not self.seconds_per_token else \
                (1 - COST_ALPHA) * self.seconds_per_token + COST_ALPHA * cost

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            role="prefill", epoch=self.epoch, compat_hash=self.compat_hash, model_name=self.runner.model_dir.name,
            block_size=self.layout.block_size, num_blocks=self.blocks.num_blocks, free_blocks=self.blocks.num_available,
            waiting=self.queued, max_model_len=self.runner.max_model_len, kv_transports=list(self.transports),
            queued_prefill_tokens=self.queued_tokens,
            prefix_hashes=self.blocks.keys_newest_first(),
            reported_at=time.time(), busy_seconds=self.engine.busy_seconds)

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(info=self.info(), prompt_tokens_computed=self.engine.prompt_tokens_computed,
                                      kv_bytes_sent=self.kv_bytes_sent)

    def busy(self) -> bool:
        return self.queued > 0

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        for t in self.transports.values():
            t.shutdown()
        self.memory.close()


class PrefillService(EngineStatus, worker_pb2_grpc.PrefillWorkerServicer):

    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        try:
            return await self.engine.prefill(request)
        except LeaseExpired as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except IncompatiblePeer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TransferError as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc}")
        except ValueError as exc:
            await refuse(context, exc)


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics):
    worker = PrefillWorker(settings, runner, eos, metrics)
    worker.start()
    return WorkerParts("pdserve.v1.PrefillWorker",
                       PrefillService(worker), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, worker.stop)
