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
import json
import logging
import time
from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

from kv_transfer.memory import KVPoolMemory

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


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


# name -> "module:Class"; imported only when chosen.
BACKENDS: dict[str, str] = {
    "shm": "kv_transfer.shm:ShmTransport",
    "nixl": "kv_transfer.nixl:NixlTransport",
    "tcp": "kv_transfer.tcp:TcpTransport",
    "fake": "kv_transfer.fake:FakeTransport",
}


# Fastest first: same-host shared memory, then NIXL (RDMA/NVLink, UCX here), then TCP.
PREFERENCE: tuple[str, ...] = ("shm", "nixl", "tcp")


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


def wait_for(transport: KVTransport, xfers: Sequence[TransferId], deadline: float,
             first_sleep: float = 0.0001, max_sleep: float = 0.005) -> None:
    """Wait until all `xfers` are DONE: woken by the transport when it can say when a
    transfer ends (`changes`/`wait_change`), else polled with exponential back-off.

    Raises TransferError on a FAILED/EXPIRED transfer and TransferTimeout once
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


def open_transports(choice: str, options: dict[str, dict] | None = None,
                    drop_rate: float = 0.0) -> dict[str, KVTransport]:
    """The backends a worker offers or uses, in preference order.

    `auto` opens every backend that works on this machine (one that cannot, e.g. NIXL
    without its library, is logged and skipped); a name opens exactly that one.
    `drop_rate` wraps each in a fault injector (tests of failed transfers)."""
    names = PREFERENCE if choice == "auto" else (choice,)
    options = options or {}
    out: dict[str, KVTransport] = {}
    for name in names:
        try:
            t = create_transport(name, **options.get(name, {}))
        except Exception as exc:              # a missing library or device
            if choice != "auto":
                raise TransferError(f"KV transport {name!r} is not available here: {exc}") from exc
            log.info("KV transport %s is not available here (%s); skipping it", name, exc)
            continue
        if drop_rate > 0:
            from kv_transfer.fault import DroppingTransport
            t = DroppingTransport(t, drop_rate)
        out[name] = t
    if not out:
        raise TransferError("no KV transport is available")
    return out


def pair(offers: Sequence[tuple[str, bytes]], transports: dict[str, KVTransport], compat_hash: str,
         on_fallback=None) -> tuple[KVTransport, PeerHandle, bool]:
    """Connect through the fastest backend both sides have (PREFERENCE order).

    A backend that cannot pair (e.g. shared memory across hosts) is logged, reported
    through `on_fallback(failed, next_or_None)`, and the next one is tried; a layout
    mismatch refuses at once. Returns (transport, peer, whether a fallback happened)."""
    usable = sorted(((b, m) for b, m in offers if b in transports), key=lambda o: PREFERENCE.index(o[0]))
    if not usable:
        raise IncompatiblePeer(f"no common KV transport: the peer offers {[b for b, _ in offers]}, "
                               f"this worker has {list(transports)}")
    for i, (backend, meta) in enumerate(usable):
        try:
            return transports[backend], transports[backend].connect(meta, compat_hash), i > 0
        except IncompatiblePeer:
            raise
        except TransferError as exc:
            nxt = usable[i + 1][0] if i + 1 < len(usable) else None
            log.warning("KV transport %s cannot pair (%s); %s", backend, exc,
                        f"falling back to {nxt}" if nxt else "no other transport left")
            if on_fallback is not None:
                on_fallback(backend, nxt)
    raise TransferError("no KV transport could pair with the peer")
