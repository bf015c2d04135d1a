"""The router's fair share among API keys (services/router/fairness.py, pure policy):
start-time fair queuing puts a light tenant's request ahead of a heavy tenant's backlog,
weights set the shares, a lone tenant is first come first served, per-key caps and token
rates refuse with a retry time, and a full queue still admits a tenant below its share.
The tokenizer's turns go round the tenants (admission.FairGate). Also the key file's
options (services/common/security.py)."""
from __future__ import annotations

import asyncio

import pytest

from services.common.security import ApiKey, KeyCheck, read_api_keys
from services.router.admission import FairGate, tenant_policies
from services.router.fairness import FairQueue, Refused, TenantPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def order(q: FairQueue, limit: int = 1) -> list[str]:
    """Tenants in dispatch order, one running at a time."""
    out = []
    while q.queued:
        (ticket,) = q.dispatch(limit)
        out.append(ticket.tenant)
        q.done(ticket)
    return out


def test_a_lone_tenant_is_served_in_arrival_order():
    q = FairQueue(100)
    tickets = [q.admit("a", cost=10 + i) for i in range(5)]
    got = q.dispatch(limit=3)
    assert got == tickets[:3] and q.running_slots == 3
    q.done(got[0])
    assert q.dispatch(limit=3) == [tickets[3]]


def test_a_light_tenant_goes_ahead_of_a_heavy_backlog():
    q = FairQueue(1000)
    for _ in range(500):
        q.admit("flood", cost=100)
    first = q.dispatch(limit=1)
    q.admit("light", cost=100)
    q.done(first[0])
    assert q.dispatch(limit=1)[0].tenant == "light"


def test_weights_set_the_shares_while_both_wait():
    q = FairQueue(1000, policies=lambda t: TenantPolicy(weight=3.0 if t == "gold" else 1.0))
    for _ in range(40):
        q.admit("gold", cost=1)
        q.admit("free", cost=1)
    served = order(q)[:40]
    assert served.count("gold") == 30 and served.count("free") == 10


def test_a_tenant_back_from_idle_gets_no_credit_for_it():
    """Served once, idle while another ran 20: back, it takes turns with the other
    rather than catching up with a burst of its own."""
    q = FairQueue(1000)
    q.admit("back", cost=1)
    for t in q.dispatch(limit=1):
        q.done(t)
    for _ in range(20):
        q.admit("busy", cost=1)
    for t in q.dispatch(limit=20):
        q.done(t)
    for _ in range(3):
        q.admit("busy", cost=1)
    for _ in range(3):
        q.admit("back", cost=1)
    assert order(q) == ["back", "busy"] * 3


def test_a_concurrency_cap_refuses_with_a_retry_time():
    q = FairQueue(100, policies=lambda t: TenantPolicy(max_concurrency=2))
    a, _ = q.admit("k", 1), q.admit("k", 1)
    with pytest.raises(Refused) as r:
        q.admit("k", 1)
    assert r.value.reason == "rate_limit_exceeded" and r.value.retry_after == 1.0
    q.admit("other", 1)                             # a cap is per tenant
    q.done(a)
    q.admit("k", 1)


def test_a_token_rate_refills_and_says_when():
    clock = Clock()
    q = FairQueue(100, policies=lambda t: TenantPolicy(tokens_per_minute=600), clock=clock)   # 10 a second
    q.admit("k", 500)
    with pytest.raises(Refused) as r:
        q.admit("k", 200)
    assert r.value.retry_after == pytest.approx(10.0)      # 100 left, 100 more at 10 a second
    clock.now = 10.0
    q.admit("k", 200)
    with pytest.raises(Refused) as r:
        q.admit("k", 601)
    assert r.value.retry_after is None                     # never fits in a minute's tokens


def test_a_request_of_several_prompts_is_admitted_or_refused_whole():
    """A completions request of several prompts is checked as one against the key's
    limits: refused, it takes nothing from the bucket nor the fair order, so a client
    that waits the retry-after it was told gets in; more prompts than the key may run
    at once is refused with no retry-after (no wait would let it in)."""
    clock = Clock()
    q = FairQueue(100, policies=lambda t: TenantPolicy(tokens_per_minute=1000, max_concurrency=4), clock=clock)
    first = q.admit_all("k", [(400, 1), (400, 1)])                 # 200 of 1,000 left
    finish = q._tenants["k"].finish
    with pytest.raises(Refused) as r:
        q.admit_all("k", [(400, 1), (400, 1)])
    assert r.value.retry_after == pytest.approx(36.0)               # 600 more, at 1,000 a minute
    assert q._tenants["k"].finish == finish and q.pending == 2     # nothing of it was taken
    for ticket in first:
        q.done(ticket)
    clock.now = 36.0
    assert len(q.admit_all("k", [(400, 1), (400, 1)])) == 2
    with pytest.raises(Refused) as r:
        q.admit_all("other", [(1, 1)] * 5)
    assert r.value.retry_after is None and "5 prompts" in r.value.message

