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
                (services/worker/kv_export.py)
             -> the prompt's last chunk samples the first token -> its writes end ->
                reply; its full blocks stay cached for later prompts
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from kv_transfer.backends import open_transports
from kv_transfer.base import IncompatiblePeer, TransferError
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.engine.core.block_pool import NoFreeBlocks
from services.engine.core.sequence import NO_TOKEN_LEFT, Sequence
from services.engine.engine import EngineOutput, StepStats
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.parallel import kv_head_ranges
from services.engine.core.scheduler import SchedulerConfig
from services.engine.model.runner import ModelRunner
from services.rpc import worker_pb2, worker_pb2_grpc
from services.worker.engine_worker import EngineWorker
from services.worker.kv_export import Export, KVExporter, LeaseExpired, PrefillCancelled
from services.worker.main import EngineStatus, WorkerParts, no_token_error, prepared, refuse
from services.worker.wire import (ERROR_CODE_KEY, REFUSED_UNSTARTED, check_request_id, check_tokens, logprob_to_proto,
                                  prompt_logprobs_to_proto, sampling_from_proto)

log = logging.getLogger(__name__)

# Smoothing of the measured compute time per prompt token (reported to the router).
COST_ALPHA = 0.2
# Ids of prefills cancelled before they came, kept to refuse them if they come later.
MAX_CANCELLED = 4096


@dataclass
class _Prefilling:
    """A prefill this worker has taken, until nothing of it can still be written into
    the decode worker's blocks (`settled`)."""
    settled: asyncio.Future
    settle: asyncio.Future | None = None        # the settle of its writes, once it has one
    seq_id: str | None = None
    export: Export | None = None
    cancelled: bool = False


def pool_blocks_that_fit(runner: ModelRunner, settings: WorkerSettings, config: SchedulerConfig, working: int,
                         cached: int) -> int:
    """The prefix cache's blocks beside the `working` ones a prefill worker needs. On a
    GPU both come out of the share --gpu-memory-utilization gives this worker, after its
    weights and activations (ModelRunner.kv_tokens): the cache shrinks to what is left,
    and a card without room for the working blocks is a clear error at start, not an
    out-of-memory error in the first allocation."""
    if runner.device.type != "cuda":
        return cached
    bs = settings.block_size
    fits = runner.kv_tokens(0, settings.gpu_memory_utilization, config.max_num_batched_tokens,
                            config.max_num_seqs) // bs
    if fits < working:
        raise ValueError(f"a prefill worker needs {working * bs} tokens of KV (twice a full context or step), "
                         f"and {settings.gpu_memory_utilization:g} of {runner.device} leaves room for {fits * bs}: "
                         "raise --gpu-memory-utilization, or lower --max-model-len")
    if working + cached > fits:
        log.warning("prefix cache: %d tokens, not %d: what --gpu-memory-utilization %g leaves beside the "
                    "working blocks", (fits - working) * bs, cached * bs, settings.gpu_memory_utilization)
        return fits - working
    return cached


