"""KV bytes crossing a real process boundary through the NIXL backend (UCX), the
compatibility handshake, and dead or stuck peers failing instead of hanging."""
import json
import multiprocessing as mp
import os
import signal
import time
import traceback

import pytest
import torch

pytest.importorskip("nixl", reason="NIXL is not installed: the nixl KV transport cannot run here")

from kv_transfer.backends import create_transport  # noqa: E402
from kv_transfer.base import IncompatiblePeer, TransferError, TransferState, TransferTimeout, wait_for  # noqa: E402
from services.engine.model.kv_cache import KVLayout, KVPoolMemory, compat_hash  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
CTX = mp.get_context("spawn")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)       # numpy has no bfloat16: compare raw bytes


def _writer(layout: KVLayout, meta: bytes, compat: str, src_blocks, dst_blocks, seed: int, q) -> None:
    try:
        torch.manual_seed(seed)
        local = KVPoolMemory.allocate(KVLayout(**{**layout.__dict__, "num_blocks": 8}))
        local.tensor.copy_(torch.randn(local.tensor.shape))
        t = create_transport("nixl")
        t.register(local, compat)
        peer = t.connect(meta, compat)
        assert t.connect(meta, compat) == peer          # a second connect reuses the loaded peer
        xfers = [t.write(peer, src_blocks, dst_blocks, range(layer, layer + 1))   # layer by layer, as prefill does
                 for layer in range(layout.num_layers)]
        wait_for(t, xfers, time.monotonic() + 30)
        q.put(("ok", _bytes(local.tensor[:, :, src_blocks]).clone().numpy()))
        t.shutdown()
        t.shutdown()                                    # safe twice
    except BaseException:
        q.put(("error", traceback.format_exc()))


def _receiver(layout: KVLayout, compat: str, q) -> None:
    """A decode worker's side: registers, hands out its metadata, then idles until killed."""
    t = create_transport("nixl")
    q.put(t.register(KVPoolMemory.allocate(layout), compat))
    time.sleep(60)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nixl_moves_bit_identical_blocks_between_processes(dtype):
    layout = KVLayout(**{**LAYOUT.__dict__, "dtype": dtype})
    pool = KVPoolMemory.allocate(layout)                 # plain memory: NIXL reaches it, no shm file
    compat = compat_hash("m", layout)
    t = create_transport("nixl")
    meta = t.register(pool, compat)
    src, dst = [0, 1, 2, 5, 6], [9, 10, 11, 3, 14]      # runs (0->9 x3), (5->3), (6->14)
    q = CTX.Queue()
    p = CTX.Process(target=_writer, args=(layout, meta, compat, src, dst, 7, q))
    p.start()
    try:
        status, payload = q.get(timeout=50)
        assert status == "ok", payload
        p.join(10)
        assert p.exitcode == 0
        assert torch.equal(_bytes(pool.tensor[:, :, dst]), torch.from_numpy(payload))
        untouched = [i for i in range(layout.num_blocks) if i not in dst]
        assert torch.count_nonzero(_bytes(pool.tensor[:, :, untouched])) == 0
    finally:
        if p.is_alive():
            p.kill()
        t.shutdown()


