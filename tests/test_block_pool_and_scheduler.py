"""Pure-Python engine parts: block pool and the token-budget scheduler."""
import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool, NoFreeBlocks
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import Sequence, SeqStatus

EOS = frozenset({2})



def update(s: Scheduler, plan, sampled: list[int]):
    """A step's results as the engine records them: launched, then its tokens read."""
    rows = plan.sampling()
    s.launched(plan, rows)
    return s.resolve(rows, [[t] for t in sampled])

def seq(rid, prompt_len=5, max_tokens=10, first=None, priority=0, **kw):
    tokens = list(range(10, 10 + prompt_len)) + ([first] if first is not None else [])
    return Sequence(rid, tokens, prompt_len, SamplingParams(max_tokens=max_tokens, temperature=0, **kw), EOS,
                    priority=priority)


def scheduler(blocks=8, block_size=4, **config) -> Scheduler:
    config.setdefault("max_num_seqs", min(8, config.get("max_num_batched_tokens", 8)))
    return Scheduler(BlockManager(BlockPool(blocks, block_size)), SchedulerConfig(**config))


def prefilled(s: Scheduler, q: Sequence) -> Sequence:
    """`q`'s prompt KV arrived through a handoff into blocks reserved for it."""
    s.reserve(q.request_id, q.prompt_len, float("inf"))
    s.add_prefilled(q)
    return q


def step(s: Scheduler, token: int = 7):
    plan = s.schedule()
    return plan, update(s, plan, [token] * len(plan.sampling()))


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


def test_config_budget_must_cover_a_decode_token_per_sequence():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32)


def test_prefilled_sequence_decodes_and_frees_blocks_on_length():
    s = scheduler()
    q = prefilled(s, seq("a", prompt_len=5, max_tokens=3, first=7))
    plan, updates = step(s, 8)
    assert [c.seq for c in plan.decode] == [q] and not plan.prefill and plan.decode[0].start == 5
    assert [(u.token_ids, u.finish_reason) for u in updates] == [([8], None)]
    _, updates = step(s, 9)
    assert updates[0].finish_reason == "length"
    assert q.status is SeqStatus.FINISHED and s.blocks.num_available == 8 and len(s) == 0


def test_first_token_eos_finishes_at_admission():
    s = scheduler()
    q = seq("a", first=2)
    s.reserve("a", q.prompt_len, float("inf"))
    assert s.add_prefilled(q) == "stop"
    assert s.blocks.num_available == 8


def test_min_tokens_and_ignore_eos_keep_going_past_eos():
    assert seq("a", first=2, min_tokens=2).check_finished() is None
    assert seq("b", first=2, ignore_eos=True).check_finished() is None


def test_one_step_holds_decode_tokens_and_several_prompts_under_the_budget():
    s = scheduler(blocks=16, max_num_batched_tokens=20)
    running = prefilled(s, seq("r", prompt_len=4, first=5))
    a, b, c = seq("a", prompt_len=6), seq("b", prompt_len=8), seq("c", prompt_len=9)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert [x.seq for x in plan.decode] == [running]
    # 1 decode token + 6 + 8 = 15; c gets the 5 tokens left of the budget
    assert [(x.seq, x.start, x.num_tokens) for x in plan.prefill] == [(a, 0, 6), (b, 0, 8), (c, 0, 5)]
    assert plan.num_tokens == 20
    assert [x.seq for x in plan.sampling()] == [running, a, b]      # c's chunk does not end its prompt
    updates = update(s, plan, [11, 12, 13])
    assert [(u.seq, u.token_ids) for u in updates] == [(running, [11]), (a, [12]), (b, [13])]
    assert c.num_computed == 5 and c.token_ids == list(range(10, 19))
    plan = s.schedule()                       # c goes on before anything new; the others decode
    assert [(x.seq, x.start, x.num_tokens) for x in plan.prefill] == [(c, 5, 4)]
    assert {x.seq for x in plan.decode} == {running, a, b}


