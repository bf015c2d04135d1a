"""Pure-Python engine parts: block pool and continuous-batching scheduler."""
import pytest

from services.engine.block_pool import BlockPool, NoFreeBlocks
from services.engine.sampling import SamplingParams
from services.engine.scheduler import Scheduler, Sequence, SeqStatus

EOS = frozenset({2})


def seq(rid, prompt_len=5, max_tokens=10, first=None, **kw):
    tokens = list(range(10, 10 + prompt_len)) + ([first] if first is not None else [])
    return Sequence(rid, tokens, prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0, **kw), EOS)


def test_pool_allocates_frees_and_catches_double_free():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and len(set(a)) == 3
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free([a[0]])
    assert pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2


def test_prefilled_sequence_decodes_and_frees_blocks_on_length():
    pool = BlockPool(8, 4)
    s = Scheduler(pool)
    q = seq("a", prompt_len=5, max_tokens=3, first=7)
    q.block_ids = pool.allocate(2)
    assert s.add_prefilled(q) is None
    plan = s.schedule()
    assert plan.decode == [q] and plan.prefill is None
    assert s.on_decoded([q], [8]) == [(q, None)]
    s.schedule()
    assert s.on_decoded([q], [9]) == [(q, "length")]
    assert q.status is SeqStatus.FINISHED and pool.num_free == 8 and len(s) == 0


def test_first_token_eos_finishes_at_admission():
    pool = BlockPool(8, 4)
    s = Scheduler(pool)
    q = seq("a", first=2)
    q.block_ids = pool.allocate(2)
    assert s.add_prefilled(q) == "stop"
    assert pool.num_free == 8


def test_min_tokens_and_ignore_eos_keep_going_past_eos():
    q = seq("a", first=2, min_tokens=2)
    assert q.check_finished() is None
    q2 = seq("b", first=2, ignore_eos=True)
    assert q2.check_finished() is None


def test_local_prefill_then_join_running_batch():
    pool = BlockPool(8, 4)
    s = Scheduler(pool)
    running = seq("r", prompt_len=4, first=5)
    running.block_ids = pool.allocate(1)
    s.add_prefilled(running)
    local = seq("l", prompt_len=6)
    s.add_waiting(local)
    plan = s.schedule()
    assert plan.prefill is local and plan.decode == [running]
    assert local.tokens_to_prefill() == local.token_ids
    assert plan.prefill_len == 6
    assert s.on_prefilled(local, 6, 42) is None
    assert s.schedule().decode == [running, local]


def test_out_of_blocks_preempts_newest_and_recomputes():
    pool = BlockPool(3, 2)
    s = Scheduler(pool)
    a, b = seq("a", prompt_len=2, first=1, max_tokens=50), seq("b", prompt_len=2, first=1, max_tokens=50)
    for q in (a, b):
        q.block_ids = pool.allocate(1)
        s.add_prefilled(q)
    plan = s.schedule()                       # each needs a 2nd block: 1 free -> b is preempted
    assert plan.decode == [a] and b.status is SeqStatus.WAITING and b.block_ids == []
    assert s.num_preemptions == 1
    s.on_decoded([a], [3])
    s.abort("a")
    plan = s.schedule()
    assert plan.prefill is b and b.tokens_to_prefill() == b.token_ids[:-1]
    assert s.on_prefilled(b, plan.prefill_len, None) is None and b.num_computed == 2


def test_abort_frees_blocks_in_any_state():
    pool = BlockPool(8, 4)
    s = Scheduler(pool, max_batch=1)
    a, b = seq("a", first=1), seq("b", first=1)
    for q in (a, b):
        q.block_ids = pool.allocate(2)
        s.add_prefilled(q)
    s.schedule()
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.READY
    s.abort("b")
    s.abort("a")
    s.abort("missing")
    assert pool.num_free == 8 and len(s) == 0


def test_chunked_prefill_interleaves_with_decoding_and_can_be_aborted():
    pool = BlockPool(16, 4)
    s = Scheduler(pool, prefill_chunk=4)
    running = seq("r", prompt_len=4, first=5, max_tokens=50)
    running.block_ids = pool.allocate(2)
    s.add_prefilled(running)
    long = seq("long", prompt_len=10)
    s.add_waiting(long)
    chunks = []
    while True:
        plan = s.schedule()
        assert running in plan.decode                  # the running sequence never waits a whole prompt
        s.on_decoded(plan.decode, [7] * len(plan.decode))
        chunks.append(plan.prefill_len)
        if s.on_prefilled(long, plan.prefill_len, 9 if long.num_computed + plan.prefill_len == 10 else None):
            break
        if long.status is SeqStatus.RUNNING:
            break
    assert chunks == [4, 4, 2] and long.num_computed == 10 and long.token_ids[-1] == 9
    assert s.prefilling is None and long in s.running
    other = seq("other", prompt_len=12)
    s.add_waiting(other)
    plan = s.schedule()
    assert plan.prefill is other and plan.prefill_len == 4
    s.on_prefilled(other, 4, None)
    assert s.schedule().prefill is other               # the next chunk of the same prompt
    free = pool.num_free
    s.abort("other")
    assert s.prefilling is None and pool.num_free == free + 3
