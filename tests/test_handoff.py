"""The KV handoff state machine, with an injected clock."""
import pytest

from kv_transfer.handoff import HandoffError, HandoffState, HandoffTable


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


def test_lease_expiry_returns_reservations_but_not_decoding_ones():
    clock = Clock()
    t = HandoffTable("e", grace_seconds=1, clock=clock)
    a = t.reserve("a", [1], 4, 5)
    b = t.reserve("b", [2], 4, 5)
    t.advance(b, HandoffState.COMPLETE)
    t.advance(b, HandoffState.DECODING)
    clock.t += 5.5
    assert t.expire() == []
    clock.t += 1
    assert t.expire() == [a] and a.state is HandoffState.EXPIRED
    assert len(t) == 1