def test_long_prompts_are_chunked_fifo_and_never_starved():
    s = scheduler(blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
    running = prefilled(s, seq("r", prompt_len=4, first=5, max_tokens=50))
    long, short = seq("long", prompt_len=20), seq("short", prompt_len=3)
    s.add(long)
    s.add(short)
    chunks = []
    while long.num_generated == 0:
        plan, _ = step(s)
        assert running in [c.seq for c in plan.decode]   # decoding never waits for a whole prompt
        chunks += [(c.seq.request_id, c.num_tokens) for c in plan.chunks if c.seq is not running]
    # the long prompt holds the budget's remainder each step; the short one starts only
    # once the long one has its last chunk in (a one-token chunk runs as a decode row)
    assert chunks == [("long", 7), ("long", 7), ("short", 1), ("long", 6)]


def test_a_more_urgent_prompt_goes_first_and_alone_among_new_prompts():
    """Priority (lower first, arrival order within one): a prompt of priority 0 passes
    the priority-1 prompts queued before it, and its step takes no new prompt of another
    priority beside it; the running sequences still decode in it."""
    s = scheduler(blocks=32, max_num_batched_tokens=32)
    running = prefilled(s, seq("r", prompt_len=4, first=5))
    flood = [seq(f"f{i}", prompt_len=4, priority=1) for i in range(3)]
    for q in flood:
        s.add(q)
    urgent = seq("u", prompt_len=4)
    s.add(urgent)
    plan = s.schedule()
    assert [c.seq for c in plan.prefill] == [urgent]
    assert [c.seq for c in plan.decode] == [running]
    update(s, plan, [7, 8])
    plan = s.schedule()
    assert [c.seq for c in plan.prefill] == flood             # then the others, in arrival order


def test_a_step_ahead_takes_only_prompts_more_urgent_than_the_paused_one():
    """`schedule_ahead(below)` (planned while a pass is paused between its layers): the
    waiting prompts of the most urgent priority under `below`, oldest first; the running
    sequences (the paused pass's) and the other prompts are left as they are, and only
    free blocks are taken."""
    s = scheduler(blocks=32, max_num_batched_tokens=32, prefill_only=True)
    paused = seq("p", prompt_len=8, priority=1)
    s.add(paused)
    assert [c.seq for c in s.schedule().prefill] == [paused]      # its pass is running
    later = [seq("f", prompt_len=4, priority=1), seq("u1", prompt_len=4, priority=0),
             seq("m", prompt_len=4, priority=2), seq("u2", prompt_len=5, priority=0)]
    for q in later:
        s.add(q)
    free = s.blocks.num_available
    ahead = s.schedule_ahead(below=1)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in ahead.prefill] == [("u1", 0, 4), ("u2", 0, 5)]
    assert s.running == [paused, later[1], later[3]] and paused.num_computed == 0
    assert list(s.waiting) == [later[0], later[2]] and s.blocks.num_available == free - 3
    assert not s.schedule_ahead(below=0) and not s.schedule_ahead(below=1)


def test_a_short_prompt_goes_whole_beside_decodes_and_a_long_one_in_capped_chunks():
    """With mixed_whole_prompt, a new prompt up to that size goes whole into a step that
    decodes when no other prompt tokens are in it (then nothing else joins it); a longer
    one, or one after another prompt's tokens, keeps the max_mixed_prefill cap."""
    s = scheduler(blocks=64, max_num_batched_tokens=32, max_mixed_prefill=4, mixed_whole_prompt=12)
    running = prefilled(s, seq("r", prompt_len=4, first=5, max_tokens=50))
    short, after = seq("short", prompt_len=12), seq("after", prompt_len=3)
    s.add(short)
    s.add(after)
    plan = s.schedule()
    assert [(c.seq, c.num_tokens) for c in plan.prefill] == [(short, 12)]
    assert [c.seq for c in plan.decode] == [running]
    update(s, plan, [7, 8])
    long = seq("long", prompt_len=13)
    s.add(long)
    chunks = []
    while long.num_generated == 0:
        plan, _ = step(s)
        chunks += [(c.seq.request_id, c.num_tokens) for c in plan.chunks if c.seq in (after, long)]
    assert ("after", 3) in chunks
    assert sum(n for r, n in chunks if r == "long") == 13 and max(n for r, n in chunks if r == "long") == 4


