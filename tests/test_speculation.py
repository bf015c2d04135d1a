"""Speculative decoding's host side, pure Python: the flag, the proposers, the adaptive
cut, and the scheduler's verify chunks (drafts kept while their samples agree, the
rest rolled back, their blocks returned)."""
import gc
import random
import tracemalloc

import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.sequence import PENDING, Sequence, SeqStatus
from services.engine.core.speculation import (Draft, NgramProposer, SpeculativeConfig, Speculator,
                                                 SuffixProposer)

EOS = frozenset({2})


def seq(rid, tokens, prompt_len=None, max_tokens=50, **kw):
    return Sequence(rid, list(tokens), len(tokens) if prompt_len is None else prompt_len,
                    SamplingParams(max_tokens=max_tokens, temperature=0, **kw), EOS)


# ---- the flag ----

def test_the_config_is_vllm_shaped_json_and_refuses_what_it_cannot_use():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == ("ngram", 5, 3, 2)
    assert SpeculativeConfig.parse('{"method": "suffix"}').method == "suffix"
    assert SpeculativeConfig.parse('{"model": "m"}').method == "draft"            # vLLM infers it from the model
    assert SpeculativeConfig.parse('{"method": "draft_model", "model": "m"}').method == "draft"
    for bad, says in [("{", "not JSON"), ("[1]", "JSON object"), ('{"method": "eagle"}', "method"),
                      ('{"num_speculative_tokens": 0}', "1 to 32"), ('{"num_speculative_tokens": 33}', "1 to 32"), ('{"num_speculative_tokens": "4"}', "int"),
                      ('{"num_speculative_tokens": true}', "int"), ('{"adaptive": 1}', "bool"),
                      ('{"prompt_lookup_min": 5}', "prompt_lookup_min"), ('{"draft_model": "x"}', "unknown keys"),
                      ('{"method": "draft"}', "draft model"), ('{"method": "ngram", "model": "m"}', "only it"),
                      ('{"model": "m", "quantization": "fp8"}', "quantization")]:
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.parse(bad)


# ---- proposers ----

def test_ngram_proposes_what_followed_the_longest_earlier_match():
    p = NgramProposer(SpeculativeConfig(prompt_lookup_min=1, prompt_lookup_max=3))
    s = seq("a", [5, 6, 7, 8, 9, 1, 6, 7, 8, 4, 3, 6, 7])
    # "6 7" occurs twice before; the longest tail match "3 6 7"? no: "6 7" (and "7"), the most recent
    assert p.propose(s, 3) == [8, 4, 3]
    s.token_ids.append(8)                            # "6 7 8": its latest occurrence is followed by 4 3 6
    assert p.propose(s, 5) == [4, 3, 6, 7, 8]
    assert p.propose(seq("b", [1, 2, 3, 4]), 4) == []            # nothing repeats
    t = seq("c", [1, 2, 3, 1, 2])
    assert p.propose(t, 4) == [3, 1, 2]                           # runs up to the end of the history


def test_ngram_grows_its_index_with_the_sequence_and_forgets_it():
    p = NgramProposer(SpeculativeConfig())
    s = seq("a", [1, 2, 3, 4])
    assert p.propose(s, 2) == []
    s.token_ids += [9, 1, 2]
    assert p.propose(s, 2) == [3, 4]
    p.finished(s)
    assert len(p._index) == 0
    t = seq("b", [1, 2, 3, 1, 2])
    p.propose(t, 2)
    del t
    gc.collect()
    assert len(p._index) == 0                    # a sequence dropped without finished() leaves nothing


def test_suffix_follows_confident_continuations_of_its_own_and_others_outputs():
    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_min_token_prob=0.5,
                                         suffix_decoding_max_spec_factor=2.0))
    done = seq("old", [1, 1, 40, 41, 42, 43, 44], prompt_len=2)
    p.finished(done)                                  # its output enters the worker's index
    s = seq("new", [7, 8, 40, 41], prompt_len=2)
    assert p.propose(s, 8) == [42, 43, 44]            # from the other request's output
    # its own history: "5 6" was followed by 7 twice and by 9 once: 7 (2/3) is confident
    own = seq("own", [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 9, 3, 5, 6])
    assert p.propose(own, 1) == [7] and p.propose(own, 1).split == [True]     # the occurrences disagreed
    assert p.propose(s, 8).split == [False] * 3
    unsure = seq("unsure", [5, 6, 7, 5, 6, 8, 5, 6, 9, 5, 6])
    assert p.propose(unsure, 4) == []                 # 1/3 each: below the floor


