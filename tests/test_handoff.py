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