def test_prompts_the_step_cannot_afford_wait_without_taking_blocks():
    """Beside a decoding sequence (a decode worker's step), prompt tokens cost more the
    more they attend to: once what the step has left affords no token of the next
    prompt, that prompt and those after it wait, holding no blocks and no slot."""
    s = scheduler(blocks=256, max_num_seqs=16, max_num_batched_tokens=512, max_mixed_prefill=64,
                  context_cost=0.01)
    prefilled(s, seq("d", prompt_len=6, first=19))
    for i in range(5):
        s.add(seq(f"w{i}", prompt_len=40))
    plan = s.schedule()
    assert all(c.num_tokens > 0 for c in plan.chunks), [(c.seq.request_id, c.num_tokens) for c in plan.chunks]
    assert [q.request_id for q in s.running] == [c.seq.request_id for c in plan.chunks]
    assert s.num_waiting >= 2

def test_prefill_chunk_caps_one_prompt_per_step():
    s = scheduler(blocks=16, max_num_batched_tokens=16, max_prefill_chunk=4)
    a, b = seq("a", prompt_len=10), seq("b", prompt_len=6)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert [(c.seq, c.num_tokens) for c in plan.prefill] == [(a, 4), (b, 4)]


def test_prompt_tokens_beside_decoding_sequences_are_capped_across_prompts():
    s = scheduler(blocks=32, max_num_batched_tokens=32, max_mixed_prefill=6)
    a, b = seq("a", prompt_len=10), seq("b", prompt_len=10)
    s.add(a)
    s.add(b)
    plan = s.schedule()                       # nothing decodes yet: the whole budget
    assert [(c.seq, c.num_tokens) for c in plan.prefill] == [(a, 10), (b, 10)]
    update(s, plan, [7, 7])
    c, d = seq("c", prompt_len=9), seq("d", prompt_len=9)
    s.add(c)
    s.add(d)
    seen = []
    while d.num_generated == 0:
        plan, _ = step(s)
        assert {x.seq for x in plan.decode} >= {a, b}         # a and b get a token every step
        assert sum(x.num_tokens for x in plan.prefill) <= 6   # all prompts together, not each
        seen += [(x.seq.request_id, x.num_tokens) for x in plan.chunks if x.seq in (c, d)]
    # c's 9 tokens go 6 + 3 and d starts in the room c leaves that step; then c decodes
    assert seen == [("c", 6), ("c", 3), ("d", 3), ("c", 1), ("d", 6)]
    with pytest.raises(ValueError):
        SchedulerConfig(max_mixed_prefill=-1)


def test_a_long_prompts_later_chunks_beside_decodes_are_smaller_by_what_they_attend_to():
    """With a context cost, the cap counts what a chunk costs: each token also attends
    to every token before it, so a chunk late in a long prompt takes fewer tokens, and
    every step that decodes beside it costs about what the first chunk's did."""
    w = 0.01                                  # attending 100 tokens costs one token's matmuls
    s = scheduler(blocks=128, max_num_batched_tokens=64, max_mixed_prefill=16, context_cost=w)
    running = prefilled(s, seq("r", prompt_len=4, first=5, max_tokens=200))
    long = seq("long", prompt_len=300)
    s.add(long)
    chunks = []
    while long.num_generated == 0:
        plan, _ = step(s)
        assert plan.decode and plan.decode[0].seq is running
        chunks += [(c.start, c.num_tokens) for c in plan.prefill]
    assert sum(n for _, n in chunks) == 300 and chunks[0] == (0, 16)

    def cost(start, n):
        return n * (1 + w * (start + (n - 1) / 2))
    allowance = cost(0, 16)
    for start, n in chunks[:-1]:               # each as large as the allowance takes
        assert cost(start, n) <= allowance * (1 + 1e-9) < cost(start, n + 1), (start, n)
    assert [n for _, n in chunks[:-1]] == sorted((n for _, n in chunks[:-1]), reverse=True)
    assert chunks[-2][1] < 8                   # past 200 tokens of context, under half the first chunk
    with pytest.raises(ValueError):
        SchedulerConfig(context_cost=-1.0)


