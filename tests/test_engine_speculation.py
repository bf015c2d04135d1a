"""Speculative decoding through the engine, in one process, float32.

Lossless: with each proposer, greedy output is `model.generate`'s token for token, and
sampled output (seeded, with top-p, penalties, logprobs) is the very output the engine
gives without speculation, several sequences at once; every block comes back.
Distribution: with a proposer whose drafts the model mostly rejects, 20,000
first-position samples at temperature 1 (and top-p 0.9) agree, by a chi-square test,
with the model's own distribution there and with samples drawn without speculation (a
small Llama-shaped model of random weights: the rule under test is the verification's,
not the model's, and 20,000 rows of the real one would take minutes)."""
from __future__ import annotations

import copy
import json
import logging
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import BlockPool
from services.engine.core.sampling import SamplingParams
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core import speculation
from services.engine.core.sequence import Sequence
from services.engine.core.speculation import SpeculativeConfig, Speculator
from services.engine.engine import LLMEngine
from services.engine.model.kv_cache import KVPoolMemory
from services.engine.model.runner import ModelRunner
from services.engine.text.tokenizer import eos_token_ids, load_tokenizer
from tests.parity_cases import CASES
from tests.test_speculation import Fixed

BLOCK = 16


@pytest.fixture(scope="module")
def runner(model_dir):
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)
    return ModelRunner(model_dir, "float32", "cpu")


def generate(runner, seqs, spec: str | None, num_blocks=512, speculator: Speculator | None = None,
             async_scheduling: bool = False, steps: list | None = None) -> tuple[dict, dict, Speculator | None]:
    """Run `seqs` (fresh copies) to their ends; each one's tokens and logprobs (and in
    `steps`, the engine's count of steps launched before the one before them was read)."""
    blocks = BlockManager(BlockPool(num_blocks, BLOCK))
    memory = KVPoolMemory.allocate(runner.layout(num_blocks, BLOCK))
    if spec:
        speculator = Speculator(SpeculativeConfig.parse(spec))
    engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
                                                 speculator), async_scheduling=async_scheduling)
    out, logprobs = {}, {}
    for s in seqs:
        engine.add(Sequence(s.request_id, list(s.token_ids), s.prompt_len, s.params, s.eos_token_ids))
        out[s.request_id], logprobs[s.request_id] = [], []
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.token_ids
            logprobs[o.request_id] += [(lp.token_id, round(lp.logprob, 4), lp.top_ids) for lp in o.logprobs or ()]
    memory.close()
    assert blocks.num_available == num_blocks
    if steps is not None:
        steps.append(engine.overlapped_steps)
    return out, logprobs, speculator


@pytest.mark.slow               # the cluster's test checks ngram's greedy output on every parity prompt
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_output_is_generates_with_each_proposer(runner, model_dir, expected, method):
    eos = eos_token_ids(model_dir)
    seqs = []
    for case in CASES:
        exp = expected[case.name]
        n = len(exp.token_ids) if case.stop else case.max_tokens
        seqs.append(Sequence(case.name, list(exp.prompt_ids), len(exp.prompt_ids),
                             SamplingParams(max_tokens=n, temperature=0), eos))
    # A prompt that asks for a passage back: drafts that are accepted, many at a time.
    tok = load_tokenizer(model_dir)
    passage = " ".join(f"item {i} costs {i * 7 % 13} coins" for i in range(30))
    copy = tok(f"Repeat exactly: {passage}\n{passage}\n")["input_ids"]
    seqs.append(Sequence("copy", copy, len(copy), SamplingParams(max_tokens=60, temperature=0), eos))
    out, _, speculator = generate(runner, seqs, f'{{"method": "{method}", "adaptive": false}}')
    for case in CASES:
        assert out[case.name] == expected[case.name].token_ids[:len(out[case.name])], case.name
        assert len(out[case.name]) == len(expected[case.name].token_ids) or not case.stop
    reference, _, _ = generate(runner, seqs[-1:], None)
    assert out["copy"] == reference["copy"]
    stats = speculator.stats
    assert stats.accepted_tokens > 20 and stats.draft_tokens >= stats.accepted_tokens   # drafts really ran


