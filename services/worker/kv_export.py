"""The sending half of the KV connector: a prompt's KV, computed in this worker's pool,
written layer by layer into the blocks another worker reserved for it.

Any worker that computes prompts can use it: it needs the engine's per-layer hook
(`push_layer`, called on the engine thread as each layer's KV is written) and the
engine loop, to abort a request whose writes failed. The receiving half is the decode
worker's reservations (the scheduler's `reserve`, services/decode/worker.py).

Writes stop at each handle's write deadline: past it the receiver may have given the
blocks to someone else, so that request fails (and only that one) instead of writing.
Blocks stay held until every write that reads them has ended (`settle`).

Tensor parallelism: each rank of either worker holds some of the model's KV heads, and
the receiver offers each rank's pool. Every receiver head is written once, by the first
writer rank that holds it (`head_writes`): whole blocks where both ranks hold the same
heads, head slices otherwise. Rank 0 posts its own writes as above; the other ranks'
are planned here and sent to them before each step (`before_step`), and they report
after it which failed (`after_step`, services/worker/ranks.py).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kv_transfer.backends import PREFERENCE, pair
from kv_transfer.base import (HeadSlice, IncompatiblePeer, KVTransport, PeerHandle, TransferError, TransferTimeout,
                              head_writes, meta_heads, wait_for)
from services.engine.core.sequence import Chunk, StepPlan
from services.engine.loop import EngineLoop
from services.engine.model.kv_cache import KVLayout
from services.engine.model.parallel import Command, RankGroup

log = logging.getLogger(__name__)

# After a failure, how long posted writes may take to end before the link is given up.
DRAIN_SECONDS = 5.0


def seconds_left(handle) -> float:
    """The seconds `handle` leaves to write: as the router passed it on, taken from when
    it arrived here; from a handle without (an older router), its wall-clock deadline,
    which holds only where the two hosts' clocks agree."""
    if handle.HasField("write_seconds"):
        return handle.write_seconds
    return handle.write_deadline - time.time()


class LeaseExpired(TransferError):
    """The receiver's write deadline passed before the KV was written."""


class PrefillCancelled(TransferError):
    """The caller went away before its prefill finished."""


@dataclass(frozen=True)
class Target:
    """A receiver pool this worker's rank 0 writes into, and which heads."""
    transport: KVTransport
    peer: PeerHandle
    heads: HeadSlice | None = None


@dataclass(frozen=True)
class RankTarget:
    """A receiver pool another rank of this worker writes into: its `peer` in that
    rank's table (`RankWriter.peers`)."""
    rank: int
    peer: int
    heads: HeadSlice | None


@dataclass
class Export:
    """Where one request's KV goes, and the writes posted so far."""
    targets: list[Target]
    dst: list[int]                      # the receiver's reserved blocks
    deadline: float                     # monotonic
    fell_back: bool = False             # a transport other than the receiver's first choice
    ranks: list[RankTarget] = field(default_factory=list)
    xfers: list[tuple[KVTransport, int]] = field(default_factory=list)
    pushed_blocks: int = 0              # leading blocks complete at the destination
    failure: TransferError | None = None

    @property
    def transport(self) -> KVTransport:
        return self.targets[0].transport

    def wait(self, deadline: float) -> None:
        """Until every write posted so far has ended (TransferError if one failed, or
        TransferTimeout at the deadline). A write leaves the list as it ends, failed or
        not: a transport forgets a transfer once it has told its end, and asked again
        reports it failed, so a later wait (the drain after a failed finish) must ask only
        about the writes still in flight."""
        while self.xfers:
            transport, xfer = self.xfers[0]
            try:
                wait_for(transport, [xfer], deadline)
            except TransferTimeout:
                raise                           # still in flight: it stays
            except TransferError:
                self.xfers.pop(0)
                raise
            self.xfers.pop(0)