def test_out_of_blocks_preempts_newest_and_recomputes_its_tokens():
    s = scheduler(blocks=3, block_size=2)
    a = prefilled(s, seq("a", prompt_len=2, first=1, max_tokens=50))
    b = prefilled(s, seq("b", prompt_len=2, first=1, max_tokens=50))
    plan, _ = step(s, 3)                      # each needs a 2nd block: 1 free -> b is preempted
    assert [c.seq for c in plan.decode] == [a] and b.status is SeqStatus.WAITING and b.block_ids == []
    assert s.num_preemptions == 1
    s.abort("a")
    plan = s.schedule()                       # b recomputes prompt and first token, then samples
    assert [(c.seq, c.start, c.num_tokens, c.samples) for c in plan.prefill] == [(b, 0, 3, True)]
    updates = update(s, plan, [4])
    assert b.token_ids[-2:] == [1, 4] and updates[0].seq is b and b.num_computed == 3


def test_abort_frees_blocks_in_any_state():
    s = scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    a = prefilled(s, seq("a", first=1))
    b = prefilled(s, seq("b", first=1))
    s.schedule()
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.READY
    c = seq("c", prompt_len=3)
    s.add(c)
    for rid in ("b", "a", "c", "missing"):
        s.abort(rid)
    assert s.blocks.num_available == 8 and len(s) == 0 and not s.has_work()


def test_prefill_only_ends_at_the_first_token_and_holds_blocks_until_released():
    s = scheduler(blocks=8, prefill_only=True, retain_finished=True)
    q = seq("p", prompt_len=6)
    s.add(q)
    _, updates = step(s, 42)
    assert [(u.token_ids, u.finish_reason) for u in updates] == [([42], "prefilled")]
    assert s.blocks.num_available == 6 and "p" in s.retained       # its transfers may still read them
    s.release("p")
    assert s.blocks.num_available == 8 and not s.retained


def test_prefix_cache_hit_skips_cached_blocks():
    s = Scheduler(BlockManager(BlockPool(8, 4), prefix_caching=True),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    first = seq("one", prompt_len=10, max_tokens=1)
    s.add(first)
    step(s)
    again = seq("two", prompt_len=10, max_tokens=1)
    s.add(again)
    plan = s.schedule()
    assert [(c.start, c.num_tokens) for c in plan.prefill] == [(8, 2)] and again.num_cached == 8


def test_a_prompt_shares_the_blocks_a_running_sequence_has_computed():
    s = Scheduler(BlockManager(BlockPool(16, 4), prefix_caching=True),
                  SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=6))
    first = seq("one", prompt_len=10, max_tokens=5)
    s.add(first)
    step(s)                                     # tokens 0-5: one full block computed, the second not yet
    s.add(seq("two", prompt_len=10, max_tokens=5))
    plan, _ = step(s)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in plan.prefill] == [("one", 6, 4), ("two", 4, 6)]
    s.add(late := seq("three", prompt_len=10, max_tokens=5))
    plan, _ = step(s)                           # "one" is still running: its two full blocks are shared
    assert late.num_cached == 8 and late.block_ids[:2] == first.block_ids[:2]
    assert [(c.seq.request_id, c.start) for c in plan.prefill] == [("three", 8)]
    while s.has_work():
        step(s)
    assert s.blocks.num_available == 16


def test_admission_keeps_a_watermark_while_others_run():
    s = scheduler(blocks=200, block_size=4, max_num_batched_tokens=1024)
    prefilled(s, seq("r", prompt_len=4, first=5))
    big = seq("big", prompt_len=4 * 198)      # would leave 1 block: under the 2-block watermark
    s.add(big)
    assert not s.schedule().prefill and big.status is SeqStatus.WAITING


def two_launched(a_tokens: int):
    """Two prefilled sequences, a (`a_tokens` at most) and b, in a step launched and not
    yet read (async scheduling): the scheduler, a, b, the step's rows and its number."""
    s = scheduler(blocks=8, block_size=4)
    a = prefilled(s, seq("a", prompt_len=5, first=1, max_tokens=a_tokens))
    b = prefilled(s, seq("b", prompt_len=5, first=1, max_tokens=10))
    first = s.schedule()
    rows = first.sampling()
    n1 = s.launch()
    s.launched(first, rows)
    return s, a, b, rows, n1