def test_a_full_queue_still_admits_a_tenant_below_its_share():
    q = FairQueue(10)
    for _ in range(10):
        q.admit("flood", 1)
    with pytest.raises(Refused) as r:
        q.admit("flood", 1)
    assert r.value.reason == "overloaded"
    q.admit("light", 1)                                     # holds 0 of its share of 5
    with pytest.raises(Refused):
        q.admit("flood", 1)


def test_a_request_left_in_the_queue_gives_its_place_back():
    q = FairQueue(10)
    running = q.admit("a", 1)
    waiting = q.admit("a", 1)
    q.dispatch(limit=1)
    q.done(waiting)                                         # its client went away
    assert q.queued == 0 and q.pending == 1
    q.done(running)
    assert q.pending == 0 and q.running_slots == 0


def test_a_request_of_many_choices_takes_that_many_slots_but_never_waits_on_an_idle_pool():
    q = FairQueue(10)
    big = q.admit("a", 1, slots=8)
    small = q.admit("a", 1, slots=1)
    assert q.dispatch(limit=4) == [big]                     # nothing ran: it goes alone
    assert q.dispatch(limit=4) == []
    q.done(big)
    assert q.dispatch(limit=4) == [small]


def test_the_key_file_carries_each_keys_share(tmp_path, caplog):
    f = tmp_path / "keys"
    f.write_text("# tenants\nsk-gold name=gold weight=3 max_concurrency=8\nsk-free tokens_per_minute=6000\n\n")
    f.chmod(0o644)
    keys = read_api_keys(["sk-cli"], str(f))
    assert "readable by every user" in caplog.text          # as the cluster secret's file is warned of
    caplog.clear()
    f.chmod(0o600)
    read_api_keys([], str(f))
    assert "readable" not in caplog.text
    assert [k.key for k in keys] == ["sk-cli", "sk-gold", "sk-free"]
    policies = tenant_policies(keys)
    assert policies["gold"] == TenantPolicy(weight=3.0, max_concurrency=8)
    free = keys[2].tenant
    assert free == "key-3"              # its place among the keys: nothing computed from the key
    assert policies[free].tokens_per_minute == 6000
    check = KeyCheck(keys)
    assert check.tenant_of_header("Bearer sk-gold") == "gold" and check.tenant_of_header("Bearer nope") == ""
    assert check.tenant_of_header("Bearer sk-free") == "key-3"
    assert KeyCheck(["sk-a", "sk-free"]).tenant_of_header("Bearer sk-free") == "key-2"
    assert ApiKey.parse(keys[1].line()).options == keys[1].options
    f.write_text("sk-x colour=blue\n")
    with pytest.raises(ValueError, match="line 1: unknown API key option"):
        read_api_keys([], str(f))
    with pytest.raises(ValueError, match="weight"):
        tenant_policies([ApiKey("k", (("weight", "-1"),))])


def test_few_prompts_wait_at_the_workers_however_many_slots_are_free():
    """Dispatch stops at `prefill_limit` tickets without a first token: a later tenant's
    prompt then waits behind those few, not behind a whole flood sent to the workers."""
    q = FairQueue(1000)
    flood = [q.admit("flood", 1) for _ in range(100)]
    assert q.dispatch(limit=64, prefill_limit=4) == flood[:4]
    light = q.admit("light", 1)
    q.first_token(flood[0])
    assert q.dispatch(limit=64, prefill_limit=4) == [light]
    q.done(flood[1])                                    # ended before its first token
    assert q.dispatch(limit=64, prefill_limit=4) == [flood[4]]
    assert q.prefilling == 4 and q.running_slots == 5


def test_a_flood_leaves_the_headroom_free_for_another_tenant():
    """With a headroom, a lone flood stops short of the limit (slots and prompts), and a
    newcomer's ticket takes the slots kept free at once, ahead of the flood's queue."""
    q = FairQueue(1000)
    flood = [q.admit("flood", 1) for _ in range(100)]
    got = q.dispatch(limit=20, prefill_limit=4, headroom=4)
    assert got == flood[:3]                              # one prompt's place kept
    for t in got:
        q.first_token(t)
    while got := q.dispatch(limit=20, prefill_limit=4, headroom=4):
        for t in got:
            q.first_token(t)
    assert q.running_slots == 16                         # 4 slots kept
    light = q.admit("light", 1)
    assert q.dispatch(limit=20, prefill_limit=4, headroom=4) == [light]
    q.done(flood[0])                                     # 16 run: the limit less the headroom
    assert q.dispatch(limit=20, prefill_limit=4, headroom=4) == []
    q.done(light)
    assert q.dispatch(limit=20, prefill_limit=4, headroom=4) == [flood[16]]