class PrefillWorker(EngineWorker):
    role = "prefill"

    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int],
                 metrics: WorkerMetrics, ranks=None) -> None:
        super().__init__(settings, runner, eos, metrics, ranks)
        bs = settings.block_size
        # Room for a full context and a full step being computed (twice over, for the
        # blocks still being read by writes) plus the prefix cache.
        working = 2 * -(-max(runner.max_model_len, self.config.max_num_batched_tokens) // bs)
        cached = pool_blocks_that_fit(runner, settings, self.config, working, settings.prefix_cache_tokens // bs)
        self._layout(working + cached)
        memory = KVPoolMemory.allocate(self.layout, device=str(runner.device), heads=runner.kv_heads)
        self.transports = open_transports(settings.kv_transport, settings.transport_options(),
                                          drop_rate=settings.fault_drop_transfers, device=str(runner.device))
        for t in self.transports.values():
            t.register(memory, self.compat_hash)
        if self.ranks is not None:          # the other ranks' pools, which they write from
            self.ranks.open_pools(self.layout.num_blocks, bs, False, self.compat_hash)
        # each rank's heads: whose slices of the model's KV this worker's ranks write
        heads = kv_head_ranges(runner.total_kv_heads, runner.tp.size)
        self.exporter = KVExporter(self.transports, self.compat_hash, self.layout,
                                   lambda failed, used: metrics.transport_fallbacks.labels(failed, used).inc(),
                                   heads=heads, group=runner.group)
        # A pass pauses between layers for another tenant's more urgent prompt (one
        # process only: the other ranks of several run the plan rank 0 sent them whole).
        self._open(memory, cached > 0, layer_hook=self.exporter.push_layer,
                   step_hooks=self.exporter if runner.leads else None, yields=runner.tp.size == 1)
        self.exporter.loop = self.loop
        self._ids = itertools.count()
        self.queued = 0
        self.queued_tokens = 0
        self.kv_bytes_sent = 0
        self.seconds_per_token = 0.0
        self._pauses_seen = 0
        self._prefilling: dict[str, _Prefilling] = {}      # by the router's request id
        self._cancelled: OrderedDict[str, None] = OrderedDict()   # ids cancelled before they came

    async def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        arrived = time.monotonic()          # the lease's seconds count from here, not after the checks
        check_request_id(req.request_id)
        if req.request_id in self._prefilling or req.request_id in self._cancelled:
            raise PrefillCancelled(f"request {req.request_id} is cancelled, or prefilling already")
        entry = self._prefilling[req.request_id] = _Prefilling(asyncio.get_running_loop().create_future())
        try:
            return await self._prefill(req, arrived, entry)
        finally:
            if entry.settle is None:        # ended before it posted any write
                self._settled(req.request_id, entry)

    async def cancel(self, request_id: str) -> bool:
        """Stop `request_id`'s prefill (the router's request ended) and return once
        nothing of it can still be written into the decode worker's blocks: its posted
        writes have ended or been given up. One not come yet is refused when it comes."""
        entry = self._prefilling.get(request_id)
        if entry is None:
            self._cancelled[request_id] = None
            while len(self._cancelled) > MAX_CANCELLED:
                self._cancelled.popitem(last=False)
            return True
        entry.cancelled = True
        if entry.export is not None:        # posts no more writes from now on
            entry.export.failure = entry.export.failure or PrefillCancelled("the router cancelled the request")
        if entry.seq_id is not None:
            self.loop.abort(entry.seq_id)
        await asyncio.shield(entry.settled)
        return True

    def _settled(self, request_id: str, entry: "_Prefilling") -> None:
        self._prefilling.pop(request_id, None)
        if not entry.settled.done():
            entry.settled.set_result(None)

    async def _prefill(self, req: worker_pb2.PrefillRequest, arrived: float,
                       entry: "_Prefilling") -> worker_pb2.PrefillResponse:
        handle = req.handle
        tokens = check_tokens(req.prompt_token_ids, self.runner.vocab_size)
        if len(tokens) > self.runner.max_model_len:
            raise ValueError(f"{len(tokens)} prompt tokens exceed the model's context of {self.runner.max_model_len}")
        if handle.num_tokens != len(tokens) or len(handle.block_ids) != self.blocks.blocks_for(len(tokens)):
            raise TransferError("handle does not match the prompt length")
        params = sampling_from_proto(req.sampling)
        constraint = await prepared(params, self.runner.vocab_size, self.grammars)
        seq = Sequence(f"{req.request_id}#{next(self._ids)}", list(tokens), len(tokens), params, self.eos,
                       constraint=constraint, priority=req.priority)
        export = await asyncio.to_thread(self.exporter.open, seq.request_id, handle, arrived)
        entry.seq_id, entry.export = seq.request_id, export
        loop = asyncio.get_running_loop()
        ended: asyncio.Future = loop.create_future()

        def sink(output: EngineOutput) -> None:
            loop.call_soon_threadsafe(lambda: ended.done() or ended.set_result(output))

        self._enqueue(len(tokens))
        t0 = time.perf_counter()
        self.loop.submit(seq, sink)
        ok = False
        try:
            if entry.cancelled:
                raise PrefillCancelled("the router cancelled the request")
            first = await asyncio.shield(ended)
            if export.failure is not None:
                raise export.failure
            if first.finish_reason == NO_TOKEN_LEFT:
                raise no_token_error(params, constraint, 0)
            if not first.token_ids:
                raise TransferError(f"the prefill ended without a token ({first.finish_reason})")
            after_compute = time.perf_counter()
            await asyncio.shield(asyncio.to_thread(self.exporter.finish, export))
            ok = True
        finally:
            if not ok:
                export.failure = export.failure or PrefillCancelled("the request ended before its prefill")
                self.loop.abort(seq.request_id)
            settle = entry.settle = asyncio.ensure_future(self._settle(seq.request_id, export, ended, drain=not ok,
                                                                       n=len(tokens)))
            settle.add_done_callback(lambda _: self._settled(req.request_id, entry))
            await asyncio.shield(settle)
        done = time.perf_counter()
        computed = len(tokens) - seq.num_cached
        transport = export.transport
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
                                          transport_fallback=export.fell_back, cached_tokens=seq.num_cached,
                                          first_logprob=logprob_to_proto(first.logprobs[0]) if first.logprobs else None,
                                          prompt_logprobs=prompt_logprobs_to_proto(first.prompt_logprobs),
                                          seconds_per_token=self.seconds_per_token)

    async def _settle(self, request_id: str, export, ended: asyncio.Future, drain: bool, n: int) -> None:
        try:
            await self.exporter.settle(request_id, export, ended, drain)
        finally:
            self._dequeue(n)

    def _enqueue(self, n: int) -> None:
        self.queued += 1
        self.queued_tokens += n
        self.metrics.waiting.set(self.queued)

    def _dequeue(self, n: int) -> None:
        self.queued -= 1
        self.queued_tokens -= n
        self.metrics.waiting.set(self.queued)

    # ---- engine thread ----
    def _on_step(self, stats: StepStats) -> None:
        self.metrics.step_seconds.labels("prefill").observe(stats.seconds)
        self.metrics.paused_passes.inc(self.engine.interjections - self._pauses_seen)
        self._pauses_seen = self.engine.interjections
        self.metrics.prompt_tokens_computed.inc(stats.prefill_tokens + stats.decode_tokens)
        tokens = stats.prefill_tokens + stats.decode_tokens
        if tokens:
            cost = stats.seconds / tokens
            self.seconds_per_token = cost if not self.seconds_per_token else \
                (1 - COST_ALPHA) * self.seconds_per_token + COST_ALPHA * cost

    def info(self) -> worker_pb2.WorkerInfo:
        info = super().info()
        info.waiting = self.queued
        info.queued_prefill_tokens = self.queued_tokens
        info.reported_at = time.time()
        info.busy_seconds = self.engine.busy_seconds
        return info

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(info=self.info(), prompt_tokens_computed=self.engine.prompt_tokens_computed,
                                      kv_bytes_sent=self.kv_bytes_sent)

    def busy(self) -> bool:
        return self.queued > 0


class PrefillService(EngineStatus, worker_pb2_grpc.PrefillWorkerServicer):

    async def Cancel(self, request, context):
        return worker_pb2.CancelResponse(stopped=await self.engine.cancel(request.request_id))

    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining",
                                trailing_metadata=((ERROR_CODE_KEY, REFUSED_UNSTARTED),))
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


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics, ranks=None):
    worker = PrefillWorker(settings, runner, eos, metrics, ranks)
    worker.start()
    return WorkerParts("pdserve.v1.PrefillWorker",
                       PrefillService(worker), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, worker.stop)