def test_a_launched_step_holds_pending_tokens_and_the_blocks_given_back_meanwhile():
    """Async scheduling: a launched step's sampled tokens stand as PENDING until resolved;
    the next step is planned over them; blocks given back while a step may still write
    them (an abort, a sequence finished by the step before) wait until it lands."""
    from services.engine.core.sequence import PENDING
    s, a, b, rows, n1 = two_launched(a_tokens=2)
    assert a.token_ids[-1] == b.token_ids[-1] == PENDING and s.in_flight
    second = s.schedule()                     # planned over the pending tokens
    assert [(c.seq, c.start) for c in second.decode] == [(a, 6), (b, 6)]
    n2 = s.launch()
    updates = s.resolve(rows, [[8], [9]])         # the first step's tokens: a reaches max_tokens
    assert [(u.seq.request_id, u.token_ids, u.finish_reason) for u in updates] == [("a", [8], "length"),
                                                                                    ("b", [9], None)]
    s.landed(n1)
    # a's blocks stay held: the second step, still running, writes a row of a's
    assert a.status is SeqStatus.FINISHED and s.blocks.num_available == 8 - 2 - 2
    rows = second.sampling()                  # taken before launched(): the PENDING tokens change it
    s.launched(second, rows)
    assert a.token_ids[-1] == 8 and b.token_ids[-2:] == [9, PENDING]
    s.abort("b")
    assert s.resolve(rows, [[5], [6]]) == []      # both ended: their tokens are dropped
    assert s.blocks.num_available == 4
    s.landed(n2)
    assert s.blocks.num_available == 8 and not s.in_flight


def test_under_a_step_in_flight_a_sequence_short_of_a_block_waits_instead_of_preempting():
    s = scheduler(blocks=3, block_size=2)
    a = prefilled(s, seq("a", prompt_len=2, first=1, max_tokens=50))
    b = prefilled(s, seq("b", prompt_len=2, first=1, max_tokens=50))
    s.launch()                                # as if a step were on the device
    plan = s.schedule()                       # each needs a 2nd block: 1 free -> a takes it, b waits
    assert [c.seq for c in plan.decode] == [a] and b.status is SeqStatus.RUNNING
    assert s.num_preemptions == 0 and s.num_sat_out == 1
    s.add(seq("c", prompt_len=1))
    assert s.schedule().prefill == []         # nor does a newcomer take what b waits for


def test_a_block_copy_holds_both_its_blocks_until_the_step_queued_after_it_lands():
    """A fork's copy of its parent's last prompt block is only queued on the device, ahead
    of the next step (copies_made): the source and the destination are held like blocks
    given back while a step runs, until that step lands, even when their sequences end
    first. Given back at once, the parent's block (it ended on its first token) would be
    handed to the next taker, whose transfer could write it before the copy reads it."""
    s = scheduler(blocks=8, block_size=4)
    child = Sequence("r#1", [], 5, SamplingParams(max_tokens=1, temperature=0), EOS)
    parent = seq("r#0", prompt_len=5, first=1, max_tokens=1)
    parent.forks = [child]
    prefilled(s, parent)                      # forks, then ends at once: its blocks go back
    (src, dst), = s.copies
    assert parent.status is SeqStatus.FINISHED and child.block_ids[-1] == dst
    plan = s.schedule()                       # the child computes its last prompt token
    s.copies_made()                           # the engine queued the copy ahead of this step
    number = s.launch()
    s.launched(plan, plan.sampling())
    taken = s.blocks.allocate(s.blocks.num_available)     # a reservation takes all it can
    assert src not in taken and dst not in taken
    s.abort("r#1")                            # the child ends too before the step lands
    assert s.blocks.num_available == 0
    s.landed(number)
    assert s.blocks.num_available == 8 - len(taken) and not s.in_flight
    s.blocks.release(taken)
    assert s.blocks.num_available == 8


def test_a_choice_aborted_before_its_parents_prompt_is_done_never_starts():
    """n > 1: a choice waits on its parent's prompt to fork from it. Aborted alone
    before that (a stop string of the client's, a cancel), it is dropped there, and the
    parent's first token forks no sequence for it."""
    s = scheduler(blocks=16, max_num_batched_tokens=64)
    parent = seq("r", prompt_len=6, max_tokens=50)
    child = Sequence("r#1", [], 6, SamplingParams(max_tokens=50, temperature=0), EOS)
    parent.forks = [child]
    s.add(parent)
    assert s.abort("r#1") is child and child.finish_reason == "abort"
    step(s, 19)
    assert s.get("r#1") is None and not s.copies and [q.request_id for q in s.running] == ["r"]