def test_suffix_drafts_as_far_as_its_match_is_long_by_default_as_vllm():
    c = SpeculativeConfig.parse('{"method": "suffix"}')
    assert c.num_speculative_tokens == c.suffix_decoding_max_tree_depth == 24          # vLLM's default
    assert SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_tree_depth": 8}').num_speculative_tokens == 8
    assert SpeculativeConfig.parse('{"method": "ngram"}').num_speculative_tokens == 4
    p = SuffixProposer(c)
    text = list(range(100, 160))
    s = seq("copy", [*text, 1, *text[:3]], prompt_len=len(text) + 4)
    assert p.propose(s, 30) == text[3:6]              # a 3-token match drafts 3 (max_spec_factor 1.0)
    s.token_ids += text[3:20]                          # a 20-token match: 20 of the 24 allowed
    assert p.propose(s, 30) == text[20:40]
    s.token_ids += text[20:30]
    assert p.propose(s, 30) == text[30:54]             # capped by the depth, 24
    half = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_spec_factor=0.5))
    assert half.propose(seq("h", [*text, 1, *text[:10]]), 30) == text[10:15]
    with pytest.raises(ValueError, match="max_spec_factor"):
        SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_spec_factor": -1}')


def test_suffix_keeps_a_bounded_number_of_outputs():
    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=2))
    for i in range(5):
        p.finished(seq(f"r{i}", [0, 100 + i, 200 + i, 300 + i], prompt_len=1))
    assert len(p.recent[""].spans) == 2
    assert p.propose(seq("x", [9, 100, 200], prompt_len=1), 2) == []      # r0 forgotten
    assert p.propose(seq("y", [9, 104, 204], prompt_len=1), 2) == [304]
    assert set(p.recent[""].index.where) == {103, 203, 104, 204}          # each followed by a token of its output
    assert len(p.recent[""].index.tokens) <= 2 * 2 * 4                   # forgotten tokens are dropped too
    for i in range(5, 500):
        p.finished(seq(f"r{i}", [0, 100 + i, 200 + i, 300 + i], prompt_len=1))
    assert len(p.recent[""].index.tokens) <= 2 * 2 * 4 and len(p.recent[""].index.where) == 4


def test_suffix_drafts_from_the_outputs_of_its_own_salt_only():
    """The outputs kept for drafting are split by prefix-cache salt (each API key's own):
    another key's answer is never drafted, so how fast a request streams tells nothing of
    what others were told. The bound counts every salt's outputs together."""
    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=3))
    p.finished(seq("a", [0, 100, 200, 300, 400], prompt_len=1, cache_salt="key-a"))
    assert p.propose(seq("b", [9, 100, 200], prompt_len=1, cache_salt="key-b"), 2) == []
    assert p.propose(seq("a2", [9, 100, 200], prompt_len=1, cache_salt="key-a"), 2) == [300, 400]
    assert p.propose(seq("none", [9, 100, 200], prompt_len=1), 2) == []
    for i, salt in enumerate(["key-b", "", "key-b"]):          # three more: key-a's is the oldest, forgotten
        p.finished(seq(f"r{i}", [0, 500 + i, 600 + i, 700 + i], prompt_len=1, cache_salt=salt))
    assert set(p.recent) == {"key-b", ""} and sum(len(o.spans) for o in p.recent.values()) == 3
    assert p.propose(seq("a3", [9, 100, 200], prompt_len=1, cache_salt="key-a"), 2) == []
    assert p.propose(seq("b2", [9, 502, 602], prompt_len=1, cache_salt="key-b"), 1) == [702]