def test_nixl_in_process_pair_checks_and_cleans_up():
    """Two agents in one process: all-layer writes, refusals of bad requests, close, shutdown."""
    dst_pool, src_pool = KVPoolMemory.allocate(LAYOUT), KVPoolMemory.allocate(LAYOUT)
    src_pool.tensor.normal_()
    a, b = create_transport("nixl"), create_transport("nixl")
    try:
        meta = a.register(dst_pool, "h")
        assert json.loads(meta)["backend"] == "nixl"
        b.register(src_pool, "h")
        peer = b.connect(meta, "h")
        wait_for(b, [b.write(peer, [0, 1, 7], [4, 5, 15])], time.monotonic() + 10)   # layers=None: all of them
        assert torch.equal(dst_pool.tensor[:, :, [4, 5, 15]], src_pool.tensor[:, :, [0, 1, 7]])
        assert b.poll(b.write(peer, [], [])) is TransferState.DONE
        assert b.poll(123456) is TransferState.FAILED                 # unknown transfer
        with pytest.raises(TransferError):
            b.write(peer, [0], [LAYOUT.num_blocks])                   # past the peer's pool
        with pytest.raises(TransferError):
            b.write(peer, [0], [1], range(LAYOUT.num_layers, LAYOUT.num_layers + 1))
        with pytest.raises(TransferError):
            b.write(peer, [0, 1], [2])
        b.close(peer)
        with pytest.raises(TransferError):
            b.write(peer, [0], [1])                                   # closed: not connected any more
        peer = b.connect(meta, "h")                                   # and it can pair again
        wait_for(b, [b.write(peer, [2], [0], range(1, 2))], time.monotonic() + 10)
        assert torch.equal(dst_pool.tensor[1, :, 0], src_pool.tensor[1, :, 2])
    finally:
        b.shutdown()
        b.shutdown()
        a.shutdown()
    with pytest.raises(TransferError):
        b.connect(meta, "h")


def test_nixl_mismatched_layout_refuses_to_pair():
    pool = KVPoolMemory.allocate(LAYOUT)
    a, b = create_transport("nixl"), create_transport("nixl")
    try:
        meta = a.register(pool, compat_hash("m", LAYOUT))
        other = KVLayout(**{**LAYOUT.__dict__, "dtype": "bfloat16"})
        with pytest.raises(IncompatiblePeer, match="refusing to pair"):
            b.connect(meta, compat_hash("m", other))
        shm_meta = json.dumps({"backend": "shm", "compat_hash": compat_hash("m", LAYOUT)}).encode()
        with pytest.raises(TransferError):
            b.connect(shm_meta, compat_hash("m", LAYOUT))
        assert json.loads(meta)["compat_hash"] == compat_hash("m", KVLayout(**{**LAYOUT.__dict__, "num_blocks": 2}))
    finally:
        a.shutdown()
        b.shutdown()


def _start_receiver(compat: str) -> tuple[mp.Process, bytes]:
    q = CTX.Queue()
    p = CTX.Process(target=_receiver, args=(LAYOUT, compat, q), daemon=True)
    p.start()
    return p, q.get(timeout=50)


def test_nixl_write_to_a_dead_peer_fails_instead_of_hanging():
    local = KVPoolMemory.allocate(LAYOUT)
    local.tensor.normal_()
    t = create_transport("nixl")
    t.register(local, "h")
    p, meta = _start_receiver("h")
    try:
        peer = t.connect(meta, "h")
        wait_for(t, [t.write(peer, [0], [0])], time.monotonic() + 10)        # the link works
        p.kill()
        p.join(10)
        start = time.monotonic()
        with pytest.raises(TransferError):                                  # FAILED (or at worst a timeout)
            wait_for(t, [t.write(peer, [1, 2], [1, 2])], start + 5)
        assert time.monotonic() - start < 5
        t.close(peer)
        start = time.monotonic()
        with pytest.raises(TransferError):                                  # the peer is gone for good
            t.connect(meta, "h")
        assert time.monotonic() - start < 5
    finally:
        if p.is_alive():
            p.kill()
        t.shutdown()


def test_nixl_stuck_peer_times_out_and_close_cancels():
    """A peer that stops answering (here: SIGSTOP before the handshake) leaves the write
    pending; the caller's deadline ends the wait and close() cancels it."""
    local = KVPoolMemory.allocate(LAYOUT)
    t = create_transport("nixl")
    t.register(local, "h")
    p, meta = _start_receiver("h")
    try:
        os.kill(p.pid, signal.SIGSTOP)
        peer = t.connect(meta, "h")
        xfer = t.write(peer, [0], [0])
        start = time.monotonic()
        with pytest.raises(TransferTimeout):
            wait_for(t, [xfer], start + 1)
        assert time.monotonic() - start < 3
        t.close(peer)
        assert t.poll(xfer) is TransferState.FAILED
    finally:
        p.kill()
        p.join(10)
        t.shutdown()