def test_a_sequence_left_no_token_ends_at_the_tokens_it_has_and_gives_its_blocks_back():
    """NO_TOKEN (constraints that leave no token) ends a sequence with NO_TOKEN_LEFT, also
    while the next step runs over its pending token: its token list and computed KV stop
    at the tokens it made, and its blocks go back once that step lands."""
    from services.engine.core.sequence import NO_TOKEN, NO_TOKEN_LEFT, PENDING
    s, a, b, rows, n1 = two_launched(a_tokens=10)
    second = s.schedule()                     # launched over the pending tokens, as the engine does:
    later = second.sampling()                 # its rows taken, then the first step's tokens read
    n2 = s.launch()
    updates = s.resolve(rows, [[NO_TOKEN], [9]])
    assert [(u.seq.request_id, u.token_ids, u.finish_reason) for u in updates] == [("a", [], NO_TOKEN_LEFT),
                                                                                    ("b", [9], None)]
    assert a.token_ids == list(range(10, 15)) + [1] and PENDING not in a.token_ids and a.num_computed <= 6
    s.launched(second, later)
    s.landed(n1)
    assert [(u.seq, u.finish_reason) for u in s.resolve(later, [[5], [NO_TOKEN]])] == [(b, NO_TOKEN_LEFT)]
    assert b.token_ids[-1] == 9
    s.landed(n2)
    assert s.blocks.num_available == 8 and len(s) == 0


def test_a_step_computes_prompt_logprobs_for_a_bounded_number_of_positions():
    """Each prompt position with prompt_logprobs is a whole-vocabulary row through the
    head, in float32, and its log-softmax: a step takes PROMPT_LOGPROB_ROWS of them at
    most, all sequences together; the rest of those prompts come in later steps, and
    prompts without wait for none of it."""
    from services.engine.core.scheduler import PROMPT_LOGPROB_ROWS
    s = scheduler(blocks=256, block_size=16, max_num_batched_tokens=2048)
    a = seq("a", prompt_len=300, max_tokens=2, prompt_logprobs=1)
    b = seq("b", prompt_len=300, max_tokens=2, prompt_logprobs=1)
    c = seq("c", prompt_len=300, max_tokens=2)
    for q in (a, c, b):
        s.add(q)
    plan = s.schedule()
    assert [(ch.seq.request_id, ch.num_tokens) for ch in plan.prefill] == [("a", PROMPT_LOGPROB_ROWS), ("c", 300)]
    update(s, plan, [7] * len(plan.sampling()))
    plan = s.schedule()
    assert [(ch.seq.request_id, ch.num_tokens) for ch in plan.prefill] == [("a", 300 - PROMPT_LOGPROB_ROWS),
                                                                           ("b", PROMPT_LOGPROB_ROWS - 44)]


def test_a_prompt_too_dear_for_a_mixed_steps_allowance_goes_a_token_a_step_and_none_empty():
    """Beside decoding sequences a prompt chunk is priced by what it attends to: a prompt
    sharing a long cached prefix is admitted, but one token at its position costs more
    than the step's allowance. It then runs a token a step (it sat in the plan with an
    empty chunk, then waited for every decode to end)."""
    from services.engine.core.block_manager import BlockManager
    from services.engine.core.block_pool import BlockPool
    s = Scheduler(BlockManager(BlockPool(128, 4), prefix_caching=True),
                  SchedulerConfig(max_num_batched_tokens=64, max_mixed_prefill=8, context_cost=0.05, max_num_seqs=4))
    long = list(range(100, 300))
    a = Sequence("a", long + [1], 201, SamplingParams(max_tokens=30, temperature=0), EOS)
    s.add(a)
    while a.num_generated == 0:
        step(s)
    b = Sequence("b", long + [2, 3, 4, 5, 6], 205, SamplingParams(max_tokens=5, temperature=0), EOS)
    s.add(b)
    for _ in range(3):
        plan, _ = step(s)
        assert all(c.num_tokens > 0 for c in plan.chunks)
    assert b.num_computed > 200 and b.num_cached == 200