def test_suffix_indexes_a_long_history_in_one_int_a_token():
    """A trie of every context of up to 24 tokens made ~24 objects a token (~10 KB: GBs at
    the default 1,000 outputs kept, and seconds of the collector's time): the index is a
    position a token, measured as the bytes it allocates, and a long sequence still finds
    its copied passage among the latest occurrences of its last token."""
    rng = random.Random(0)
    p = SuffixProposer(SpeculativeConfig(method="suffix", suffix_decoding_max_cached_requests=1000))
    done = [seq(f"r{i}", [0] + [rng.randrange(100, 3000) for _ in range(300)], prompt_len=1) for i in range(1000)]
    tracemalloc.start()
    try:
        for s in done:
            p.finished(s)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 100 * 1000 * 300                     # ~70 bytes a token
    text = [rng.randrange(100, 3000) for _ in range(8000)]
    long = seq("long", [1, *text, *text[100:130]])
    assert p.propose(long, 24) == text[130:154]        # a 24-token match: 24 drafted


# ---- the adaptive cut ----

def test_the_cut_drafts_only_what_pays_for_its_rows():
    spec = Speculator(SpeculativeConfig(method="ngram", prompt_lookup_min=1))
    seqs = [seq(f"s{i}", [1, 2, 3, 1, 2], prompt_len=3) for i in range(4)]
    first = spec.drafts([(s, 10) for s in seqs])
    assert all(first[s] == [3, 1, 2] for s in seqs)          # no costs measured yet: everything
    # A decode step costs 10 ms plus 10 ms a row: a drafted row costs as much as a plain one.
    for rows in (1, 4, 8, 16, 4, 8):
        spec.observe(rows, 0.010 + 0.010 * rows)
    for s in seqs:                                            # nothing was ever accepted
        for _ in range(20):
            spec.accepted(s, 3, 0)
    spec._steps = 1
    assert spec.drafts([(s, 10) for s in seqs]) == {}
    newcomer = seq("new", [1, 2, 3, 1, 2], prompt_len=3)
    assert spec.drafts([(s, 10) for s in seqs] + [(newcomer, 10)]) == {newcomer: [3, 1, 2]}   # its first: whole
    spec.accepted(newcomer, 3, 0)
    assert spec.drafts([(newcomer, 10)]) == {}                 # then its record decides
    for s in seqs:                                            # now every draft is accepted
        for _ in range(40):
            spec.accepted(s, 3, 3)
    assert all(len(d) == 3 for d in spec.drafts([(s, 10) for s in seqs]).values())


def test_the_cut_follows_the_step_cost():
    spec = Speculator(SpeculativeConfig(method="ngram", prompt_lookup_min=1))
    s = seq("s", [1, 2, 3, 1, 2], prompt_len=3)
    for _ in range(30):
        spec.accepted(s, 3, 1)                                # about one draft in two accepted
    for rows in (1, 2, 4, 8):                                 # rows are nearly free (memory-bound decode)
        spec.observe(rows, 0.050 + 0.0001 * rows)
    spec._steps = 1
    assert len(spec.drafts([(s, 10)])[s]) == 3
    spec2 = Speculator(SpeculativeConfig(method="ngram", prompt_lookup_min=1))
    for _ in range(30):
        spec2.accepted(s, 3, 1)
    for rows in (1, 2, 4, 8):                                 # rows cost all (compute-bound)
        spec2.observe(rows, 0.001 + 0.050 * rows)
    spec2._steps = 1
    assert spec2.drafts([(s, 10)]) == {}


class Copying:
    """A proposer that drafts `most` tokens, found after a match of `match(seq)` tokens."""
    def __init__(self, match):
        self.match = match

    def propose(self, seq, most):
        return Draft(list(range(100, 100 + most)), match=self.match(seq))

    def finished(self, seq):
        pass


def compute_bound(proposer) -> Speculator:
    """A suffix speculator whose decode steps have cost ~12 ms plus 1.5 ms a row (one CPU core)."""
    spec = Speculator(SpeculativeConfig(method="suffix"), proposer)
    for rows in (4, 8, 40, 100, 4, 60):
        spec.observe(rows, 0.012 + 0.0015 * rows)
    return spec


