"""The decode side's record of every KV handoff, as an explicit state machine.

    RESERVED -> COMPLETE -> DECODING -> RELEASED
    FAILED / EXPIRED from any state before RELEASED

The prefill worker writes into RESERVED blocks one-sided (nothing tells the decode worker
while it writes); its Decode call says the writes are COMPLETE.

Blocks are reserved with a lease: a writer must stop writing before `write_deadline`.
The blocks themselves are the decode worker's scheduler's (`Scheduler.reserve`): if
nobody has started decoding by `write_deadline` and a grace period, the scheduler
gives them back and the worker ends the handoff EXPIRED. Transitions are idempotent
(repeating one is a no-op), illegal ones raise `HandoffError`, and every change is
logged. Plain Python with an injected clock, so it is tested without processes.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


class HandoffState(enum.Enum):
    RESERVED = "reserved"
    COMPLETE = "complete"
    DECODING = "decoding"
    RELEASED = "released"
    FAILED = "failed"
    EXPIRED = "expired"


TERMINAL = frozenset({HandoffState.RELEASED, HandoffState.FAILED, HandoffState.EXPIRED})
_NEXT = {
    HandoffState.RESERVED: {HandoffState.COMPLETE},
    HandoffState.COMPLETE: {HandoffState.DECODING},
    HandoffState.DECODING: {HandoffState.RELEASED},
}


class HandoffError(Exception):
    """A handoff is unknown, from another epoch, or asked for an illegal transition."""


@dataclass
class KVHandoff:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    write_deadline: float
    state: HandoffState = HandoffState.RESERVED


class HandoffTable:
    def __init__(self, epoch: str, clock: Callable[[], float] = time.time) -> None:
        self.epoch = epoch
        self._clock = clock
        self._live: dict[str, KVHandoff] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def reserve(self, request_id: str, block_ids: list[int], num_tokens: int,
                lease_seconds: float) -> KVHandoff:
        if request_id in self._live:
            raise HandoffError(f"request {request_id} already holds a reservation")
        h = KVHandoff(request_id, block_ids, num_tokens, self._clock() + lease_seconds)
        self._live[request_id] = h
        log.debug("handoff %s RESERVED %d blocks", request_id, len(block_ids))
        return h

    def get(self, request_id: str, epoch: str) -> KVHandoff:
        if epoch != self.epoch:
            raise HandoffError(f"stale handle: epoch {epoch!r}, this worker is {self.epoch!r}")
        h = self._live.get(request_id)
        if h is None:
            raise HandoffError(f"no live reservation for request {request_id} (released or expired)")
        return h

    def advance(self, h: KVHandoff, new: HandoffState) -> None:
        if h.state is new:
            return
        if new in TERMINAL:
            self._end(h, new)
            return
        if new not in _NEXT.get(h.state, ()):
            raise HandoffError(f"handoff {h.request_id}: {h.state.value} -> {new.value} is not allowed")
        log.debug("handoff %s %s -> %s", h.request_id, h.state.name, new.name)
        h.state = new

    def pop(self, request_id: str, final: HandoffState) -> KVHandoff | None:
        """End a handoff (RELEASED, FAILED or EXPIRED); returns it if it was live."""
        h = self._live.get(request_id)
        if h is not None:
            self._end(h, final)
        return h

    def _end(self, h: KVHandoff, final: HandoffState) -> None:
        log.debug("handoff %s %s -> %s", h.request_id, h.state.name, final.name)
        h.state = final
        self._live.pop(h.request_id, None)
