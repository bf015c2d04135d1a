"""Prefill worker: runs a prompt in one pass and pushes its KV into a decode worker.

A request's life here:
  Prefill RPC -> wait for the engine thread (one prompt at a time, FIFO)
             -> connect to the decode worker's KV memory (compat hash checked, cached)
             -> forward pass into local blocks; after each layer, that layer's blocks
                are written into the reserved decode blocks (transfer overlaps compute)
             -> sample the first token -> local blocks back to the pool -> reply

Writes stop at the handle's write deadline: past it the decode worker may have given
the blocks to someone else, so a late prefill fails instead of writing.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.base import PeerHandle, TransferError, create_transport
from kv_transfer.memory import KVPoolMemory
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.common.wire import sampling_from_proto
from services.engine.block_pool import BlockPool, NoFreeBlocks
from services.engine.runner import ModelRunner
from services.engine.sampler import sample
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class LeaseExpired(TransferError):
    """The decode worker's write deadline passed before the KV was written."""


class PrefillEngine:
    def __init__(self, settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int],
                 metrics: WorkerMetrics) -> None:
        import uuid
        self.runner = runner
        self.eos = eos
        self.metrics = metrics
        self.epoch = uuid.uuid4().hex[:12]
        # Local blocks only stage one prompt at a time: room for two full contexts.
        num_blocks = 2 * -(-runner.max_model_len // settings.block_size)
        self.layout = runner.layout(num_blocks, settings.block_size)
        self.compat_hash = runner.compat_hash(self.layout)
        self.memory = KVPoolMemory.allocate(self.layout, device=str(runner.device))
        self.pool = BlockPool(num_blocks, settings.block_size)
        self.transport = create_transport(settings.kv_transport)
        self.transport.register(self.memory, self.compat_hash)
        self._peers: dict[bytes, PeerHandle] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-engine")
        self._lock = threading.Lock()
        self.queued = 0
        self.prompt_tokens_computed = 0
        self.kv_bytes_sent = 0
        metrics.blocks_total.set(num_blocks)
        metrics.blocks_free.set(num_blocks)

    def _peer(self, meta: bytes, compat: str) -> PeerHandle:
        if compat != self.compat_hash:
            raise TransferError(f"decode worker layout {compat} differs from ours {self.compat_hash}")
        peer = self._peers.get(meta)
        if peer is None:
            peer = self._peers[meta] = self.transport.connect(meta, self.compat_hash)
        return peer

    def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        handle = req.handle
        tokens = list(req.prompt_token_ids)
        if handle.transport != self.transport.name:
            raise TransferError(f"handle wants transport {handle.transport!r}, this worker has {self.transport.name!r}")
        if handle.num_tokens != len(tokens) or len(handle.block_ids) != self.pool.blocks_for(len(tokens)):
            raise TransferError("handle does not match the prompt length")
        peer = self._peer(handle.transport_meta, handle.compat_hash)
        params = sampling_from_proto(req.sampling)
        blocks = self.pool.allocate(len(handle.block_ids))
        dst = list(handle.block_ids)
        layer_bytes = self.layout.block_bytes_per_layer * len(blocks)
        xfer_seconds = 0.0

        def push_layer(layer: int) -> None:
            nonlocal xfer_seconds
            if time.time() >= handle.write_deadline:
                raise LeaseExpired(f"write deadline passed at layer {layer}")
            t = time.perf_counter()
            self.transport.write(peer, blocks, dst, range(layer, layer + 1))
            xfer_seconds += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            self.metrics.blocks_free.set(self.pool.num_free)
            logits = self.runner.prefill(self.memory, tokens, blocks, on_layer=push_layer)
            first = sample(logits[None], [params], [0], self.eos)[0]
        finally:
            self.pool.free(blocks)
            self.metrics.blocks_free.set(self.pool.num_free)
        elapsed = time.perf_counter() - t0
        kv_bytes = layer_bytes * self.layout.num_layers
        self.prompt_tokens_computed += len(tokens)
        self.kv_bytes_sent += kv_bytes
        self.metrics.prompt_tokens_computed.inc(len(tokens))
        self.metrics.generated_tokens.inc()
        self.metrics.kv_bytes.labels("sent", self.transport.name).inc(kv_bytes)
        self.metrics.kv_transfer_seconds.labels(self.transport.name).observe(xfer_seconds)
        self.metrics.step_seconds.labels("prefill").observe(elapsed)
        return worker_pb2.PrefillResponse(first_token_id=first, kv_bytes=kv_bytes, prefill_seconds=elapsed,
                                          transfer_seconds=xfer_seconds, transport=self.transport.name)

    async def submit(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        self.queued += 1
        self.metrics.waiting.set(self.queued)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.prefill, req)
        finally:
            self.queued -= 1
            self.metrics.waiting.set(self.queued)

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            role="prefill", epoch=self.epoch, compat_hash=self.compat_hash, model_name=self.runner.model_dir.name,
            block_size=self.layout.block_size, num_blocks=self.pool.num_blocks, free_blocks=self.pool.num_free,
            waiting=self.queued, max_model_len=self.runner.max_model_len, kv_transport=self.transport.name)

    def stop(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.transport.shutdown()
        self.memory.close()


class PrefillService(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    async def Info(self, request, context):
        return self.engine.info()

    async def Stats(self, request, context):
        e = self.engine
        return worker_pb2.WorkerStats(info=e.info(), prompt_tokens_computed=e.prompt_tokens_computed,
                                      kv_bytes_sent=e.kv_bytes_sent)

    async def Prefill(self, request, context):
        try:
            return await self.engine.submit(request)
        except LeaseExpired as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (TransferError, ValueError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics):
    from services.common.worker_main import WorkerParts
    engine = PrefillEngine(settings, runner, eos, metrics)
    return WorkerParts("pdserve.v1.PrefillWorker",
                       lambda server: worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillService(engine), server),
                       engine.stop)