class PricedSpeculator(Speculator):
    """The real speculator with a step cost fixed in advance (the cost line a worker
    learns from its step times, which a test cannot rely on): flat, drafting always
    pays; in proportion to the rows, it never does, but for a sequence's first draft
    and the exploring steps."""

    def __init__(self, config: SpeculativeConfig, pays: bool) -> None:
        super().__init__(config)
        for rows in (1, 2, 4, 8, 16):
            super().observe(rows, 0.01 if pays else 0.01 * rows)
        assert self._cost.known

    def observe(self, rows: int, seconds: float) -> None:
        pass


# Where drafting never pays the run has both kinds of step: overlapping ones, and the
# first drafts and exploring steps, verified before the next step is planned.
@pytest.mark.parametrize("pays", [pytest.param(True, marks=pytest.mark.slow), False],
                         ids=["drafting-pays", "drafting-never-pays"])
def test_async_scheduling_with_drafts_keeps_generates_output(runner, model_dir, expected, pays, caplog,
                                                             monkeypatch):
    """Under async scheduling a step that would draft reads the step in flight first and
    a verify step is read before the next is planned; where drafting does not pay, the
    steps overlap as without a speculator. Greedy output is generate's either way, and
    no step failed (a failed step is run again one sequence at a time, which would hide
    a wrong plan)."""
    eos = eos_token_ids(model_dir)
    tok = load_tokenizer(model_dir)
    passage = " ".join(f"item {i} costs {i * 7 % 13} coins" for i in range(20))
    copy = tok(f"Repeat exactly: {passage}\n{passage}\n")["input_ids"]
    seqs = [Sequence("copy", copy, len(copy), SamplingParams(max_tokens=40, temperature=0), eos)]
    for case in CASES[:3]:
        exp = expected[case.name]
        seqs.append(Sequence(case.name, list(exp.prompt_ids), len(exp.prompt_ids),
                             SamplingParams(max_tokens=min(24, len(exp.token_ids)), temperature=0), eos))
    reference, _, _ = generate(runner, seqs[:1], None)
    monkeypatch.setattr(speculation, "EXPLORE_EVERY", 4)      # drafts between overlapping steps, where not paying
    overlapped: list[int] = []
    speculator = PricedSpeculator(SpeculativeConfig.parse('{"method": "ngram"}'), pays)
    with caplog.at_level(logging.ERROR, logger="services.engine.engine"):
        out, _, _ = generate(runner, seqs, None, speculator=speculator, async_scheduling=True, steps=overlapped)
    assert not caplog.records, caplog.text[-2000:]
    assert out["copy"] == reference["copy"]
    for case, seq in zip(CASES[:3], seqs[1:]):
        assert out[case.name] == expected[case.name].token_ids[:seq.params.max_tokens], case.name
    assert speculator.stats.accepted_tokens > 0                     # drafts were verified
    if not pays:
        assert overlapped[0] > 0                                    # and the other steps overlapped


@pytest.mark.slow          # rejected drafts' distribution below, by default
def test_sampled_output_is_what_it_is_without_speculation(runner, model_dir, expected):
    """Seeded sampling draws the same uniform number at each output index with or without
    drafts, and a drafted position keeps its draft only where that draw chose it: the
    output, its logprobs and the penalties' view of the history are unchanged."""
    eos = eos_token_ids(model_dir)
    prompt = expected["long"].prompt_ids[:150]
    kinds = [dict(temperature=0.8, top_p=0.9, seed=7), dict(temperature=1.0, top_k=20, seed=3, logprobs=3),
             dict(temperature=0.7, seed=11, repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=5)]
    seqs = [Sequence(f"s{i}", list(prompt), len(prompt), SamplingParams(max_tokens=24, **kw), eos)
            for i, kw in enumerate(kinds)]
    plain, plain_lp, _ = generate(runner, seqs, None)
    drafted, drafted_lp, speculator = generate(runner, seqs, '{"method": "suffix", "adaptive": false}')
    assert drafted == plain
    assert drafted_lp == plain_lp
    assert speculator.stats.drafts > 0


# ---- the distribution ----

@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)          # a peaked distribution: a few likely tokens, a long tail
    reference = copy.deepcopy(model).eval()
    return ModelRunner(Path("tiny-llama"), "float32", "cpu", attention="torch", model=model), reference


