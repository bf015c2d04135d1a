"""An in-process transport for unit tests: peers meet in a shared `FakeFabric`, and
writes succeed at once (or fail, when the fabric is told to drop them)."""
from __future__ import annotations

import json
from typing import ClassVar, Sequence

from kv_transfer.base import (HeadSlice, IncompatiblePeer, PeerHandle, TransferError, TransferId, TransferState,
                              block_runs, check_heads, head_slices, pool_meta)
from services.engine.model.kv_cache import KVPoolMemory


class FakeFabric:
    def __init__(self) -> None:
        self.pools: dict[str, tuple[KVPoolMemory, str]] = {}
        self.drop_writes = False
        self.bytes_moved = 0


class FakeTransport:
    name: ClassVar[str] = "fake"
    device_memory: ClassVar[bool] = True       # copies between tensors in one process

    def __init__(self, fabric: FakeFabric | None = None) -> None:
        self.fabric = fabric or FakeFabric()
        self._local: KVPoolMemory | None = None
        self._states: dict[int, TransferState] = {}

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        self._local = pool
        key = f"pool-{id(pool)}"
        self.fabric.pools[key] = (pool, compat_hash)
        return pool_meta(pool, self.name, compat_hash, key=key)

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        meta = json.loads(peer)
        if meta["key"] not in self.fabric.pools:
            raise TransferError("peer unknown to the fabric")
        if meta["compat_hash"] != compat_hash:
            raise IncompatiblePeer(f"peer {meta['compat_hash']} != ours {compat_hash}")
        return PeerHandle(meta["key"])

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        xfer = len(self._states) + 1
        if self.fabric.drop_writes:
            self._states[xfer] = TransferState.FAILED
            return xfer
        target, _ = self.fabric.pools[peer.peer_id]
        check_heads(heads, self._local.tensor.shape[4], target.tensor.shape[4])
        hs, hd = head_slices(heads)
        layers = layers or range(self._local.layout.num_layers)
        for s, d, n in block_runs(src, dst):
            chunk = self._local.tensor[layers.start:layers.stop, :, s:s + n, :, hs]
            target.tensor[layers.start:layers.stop, :, d:d + n, :, hd].copy_(chunk)
            self.fabric.bytes_moved += chunk.numel() * chunk.element_size()
        self._states[xfer] = TransferState.DONE
        return xfer

    def poll(self, xfer: TransferId) -> TransferState:
        return self._states.get(xfer, TransferState.FAILED)

    def close(self, peer: PeerHandle) -> None:
        pass

    def shutdown(self) -> None:
        pass
