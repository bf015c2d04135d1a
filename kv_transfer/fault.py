"""Fault injection for tests of failed transfers: wraps a real backend and makes a
seeded fraction of requests' transfers fail midway (after half of their writes went
through), exactly as a dropped link would look to the writer."""
from __future__ import annotations

import random
from typing import Sequence

from kv_transfer.base import KVTransport, PeerHandle, TransferId, TransferState
from kv_transfer.memory import KVPoolMemory


class DroppingTransport:
    def __init__(self, inner: KVTransport, rate: float, seed: int = 0) -> None:
        self.inner = inner
        self.name = inner.name
        self.rate = rate
        self._rng = random.Random(seed)
        self._dropped: set[TransferId] = set()
        self._drop_layers_from: int | None = None

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        self._num_layers = pool.layout.num_layers
        return self.inner.register(pool, compat_hash)

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        return self.inner.connect(peer, compat_hash)

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None) -> TransferId:
        start = layers.start if layers is not None else 0
        if start == 0:                        # a new request begins: decide its fate
            self._drop_layers_from = self._num_layers // 2 if self._rng.random() < self.rate else None
        xfer = self.inner.write(peer, src, dst, layers)
        if self._drop_layers_from is not None and start >= self._drop_layers_from:
            self._dropped.add(xfer)
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
