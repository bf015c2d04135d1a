"""KV transfer over plain TCP, for hosts without NIXL.

The receiving side (decode worker) listens; each writer connection is served by one
thread that reads frames straight into the pool tensor (no staging copy) and
acknowledges each frame once its bytes are in memory. The writing side keeps a few
connections ("streams") per peer, each with a sender thread (so `write` returns at once
and the transfer overlaps the next layer's compute) and an ack reader thread. A frame
goes out in one `sendmsg` of all its pieces and is scattered straight into the blocks
by `recvmsg_into`. Writers wait on a condition the ack reader signals, not on a
polling loop.

Frame: header (magic, xfer id, first layer, layer count, run count, first head, head
count), then the runs (dst start block, block count), then for each layer, K then V,
each run's bytes. A head count of 0 means whole blocks; otherwise the frame carries
those heads of each block only (pools split by tensor parallelism), staged on both
ends because a head slice of a block is not contiguous.
A dead or stuck peer fails the transfer after `io_timeout` seconds; nothing waits forever.
"""
from __future__ import annotations

import logging
import queue
import secrets
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

import torch

from kv_transfer.base import (HeadSlice, PeerHandle, TransferError, TransferId, TransferState, block_runs,
                              check_heads, head_slices, meta_heads, pool_meta, read_peer_meta)
from services.engine.model.kv_cache import KVPoolMemory

log = logging.getLogger(__name__)

MAGIC = 0x4B565450                       # "KVTP"
HEADER = struct.Struct("!IQHHIHH")       # magic, xfer id, first layer, layer count, run count, head, heads
RUN = struct.Struct("!II")               # dst start block, block count
ACK = struct.Struct("!QB")               # xfer id, ok
HELLO = struct.Struct("!I32s")           # magic, shared token
_IOV_MAX = 512                           # buffers per sendmsg/recvmsg call (Linux allows 1024)
ACCEPT_RETRY_SECONDS = 0.1               # after a failed accept (out of descriptors): its next try
MAX_FINISHED = 4096                      # outcomes kept for transfers nobody polled (bounded, as NIXL's)
# A connection that has not sent its hello (the pool's token) within HELLO_SECONDS is
# closed, and no more than MAX_UNPROVEN wait at once: each holds a thread, and anyone who
# reaches the port could open them by the thousand.
HELLO_SECONDS = 5.0
MAX_UNPROVEN = 64


def _bytes_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor slice, without copying."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def _consume(views: list[memoryview], n: int) -> None:
    """Drop the first `n` bytes of `views`, in place."""
    while views and n >= views[0].nbytes:
        n -= views.pop(0).nbytes
    if n:
        views[0] = views[0][n:]


