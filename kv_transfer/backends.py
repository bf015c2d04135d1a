"""KV-transfer backends by name: which exist, which a worker opens, and how a writer
pairs with a peer through the fastest one both sides have."""
from __future__ import annotations

import importlib
import logging
from typing import Sequence

from kv_transfer.base import IncompatiblePeer, KVTransport, PeerHandle, TransferError
from kv_transfer.fault import DroppingTransport

log = logging.getLogger(__name__)


# name -> "module:Class"; imported only when chosen.
BACKENDS: dict[str, str] = {
    "shm": "kv_transfer.shm:ShmTransport",
    "nixl": "kv_transfer.nixl:NixlTransport",
    "tcp": "kv_transfer.tcp:TcpTransport",
    "fake": "kv_transfer.fake:FakeTransport",
}


# Fastest first: same-host shared memory, then NIXL (RDMA/NVLink, UCX here), then TCP.
PREFERENCE: tuple[str, ...] = ("shm", "nixl", "tcp")


def transport_class(name: str) -> type:
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}; known: {', '.join(sorted(BACKENDS))}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def create_transport(name: str, **kwargs) -> KVTransport:
    return transport_class(name)(**kwargs)


def open_transports(choice: str, options: dict[str, dict] | None = None,
                    drop_rate: float = 0.0, device: str = "cpu") -> dict[str, KVTransport]:
    """The backends a worker offers or uses, in preference order, for a KV pool on
    `device`.

    `auto` opens every backend that works on this machine (one that cannot, e.g. NIXL
    without its library, is logged and skipped); a name opens exactly that one. A pool
    on a GPU is offered only through backends that address device memory (NIXL): `auto`
    leaves the host-only ones out, and naming one is refused with the reason.
    `drop_rate` wraps each in a fault injector (tests of failed transfers)."""
    names = PREFERENCE if choice == "auto" else (choice,)
    options = options or {}
    on_device = not device.startswith("cpu")
    out: dict[str, KVTransport] = {}
    for name in names:
        if on_device and not _device_capable(name):
            if choice != "auto":
                raise TransferError(f"KV transport {name!r} moves host memory only, and the KV pool is on "
                                    f"{device}: use --kv-transport nixl (or auto)")
            log.info("KV transport %s moves host memory only; not offered for a pool on %s", name, device)
            continue
        try:
            t = create_transport(name, **options.get(name, {}))
        except Exception as exc:              # a missing library or device
            if choice != "auto":
                raise TransferError(f"KV transport {name!r} is not available here: {exc}") from exc
            log.info("KV transport %s is not available here (%s); skipping it", name, exc)
            continue
        if drop_rate > 0:
            t = DroppingTransport(t, drop_rate)
        out[name] = t
    if not out:
        raise TransferError("no KV transport is available" + (f" for a KV pool on {device} (NIXL is needed: "
                                                              "pip install nixl)" if on_device else ""))
    return out


def _device_capable(name: str) -> bool:
    try:
        return bool(transport_class(name).device_memory)
    except ImportError:                 # its library is missing: opening it will say so
        return True


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
