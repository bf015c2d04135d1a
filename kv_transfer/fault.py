"""Fault injection for tests of failed transfers: wraps a real backend and makes a
seeded fraction of writes fail midway, exactly as a dropped link looks to the writer.

A write is known by its peer and destination blocks: the layer-by-layer writes of one
request's chunk share them. Its fate is drawn when its first layer is written; a doomed
one's writes from the middle layer on go through but poll as FAILED, so half its
layers landed, as when a link drops mid-transfer."""
from __future__ import annotations

import random
from typing import Sequence

from kv_transfer.base import HeadSlice, KVTransport, PeerHandle, TransferId, TransferState
from services.engine.model.kv_cache import KVPoolMemory


class DroppingTransport:
    def __init__(self, inner: KVTransport, rate: float, seed: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.rate = rate
        self._rng = random.Random(seed)
        self._doomed: dict[tuple[str, tuple[int, ...]], bool] = {}
        self._dropped: set[TransferId] = set()
        self._num_layers = 0

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        self._num_layers = pool.layout.num_layers
        return self.inner.register(pool, compat_hash)

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        return self.inner.connect(peer, compat_hash)

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        start = layers.start if layers is not None else 0
        stop = layers.stop if layers is not None else self._num_layers
        key = (peer.peer_id, tuple(dst), heads)
        if start == 0 or key not in self._doomed:
            self._doomed[key] = self._rng.random() < self.rate
        xfer = self.inner.write(peer, src, dst, layers, heads, deadline)
        if self._doomed[key] and stop > self._num_layers // 2:
            self._dropped.add(xfer)
        if stop >= self._num_layers:                  # the write's last layer: forget it
            self._doomed.pop(key, None)
        return xfer

    def poll(self, xfer: TransferId) -> TransferState:
        state = self.inner.poll(xfer)
        if xfer in self._dropped and state is not TransferState.PENDING:
            self._dropped.discard(xfer)
            return TransferState.FAILED
        return state

    def close(self, peer: PeerHandle) -> None:
        self.inner.close(peer)

    def shutdown(self) -> None:
        self.inner.shutdown()