def test_the_cut_keeps_drafts_found_by_long_matches_and_drops_those_of_short_ones():
    """Copied passages are kept in runs: a draft found after a long match is usually kept
    whole, one after a single matched token rarely, whichever sequence drafts it. The cut
    learns that per match length: at four sequences, compute-bound, it verifies long
    matches' drafts and none of the short ones', even for a sequence whose last drafts
    (short matches, at an edit) were all rejected."""
    match = {}
    spec = compute_bound(Copying(match.__getitem__))
    seqs = [seq(f"s{i}", [1, 2, 3]) for i in range(4)]
    for _ in range(40):
        for i, s in enumerate(seqs):
            match[s] = 20 if i < 2 else 1
        spec.drafts([(s, 30) for s in seqs])
        for i, s in enumerate(seqs):
            spec.accepted(s, 24, (24, 20, 0, 1)[i])
    spec._steps = 1
    match.update({seqs[0]: 1, seqs[1]: 1, seqs[2]: 20, seqs[3]: 24})
    got = spec.drafts([(s, 30) for s in seqs])
    assert seqs[0] not in got and seqs[1] not in got
    assert len(got[seqs[2]]) >= 16 and len(got[seqs[3]]) >= 16
    assert Draft([1, 2], match=3) == [1, 2] and NgramProposer(SpeculativeConfig()).propose(
        seq("n", [1, 2, 3, 4, 1, 2, 3]), 2).match == 3      # ngram: the n-gram it matched


def test_the_cut_drops_tokens_where_the_matched_occurrences_disagreed():
    """A copied passage's source may fork (a line that occurs twice, followed by different
    lines): past the fork the draft is the majority's guess, kept far less often than
    where every occurrence agreed. With the same match length, the cut learns that per
    token: it keeps a draft's agreed tokens and drops those past the fork."""
    fork = 4

    class Forking(Copying):
        def propose(self, seq, most):
            return Draft(list(range(100, 100 + most)), match=20, split=[j >= fork for j in range(most)])

    spec = compute_bound(Forking(None))
    seqs = [seq(f"s{i}", [1, 2, 3]) for i in range(4)]
    for _ in range(40):
        spec.drafts([(s, 24) for s in seqs])
        for s in seqs:
            spec.accepted(s, 24, fork + (s is seqs[0]))    # past the fork, rarely kept
    spec._steps = 1
    got = spec.drafts([(s, 24) for s in seqs])
    assert got and all(len(d) == fork for d in got.values())
    assert Draft([1, 2, 3], split=[False, True]).classes() == [0, 1, 0]


def test_drafts_grow_past_the_longest_verified_while_runs_are_kept_whole():
    """Positions no draft has reached yet are estimated from the position before: drafts
    of 8 kept whole let the next one be verified past 8 (a flat prior of one half per
    new position held every draft at the longest ever verified)."""
    spec = compute_bound(Copying(lambda seq: 24))
    seqs = [seq(f"s{i}", [1, 2, 3]) for i in range(4)]
    spec.drafts([(s, 8) for s in seqs])
    for _ in range(20):
        for s in seqs:
            spec.accepted(s, 8, 8)
    spec._steps = 1
    assert all(len(d) > 12 for d in spec.drafts([(s, 24) for s in seqs]).values())


# ---- the scheduler's verify chunks ----

class Fixed:
    """A proposer that drafts the given tokens for every sequence."""
    def __init__(self, draft):
        self.draft = draft

    def propose(self, seq, most):
        return self.draft[:most]

    def finished(self, seq):
        pass


def speculating(draft, blocks=16, block_size=4, **config) -> Scheduler:
    spec = Speculator(SpeculativeConfig(adaptive=False))
    spec.proposer = Fixed(draft)
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 64)
    return Scheduler(BlockManager(BlockPool(blocks, block_size)), SchedulerConfig(**config), spec)


def run(s: Scheduler, sampled):
    plan = s.schedule()
    rows = plan.sampling()
    s.launched(plan, rows)
    return plan, s.resolve(rows, sampled(rows))


def test_a_replay_weighs_drafts_against_recorded_answers():
    """bench.spec_replay: answers that copy their prompts with a few changes, four at a
    time. Off, one token a row; suffix drafts win on the cost line, the oracle (every
    draft cut where it fails) at least as much, and a draft is never kept past the
    recorded answer."""
    from bench.spec_replay import replay
    rng = random.Random(0)
    answers = []
    for _ in range(8):
        prompt = [rng.randrange(3, 500) for _ in range(200)]
        output = [t if rng.random() > 0.03 else rng.randrange(3, 500) for t in prompt[:150]]
        answers.append({"prompt_ids": prompt, "output_ids": output})
    off = replay(answers, 4, None, 16.0, 1.4)
    assert off.tokens == off.rows == 8 * 149          # the first token of each comes with its prefill
    suffix = replay(answers, 4, SpeculativeConfig(method="suffix"), 16.0, 1.4)
    oracle = replay(answers, 4, SpeculativeConfig(method="suffix"), 16.0, 1.4, oracle=True)
    assert suffix.tokens == oracle.tokens == off.tokens and suffix.accepted <= suffix.drafted
    speed = [r.tokens / r.seconds for r in (off, suffix, oracle)]
    assert speed[1] > 1.5 * speed[0] and speed[2] >= speed[1]

