"""Calls from a worker thread into an asyncio event loop, coalesced.

`loop.call_soon_threadsafe` wakes the loop by writing to its self-pipe on every call.
An engine step that emits a token for each of 32 streams would make 32 writes and 32
wake-ups; through a `Mailbox` it makes one, and the loop runs the step's 32 calls in one
pass, in the order they were posted.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any, Callable


class Mailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False         # a drain is on the loop's queue and has not taken the calls yet

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop, after every call posted before it. Thread-safe;
        RuntimeError if the loop is closed, as call_soon_threadsafe."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, deque()
            self._scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as exc:            # one bad call must not drop the ones after it
                self.loop.call_exception_handler({
                    "message": f"Mailbox call {fn!r} failed", "exception": exc})
