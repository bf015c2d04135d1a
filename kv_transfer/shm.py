"""Same-host KV transfer through shared memory: the writer maps the decode worker's
pool file and copies its blocks straight into the reserved blocks (one copy)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Sequence

from kv_transfer.base import (HeadSlice, PeerHandle, TransferError, TransferId, TransferState, block_runs,
                              check_heads, head_slices, pool_meta, read_peer_meta)
from services.engine.model.kv_cache import KVLayout, KVPoolMemory

log = logging.getLogger(__name__)


class ShmTransport:
    name: ClassVar[str] = "shm"
    device_memory: ClassVar[bool] = False       # a file in /dev/shm: host memory only

    def __init__(self) -> None:
        self._local: KVPoolMemory | None = None
        self._peers: dict[str, KVPoolMemory] = {}
        self._next_xfer = 0

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        self._local = pool
        return pool_meta(pool, self.name, compat_hash, path=str(pool.path) if pool.path else None)

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        meta = read_peer_meta(peer, self.name, compat_hash)
        if not meta.get("path"):
            raise TransferError("peer pool is not in shared memory")
        path = meta["path"]
        # Checked on every connect, cached or not: a restarted peer's successor removes
        # the old segment, so a stale handle cannot write into memory nobody reads.
        if not Path(path).exists():
            self.close(PeerHandle(path))
            raise TransferError(f"peer shared memory {path} is gone (the peer restarted or died)")
        # Other peers that stopped or died since: their segments are gone from /dev/shm,
        # but the pages stay the host's until the last mapping of them goes.
        for gone in [p for p in self._peers if p != path and not Path(p).exists()]:
            self.close(PeerHandle(gone))
        if path not in self._peers:
            self._peers[path] = KVPoolMemory.attach(Path(path), KVLayout(**meta["layout"]))
        return PeerHandle(peer_id=path)

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        if self._local is None:
            raise TransferError("register() a local pool before writing")
        target = self._peers.get(peer.peer_id)
        if target is None:
            raise TransferError(f"not connected to {peer.peer_id}")
        source = self._local.tensor
        check_heads(heads, source.shape[4], target.tensor.shape[4])
        hs, hd = head_slices(heads)
        layers = layers if layers is not None else range(self._local.layout.num_layers)
        for s, d, n in block_runs(src, dst):
            target.tensor[layers.start:layers.stop, :, d:d + n, :, hd].copy_(
                source[layers.start:layers.stop, :, s:s + n, :, hs])
        self._next_xfer += 1
        return self._next_xfer

    def poll(self, xfer: TransferId) -> TransferState:
        return TransferState.DONE       # copies complete inside write()

    def close(self, peer: PeerHandle) -> None:
        pool = self._peers.pop(peer.peer_id, None)
        if pool is not None:
            pool.close()

    def shutdown(self) -> None:
        for key in list(self._peers):
            self.close(PeerHandle(key))