def test_drafts_are_kept_up_to_the_first_disagreement_and_the_rest_rolled_back():
    s = speculating([20, 21, 22, 23])
    a = seq("a", range(10, 16), max_tokens=50)             # 6 prompt tokens: 2 blocks of 4
    s.add(a)
    plan, (u,) = run(s, lambda rows: [[19]])               # the prompt; first token 19
    assert (u.token_ids, plan.verify) == ([19], [])
    plan, (u,) = run(s, lambda rows: [[20, 21, 30, 31, 32]])
    (c,) = plan.verify
    assert (c.start, c.num_tokens, c.draft, c.token_ids) == (6, 5, (20, 21, 22, 23), [19, 20, 21, 22, 23])
    assert u.token_ids == [20, 21, 30]                     # two drafts kept, then the sample that differed
    assert a.token_ids[6:] == [19, 20, 21, 30] and a.num_computed == 9
    assert len(a.block_ids) == 3 and s.blocks.num_available == 16 - 3     # the drafts' 4th block came back
    plan, (u,) = run(s, lambda rows: [[20, 21, 22, 23, 24]])
    assert u.token_ids == [20, 21, 22, 23, 24] and a.num_computed == 14   # all kept, and the bonus token
    st = s.speculator.stats
    assert (st.drafts, st.draft_tokens, st.accepted_tokens, st.accepted_per_pos) == (2, 8, 6, [2, 2, 1, 1])


def test_a_sequence_ends_inside_its_drafts():
    s = speculating([20, 21, 22, 23])
    a = seq("a", range(10, 16), max_tokens=4)
    b = seq("b", range(10, 16), max_tokens=50)
    s.add(a)
    s.add(b)
    run(s, lambda rows: [[19], [19]])
    plan, (ua, ub) = run(s, lambda rows: [[20, 21, 22, 23][:c.num_sampled] for c in rows[:1]] +
                         [[20, 2, 5, 5, 5]])
    assert [c.num_tokens for c in plan.verify] == [3, 5]  # a may take 3 more tokens: 2 drafts
    assert (ua.token_ids, ua.finish_reason) == ([20, 21, 22], "length")
    assert (ub.token_ids, ub.finish_reason) == ([20, 2], "stop")          # EOS inside the drafts
    assert a.status is b.status is SeqStatus.FINISHED
    assert s.blocks.num_available == 16                     # every block back


def test_drafts_take_only_free_blocks_and_none_over_a_pending_token():
    s = speculating([20, 21, 22, 23], blocks=2)
    a = seq("a", range(10, 16), max_tokens=50)
    s.add(a)
    run(s, lambda rows: [[19]])                            # 7 tokens in 2 blocks of 4: room for 8
    plan, _ = run(s, lambda rows: [[5] * rows[0].num_sampled])
    assert plan.verify[0].draft == (20,)                    # the draft cut to the room left
    s2 = speculating([20, 21, 22, 23], blocks=2)
    b = seq("b", range(10, 17), max_tokens=50)
    s2.add(b)
    run(s2, lambda rows: [[19]])                           # 8 tokens: both blocks full
    plan, _ = run(s2, lambda rows: [[5]])
    assert plan.verify == [] and [c.seq for c in plan.decode] == [b]     # no room: no draft, no preemption
    b.token_ids.append(PENDING)
    assert s2.speculator.drafts([(b, 10)]) == {}


# ---- what `pdserve bench --server-metrics` reads ----

def test_bench_reads_acceptance_from_vllm_counter_names():
    from services.bench.server_metrics import acceptance, parse
    page = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="3"} 3.0