def test_where_tenants_share_a_flood_gets_the_later_priority_at_the_workers():
    """With `prioritize`, a ticket gets priority 0 only while its tenant is under the
    share it would have beside one more tenant and has no prompt prefilling; the others
    1, so their prompts wait at the workers behind a newcomer's. A flood's start is within
    its share, but its first prompt already prefills: the rest go behind another tenant's
    first. Without `prioritize` (a lone tenant's cluster) every ticket has 0."""
    q = FairQueue(1000)
    flood = [q.admit("flood", 1) for _ in range(40)]
    got = q.dispatch(limit=20, prioritize=True)
    assert [t.priority for t in got] == [0] + [1] * 19
    light = q.admit("light", 1)
    q.done(flood[0])
    assert q.dispatch(limit=20, prioritize=True) == [light] and light.priority == 0
    q.done(flood[1])
    (next_flood,) = q.dispatch(limit=20, prioritize=True)
    assert next_flood.tenant == "flood" and next_flood.priority == 1
    # a tenant with nothing prefilling, within its share, is first again
    q3 = FairQueue(1000)
    a, b = q3.admit("a", 1), q3.admit("a", 1)
    assert [t.priority for t in q3.dispatch(limit=20, prioritize=True)] == [0, 1]
    q3.first_token(a)
    q3.first_token(b)
    c = q3.admit("a", 1)
    assert q3.dispatch(limit=20, prioritize=True) == [c] and c.priority == 0
    q2 = FairQueue(1000)
    for _ in range(40):
        q2.admit("flood", 1)
    assert {t.priority for t in q2.dispatch(limit=20)} == {0}


def test_two_floods_both_stay_out_of_the_headroom():
    """Each of two flooding tenants runs past the share it would have beside a third:
    neither takes the headroom, which stays for whoever comes next."""
    q = FairQueue(1000)
    for _ in range(50):
        q.admit("a", 1)
        q.admit("b", 1)
    while got := q.dispatch(limit=12, headroom=4):
        pass
    assert q.running_slots == 8
    third = q.admit("c", 1)
    assert q.dispatch(limit=12, headroom=4) == [third]


def test_dispatch_never_scans_a_floods_backlog(monkeypatch):
    """Each call looks at each tenant's first ticket, not at every ticket queued: with a
    flood's 5,000 waiting past the headroom, a call that dispatches nothing checks the
    share of a handful of tenants, and another tenant's request still passes the backlog at once.
    (The router dispatches on every admission, first token and end: a scan of the whole
    queue made a flood's intake quadratic.)"""
    q = FairQueue(100_000)
    for _ in range(5000):
        q.admit("flood", 1)
    while got := q.dispatch(limit=64, prefill_limit=4, headroom=4):
        for t in got:
            q.first_token(t)
    checks = []
    share = FairQueue._under_share

    def counted(self, limit):
        under = share(self, limit)
        return lambda *a: checks.append(a) or under(*a)
    monkeypatch.setattr(FairQueue, "_under_share", counted)
    assert q.dispatch(limit=64, prefill_limit=4, headroom=4) == [] and len(checks) <= 3
    light = q.admit("light", 1)
    checks.clear()
    assert q.dispatch(limit=64, prefill_limit=4, headroom=4) == [light] and len(checks) <= 6
    assert q.queued == 5000 - 60


def test_tokenizer_turns_go_round_the_tenants():
    """Two slots; a flood queues 50 jobs, then another tenant one: it runs in one of the
    next two turns (round robin from the flood), not after the flood. A waiter cancelled while it waits, or just as
    it is handed a turn, loses no slot."""
    async def run() -> list[str]:
        gate, order, release = FairGate(2), [], asyncio.Event()

        async def job(tenant: str, i: int) -> None:
            async with gate.turn(tenant):
                order.append(f"{tenant}{i}")
                await release.wait()

        flood = [asyncio.create_task(job("a", i)) for i in range(50)]
        await asyncio.sleep(0)
        light = asyncio.create_task(job("b", 0))
        gone = asyncio.create_task(job("c", 0))
        await asyncio.sleep(0)
        gone.cancel()
        release.set()
        await asyncio.gather(*flood, light, return_exceptions=True)
        assert gate.free == 2 and not gate._waiting
        return order
    order = asyncio.run(run())
    assert order[:2] == ["a0", "a1"] and order.index("b0") in (2, 3) and "c0" not in order
    assert len(order) == 51


def test_a_turn_handed_to_a_caller_that_just_left_passes_on():
    """One slot: the holder ends its turn, which hands it to the next waiter, and that
    waiter is cancelled before it runs; the turn goes to the waiter after it, and the
    gate ends free."""
    async def run() -> list[str]:
        gate, order, tasks = FairGate(1), [], {}
        hold = asyncio.Event()

        async def job(tenant: str) -> None:
            async with gate.turn(tenant):
                order.append(tenant)
                if tenant == "a":
                    await hold.wait()
            if tenant == "a":
                tasks["b"].cancel()         # b was handed the turn just now, and has not run

        tasks["a"] = asyncio.create_task(job("a"))
        await asyncio.sleep(0)
        tasks["b"], tasks["c"] = asyncio.create_task(job("b")), asyncio.create_task(job("c"))
        await asyncio.sleep(0)
        hold.set()
        await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 10)   # c gets a turn
        assert gate.free == 1 and not gate._waiting
        return order
    assert asyncio.run(run()) == ["a", "c"]
