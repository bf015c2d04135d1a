"""The prefill worker's layer-by-layer push, under chunked prefill, with transports that
misbehave as real ones may: one whose writes land in reverse order (two writes to one
destination block have no order between them, so none may be posted), and one that
raises something other than TransferError on one layer (the request must fail loudly,
never go on with a layer missing). The real model, in process, with the worker's own
engine and push code; the transports are doubles over the in-process fake fabric."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from kv_transfer.base import TransferError, TransferState
from kv_transfer.fake import FakeFabric, FakeTransport
from services.common.metrics import WorkerMetrics
from services.common.settings import WorkerSettings
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.engine.text.tokenizer import eos_token_ids
from services.prefill.worker import PrefillWorker
from services.rpc import generate_pb2, worker_pb2

BLOCK = 16
CHUNK = 24                                  # chunks end mid-block: 24, 48 (a boundary), 72, ...
PROMPT = [(i * 7919) % 20000 + 100 for i in range(83)]


class ReverseOrderTransport(FakeTransport):
    """Reads a write's source when it is posted, as a DMA engine soon would, and lands
    the writes at the destination in reverse order once anything is polled."""

    def __init__(self, fabric: FakeFabric) -> None:
        super().__init__(fabric)
        self._posted: list[tuple[object, list[int], range, torch.Tensor]] = []

    def write(self, peer, src, dst, layers=None, heads=None, deadline=None):
        assert heads is None, "whole blocks only: a one-process pool holds every head"
        layers = layers or range(self._local.layout.num_layers)
        data = self._local.tensor[layers.start:layers.stop, :, list(src)].clone()
        self._posted.append((peer, list(dst), layers, data))
        xfer = len(self._states) + 1
        self._states[xfer] = TransferState.PENDING
        return xfer

    def poll(self, xfer):
        for peer, dst, layers, data in reversed(self._posted):
            target, _ = self.fabric.pools[peer.peer_id]
            target.tensor[layers.start:layers.stop, :, dst] = data
        self._posted.clear()
        for x in self._states:
            self._states[x] = TransferState.DONE
        return self._states[xfer]


class FailsOnALayer(FakeTransport):
    def write(self, peer, src, dst, layers=None, heads=None, deadline=None):
        if layers is not None and layers.start == 5:
            raise ValueError("a descriptor the backend could not build")
        return super().write(peer, src, dst, layers, heads, deadline)


@pytest.fixture(scope="module")
def runner(model_dir):
    torch.set_num_threads(1)
    return ModelRunner(model_dir, "float32", "cpu", attention="torch")


def _prefill(runner, model_dir, transport_class, clock_behind: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill PROMPT in chunks of CHUNK through a PrefillWorker whose transport is
    `transport_class`, into a handle from a decode host whose clock is `clock_behind`
    seconds behind this one's; returns (what landed in the destination blocks, what the prefill
    worker's own blocks hold), both [layers, 2, blocks, ...]."""
    settings = WorkerSettings(role="prefill", dtype="float32", kv_transport="shm", prefill_chunk_tokens=CHUNK,
                              prefix_cache_tokens=0, block_size=BLOCK)
    worker = PrefillWorker(settings, runner, eos_token_ids(model_dir), WorkerMetrics("prefill", "test"))
    worker.transports.pop("shm").shutdown()                 # the double takes its place, under its name
    fabric = FakeFabric()
    worker.transports["shm"] = transport_class(fabric)
    worker.transports["shm"].register(worker.memory, worker.compat_hash)
    blocks = -(-len(PROMPT) // BLOCK)
    dst_pool = KVPoolMemory.allocate(runner.layout(blocks + 4, BLOCK))
    dst_pool.tensor.fill_(-7.0)                              # old bytes
    dst = list(range(2, 2 + blocks))
    meta = FakeTransport(fabric).register(dst_pool, worker.compat_hash)
    handle = worker_pb2.KVHandle(request_id="r", epoch="e", block_ids=dst, num_tokens=len(PROMPT),
                                 write_deadline=time.time() - clock_behind + 60, write_seconds=60,
                                 compat_hash=worker.compat_hash,
                                 offers=[worker_pb2.TransportOffer(backend="shm", meta=meta)])
    req = worker_pb2.PrefillRequest(request_id="r", prompt_token_ids=PROMPT, handle=handle,
                                    sampling=generate_pb2.SamplingParams(max_tokens=1, temperature=0, top_p=1))
    own: dict[str, torch.Tensor] = {}
    release = worker.loop.release

    def keep_then_release(request_id: str) -> None:      # the worker's own blocks, before they go back
        seq = worker.engine.scheduler.retained[request_id]
        own[request_id] = worker.memory.tensor[:, :, seq.block_ids].clone()
        release(request_id)
    worker.loop.release = keep_then_release
    worker.start()
    try:
        asyncio.run(worker.prefill(req))
        (blocks_there,) = own.values()
        return dst_pool.tensor[:, :, dst].clone(), blocks_there
    finally:
        worker.stop()
        dst_pool.close()


def test_writes_landing_in_any_order_leave_the_prompts_kv_whole(runner, model_dir):
    landed, own = _prefill(runner, model_dir, ReverseOrderTransport)
    assert torch.equal(landed, own), "a block written twice kept its older, partial bytes"


def test_the_lease_holds_whatever_the_decode_hosts_clock_says(runner, model_dir):
    """A handle carries the seconds it leaves to write, not only its wall-clock deadline:
    a decode host whose clock is an hour behind (its deadline long past on this host's
    clock) still gets its KV."""
    landed, own = _prefill(runner, model_dir, FakeTransport, clock_behind=3600)
    assert torch.equal(landed, own)


def test_a_write_that_raises_on_one_layer_fails_the_prefill_loudly(runner, model_dir):
    with pytest.raises(TransferError, match="layer 5"):
        _prefill(runner, model_dir, FailsOnALayer)