class KVExporter:
    """The exports of one worker's requests, by engine request id. `loop` is the worker's
    engine loop, set once it exists (the engine is built with `push_layer` first)."""

    def __init__(self, transports: dict[str, KVTransport], compat_hash: str, layout: KVLayout,
                 on_fallback: Callable[[str, str], None] = lambda failed, used: None,
                 heads: list[range] | None = None, group: RankGroup | None = None) -> None:
        """`heads`: the model's KV heads each rank of this worker holds (one rank: all);
        `group`: the ranks' group, when there are several."""
        self.transports = transports
        self.compat_hash = compat_hash
        self.layout = layout
        self.heads = heads or [range(layout.num_kv_heads)]
        self.group = group if len(self.heads) > 1 else None
        self.loop: EngineLoop | None = None
        self._on_fallback = on_fallback
        self._exports: dict[str, Export] = {}
        self._pair_lock = threading.Lock()
        self._rank_peers: dict[tuple[int, str, bytes], int] = {}       # (rank, backend, meta) -> its peer index
        self._connects: dict[tuple[int, int], bytes] = {}   # (rank, peer index): pairings to send before the next step
        self._step: list[tuple[str, Export]] | None = None              # exports other ranks write this step

    def open(self, request_id: str, handle, arrived: float | None = None) -> Export:
        """Connect to the receiver of `handle` (a KVHandle: compat hash checked, the
        link cached per peer) and track `request_id`'s writes to its blocks, until the
        seconds its lease leaves from `arrived` (time.monotonic() when the handle came:
        a grammar compiled or a link paired since takes from the lease, not after it).
        Blocking: call it off the event loop."""
        if handle.compat_hash != self.compat_hash:
            raise IncompatiblePeer(f"decode worker KV layout {handle.compat_hash} differs from ours "
                                   f"{self.compat_hash} (model, dtype, quantization, block size or protocol): "
                                   "refusing to pair")
        by_rank: dict[int, list[tuple[str, bytes]]] = {}
        for o in handle.offers:
            by_rank.setdefault(o.rank, []).append((o.backend, o.meta))
        if sorted(by_rank) != list(range(len(by_rank))):
            raise TransferError(f"the receiver offers pools of ranks {sorted(by_rank)}")
        theirs = [meta_heads(by_rank[d][0][1]) for d in range(len(by_rank))]
        targets, ranks, fell_back = [], [], False
        writes = head_writes(self.heads, theirs)
        with self._pair_lock:
            for p, d, heads in writes:          # rank 0's first: the others use the backend it paired through
                if p == 0:
                    transport, peer, fell = pair(by_rank[d], self.transports, self.compat_hash,
                                                 lambda failed, used: self._on_fallback(failed, used or "none"))
                    targets.append(Target(transport, peer, heads))
                    fell_back = fell_back or fell
            for p, d, heads in writes:
                if p:
                    ranks.append(RankTarget(p, self._rank_peer(p, by_rank[d], targets[0].transport.name), heads))
        deadline = (time.monotonic() if arrived is None else arrived) + seconds_left(handle)
        export = Export(targets, list(handle.block_ids), deadline, fell_back, ranks)
        self._exports[request_id] = export
        return export

    def _rank_peer(self, rank: int, offers: list[tuple[str, bytes]], chosen: str) -> int:
        """Rank `rank`'s index for the receiver pool of `offers`, through `chosen` (the
        backend rank 0 paired through: shared memory offered across hosts fails there
        and falls back) where offered, else the first this worker has in preference
        order (its ranks open the same ones). That rank pairs with it before the next
        step, for every export, as rank 0 does: connecting again is free while its link
        lives, and a link that failed (a TCP link past its I/O timeout fails every write
        after) is made anew. Under `_pair_lock`."""
        usable = sorted((o for o in offers if o[0] in self.transports),
                        key=lambda o: (o[0] != chosen, PREFERENCE.index(o[0])))
        if not usable:
            raise IncompatiblePeer(f"no common KV transport: the peer offers {[b for b, _ in offers]}")
        backend, meta = usable[0]
        key = (rank, backend, meta)
        index = self._rank_peers.setdefault(key, len(self._rank_peers))
        self._connects[rank, index] = backend.encode() + b"\0" + meta
        return index

    def finish(self, export: Export) -> None:
        """Wait for `export`'s writes to end (TransferError if one failed or the lease ran
        out). Blocking."""
        export.wait(export.deadline)

    async def settle(self, request_id: str, export: Export, ended: asyncio.Future, drain: bool) -> None:
        """After a request ends either way: once the engine is done with it, let writes
        already posted end (or give up on the link) before its blocks can be reused."""
        try:
            await ended
            if drain:
                await asyncio.to_thread(self._drain, export)
        finally:
            self._exports.pop(request_id, None)
            self.loop.release(request_id)

    def _drain(self, export: Export) -> None:
        try:
            export.wait(min(export.deadline, time.monotonic() + DRAIN_SECONDS))
        except TransferError:
            for t in export.targets:
                t.transport.close(t.peer)               # a failed link: the next request reconnects

    # ---- engine thread ----
    def push_layer(self, layer: int, plan: StepPlan) -> None:
        """Layer `layer` of this step is written: post its writes, request by request.
        A chunk pushes only the blocks it completes (the prompt's last chunk, its last
        partial block too), so no destination block is written twice: two writes to one
        block would have no order between them. A request whose lease ran out or whose
        write failed, however it failed, stops writing and is aborted (its KV at the
        receiver is incomplete); the others go on."""
        last_layer = layer == self.layout.num_layers - 1
        for c in plan.chunks:
            export = self._exports.get(c.seq.request_id)
            if export is None or export.failure is not None:
                continue
            first, stop = self._blocks(c, export)
            try:
                if time.monotonic() >= export.deadline:
                    raise LeaseExpired(f"write deadline passed at layer {layer}")
                if stop > first:
                    for t in export.targets:
                        export.xfers.append((t.transport, t.transport.write(
                            t.peer, c.seq.block_ids[first:stop], export.dst[first:stop], range(layer, layer + 1),
                            t.heads, export.deadline)))
            except Exception as exc:            # noqa: BLE001 - any failed post leaves the KV incomplete
                self._fail(c.seq.request_id, export, exc if isinstance(exc, TransferError) else TransferError(
                    f"posting layer {layer}'s write failed: {type(exc).__name__}: {exc}"))
                continue
            if last_layer:
                export.pushed_blocks = stop

    def _blocks(self, c: Chunk, export: Export) -> tuple[int, int]:
        """The blocks chunk `c` completes, [first, stop) of the prompt's."""
        bs = self.layout.block_size
        end = c.start + c.num_tokens
        return export.pushed_blocks, (-(-end // bs) if end >= c.seq.prompt_len else end // bs)

    def _fail(self, request_id: str, export: Export, failure: TransferError) -> None:
        export.failure = failure
        log.warning("request %s: %s", request_id, failure)
        self.loop.abort(request_id)

    def before_step(self, plan: StepPlan) -> None:
        """Engine thread, before a step: the other ranks' writes in it (and pairings
        they need first), sent to them."""
        if self.group is None:
            return
        with self._pair_lock:
            connects, self._connects = self._connects, {}
        for (rank, index), data in connects.items():
            self.group.send(Command.CONNECT, [rank, index], data)
        orders: list[int] = [0]
        step: list[tuple[str, Export]] = []
        now = time.monotonic()
        for c in plan.chunks:
            export = self._exports.get(c.seq.request_id)
            if export is None or export.failure is not None or not export.ranks:
                continue
            first, stop = self._blocks(c, export)
            if stop <= first:
                continue
            src, dst = c.seq.block_ids[first:stop], export.dst[first:stop]
            ms = max(0, int((export.deadline - now) * 1000))
            for t in export.ranks:
                h = t.heads or HeadSlice(0, 0, 0)
                orders += [t.rank, len(step), t.peer, len(src), *src, *dst, h.src, h.dst, h.count, ms]
            step.append((c.seq.request_id, export))
        self._step = step if step else None
        if step:
            orders[0] = len(step)
            self.group.send(Command.EXPORTS, orders)

    def after_step(self, plan: StepPlan) -> None:
        """Engine thread, after the step: the other ranks' writes that failed fail their
        requests."""
        if self._step is None:
            return
        step, self._step = self._step, None
        for i in self.group.marked(len(step), ()):
            request_id, export = step[i]
            if export.failure is None:
                self._fail(request_id, export, TransferError("another tensor-parallel rank's KV write failed "
                                                             "(its log says why)"))
