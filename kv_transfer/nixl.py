"""KV transfer through NIXL: one-sided WRITEs into the decode worker's pool (UCX here;
RDMA or NVLink where the hardware has them).

Both sides register their pool tensor with their own NIXL agent. The decode worker's
`register` returns its agent metadata (connection info and memory keys) as bytes, which
pdserve carries to writers in the reservation handle: NIXL's own listener is never used.
A writer loads that metadata once per peer agent and turns each `write` into one NIXL
WRITE whose descriptors are the merged block runs (`block_runs`) of each layer, K and V.

The agent runs without NIXL's progress thread (it busy-spins, which halves throughput on
a small host): a writer's `poll` drives its own transfers. UCX still needs the receiving
agent to answer a new writer's connection handshake, so a light thread progresses the
agent every `progress_interval` seconds; one lock serializes every call into the agent.
Between processes on one host UCX copies with CMA inside the post, so `write` returns
once the bytes are across (the GIL is released meanwhile). A dead peer fails its
transfers (`poll` returns FAILED); a stuck one leaves them PENDING until the caller's
deadline (`wait_for`), and `close` then cancels them.
"""
from __future__ import annotations

import atexit
import base64
import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np
import nixl._bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_agent_config, nixl_xfer_handle

from kv_transfer.base import (HeadSlice, PeerHandle, TransferError, TransferId, TransferState, block_runs,
                              check_heads, pool_meta, read_peer_meta)
from services.engine.model.kv_cache import KVLayout, KVPoolMemory

log = logging.getLogger(__name__)

# NIXL raises its own exception types, which share no base class beyond Exception.
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    v for k, v in vars(nixl_bindings).items() if k.startswith("nixl") and k.endswith("Error") and isinstance(v, type))
MAX_FINISHED = 4096                     # outcomes kept for transfers nobody polled (bounded)


@dataclass(frozen=True)
class _Region:
    """A registered pool as the writer addresses it."""
    base: int
    layout: KVLayout
    mem_type: str                       # "DRAM" or "VRAM"
    device: int

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V): the stride between blocks."""
        return self.layout.block_bytes_per_layer // 2

    def addresses(self, layers: Sequence[int], starts: np.ndarray) -> np.ndarray:
        """Start address of each run for each (layer, K/V), in that nesting order."""
        lkv = (np.asarray(layers, dtype=np.uint64)[:, None] * 2 + np.arange(2, dtype=np.uint64)).reshape(-1)
        blocks = lkv[:, None] * np.uint64(self.layout.num_blocks) + starts[None, :]
        return (np.uint64(self.base) + blocks * np.uint64(self.block_bytes)).reshape(-1)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token's K (or V), every head: the stride between slots."""
        return self.block_bytes // self.layout.block_size

    def head_addresses(self, layers: Sequence[int], blocks: np.ndarray, head: int) -> np.ndarray:
        """Where head `head` starts in each slot of each of `blocks`, for each (layer,
        K/V): a head slice of a block is one piece per slot ([slot, head, dim] layout)."""
        lkv = (np.asarray(layers, dtype=np.uint64)[:, None] * 2 + np.arange(2, dtype=np.uint64)).reshape(-1)
        bs = np.uint64(self.layout.block_size)
        slots = ((lkv[:, None] * np.uint64(self.layout.num_blocks) + blocks[None, :])[..., None] * bs
                 + np.arange(self.layout.block_size, dtype=np.uint64))
        head_bytes = self.slot_bytes // self.layout.num_kv_heads
        return (np.uint64(self.base) + slots * np.uint64(self.slot_bytes) + np.uint64(head * head_bytes)).reshape(-1)


def interfaces_of(host: str) -> list[str]:
    """The network interfaces that own `host`'s address ([] for a wildcard or an address
    no interface has)."""
    import ipaddress
    import socket

    import psutil
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return []
    if address.is_unspecified:
        return []
    return sorted(name for name, addrs in psutil.net_if_addrs().items()
                  if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == str(address)
                         for a in addrs))


