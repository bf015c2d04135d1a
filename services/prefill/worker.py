"""Prefill worker: runs a prompt in one pass and pushes its KV into a decode worker.

A request's life here:
  Prefill RPC -> wait for the engine thread (one prompt at a time, FIFO)
             -> connect to the decode worker's KV memory (compat hash checked, cached)
             -> take the prompt's blocks: its leading blocks already in the prefix
                cache are reused, the rest are new
             -> forward pass over the uncached tokens into local blocks; after each
                layer, all the prompt's blocks of that layer are written into the
                reserved decode blocks (transfer overlaps compute)
             -> sample the first token -> full blocks stay cached -> reply

Writes stop at the handle's write deadline: past it the decode worker may have given
the blocks to someone else, so a late prefill fails instead of writing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from kv_transfer.base import (IncompatiblePeer, KVTransport, PeerHandle, TransferError, open_transports, pair,
                              wait_for)
from kv_transfer.memory import KVPoolMemory
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.common.worker_main import EngineStatus, WorkerParts
from services.common.wire import sampling_from_proto
from services.engine.block_pool import BlockPool, NoFreeBlocks
from services.engine.prefix_cache import PrefixCache
from services.engine.runner import ModelRunner
from services.engine.sampler import sample
from services.rpc import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


# Keys of cached blocks a worker advertises to the router (8 bytes each).
PREFIX_SUMMARY_BLOCKS = 4096


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
        # Room for one full context being computed plus the prefix cache.
        num_blocks = -(-runner.max_model_len // settings.block_size) + settings.prefix_cache_tokens // settings.block_size
        self.layout = runner.layout(num_blocks, settings.block_size)
        self.compat_hash = runner.compat_hash(self.layout)
        self.memory = KVPoolMemory.allocate(self.layout, device=str(runner.device))
        self.pool = BlockPool(num_blocks, settings.block_size)
        self.cache = PrefixCache(self.pool, enabled=settings.prefix_cache_tokens > 0)
        self.transports = open_transports(settings.kv_transport, settings.transport_options(),
                                          drop_rate=settings.fault_drop_transfers)
        for t in self.transports.values():
            t.register(self.memory, self.compat_hash)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-engine")
        self.queued = 0
        self.queued_tokens = 0
        self.prompt_tokens_computed = 0
        self.busy_seconds = 0.0                # in prefill passes, for the autoscaler
        self.kv_bytes_sent = 0
        metrics.blocks_total.set(num_blocks)
        metrics.blocks_free.set(num_blocks)

    def _pair(self, handle) -> tuple[KVTransport, PeerHandle, bool]:
        if handle.compat_hash != self.compat_hash:
            raise IncompatiblePeer(f"decode worker KV layout {handle.compat_hash} differs from ours "
                                   f"{self.compat_hash} (model, dtype, block size or protocol): refusing to pair")
        return pair([(o.backend, o.meta) for o in handle.offers], self.transports, self.compat_hash,
                    lambda failed, used: self.metrics.transport_fallbacks.labels(failed, used or "none").inc())

    def prefill(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        handle = req.handle
        tokens = list(req.prompt_token_ids)
        if handle.num_tokens != len(tokens) or len(handle.block_ids) != self.pool.blocks_for(len(tokens)):
            raise TransferError("handle does not match the prompt length")
        # The lease is wall-clock (it crosses processes); waits below use the monotonic clock.
        deadline = time.monotonic() + (handle.write_deadline - time.time())
        transport, peer, fell_back = self._pair(handle)
        params = sampling_from_proto(req.sampling)
        hit = self.cache.acquire(tokens)
        blocks, start = hit.block_ids, hit.cached_tokens
        dst = list(handle.block_ids)
        xfers: list[int] = []

        def push_layer(layer: int) -> None:
            if time.monotonic() >= deadline:
                raise LeaseExpired(f"write deadline passed at layer {layer}")
            xfers.append(transport.write(peer, blocks, dst, range(layer, layer + 1)))

        t0 = time.perf_counter()
        computed = False
        try:
            self._set_free_gauge()
            logits = self.runner.prefill(self.memory, tokens[start:], blocks, start=start, on_layer=push_layer)
            computed = True
            first = sample(logits[None], [params], [0], self.eos)[0]
            after_compute = time.perf_counter()
            wait_for(transport, xfers, deadline)
        except BaseException:
            self._drain(transport, peer, xfers, deadline)
            raise
        finally:
            self.cache.release(hit, computed)
            self._set_free_gauge()
        done = time.perf_counter()
        kv_bytes = self.layout.block_bytes_per_layer * len(blocks) * self.layout.num_layers
        self.prompt_tokens_computed += len(tokens) - start
        self.busy_seconds += done - t0
        self.kv_bytes_sent += kv_bytes
        self.metrics.prompt_tokens_computed.inc(len(tokens) - start)
        self.metrics.prefix_cache_tokens.labels("hit").inc(start)
        self.metrics.prefix_cache_tokens.labels("miss").inc(len(tokens) - start)
        self.metrics.generated_tokens.inc()
        self.metrics.kv_bytes.labels("sent", transport.name).inc(kv_bytes)
        self.metrics.kv_transfer_seconds.labels(transport.name).observe(done - after_compute)
        self.metrics.step_seconds.labels("prefill").observe(done - t0)
        return worker_pb2.PrefillResponse(first_token_id=first, kv_bytes=kv_bytes, prefill_seconds=done - t0,
                                          transfer_seconds=done - after_compute, transport=transport.name,
                                          transport_fallback=fell_back, cached_tokens=start)

    def _set_free_gauge(self) -> None:
        self.metrics.blocks_free.set(self.cache.num_available)

    def _drain(self, transport: KVTransport, peer: PeerHandle, xfers: list[int], deadline: float) -> None:
        """After a failure, let writes already posted end (or give up on the link) before
        the staging blocks are reused, so no stale bytes can follow."""
        try:
            wait_for(transport, xfers, min(deadline, time.monotonic() + 5))
        except TransferError:
            transport.close(peer)                   # a failed link: the next request reconnects

    async def submit(self, req: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        n = len(req.prompt_token_ids)
        self.queued += 1
        self.queued_tokens += n
        self.metrics.waiting.set(self.queued)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self.prefill, req)
        finally:
            self.queued -= 1
            self.queued_tokens -= n
            self.metrics.waiting.set(self.queued)

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            role="prefill", epoch=self.epoch, compat_hash=self.compat_hash, model_name=self.runner.model_dir.name,
            block_size=self.layout.block_size, num_blocks=self.pool.num_blocks, free_blocks=self.cache.num_available,
            waiting=self.queued, max_model_len=self.runner.max_model_len, kv_transports=list(self.transports),
            queued_prefill_tokens=self.queued_tokens, prefix_hashes=self.cache.keys_newest_first(PREFIX_SUMMARY_BLOCKS),
            reported_at=time.time(), busy_seconds=self.busy_seconds)

    def stats(self) -> worker_pb2.WorkerStats:
        return worker_pb2.WorkerStats(info=self.info(), prompt_tokens_computed=self.prompt_tokens_computed,
                                      kv_bytes_sent=self.kv_bytes_sent)

    def busy(self) -> bool:
        return self.queued > 0

    def stop(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
        for t in self.transports.values():
            t.shutdown()
        self.memory.close()


class PrefillService(EngineStatus, worker_pb2_grpc.PrefillWorkerServicer):

    async def Prefill(self, request, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is draining")
        try:
            return await self.engine.submit(request)
        except LeaseExpired as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except IncompatiblePeer as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except TransferError as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def build(settings: WorkerSettings, runner: ModelRunner, eos: frozenset[int], metrics: WorkerMetrics):
    engine = PrefillEngine(settings, runner, eos, metrics)
    return WorkerParts("pdserve.v1.PrefillWorker",
                       PrefillService(engine), worker_pb2_grpc.add_PrefillWorkerServicer_to_server, engine.stop)