def first_tokens(runner, prompt, first, params, draft, n, batch=2000) -> list[tuple[int, int]]:
    """`n` sequences whose prompt KV is in place and whose first token (`first`) was
    sampled elsewhere, each with a seed of its own: the two tokens each takes next."""
    rng = random.Random(len(draft or ()))
    pool = batch * 2 + 8
    out: list[tuple[int, int]] = []
    while len(out) < n:
        blocks = BlockManager(BlockPool(pool, BLOCK))
        memory = KVPoolMemory.allocate(runner.layout(pool, BLOCK))
        speculator = None
        if draft:
            speculator = Speculator(SpeculativeConfig(adaptive=False))
            speculator.proposer = Fixed(draft)
        engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(
            max_num_seqs=batch, max_num_batched_tokens=batch * 4, retain_finished=True), speculator))
        donor = Sequence("donor", list(prompt), len(prompt), SamplingParams(max_tokens=1, temperature=0), frozenset())
        engine.add(donor)
        while engine.has_work():
            engine.step()
        donated = engine.scheduler.retained.pop("donor").block_ids
        engine.scheduler.config = replace(engine.scheduler.config, retain_finished=False)
        for i in range(batch):
            reserved = engine.scheduler.reserve(f"r{i}", len(prompt), float("inf")).block_ids
            engine.memory.copy_blocks(list(zip(donated, reserved)))
            engine.add_prefilled(Sequence(f"r{i}", list(prompt) + [first], len(prompt),
                                          replace(params, seed=rng.getrandbits(63)), frozenset()))
        engine.scheduler.blocks.release(donated)
        taken: dict[str, list[int]] = {f"r{i}": [] for i in range(batch)}
        while engine.has_work():
            for o in engine.step():
                taken[o.request_id] += o.token_ids
        memory.close()
        assert blocks.num_available == pool
        out += [tuple(t) for t in taken.values()]
    return out[:n]


def agrees(samples: list[int], p: torch.Tensor) -> float:
    """The chi-square p-value of `samples` against the distribution `p` (categories
    expected at least 5 times; the rest pooled)."""
    n = len(samples)
    order = p.argsort(descending=True).tolist()
    big = [t for t in order if p[t] * n >= 5]
    index = {t: i for i, t in enumerate(big)}
    got = [0] * (len(big) + 1)
    for t in samples:
        got[index.get(t, len(big))] += 1
    want = [float(p[t]) * n for t in big]
    want.append(n - sum(want))
    if want[-1] < 5:                                   # too little left to pool: fold it in
        rest, expected_rest = got.pop(), want.pop()
        got[-1] += rest
        want[-1] += expected_rest
    if len(got) == 1:                                   # one token possible: nothing to test but that
        return 1.0 if got[0] == n else 0.0
    total = sum(want)
    return chisquare(got, [w * n / total for w in want]).pvalue


