"""The KV-transfer seam: one small interface, backends registered by name.

A decode worker `register`s its block memory and hands the returned metadata to
writers through pdserve's own control channel (the reservation handle). A prefill
worker `connect`s to that metadata, checking the compatibility hash, and `write`s
blocks of its own registered pool into the peer's reserved blocks, optionally one
layer at a time so transfer overlaps compute.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

from kv_transfer.memory import KVPoolMemory


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


class TransferError(Exception):
    """A transfer could not be set up or did not complete."""


class IncompatiblePeer(TransferError):
    """The peer's KV layout or model differs: pairing is refused."""


@dataclass(frozen=True)
class PeerHandle:
    peer_id: str                        # stable for one peer epoch


TransferId = int


class KVTransport(Protocol):
    name: ClassVar[str]

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        """Make `pool` reachable; returns the metadata a peer needs to write into it."""

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        """Pair with a peer from its metadata; raises IncompatiblePeer on mismatch."""

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None) -> TransferId:
        """Copy local blocks `src` into the peer's blocks `dst` (non-blocking)."""

    def poll(self, xfer: TransferId) -> TransferState: ...

    def close(self, peer: PeerHandle) -> None: ...

    def shutdown(self) -> None: ...


# name -> "module:Class"; imported only when chosen.
BACKENDS: dict[str, str] = {
    "shm": "kv_transfer.shm:ShmTransport",
    "fake": "kv_transfer.fake:FakeTransport",
}


def create_transport(name: str, **kwargs) -> KVTransport:
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def block_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge block pairs into (src_start, dst_start, length) runs of consecutive ids,
    so a transfer copies a few large slices instead of many small blocks."""
    if len(src) != len(dst):
        raise TransferError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
