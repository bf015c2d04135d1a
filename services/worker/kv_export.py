"""The sending half of the KV connector: a prompt's KV, computed in this worker's pool,
written layer by layer into the blocks another worker reserved for it.

Any worker that computes prompts can use it: it needs the engine's per-layer hook
(`push_layer`, called on the engine thread as each layer's KV is written) and the
engine loop, to abort a request whose writes failed. The receiving half is the decode
worker's reservations (the scheduler's `reserve`, services/decode/worker.py).

Writes stop at each handle's write deadline: past it the receiver may have given the
blocks to someone else, so that request fails (and only that one) instead of writing.
Blocks stay held until every write that reads them has ended (`settle`).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from kv_transfer.backends import pair
from kv_transfer.base import IncompatiblePeer, KVTransport, PeerHandle, TransferError, wait_for
from services.engine.core.sequence import StepPlan
from services.engine.loop import EngineLoop
from services.engine.model.kv_cache import KVLayout

log = logging.getLogger(__name__)

# After a failure, how long posted writes may take to end before the link is given up.
DRAIN_SECONDS = 5.0


class LeaseExpired(TransferError):
    """The receiver's write deadline passed before the KV was written."""


class PrefillCancelled(TransferError):
    """The caller went away before its prefill finished."""


@dataclass
class Export:
    """Where one request's KV goes, and the writes posted so far."""
    transport: KVTransport
    peer: PeerHandle
    dst: list[int]                      # the receiver's reserved blocks
    deadline: float                     # monotonic
    fell_back: bool = False             # a transport other than the receiver's first choice
    xfers: list[int] = field(default_factory=list)
    pushed_blocks: int = 0              # leading blocks complete at the destination
    failure: TransferError | None = None


class KVExporter:
    """The exports of one worker's requests, by engine request id. `loop` is the worker's
    engine loop, set once it exists (the engine is built with `push_layer` first)."""

    def __init__(self, transports: dict[str, KVTransport], compat_hash: str, layout: KVLayout,
                 on_fallback: Callable[[str, str], None] = lambda failed, used: None) -> None:
        self.transports = transports
        self.compat_hash = compat_hash
        self.layout = layout
        self.loop: EngineLoop | None = None
        self._on_fallback = on_fallback
        self._exports: dict[str, Export] = {}
        self._pair_lock = threading.Lock()

    def open(self, request_id: str, handle) -> Export:
        """Connect to the receiver of `handle` (a KVHandle: compat hash checked, the
        link cached per peer) and track `request_id`'s writes to its blocks. Blocking:
        call it off the event loop."""
        if handle.compat_hash != self.compat_hash:
            raise IncompatiblePeer(f"decode worker KV layout {handle.compat_hash} differs from ours "
                                   f"{self.compat_hash} (model, dtype, quantization, block size or protocol): "
                                   "refusing to pair")
        with self._pair_lock:
            transport, peer, fell_back = pair([(o.backend, o.meta) for o in handle.offers], self.transports,
                                              self.compat_hash,
                                              lambda failed, used: self._on_fallback(failed, used or "none"))
        # The lease is wall-clock (it crosses processes); waits use the monotonic clock.
        deadline = time.monotonic() + (handle.write_deadline - time.time())
        export = Export(transport, peer, list(handle.block_ids), deadline, fell_back)
        self._exports[request_id] = export
        return export

    def finish(self, export: Export) -> None:
        """Wait for `export`'s writes to end (TransferError if one failed or the lease ran
        out). Blocking."""
        wait_for(export.transport, export.xfers, export.deadline)

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
            wait_for(export.transport, export.xfers, min(export.deadline, time.monotonic() + DRAIN_SECONDS))
        except TransferError:
            export.transport.close(export.peer)          # a failed link: the next request reconnects

    # ---- engine thread ----
    def push_layer(self, layer: int, plan: StepPlan) -> None:
        """Layer `layer` of this step is written: post its writes, request by request.
        A chunk pushes only the blocks it completes (the prompt's last chunk, its last
        partial block too), so no destination block is written twice: two writes to one
        block would have no order between them. A request whose lease ran out or whose
        write failed, however it failed, stops writing and is aborted (its KV at the
        receiver is incomplete); the others go on."""
        last_layer = layer == self.layout.num_layers - 1
        bs = self.layout.block_size
        for c in plan.chunks:
            export = self._exports.get(c.seq.request_id)
            if export is None or export.failure is not None:
                continue
            end = c.start + c.num_tokens
            first, stop = export.pushed_blocks, (-(-end // bs) if end >= c.seq.prompt_len else end // bs)
            try:
                if time.monotonic() >= export.deadline:
                    raise LeaseExpired(f"write deadline passed at layer {layer}")
                if stop > first:
                    export.xfers.append(export.transport.write(export.peer, c.seq.block_ids[first:stop],
                                                               export.dst[first:stop], range(layer, layer + 1)))
            except Exception as exc:            # noqa: BLE001 - any failed post leaves the KV incomplete
                export.failure = exc if isinstance(exc, TransferError) else TransferError(
                    f"posting layer {layer}'s write failed: {type(exc).__name__}: {exc}")
                log.warning("request %s: %s", c.seq.request_id, export.failure)
                self.loop.abort(c.seq.request_id)
                continue
            if last_layer:
                export.pushed_blocks = stop