def target_probs(model, prompt, after: list[int], params) -> torch.Tensor:
    """The distribution a position is drawn from: the model's next-token probabilities
    after prompt + `after` (transformers' own forward), cut to top-p."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + after])).logits[0, -1].double()
    p = torch.softmax(logits / params.temperature, -1)
    if params.top_p < 1.0:
        ranked, order = p.sort(descending=True)
        keep = (ranked.cumsum(0) - ranked) < params.top_p
        mask = torch.zeros_like(p, dtype=torch.bool)
        mask[order[keep]] = True
        p = torch.where(mask, p, torch.zeros_like(p))
        p /= p.sum()
    return p


@pytest.mark.parametrize("top_p", [1.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_samples_with_rejected_drafts_keep_the_models_distribution(tiny, top_p):
    """A draft of the third likeliest token, rejected most of the time: the first
    position's 20,000 samples follow the model's distribution there and agree with 20,000
    drawn without speculation; a draft is kept as often as the model would choose it;
    and the token after each first position follows the model's distribution after
    that token, whether the draft was kept (its bonus token) or not (then the position's
    sample after the draft must have been thrown away)."""
    runner, reference = tiny
    prompt, first = [5, 9, 17, 3, 40, 22, 8, 31, 12, 7], 19
    params = SamplingParams(max_tokens=3, temperature=1.0, top_p=top_p)
    p = target_probs(reference, prompt, [first], params)
    order = p.argsort(descending=True).tolist()
    draft, likeliest = order[2], order[0]
    assert 0.02 < float(p[draft]) < 0.5
    n = 20_000
    drafted = first_tokens(runner, prompt, first, params, [draft], n)
    plain = first_tokens(runner, prompt, first, params, None, n)
    firsts = [a for a, _ in drafted]
    assert agrees(firsts, p) > 0.01
    table = [[firsts.count(t), [a for a, _ in plain].count(t)] for t in set(firsts) | {a for a, _ in plain}]
    assert chi2_contingency([r for r in table if sum(r) >= 10]).pvalue > 0.01
    assert abs(firsts.count(draft) / n - float(p[draft])) < 0.02        # kept with its probability
    for after in (draft, likeliest):
        seconds = [b for a, b in drafted if a == after]
        assert len(seconds) > 500
        assert agrees(seconds, target_probs(reference, prompt, [first, after], params)) > 0.01, after


# ---- the draft model ----

@pytest.mark.parametrize("quantization", ["none", pytest.param("int8", marks=pytest.mark.slow)])
def test_a_draft_model_drafts_and_the_output_stays_generates(runner, model_dir, expected, quantization):
    """The default model drafting for itself: in float32 its greedy drafts are nearly all
    accepted; its int8 copy drafts less well, and the output is the same either way."""
    from services.engine.model.draft import DraftProposer
    config = SpeculativeConfig.parse(json.dumps({"model": str(model_dir), "num_speculative_tokens": 4,
                                                 "quantization": quantization, "adaptive": False}))
    assert config.method == "draft"
    draft_runner = runner if quantization == "none" else ModelRunner(model_dir, "float32", "cpu",
                                                                      quantization="int8")
    eos = eos_token_ids(model_dir)
    seqs = []
    cases = [c for c in CASES if c.name in ("short", "multi_turn", "stop_string")]
    for case in cases:
        exp = expected[case.name]
        n = len(exp.token_ids) if case.stop else case.max_tokens
        seqs.append(Sequence(case.name, list(exp.prompt_ids), len(exp.prompt_ids),
                             SamplingParams(max_tokens=n, temperature=0), eos))
    proposer = DraftProposer(config, runner, 4096, BLOCK, runner=draft_runner)
    out, _, speculator = generate(runner, seqs, None, speculator=Speculator(config, proposer))
    for case in cases:
        assert out[case.name] == expected[case.name].token_ids[:len(out[case.name])], case.name
    stats = speculator.stats
    rate = stats.accepted_tokens / stats.draft_tokens
    assert stats.drafts > 10
    assert rate > 0.9 if quantization == "none" else 0.3 < rate < 1.0, rate
    assert proposer.blocks.num_available == proposer.blocks.num_blocks     # every draft block back
    proposer.close()


def test_a_draft_of_a_smaller_vocabulary_is_never_fed_a_token_past_it(runner, model_dir):
    """Qwen2.5-0.5B drafting for 7B has 128 fewer token ids: a sequence holding one of
    those (a client's token-id prompt) gets no drafts, and the draft model never sees
    it (on a GPU, an embedding lookup past the table is a device-side assert)."""
    from services.engine.model.draft import DraftProposer

    class SmallerVocabulary:
        vocab_size = 30000

        def __getattr__(self, name):
            return getattr(runner, name)

        def execute(self, pool, batch):
            assert max(batch.decode_tokens + batch.prefill_tokens) < self.vocab_size, "fed past the vocabulary"
            return runner.execute(pool, batch)
    config = SpeculativeConfig.parse(json.dumps({"model": str(model_dir), "num_speculative_tokens": 3}))
    proposer = DraftProposer(config, runner, 1024, BLOCK, runner=SmallerVocabulary())
    eos = eos_token_ids(model_dir)
    past = Sequence("past", [100, 200, 40000, 300], 4, SamplingParams(max_tokens=8, temperature=0), eos)
    within = Sequence("within", [100, 200, 300, 400], 4, SamplingParams(max_tokens=8, temperature=0), eos)
    drafts = proposer.propose_all([(past, 3), (within, 3)])
    assert past not in drafts and len(drafts[within]) == 3
    proposer.close()


def test_a_draft_pass_that_fails_leaves_no_record_of_kv_it_did_not_write(runner, model_dir):
    """A draft model's forward pass that fails (out of memory) costs that step's drafts;
    the draft cache does not take the tokens it was fed for computed, so later drafts are
    what a proposer that never failed drafts."""
    from services.engine.model.draft import DraftProposer

    class FailsOnce:
        decode_steps = 0

        def __getattr__(self, name):
            return getattr(runner, name)

        def execute(self, pool, batch):
            if len(batch.decode_tokens) == 1 and not batch.segments:
                FailsOnce.decode_steps += 1
                if FailsOnce.decode_steps == 2:     # the second draft's KV is never written
                    raise MemoryError("draft pool")
            return runner.execute(pool, batch)
    config = SpeculativeConfig.parse(json.dumps({"model": str(model_dir), "num_speculative_tokens": 3}))
    eos = eos_token_ids(model_dir)
    prompt = load_tokenizer(model_dir).encode("The capital of France is")

    def seq() -> Sequence:
        return Sequence("s", list(prompt), len(prompt), SamplingParams(max_tokens=8, temperature=0), eos)
    fresh = DraftProposer(config, runner, 1024, BLOCK, runner=runner)
    (taken,) = fresh.propose_all([(seq(), 3)]).values()
    failing, s = DraftProposer(config, runner, 1024, BLOCK, runner=FailsOnce()), seq()
    with pytest.raises(MemoryError):            # fed the first two drafts, the second to the step that failed
        failing.propose_all([(s, 3)])
    s.token_ids += taken                        # the target took them all
    again = seq()
    again.token_ids += taken
    fresh = DraftProposer(config, runner, 1024, BLOCK, runner=runner)
    assert list(failing.propose_all([(s, 3)]).values()) == list(fresh.propose_all([(again, 3)]).values())
    failing.close()
    fresh.close()


def test_structured_output_drafts_what_its_grammar_allows_and_stays_what_it_was(runner, model_dir):
    """Under a JSON schema the drafts are cut to what the grammar allows, each drafted
    position is masked as its row would be after the drafts before it (the matcher
    follows them and rolls back), and the output is the output without speculation:
    valid JSON of the schema, token for token."""
    from services.engine.structured import Grammars
    from services.engine.text.tokenizer import encode_chat
    tok = load_tokenizer(model_dir)
    eos = eos_token_ids(model_dir)
    grammars = Grammars(lambda: tok, runner.vocab_size, eos)
    schema = json.dumps({"type": "object", "properties": {"fruits": {"type": "array", "minItems": 4, "maxItems": 6,
                                                                     "items": {"type": "object", "properties": {
                                                                         "name": {"type": "string", "maxLength": 12},
                                                                         "colour": {"type": "string",
                                                                                    "maxLength": 12}},
                                                                               "required": ["name", "colour"]}}},
                         "required": ["fruits"]})
    prompt = encode_chat(tok, [{"role": "user", "content": "List some fruits and their colours as JSON."}])
    params = SamplingParams(max_tokens=120, temperature=0, json_schema=schema)

    def run(speculator, name="s"):
        seq = Sequence(name, list(prompt), len(prompt), params, eos, constraint=grammars.constraint(schema))
        blocks = BlockManager(BlockPool(64, BLOCK))
        memory = KVPoolMemory.allocate(runner.layout(64, BLOCK))
        engine = LLMEngine(runner, memory, Scheduler(blocks, SchedulerConfig(max_num_seqs=4,
                                                                             max_num_batched_tokens=256), speculator))
        engine.add(seq)
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.token_ids
        memory.close()
        assert blocks.num_available == 64
        return out

    plain = run(None)
    speculator = Speculator(SpeculativeConfig.parse('{"method": "suffix", "adaptive": false}'))
    drafted = run(speculator)
    assert drafted == plain
    value = json.loads(tok.decode(drafted, skip_special_tokens=True))
    assert 4 <= len(value["fruits"]) <= 6 and all({"name", "colour"} <= set(f) for f in value["fruits"])
    assert speculator.stats.accepted_tokens > 5             # the repeated keys were drafted and kept
    # The same request again finds its whole output in the worker's index, the stop token
    # that ends the grammar too: drafted up to it, never past it (the verify row after it
    # would ask a finished grammar for a mask)
    assert run(speculator, "again") == plain
