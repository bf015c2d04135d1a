"""The engine thread: an `LLMEngine` stepped while it has work, asleep otherwise, and
each request's outputs delivered to the sink it was submitted with. What a worker
drives; other threads reach the engine through it (`submit`, `abort`, `call`)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

import torch

from services.engine.core.sequence import Sequence
from services.engine.engine import EngineOutput, LLMEngine, StepStats
from services.engine.model.device import use_device

log = logging.getLogger(__name__)
T = TypeVar("T")


# Steps failing one after another (not one request's: the engine runs those alone and
# fails only them) after which every request here ends with an error instead of waiting
# on an engine that cannot step.
FAILING_STEPS = 3

# What a worker hands the loop to receive a request's output, called on the engine
# thread. A prefilled sequence's sink also hears an output with no tokens and no finish
# when it joins the running batch, before that step's forward pass.
Sink = Callable[[EngineOutput], None]


class EngineLoop:
    """The engine thread: steps while there is work and sleeps until woken otherwise,
    delivering each request's output to the sink it was submitted with. `tick` runs
    before every step (a worker's lease expiry, gauges); `on_step` after each one that
    ran a forward pass."""

    def __init__(self, engine: LLMEngine, tick: Callable[[], None] | None = None,
                 on_step: Callable[[StepStats], None] | None = None, name: str = "engine") -> None:
        self.engine = engine
        self.tick = tick
        self.on_step = on_step
        # Called on the engine thread once steps keep failing (after every request here
        # has ended with an error): the worker stops rather than stay routable.
        self.on_failing: Callable[[], None] | None = None
        self._sinks: dict[str, Sink] = {}
        self._submitting = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._threads = torch.get_num_threads()
        engine.on_joined = self._joined
        engine.interjected = self._interjected

    def _joined(self, request_ids: list[str]) -> None:
        """A prefilled sequence starts decoding: its sink hears an empty output now."""
        for request_id in request_ids:
            sink = self._sinks.get(request_id)
            if sink is not None:
                sink(EngineOutput(request_id, [], None))

    def _interjected(self, outputs: list[EngineOutput], stats: StepStats | None) -> None:
        """A step run inside another's paused pass (LLMEngine's `yields`): its outputs
        go out now, not when the paused pass ends."""
        if stats is not None and self.on_step is not None:
            self.on_step(stats)
        self._deliver(outputs)

    def submit(self, seq: Sequence, sink: Sink, prefilled: bool = False,
               fork_sinks: list[Sink] = ()) -> None:
        """`fork_sinks`: one per sequence in `seq.forks`, which the engine starts itself.
        An id already here is a ValueError: its sink must never take another's place."""
        sinks = {seq.request_id: sink}
        sinks.update((child.request_id, s) for child, s in zip(seq.forks, fork_sinks, strict=True))
        with self._submitting:                  # RPC threads submit concurrently
            taken = next((request_id for request_id in sinks if request_id in self._sinks), None)
            if taken is not None or len(sinks) != 1 + len(seq.forks):
                raise ValueError(f"request {taken or seq.request_id} is already in the engine")
            self._sinks.update(sinks)
        (self.engine.add_prefilled if prefilled else self.engine.add)(seq)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)
        self._wake.set()

    def call(self, action: Callable[[], T]) -> Future[T]:
        """`action()` on the engine thread (LLMEngine.call)."""
        future = self.engine.call(action)
        self._wake.set()
        return future

    def wake(self) -> None:
        self._wake.set()

    @property
    def num_requests(self) -> int:
        return len(self._sinks)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        # OpenMP's thread count is per thread: one set in the main thread does not reach
        # this one, whose matmuls would otherwise fan out over every core (and spin on a
        # worker pinned to one). CUDA's current device is per thread too.
        torch.set_num_threads(self._threads)
        use_device(self.engine.runner.device)
        failures = 0
        while not self._stopping:
            if self.tick is not None:
                with self.engine.scheduling:        # a tick may change the scheduler (leases)
                    self.tick()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            before = self.engine.last_step
            try:
                outputs = self.engine.step()
            except Exception:                   # never lose the thread
                failures += 1
                log.exception("engine step failed (%d in a row)", failures)
                if failures >= FAILING_STEPS:
                    self._fail_all()
                    failures = 0
                continue
            failures = 0
            ran = self.engine.last_step is not before
            if self.on_step is not None and ran:
                self.on_step(self.engine.last_step)
            self._deliver(outputs)
            if not ran and not outputs and not self.engine.in_flight:
                # work that cannot run yet (no free blocks): wait for a release instead of spinning
                self._wake.wait(timeout=0.01)
                self._wake.clear()

    def _fail_all(self) -> None:
        """Every request here ends with an error, now: its stream ends (the worker's
        handler releases what it holds) and the engine is told to drop it."""
        with self._submitting:
            sinks, self._sinks = self._sinks, {}
        log.error("engine steps keep failing: ending its %d requests with an error", len(sinks))
        for request_id, sink in sinks.items():
            self.engine.abort(request_id)
            sink(EngineOutput(request_id, [], "error"))
        if self.on_failing is not None:
            self.on_failing()

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for o in outputs:
            sink = self._sinks.pop(o.request_id, None) if o.finish_reason else self._sinks.get(o.request_id)
            if sink is not None:
                sink(o)