def _send_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Send `views` back to back with as few system calls as the kernel allows."""
    views = [v for v in views if v.nbytes]
    while views:
        _consume(views, sock.sendmsg(views[:_IOV_MAX]))


def _recv_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill `views` in order from the stream, scattering each read across them."""
    views = [v for v in views if v.nbytes]
    while views:
        got = sock.recvmsg_into(views[:_IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        _consume(views, got)


def _tune(sock: socket.socket, send_timeout: float | None = None) -> None:
    """Blocking socket; sends (not receives) time out, so an idle link is fine but a
    peer that stops reading fails the transfer. Buffer sizes are left to the kernel's
    autotuning: a fixed SO_SNDBUF/SO_RCVBUF turns it off and was slower here."""
    sock.settimeout(None)
    if send_timeout:
        sec = int(send_timeout)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", sec, int((send_timeout - sec) * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


@dataclass
class _Stream:
    sock: socket.socket
    jobs: "queue.SimpleQueue[tuple | None]" = field(default_factory=queue.SimpleQueue)


@dataclass
class _Peer:
    streams: list[_Stream]
    pending: dict[int, int] = field(default_factory=dict)      # xfer -> frames not yet acked
    dead: str | None = None
    turn: int = 0                                               # round robin over streams
    num_heads: int = 0                                          # KV heads in the peer's pool


class TcpTransport:
    name: ClassVar[str] = "tcp"
    device_memory: ClassVar[bool] = False       # reads and writes through host memory views

    def __init__(self, host: str = "127.0.0.1", advertise: str | None = None, io_timeout: float = 10.0,
                 streams: int = 2) -> None:
        if streams < 1:
            raise ValueError("streams must be at least 1")
        self.host = host
        self.streams = streams
        self.advertise = advertise or host
        self.io_timeout = io_timeout
        self._local: KVPoolMemory | None = None
        self._token = secrets.token_bytes(32)
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._peers: dict[str, _Peer] = {}
        self._states: dict[int, TransferState] = {}
        self._finished: deque[int] = deque()  # transfers in `_states` that have ended, oldest first
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._version = 0                   # bumped whenever a transfer leaves PENDING
        self._next = 0
        self._closed = False
        self._unproven = 0                  # accepted connections yet to send their hello

    # ---- receiving side ----
    def register(self, pool: KVPoolMemory, compat_hash: str) -> bytes:
        self._local = pool
        if self._listener is None:
            self._listener = socket.create_server((self.host, 0), backlog=64)
            threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()
        port = self._listener.getsockname()[1]
        return pool_meta(pool, self.name, compat_hash, host=self.advertise, port=port, token=self._token.hex())

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed or self._listener.fileno() < 0:
                    return
                # Out of descriptors or buffers for now: writers wait in the backlog
                # meanwhile, and this thread is the only one that takes them.
                log.warning("KV receiver cannot accept a writer (%s); trying again", exc)
                time.sleep(ACCEPT_RETRY_SECONDS)
                continue
            _tune(conn)
            with self._lock:
                strangers = self._unproven
                self._unproven += strangers < MAX_UNPROVEN
            if strangers >= MAX_UNPROVEN:           # connections that have not said who they are
                conn.close()
                continue
            self._conns.add(conn)
            try:
                threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-recv", daemon=True).start()
            except RuntimeError as exc:             # no thread to be had now: this writer retries
                log.warning("KV receiver cannot serve a writer (%s)", exc)
                self._proven(None)
                self._conns.discard(conn)
                conn.close()

    def _proven(self, conn: socket.socket | None) -> None:
        """A connection has said who it is (or gone): one less waited on to."""
        with self._lock:
            self._unproven -= 1
        if conn is not None:
            conn.settimeout(None)

    def _serve(self, conn: socket.socket) -> None:
        proven = False
        try:
            hello = bytearray(HELLO.size)
            conn.settimeout(HELLO_SECONDS)          # a writer says who it is at once, or is let go
            _recv_all(conn, [memoryview(hello)])
            magic, token = HELLO.unpack(hello)
            if magic != MAGIC or not secrets.compare_digest(token, self._token):
                raise ConnectionError("bad hello from a KV writer")
            proven = True
            self._proven(conn)
            header = bytearray(HEADER.size)
            while True:
                _recv_all(conn, [memoryview(header)])
                magic, xfer, first, count, nruns, head, nheads = HEADER.unpack(header)
                if magic != MAGIC:
                    raise ConnectionError("bad frame magic")
                if nruns > self._local.tensor.shape[2]:        # more runs than blocks: no writer sends that
                    raise ConnectionError(f"a frame of {nruns} runs, more than the pool's blocks")
                raw = bytearray(RUN.size * nruns)
                _recv_all(conn, [memoryview(raw)])
                runs = [RUN.unpack_from(raw, i * RUN.size) for i in range(nruns)]
                ok = self._receive(conn, first, count, runs, head, nheads)
                conn.sendall(ACK.pack(xfer, 1 if ok else 0))
        except (ConnectionError, OSError) as exc:
            if not self._closed:
                log.debug("KV writer connection ended: %s", exc)
        finally:
            if not proven:
                self._proven(None)
            self._conns.discard(conn)
            conn.close()

    def _receive(self, conn: socket.socket, first: int, count: int, runs: list[tuple[int, int]], head: int = 0,
                 nheads: int = 0) -> bool:
        t = self._local.tensor
        nblocks = t.shape[2]
        valid = (first + count <= t.shape[0] and all(n > 0 and d + n <= nblocks for d, n in runs)
                 and head + nheads <= t.shape[4])
        block = t[0, 0, 0].numel() if not nheads else t[0, 0, 0, :, :nheads].numel()
        if not valid:                            # read and drop: the frame is out of bounds
            left = 2 * count * sum(n for _, n in runs) * block * t.element_size()
            sink = memoryview(bytearray(min(left, 1 << 20)))
            while left:
                chunk = min(left, len(sink))
                _recv_all(conn, [sink[:chunk]])
                left -= chunk
            return False
        if nheads:                               # into a staging copy, then into the heads' places
            parts = [(t[layer, kv, d:d + n, :, head:head + nheads],
                      torch.empty((n, t.shape[3], nheads, t.shape[5]), dtype=t.dtype))
                     for layer in range(first, first + count) for kv in (0, 1) for d, n in runs]
            _recv_all(conn, [_bytes_view(staged) for _, staged in parts])
            for place, staged in parts:
                place.copy_(staged)
            return True
        _recv_all(conn, [_bytes_view(t[layer, kv, d:d + n])
                         for layer in range(first, first + count) for kv in (0, 1) for d, n in runs])
        return True

    # ---- writing side ----
    def connect(self, peer: bytes, compat_hash: str) -> PeerHandle:
        meta = read_peer_meta(peer, self.name, compat_hash)
        key = f"{meta['host']}:{meta['port']}:{meta['token'][:8]}"
        with self._lock:
            p = self._peers.pop(key, None)
            if p is not None and p.dead is None:
                self._peers[key] = p
                return PeerHandle(key)
            # Dead links to other peers (a decode worker that restarted has a new token,
            # so nothing would reconnect under their keys): their sockets go now.
            dead = [self._peers.pop(k) for k, other in list(self._peers.items()) if other.dead]
        for link in dead + ([p] if p is not None else []):     # their threads have ended or will
            self._close_socks(link)
        socks = []
        try:
            for _ in range(self.streams):
                sock = socket.create_connection((meta["host"], meta["port"]), timeout=self.io_timeout)
                socks.append(sock)
                _tune(sock, send_timeout=self.io_timeout)
                sock.sendall(HELLO.pack(MAGIC, bytes.fromhex(meta["token"])))
        except OSError as exc:
            for sock in socks:
                sock.close()
            raise TransferError(f"cannot reach KV peer {meta['host']}:{meta['port']}: {exc}") from None
        p = _Peer([_Stream(sock) for sock in socks], num_heads=len(meta_heads(peer)))
        for st in p.streams:
            threading.Thread(target=self._send_loop, args=(p, st), name="kv-tcp-send", daemon=True).start()
            threading.Thread(target=self._ack_loop, args=(p, st), name="kv-tcp-ack", daemon=True).start()
        with self._lock:
            self._peers[key] = p
        return PeerHandle(key)

    def write(self, peer: PeerHandle, src: Sequence[int], dst: Sequence[int],
              layers: range | None = None, heads: HeadSlice | None = None,
              deadline: float | None = None) -> TransferId:
        if self._local is None:
            raise TransferError("register() a local pool before writing")
        p = self._peers.get(peer.peer_id)
        if p is None:
            raise TransferError(f"not connected to {peer.peer_id}")
        check_heads(heads, self._local.tensor.shape[4], p.num_heads)
        layers = layers if layers is not None else range(self._local.layout.num_layers)
        runs = block_runs(src, dst)
        # A many-layer write is cut into one frame per stream; single layers take turns.
        k = max(1, min(len(p.streams), len(layers)))
        cuts = [layers.start + len(layers) * i // k for i in range(k + 1)]
        with self._lock:
            self._next += 1
            xfer = self._next
            self._states[xfer] = TransferState.PENDING
            if p.dead:
                self._end(xfer, TransferState.FAILED)
                return xfer
            p.pending[xfer] = k
            first = p.turn
            p.turn = (p.turn + k) % len(p.streams)
        for i in range(k):
            p.streams[(first + i) % len(p.streams)].jobs.put((xfer, range(cuts[i], cuts[i + 1]), runs, heads,
                                                              deadline))
        return xfer

    def _send_loop(self, p: _Peer, st: _Stream) -> None:
        try:
            while True:
                job = st.jobs.get()
                if job is None:
                    return
                xfer, layers, runs, heads, deadline = job
                if not self._still_to_send(p, xfer, deadline):
                    continue
                t = self._local.tensor              # write() only queues jobs once registered
                head = HEADER.pack(MAGIC, xfer, layers.start, len(layers), len(runs), heads.dst if heads else 0,
                                   heads.count if heads else 0)
                head += b"".join(RUN.pack(d, n) for _, d, n in runs)
                _send_all(st.sock, [memoryview(head)] + self._pieces(t, layers, runs, heads))
        except (OSError, ValueError) as exc:            # ValueError: socket closed under us
            self._kill(p, f"send failed: {exc}")

    def _still_to_send(self, p: _Peer, xfer: int, deadline: float | None) -> bool:
        """Whether a queued frame of `xfer` is to go out: not once the transfer has
        failed, nor past its deadline (behind a backlog on the link), when its
        destination blocks may have gone back to the peer's pool: the transfer FAILs."""
        with self._lock:
            if self._states.get(xfer) is not TransferState.PENDING:
                return False
            if deadline is None or time.monotonic() < deadline:
                return True
            p.pending.pop(xfer, None)
            self._end(xfer, TransferState.FAILED)
            self._bump()
            return False

    @staticmethod
    def _pieces(t: torch.Tensor, layers: range, runs: list[tuple[int, int, int]],
                heads: HeadSlice | None) -> list[memoryview]:
        """A frame's bytes: each layer's K then V of each run, whole blocks (views of the
        pool) or a head slice of them (staged contiguous copies). Built in a call of its
        own: the sender thread keeps no tensor between frames (a daemon thread holding
        one at exit can abort the process in torch's teardown)."""
        if heads is None:
            return [_bytes_view(t[layer, kv, s:s + n]) for layer in layers for kv in (0, 1) for s, _, n in runs]
        hs, _ = head_slices(heads)
        return [_bytes_view(t[layer, kv, s:s + n, :, hs].contiguous())
                for layer in layers for kv in (0, 1) for s, _, n in runs]

    def _ack_loop(self, p: _Peer, st: _Stream) -> None:
        buf = bytearray(ACK.size)
        try:
            while True:
                _recv_all(st.sock, [memoryview(buf)])
                xfer, ok = ACK.unpack(buf)
                with self._lock:
                    left = p.pending.get(xfer)
                    if left is None:
                        continue
                    if not ok:
                        left = 0
                        self._end(xfer, TransferState.FAILED)
                    else:
                        left -= 1
                    if left:
                        p.pending[xfer] = left
                        continue
                    del p.pending[xfer]
                    self._end(xfer, TransferState.DONE)
                    self._bump()
        except (ConnectionError, OSError) as exc:
            self._kill(p, f"connection lost: {exc}")

    def _kill(self, p: _Peer, why: str) -> None:
        """Fail everything in flight on this peer and never use its connections again."""
        with self._lock:
            if p.dead:
                return
            p.dead = why
            for x in p.pending:
                self._end(x, TransferState.FAILED)
            p.pending.clear()
            self._bump()
        if not self._closed:
            log.warning("KV connection failed (%s); its pending transfers are FAILED", why)
        for st in p.streams:
            try:
                st.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            st.jobs.put(None)

    @staticmethod
    def _close_socks(p: _Peer) -> None:
        for st in p.streams:
            st.sock.close()

    def _end(self, xfer: int, state: TransferState) -> None:
        """A pending transfer's outcome, kept until polled; of those nobody polls (a wait
        given up at a failure), the oldest are forgotten past MAX_FINISHED. Call with the
        lock held."""
        if self._states.get(xfer) is not TransferState.PENDING:
            return
        self._states[xfer] = state
        self._finished.append(xfer)
        while len(self._finished) > MAX_FINISHED:
            self._states.pop(self._finished.popleft(), None)

    def _bump(self) -> None:
        """Call with the lock held."""
        self._version += 1
        self._changed.notify_all()

    def changes(self) -> int:
        with self._lock:
            return self._version

    def wait_change(self, seen: int, timeout: float) -> None:
        """Block until some transfer has ended since `changes()` returned `seen`."""
        with self._changed:
            self._changed.wait_for(lambda: self._version != seen, timeout)

    def poll(self, xfer: TransferId) -> TransferState:
        with self._lock:
            state = self._states.get(xfer, TransferState.FAILED)
            if state is not TransferState.PENDING:
                self._states.pop(xfer, None)
            return state

    def close(self, peer: PeerHandle) -> None:
        p = self._peers.pop(peer.peer_id, None)
        if p is not None:
            self._kill(p, "closed")
            self._close_socks(p)

    def shutdown(self) -> None:
        self._closed = True
        for key in list(self._peers):
            self.close(PeerHandle(key))
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