def confine_ucx(host: str | None) -> None:
    """UCX listens on every interface it finds unless told otherwise: a worker given
    --host 127.0.0.1 would still accept KV connections on its external address. Confine
    UCX's network devices to the interfaces owning `host` (nothing for a wildcard), unless
    the operator set UCX_NET_DEVICES (RDMA devices, say). UCX reads it when the agent is
    created, so this runs first; shared-memory transports are not network devices and
    stay available."""
    if not host or "UCX_NET_DEVICES" in os.environ:
        return
    names = interfaces_of(host)
    if names:
        os.environ["UCX_NET_DEVICES"] = ",".join(names)
        log.info("UCX confined to %s (the interface of %s)", ",".join(names), host)


@dataclass(frozen=True)
class _Peer:
    agent: str
    digest: str                         # of its metadata: a re-registered pool reloads
    region: _Region


def _region(pool: KVPoolMemory) -> _Region:
    t = pool.tensor
    return _Region(base=t.data_ptr(), layout=pool.layout, mem_type="DRAM" if t.device.type == "cpu" else "VRAM",
                   device=max(t.get_device(), 0))


class NixlTransport:
    name: ClassVar[str] = "nixl"
    device_memory: ClassVar[bool] = True       # registers VRAM with NIXL

    def __init__(self, progress_interval: float = 0.01, backends: Sequence[str] = ("UCX",),
                 host: str | None = None) -> None:
        confine_ucx(host)
        self._agent_name = f"pdserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No progress thread (busy-spins), no listener (metadata goes over pdserve's channel).
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=list(backends))
        self._agent: nixl_agent | None = nixl_agent(self._agent_name, config)
        if not self._agent.backends:
            raise TransferError(f"NIXL has none of the backends {list(backends)} (plugins: "
                                f"{self._agent.get_plugin_list()})")
        self._lock = threading.Lock()
        self._local: KVPoolMemory | None = None
        self._region: _Region | None = None
        self._registered = None         # nixlRegDList of the local pool
        self._peers: dict[str, _Peer] = {}
        self._inflight: dict[int, tuple[nixl_xfer_handle, str]] = {}
        self._finished: dict[int, TransferState] = {}
        self._next_xfer = 0
        self._progress_interval = progress_interval
        self._stop = threading.Event()
        self._progress: threading.Thread | None = None

    def _open_agent(self) -> nixl_agent:
        if self._agent is None:
            raise TransferError("NIXL transport is shut down")
        return self._agent

    # ---- receiving side (and the writer's own source pool) ----
    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        if not pool.tensor.is_contiguous():
            raise TransferError("NIXL needs a contiguous pool tensor")
        with self._lock:
            agent = self._open_agent()
            if self._local is not pool:
                if self._registered is not None:
                    agent.deregister_memory(self._registered)
                    self._registered = None
                try:
                    self._registered = agent.register_memory(pool.tensor)
                except NIXL_ERRORS as exc:
                    raise TransferError(f"NIXL could not register the KV pool: {exc}") from None
                self._local, self._region = pool, _region(pool)
            agent_md = agent.get_agent_metadata()
            r = self._region
            self._start_progress()
        return pool_meta(pool, self.name, compat_hash, agent=self._agent_name,
                         agent_md=base64.b64encode(agent_md).decode(), base=r.base, mem_type=r.mem_type,
                         device=r.device)

    def _start_progress(self) -> None:
        """Writers' connection handshakes need this agent to make progress now and then
        (caller holds the lock)."""
        if self._progress is None and self._progress_interval > 0:
            self._progress = threading.Thread(target=self._progress_loop, name="kv-nixl-progress", daemon=True)
            self._progress.start()
            # A daemon thread caught inside a NIXL call at interpreter exit aborts the process
            # (std::terminate): stop it first if the owner never calls shutdown().
            atexit.register(self._halt_progress)

    def _halt_progress(self) -> None:
        self._stop.set()
        if self._progress is not None and self._progress is not threading.current_thread():
            self._progress.join(timeout=5)

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            time.sleep(self._progress_interval)         # cheaper than a timed Event.wait
            with self._lock:
                if self._agent is None:
                    return
                try:
                    self._agent.get_new_notifs()        # progresses the UCX worker
                except NIXL_ERRORS as exc:
                    log.debug("NIXL progress failed: %s", exc)

    # ---- writing side ----
    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        meta = read_peer_meta(peer, self.name, compat_hash)
        agent_md = base64.b64decode(meta["agent_md"])
        name = meta["agent"]
        digest = hashlib.sha256(agent_md).hexdigest()
        with self._lock:
            agent = self._open_agent()
            known = self._peers.get(name)
            if known is not None and known.digest == digest:
                return PeerHandle(name)                 # already loaded: connecting again is free
            if known is not None:                       # same agent, new pool: reload its keys
                self._drop_peer(name)
            try:
                loaded = agent.add_remote_agent(agent_md)   # also opens the UCX endpoint
            except NIXL_ERRORS as exc:
                raise TransferError(f"cannot reach NIXL peer {name} (gone?): {exc}") from None
            loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
            if loaded != name:
                agent.remove_remote_agent(loaded)
                raise TransferError(f"peer metadata names agent {name!r} but describes {loaded!r}")
            region = _Region(base=meta["base"], layout=KVLayout(**meta["layout"]), mem_type=meta["mem_type"],
                             device=meta["device"])
            self._peers[name] = _Peer(name, digest, region)
        return PeerHandle(name)

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        with self._lock:
            agent = self._open_agent()
            if self._region is None:
                raise TransferError("register() a local pool before writing")
            p = self._peers.get(peer.peer_id)
            if p is None:
                raise TransferError(f"not connected to {peer.peer_id}")
            local, remote = self._region, p.region
            check_heads(heads, local.layout.num_kv_heads, remote.layout.num_kv_heads)
            if local.block_bytes // local.layout.num_kv_heads != remote.block_bytes // remote.layout.num_kv_heads:
                raise TransferError(f"peer blocks are {remote.block_bytes} bytes, ours {local.block_bytes}")
            layers = layers if layers is not None else range(local.layout.num_layers)
            runs = np.asarray(block_runs(src, dst), dtype=np.int64).reshape(-1, 3)
            self._check_bounds(runs, layers, local.layout, remote.layout)
            self._next_xfer += 1
            xfer = self._next_xfer
            if len(runs) == 0 or len(layers) == 0:
                self._finish(xfer, TransferState.DONE)
                return xfer
            src_addrs, dst_addrs, lengths = self._pieces(local, remote, runs, layers, heads)
            handle = None
            try:
                handle = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(self._dlist(src_addrs, lengths, local.device), local.mem_type),
                    agent.get_xfer_descs(self._dlist(dst_addrs, lengths, remote.device), remote.mem_type), p.agent)
                status = agent.transfer(handle)
            except NIXL_ERRORS as exc:
                # Typically the peer is gone: the caller sees a FAILED transfer, like a dropped link.
                log.warning("NIXL write to %s failed: %s", p.agent, exc)
                status = "ERR"
            if status == "PROC":
                self._inflight[xfer] = (handle, p.agent)
            else:                       # UCX often completes the copy inside the post (CMA)
                if handle is not None:
                    self._release(handle)
                self._finish(xfer, TransferState.DONE if status == "DONE" else TransferState.FAILED)
            return xfer

    @staticmethod
    def _pieces(local: _Region, remote: _Region, runs: np.ndarray, layers: range,
                heads: HeadSlice | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Source addresses, destination addresses and lengths, in (layer, K/V, run)
        order on both sides: whole runs of blocks, or with `heads` one piece per slot
        of each block."""
        if heads is None:
            lengths = np.tile(runs[:, 2].astype(np.uint64) * np.uint64(local.block_bytes), 2 * len(layers))
            return (local.addresses(layers, runs[:, 0].astype(np.uint64)),
                    remote.addresses(layers, runs[:, 1].astype(np.uint64)), lengths)
        src = np.concatenate([np.arange(s, s + n, dtype=np.uint64) for s, _, n in runs])
        dst = np.concatenate([np.arange(d, d + n, dtype=np.uint64) for _, d, n in runs])
        src_addrs = local.head_addresses(layers, src, heads.src)
        piece = np.uint64(heads.count * (local.slot_bytes // local.layout.num_kv_heads))
        return src_addrs, remote.head_addresses(layers, dst, heads.dst), np.full_like(src_addrs, piece)

    @staticmethod
    def _check_bounds(runs: np.ndarray, layers: range, local: KVLayout, remote: KVLayout) -> None:
        """Out-of-range ids would address memory outside the pools: refuse them here."""
        if len(layers) and (min(layers) < 0 or max(layers) >= min(local.num_layers, remote.num_layers)):
            raise TransferError(f"layers {layers} out of range")
        if len(runs):
            if runs[:, :2].min() < 0:
                raise TransferError("negative block id")
            if (runs[:, 0] + runs[:, 2]).max() > local.num_blocks:
                raise TransferError(f"source block out of range (pool has {local.num_blocks})")
            if (runs[:, 1] + runs[:, 2]).max() > remote.num_blocks:
                raise TransferError(f"destination block out of range (peer pool has {remote.num_blocks})")

    @staticmethod
    def _dlist(addrs: np.ndarray, lengths: np.ndarray, device: int) -> np.ndarray:
        """NIXL's Nx3 descriptor array: (address, length, device id)."""
        return np.stack([addrs, lengths, np.full_like(addrs, device)], axis=1)

    def poll(self, xfer: TransferId) -> TransferState:
        with self._lock:
            state = self._finished.pop(xfer, None)
            if state is not None:
                return state
            entry = self._inflight.get(xfer)
            if entry is None or self._agent is None:
                return TransferState.FAILED
            handle, peer = entry
            try:
                status = self._agent.check_xfer_state(handle)   # also drives the transfer
            except NIXL_ERRORS as exc:
                log.warning("NIXL transfer %d to %s failed: %s", xfer, peer, exc)
                status = "ERR"
            if status == "PROC":
                return TransferState.PENDING
            del self._inflight[xfer]
            self._release(handle)
            return TransferState.DONE if status == "DONE" else TransferState.FAILED

    def _finish(self, xfer: int, state: TransferState) -> None:
        self._finished[xfer] = state
        while len(self._finished) > MAX_FINISHED:
            del self._finished[next(iter(self._finished))]

    @staticmethod
    def _release(handle: nixl_xfer_handle) -> None:
        try:
            handle.release()                            # cancels it if still in flight
        except NIXL_ERRORS as exc:
            # NIXL keeps the handle and retries when the agent is destroyed.
            log.warning("NIXL could not release a transfer handle: %s", exc)

    def _drop_peer(self, name: str) -> None:
        """Cancel what is in flight to `name` and forget it (caller holds the lock)."""
        for xfer, (handle, peer) in list(self._inflight.items()):
            if peer == name:
                del self._inflight[xfer]
                self._release(handle)
                self._finish(xfer, TransferState.FAILED)
        if self._peers.pop(name, None) is not None and self._agent is not None:
            try:
                self._agent.remove_remote_agent(name)
            except NIXL_ERRORS as exc:
                log.debug("NIXL could not remove peer %s: %s", name, exc)

    def close(self, peer: PeerHandle) -> None:
        with self._lock:
            self._drop_peer(peer.peer_id)

    def shutdown(self) -> None:
        self._halt_progress()
        atexit.unregister(self._halt_progress)
        with self._lock:
            if self._agent is None:
                return
            for name in list(self._peers):
                self._drop_peer(name)
            for handle, _ in self._inflight.values():
                self._release(handle)
            self._inflight.clear()
            if self._registered is not None:
                try:
                    self._agent.deregister_memory(self._registered)
                except NIXL_ERRORS as exc:
                    log.debug("NIXL could not deregister the KV pool: %s", exc)
            self._registered = self._local = self._region = None
            self._agent = None                          # destroys the agent and its UCX worker
