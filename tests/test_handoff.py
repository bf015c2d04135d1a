"""The KV handoff state machine, with an injected clock, and the reservations behind it,
which are the decode worker's scheduler's."""
import pytest

from kv_transfer.handoff import HandoffError, HandoffState, HandoffTable
from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_happy_path_and_idempotent_transitions():
    t = HandoffTable("e1", clock=Clock())
    h = t.reserve("r", [1, 2], 20, lease_seconds=5)
    t.advance(h, HandoffState.COMPLETE)
    t.advance(h, HandoffState.COMPLETE)
    t.advance(h, HandoffState.DECODING)
    with pytest.raises(HandoffError):
        t.advance(h, HandoffState.COMPLETE)             # no way back
    assert t.pop("r", HandoffState.RELEASED) is h and h.state is HandoffState.RELEASED
    assert t.pop("r", HandoffState.RELEASED) is None and len(t) == 0


def test_stale_epoch_and_unknown_request_are_refused():
    t = HandoffTable("e2", clock=Clock())
    t.reserve("r", [1], 4, 5)
    with pytest.raises(HandoffError, match="stale"):
        t.get("r", "e1")
    with pytest.raises(HandoffError):
        t.get("x", "e2")
    with pytest.raises(HandoffError):
        t.reserve("r", [2], 4, 5)


def test_lease_expiry_returns_reservations_but_not_claimed_ones():
    """Reservations are the scheduler's: past its expiry one goes back to the pool, unless
    a decode has claimed it (its sequence is on its way to `add_prefilled`)."""
    s = Scheduler(BlockManager(BlockPool(8, 4)), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    a = s.reserve("a", 6, expires=1005.0)
    s.reserve("b", 4, expires=1005.0)
    assert s.blocks.num_available == 5
    assert s.expire(1004.9) == []
    assert s.expire(1006.0, claimed={"b"}.__contains__) == [a] and s.blocks.num_available == 7
    with pytest.raises(ValueError, match="already here"):
        s.reserve("b", 4, expires=2000.0)
    assert s.cancel("b") is not None and s.cancel("b") is None and s.blocks.num_available == 8


def test_a_prefilled_sequence_takes_its_reservations_blocks_and_no_other():
    s = Scheduler(BlockManager(BlockPool(8, 4)), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    eos = frozenset({2})
    with pytest.raises(ValueError, match="no reservation"):
        s.add_prefilled(Sequence("x", [5] * 5 + [9], 5, SamplingParams(max_tokens=4), eos))
    r = s.reserve("r", 5, expires=float("inf"))
    with pytest.raises(ValueError, match="covers 5 tokens"):
        s.add_prefilled(Sequence("r", [5] * 7 + [9], 7, SamplingParams(max_tokens=4), eos))
    seq = Sequence("r", [5] * 5 + [9], 5, SamplingParams(max_tokens=4), eos)
    assert s.add_prefilled(seq) is None and seq.block_ids == r.block_ids and not s.remote


def _decode_worker(engine_wait: float):
    """A decode worker's handoff side over a real scheduler, its engine a double whose
    `now` waits `engine_wait` seconds before acting (the real one waits for the engine's
    scheduling lock, as long as a step's planning takes): the waits under test cannot be
    made to last on demand with a real engine."""
    import threading
    import time
    from types import SimpleNamespace

    from services.decode.worker import DecodeWorker
    s = Scheduler(BlockManager(BlockPool(64, 16)), SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))

    class Engine:
        scheduler = s

        def now(self, action):
            time.sleep(engine_wait)
            return action()
    w = DecodeWorker.__new__(DecodeWorker)
    w.engine, w.epoch, w._lock, w._decoding = Engine(), "e1", threading.Lock(), set()
    w.loop = SimpleNamespace(call=lambda action: action(), abort=lambda request_id: None)
    w.runner, w.settings = SimpleNamespace(max_model_len=1024), SimpleNamespace(max_lease_seconds=300.0)
    w.handoffs = HandoffTable("e1")
    return w, s


def test_a_writers_deadline_never_outlasts_its_blocks_whatever_the_reservation_waited():
    """The writer's deadline and the blocks' expiry come from one instant: a reservation
    that waited on the engine (past the grace between the two) used to hand the writer a
    deadline after the moment its blocks went back to the pool, where another request's
    KV could then be overwritten."""
    import asyncio

    from services.decode.worker import LEASE_GRACE_SECONDS
    w, s = _decode_worker(engine_wait=LEASE_GRACE_SECONDS + 0.5)
    h = asyncio.run(w.reserve("r", 40, 10.0))
    assert h.write_deadline + LEASE_GRACE_SECONDS <= s.remote["r"].expires + 0.01     # clock reads apart


def test_a_reservation_whose_caller_left_mid_reserve_goes_back():
    """The Reserve call is cancelled (its deadline, its caller gone) while the engine
    makes the reservation: the blocks go back once it is made, and a Release by the
    request's id (the router's, after a Reserve that timed out) finds none left over."""
    import asyncio

    async def main():
        w, s = _decode_worker(engine_wait=0.3)
        task = asyncio.create_task(w.reserve("r", 200, 30.0))
        await asyncio.sleep(0.1)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        await asyncio.sleep(0.5)
        return s
    s = asyncio.run(main())
    assert "r" not in s.remote and s.blocks.num_available == 64
