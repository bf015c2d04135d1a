"""KV bytes crossing a real process boundary through the shm backend, and the
compatibility handshake."""
import json
import multiprocessing as mp

import pytest
import torch

from kv_transfer.base import IncompatiblePeer, TransferState, block_runs, create_transport
from kv_transfer.fake import FakeFabric, FakeTransport
from kv_transfer.memory import KVLayout, KVPoolMemory, compat_hash, live_segments

LAYOUT = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def _writer(meta: bytes, compat: str, src_blocks, dst_blocks, seed: int, q) -> None:
    torch.manual_seed(seed)
    local = KVPoolMemory.allocate(KVLayout(**{**LAYOUT.__dict__, "num_blocks": 8}))
    local.tensor.copy_(torch.randn(local.tensor.shape))
    t = create_transport("shm")
    t.register(local, compat)
    peer = t.connect(meta, compat)
    for layer in range(LAYOUT.num_layers):            # layer by layer, as prefill does
        assert t.poll(t.write(peer, src_blocks, dst_blocks, range(layer, layer + 1))) is TransferState.DONE
    q.put(local.tensor[:, :, src_blocks].clone().numpy())
    t.shutdown()


def test_shm_moves_bit_identical_blocks_between_processes():
    pool = KVPoolMemory.allocate(LAYOUT, shared=True)
    compat = compat_hash("m", LAYOUT)
    t = create_transport("shm")
    meta = t.register(pool, compat)
    src, dst = [0, 1, 2, 5], [9, 10, 11, 3]
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_writer, args=(meta, compat, src, dst, 7, q))
    p.start()
    sent = torch.from_numpy(q.get(timeout=60))
    p.join(60)
    assert p.exitcode == 0
    assert torch.equal(pool.tensor[:, :, dst], sent)
    untouched = [i for i in range(LAYOUT.num_blocks) if i not in dst]
    assert torch.count_nonzero(pool.tensor[:, :, untouched]) == 0
    path = pool.path
    pool.close()
    assert not path.exists() and path not in live_segments()


def test_mismatched_layout_refuses_to_pair():
    pool = KVPoolMemory.allocate(LAYOUT, shared=True)
    try:
        meta = create_transport("shm").register(pool, compat_hash("m", LAYOUT))
        other = KVLayout(**{**LAYOUT.__dict__, "dtype": "bfloat16"})
        with pytest.raises(IncompatiblePeer):
            create_transport("shm").connect(meta, compat_hash("m", other))
        assert json.loads(meta)["compat_hash"] == compat_hash("m", KVLayout(**{**LAYOUT.__dict__, "num_blocks": 2}))
    finally:
        pool.close()


def test_fake_backend_copies_and_can_drop():
    fabric = FakeFabric()
    dst_pool, src_pool = KVPoolMemory.allocate(LAYOUT), KVPoolMemory.allocate(LAYOUT)
    src_pool.tensor.normal_()
    a, b = FakeTransport(fabric), FakeTransport(fabric)
    meta = a.register(dst_pool, "h")
    b.register(src_pool, "h")
    peer = b.connect(meta, "h")
    assert b.poll(b.write(peer, [0, 1], [4, 5])) is TransferState.DONE
    assert torch.equal(dst_pool.tensor[:, :, 4:6], src_pool.tensor[:, :, 0:2])
    fabric.drop_writes = True
    assert b.poll(b.write(peer, [2], [6])) is TransferState.FAILED


def test_block_runs_merge_consecutive_pairs():
    assert block_runs([0, 1, 2, 7], [5, 6, 7, 1]) == [(0, 5, 3), (7, 1, 1)]
    assert create_transport("fake").name == "fake"
    with pytest.raises(ValueError):
        create_transport("carrier-pigeon")
