"""The KV-transfer seam: one small interface, backends registered by name.

A decode worker `register`s its block memory and hands the returned metadata to
writers through pdserve's own control channel (the reservation handle). A prefill
worker `connect`s to that metadata, checking the compatibility hash, and `write`s
blocks of its own registered pool into the peer's reserved blocks, optionally one
layer at a time so transfer overlaps compute.
"""
from __future__ import annotations

import enum
import json
import logging
import time
from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

from services.engine.model.kv_cache import KVPoolMemory

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class TransferError(Exception):
    """A transfer could not be set up or did not complete."""


class IncompatiblePeer(TransferError):
    """The peer's KV layout or model differs: pairing is refused."""


class TransferTimeout(TransferError):
    """A transfer did not complete before its deadline (a dead or stuck peer)."""


@dataclass(frozen=True)
class PeerHandle:
    peer_id: str                        # stable for one peer epoch


TransferId = int


@dataclass(frozen=True)
class HeadSlice:
    """A write of some KV heads only: `count` heads from the source pool's head `src`
    into the destination pool's head `dst` (pools that split the model's heads
    differently: tensor-parallel workers of other degrees)."""
    src: int
    dst: int
    count: int


def pool_meta(pool: KVPoolMemory, backend: str, compat_hash: str, **fields) -> bytes:
    """A registered pool's metadata as every backend gives it: which backend, the
    compatibility hash, the pool's layout and the model's KV heads it holds."""
    return json.dumps({"backend": backend, "compat_hash": compat_hash, "layout": pool.layout.__dict__,
                       "heads": [pool.heads.start, pool.heads.stop], **fields}).encode()


def meta_heads(peer: bytes) -> range:
    """The model's KV heads a registered pool holds, from its metadata."""
    try:
        meta = json.loads(peer)
        if "heads" in meta:
            return range(*meta["heads"])
        return range(meta["layout"]["num_kv_heads"])
    except (ValueError, KeyError, TypeError):
        raise TransferError("unreadable peer metadata: no KV heads") from None


class KVTransport(Protocol):
    name: ClassVar[str]
    device_memory: ClassVar[bool]       # can register and move a pool that lives on a GPU

    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        """Make `pool` reachable; returns the metadata a peer needs to write into it."""

    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        """Pair with a peer from its metadata; raises IncompatiblePeer on mismatch."""

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        """Copy local blocks `src` into the peer's blocks `dst` (non-blocking); with
        `heads`, only those heads of each block. `deadline` (time.monotonic()): past
        it the peer's blocks may be someone else's, so a transport that queues writes
        (TCP) never begins one then, and the write FAILs; one that posts at once has
        begun it before returning."""

    def poll(self, xfer: TransferId) -> TransferState: ...

    def close(self, peer: PeerHandle) -> None: ...

    def shutdown(self) -> None: ...


def read_peer_meta(peer: bytes, backend: str, compat_hash: str) -> dict:
    """Decode a peer's registration metadata and check that pairing is allowed."""
    try:
        meta = json.loads(peer)
    except ValueError:
        raise TransferError(f"unreadable {backend} peer metadata") from None
    if meta.get("backend") != backend:
        raise TransferError(f"peer speaks {meta.get('backend')!r}, not {backend!r}")
    if meta.get("compat_hash") != compat_hash:
        raise IncompatiblePeer(
            f"peer KV layout {meta.get('compat_hash')} differs from ours {compat_hash}: refusing to pair")
    return meta


def head_slices(heads: HeadSlice | None) -> tuple[slice, slice]:
    """The source's and the destination's head dimension slices of a write (all heads
    without a head slice)."""
    if heads is None:
        return slice(None), slice(None)
    return slice(heads.src, heads.src + heads.count), slice(heads.dst, heads.dst + heads.count)


def check_heads(heads: HeadSlice | None, local: int, remote: int) -> None:
    """A head slice must lie inside both pools (TransferError otherwise); without one,
    both pools must hold the same number of heads."""
    if heads is None:
        if local != remote:
            raise TransferError(f"whole blocks of {local} KV heads into blocks of {remote}: give a head slice")
        return
    if heads.count < 1 or heads.src < 0 or heads.dst < 0 or heads.src + heads.count > local \
            or heads.dst + heads.count > remote:
        raise TransferError(f"heads {heads} lie outside pools of {local} and {remote} heads")


def head_writes(ours: Sequence[range], theirs: Sequence[range]) -> list[tuple[int, int, HeadSlice | None]]:
    """Who writes which KV heads where, between a writer whose ranks hold `ours` (the
    model's heads, by rank) and a receiver whose ranks hold `theirs`: (writer rank,
    receiver rank, heads; None for whole blocks), each receiver head written once, by
    the first writer rank that holds it (heads replicated over ranks are written once
    into each receiver rank that holds them). vLLM's NIXL connector calls the ratio of
    the degrees `tp_ratio`."""
    out: list[tuple[int, int, HeadSlice | None]] = []
    for d, held in enumerate(theirs):
        runs: list[list[int]] = []            # [writer rank, first head, count]
        for h in held:
            p = next((i for i, r in enumerate(ours) if h in r), None)
            if p is None:
                raise IncompatiblePeer(f"no rank of this worker holds KV head {h} (it holds {list(ours)})")
            if runs and runs[-1][0] == p and runs[-1][1] + runs[-1][2] == h:
                runs[-1][2] += 1
            else:
                runs.append([p, h, 1])
        for p, h, n in runs:
            whole = n == len(ours[p]) == len(held)
            out.append((p, d, None if whole else HeadSlice(h - ours[p].start, h - held.start, n)))
    return out


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


def wait_all(xfers: Sequence[tuple[KVTransport, TransferId]], deadline: float) -> None:
    """`wait_for` over transfers posted through several transports: (transport, id) pairs."""
    by_transport: dict[int, tuple[KVTransport, list[TransferId]]] = {}
    for transport, xfer in xfers:
        by_transport.setdefault(id(transport), (transport, []))[1].append(xfer)
    for transport, ids in by_transport.values():
        wait_for(transport, ids, deadline)


def wait_for(transport: KVTransport, xfers: Sequence[TransferId], deadline: float,
             first_sleep: float = 0.0001, max_sleep: float = 0.005) -> None:
    """Wait until all `xfers` are DONE: woken by the transport when it can say when a
    transfer ends (`changes`/`wait_change`), else polled with exponential back-off.

    Raises TransferError on a FAILED transfer and TransferTimeout once
    `time.monotonic()` passes `deadline`: no transfer is ever waited on forever."""
    pending = list(xfers)
    sleep = first_sleep
    watch = getattr(transport, "wait_change", None)
    while pending:
        seen = transport.changes() if watch else 0
        still = []
        for x in pending:
            state = transport.poll(x)
            if state is TransferState.DONE:
                continue
            if state is not TransferState.PENDING:
                raise TransferError(f"transfer {x} ended {state.value}")
            still.append(x)
        pending = still
        if not pending:
            return
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"{len(pending)} transfer(s) still pending at the deadline")
        if watch:
            watch(seen, min(max_sleep, max(0.0, deadline - time.monotonic())))
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, max_sleep)
