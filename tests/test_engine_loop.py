"""The engine and its thread where nothing steps: an engine that cannot step (a test
double of the engine, since what is under test is the loop's own handling), and an
engine left idle with a fork's block copy queued (a runner double that copies on the
host: no model is needed where no step runs)."""
import time
from types import SimpleNamespace

import torch

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence
from services.engine.engine import LLMEngine
from services.engine.loop import FAILING_STEPS, EngineLoop
from services.engine.model.device import HostStream


def test_an_engine_whose_steps_keep_failing_ends_its_requests_with_an_error():
    """Steps that fail one after another (a device lost, a bug outside any one request)
    end every request with an error, each dropped from the engine, rather than leave
    their streams waiting on an engine that cannot step; the thread goes on, and tells
    the worker (which stops, leaving the routers' choice, for its supervisor to start a
    fresh one)."""
    class Broken:
        runner = SimpleNamespace(device=torch.device("cpu"))
        on_joined = interjected = last_step = None
        in_flight = False

        def __init__(self) -> None:
            self.steps, self.aborted = 0, []

        def has_work(self) -> bool:
            return True

        def step(self):
            self.steps += 1
            raise RuntimeError("device lost")

        def add(self, seq) -> None:
            pass

        def abort(self, request_id: str) -> None:
            self.aborted.append(request_id)
    engine, got, told = Broken(), {}, []
    loop = EngineLoop(engine)
    loop.on_failing = lambda: told.append(len(got))
    for rid in ("a", "b"):
        loop.submit(Sequence(rid, [1, 2, 3], 3, SamplingParams(max_tokens=4), frozenset()),
                    lambda output, rid=rid: got.setdefault(rid, output))
    loop.start()
    for _ in range(200):
        if len(got) == 2:
            break
        time.sleep(0.01)
    loop.stop()
    assert {rid: o.finish_reason for rid, o in got.items()} == {"a": "error", "b": "error"}
    assert sorted(engine.aborted) == ["a", "b"] and loop.num_requests == 0 and engine.steps >= FAILING_STEPS
    assert told and told[0] == 2                    # after every request had its error


def test_choices_that_end_before_their_copy_runs_leave_no_block_held_on_an_idle_engine():
    """n > 1: the parent's first token forks a choice, whose copy of the last prompt
    block is queued ahead of the next step; the client leaves and both choices end
    before it. No step follows to land the copy, so the engine waits for the copy
    itself and every block goes back, not held until some other request runs."""
    copied = []
    runner = SimpleNamespace(stream=HostStream(), copy_blocks=lambda memory, pairs: copied.extend(pairs))
    s = Scheduler(BlockManager(BlockPool(8, 4)), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    engine = LLMEngine(runner=runner, memory=None, scheduler=s)
    parent = Sequence("r", list(range(10, 15)) + [1], 5, SamplingParams(max_tokens=4, temperature=0), frozenset())
    parent.forks = [Sequence("r#1", [], 5, SamplingParams(max_tokens=4, temperature=0), frozenset())]
    s.reserve("r", 5, float("inf"))
    engine.add_prefilled(parent)        # forks as the step takes it in: the copy is queued
    for rid in ("r", "r#1"):            # and both end in the same step, before any runs
        engine.abort(rid)
    outputs = engine.step()
    assert sorted(o.finish_reason for o in outputs) == ["abort", "abort"] and copied
    assert not engine.has_work() and s.blocks.num_available == 8