vllm:spec_decode_num_drafts_created 1.7e9
vllm:num_requests_running{model_name="m"} 3.0
"""
    before = parse(page.replace("10.0", "4.0").replace("40.0", "16.0").replace("25.0", "10.0"))
    a = acceptance(before, parse(page))
    assert (a.drafts, a.draft_tokens, a.accepted_tokens) == (6, 24, 15)
    assert a.rate == 15 / 24 and a.mean_length == 1 + 15 / 6
    assert acceptance({}, parse("vllm:num_requests_running 1")) is None
    assert "no drafts" in acceptance(parse(page), parse(page)).describe()


def test_drafts_never_starve_or_preempt_another_sequence():
    """Two sequences prefilled elsewhere, one block left: the first one's draft may use
    the room left in its own last block, not the free block the second needs for its own
    next token (whose free slots the second's draft may use); and drafts take no token
    of the budget another sequence's turn needs."""
    s = speculating([20, 21, 22, 23], blocks=5, max_num_batched_tokens=8, max_num_seqs=2)
    a, b = seq("a", list(range(10, 16)) + [19], prompt_len=6), seq("b", list(range(30, 38)) + [19], prompt_len=8)
    for q in (a, b):
        s.reserve(q.request_id, q.prompt_len, float("inf"))
        s.add_prefilled(q)
    assert s.blocks.num_available == 1                 # a: 2 blocks (room for 1 more token), b: 2 full ones
    plan, _ = run(s, lambda rows: [[5] * r.num_sampled for r in rows])
    # a drafts into its last block's one free slot; b into the block its own token opens
    assert [(c.seq.request_id, c.draft) for c in plan.chunks] == [("a", (20,)), ("b", (20, 21, 22))]
    assert s.num_preemptions == 0 and len(b.block_ids) == 3
    s2 = speculating([20, 21, 22, 23], blocks=16, max_num_batched_tokens=3, max_num_seqs=2)
    c, d = seq("c", list(range(10, 16)) + [19], prompt_len=6), seq("d", list(range(30, 36)) + [19], prompt_len=6)
    for q in (c, d):
        s2.reserve(q.request_id, q.prompt_len, float("inf"))
        s2.add_prefilled(q)
    plan, _ = run(s2, lambda rows: [[5] * r.num_sampled for r in rows])
    assert sorted(c.seq.request_id for c in plan.chunks) == ["c", "d"]   # the budget of 3 leaves one draft
    assert sum(len(c.draft) for c in plan.chunks) == 1


def test_drafts_leave_a_running_prompt_its_chunk_and_the_step_its_budget():
    """A prompt still being chunked runs before two decoding sequences: drafts get only
    what the prompt's chunk and every sequence's own token leave, so the step stays
    within its budget and no sequence gets a chunk of no (or negative) length."""
    s = speculating([20, 21, 22, 23], blocks=64, max_num_batched_tokens=16)
    p = seq("p", range(100, 131))
    s.add(p)
    run(s, lambda rows: [[9] * r.num_sampled for r in rows])
    for rid, base in (("d", 10), ("e", 30)):
        q = seq(rid, list(range(base, base + 6)) + [19], prompt_len=6)
        s.reserve(rid, 6, float("inf"))
        s.add_prefilled(q)
    plan = s.schedule()
    assert plan.num_tokens == sum(c.num_tokens for c in plan.chunks) <= 16
    assert all(c.num_tokens > 0 for c in plan.chunks), [(c.seq.request_id, c.num_tokens) for c in plan.chunks]


def test_a_proposer_that_raises_costs_its_drafts_not_the_step():
    """A proposer failing (a draft model out of memory) leaves the step to run without
    drafts, every sequence still planned, and the next step drafts again."""
    class Failing:
        calls = 0

        def propose(self, seq, most):
            Failing.calls += 1
            if Failing.calls == 1:
                raise RuntimeError("out of memory")
            return [20, 21]

        def finished(self, seq):
            pass
    s = speculating([])
    s.speculator.proposer = Failing()
    q = seq("q", list(range(10, 16)) + [19], prompt_len=6)
    s.reserve("q", 6, float("inf"))
    s.add_prefilled(q)
    plan, _ = run(s, lambda rows: [[5] * r.num_sampled for r in rows])
    assert [(c.seq.request_id, c.draft) for c in plan.chunks] == [("q", ())] and s.failed_drafts == 1
    plan, _ = run(s, lambda rows: [[5] * r.num_sampled for r in rows])
    assert plan.chunks[0].draft == (20, 21)
