"""Batched sampling: one pass over the batch, per-row temperature, top-k, top-p and seed,
and a seeded row draws the same token whatever it is batched with, on any device."""
from __future__ import annotations

import pytest
import torch

from services.engine.model.sampler import History, TokenHistory, choose, sample
from services.engine.core.sampling import SamplingParams

VOCAB = 4096


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 3


PARAMS = [SamplingParams(max_tokens=8, temperature=0.0),
          SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=11),
          SamplingParams(max_tokens=8, temperature=1.3, top_p=0.8, seed=12),
          SamplingParams(max_tokens=8, temperature=1.0, top_k=50, top_p=0.5, seed=13),
          SamplingParams(max_tokens=8, temperature=0.9, seed=14)]


def _check_batch_independence(device: str) -> None:
    logits = _rows(len(PARAMS)).to(device)
    for step in range(4):
        together = sample(logits, PARAMS, [step] * len(PARAMS), frozenset()).token_ids
        alone = [sample(logits[i:i + 1], [p], [step], frozenset()).token_ids[0]
                 for i, p in enumerate(PARAMS)]
        assert together == alone, step
        shuffled = [4, 2, 0, 3, 1]
        again = sample(logits[shuffled], [PARAMS[i] for i in shuffled], [step] * 5, frozenset()).token_ids
        assert again == [together[i] for i in shuffled]
        drawn = sample(logits[1:], PARAMS[1:], [step] * 4, frozenset()).token_ids    # no greedy row
        assert drawn == together[1:]
    assert sample(logits[:0], [], [], frozenset()).token_ids == []


def test_a_seeded_row_draws_the_same_token_whatever_its_batch():
    _check_batch_independence("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_seeded_row_draws_the_same_token_whatever_its_batch_on_a_gpu():
    _check_batch_independence("cuda")
    logits = _rows(len(PARAMS))
    gpu = sample(logits.cuda(), PARAMS, [0] * 5, frozenset()).token_ids
    assert gpu == sample(logits, PARAMS, [0] * 5, frozenset()).token_ids


def test_each_row_keeps_to_its_own_top_k_and_top_p():
    logits = _rows(len(PARAMS), seed=3)
    order = logits.argsort(dim=-1, descending=True)
    probs = torch.softmax(logits / torch.tensor([max(p.temperature, 1e-6) for p in PARAMS])[:, None], dim=-1)
    for step in range(40):
        out = sample(logits, PARAMS, [step] * len(PARAMS), frozenset()).token_ids
        assert out[0] == int(logits[0].argmax())                       # greedy
        assert out[1] in order[1, :5].tolist()                          # top_k 5
        assert out[3] in order[3, :50].tolist()                         # top_k 50 (and top_p)
        ranked = probs[2][order[2]]                                     # top_p 0.8: within the nucleus
        nucleus = int((ranked.cumsum(0) - ranked < 0.8).sum())
        assert out[2] in order[2, :nucleus].tolist()


def test_penalties_follow_openai_and_transformers_definitions():
    """Presence and frequency (OpenAI: output tokens only) and repetition (CTRL, as
    transformers' RepetitionPenaltyLogitsProcessor: prompt and output) against the
    formulas written out by hand."""
    logits = _rows(3, seed=5)
    prompt, output = [7, 8, 8], [8, 9, 9, 9]
    history = History(prompt + output, len(prompt))
    params = [SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25,
                             logprobs=0),
              SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3, logprobs=0),
              SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)]
    got = sample(logits, params, [4] * 3, frozenset(), [history] * 3).logprobs
    expected = logits.clone()
    for token, count in ((8, 1), (9, 3)):
        expected[0, token] -= 0.25 * count + 0.5
    for token in (7, 8, 9):
        x = expected[1, token]
        expected[1, token] = x / 1.3 if x > 0 else x * 1.3
    want = torch.log_softmax(expected, dim=-1)
    for row in range(3):
        token = int(want[row].argmax())
        assert got[row].token_id == token
        assert got[row].logprob == pytest.approx(float(want[row, token]), abs=1e-5)


def test_a_history_kept_on_the_device_penalizes_as_one_copied_afresh_every_step():
    """A sequence's tokens kept from step to step (each step copies only the new ones),
    with a verify step's drafts after them, and started afresh when the tokens given are
    fewer than before (a fork's own tokens): the processed logits equal those of the
    whole history copied at each step."""
    g = torch.Generator().manual_seed(9)
    params = [SamplingParams(max_tokens=64, temperature=0.0, presence_penalty=0.4, frequency_penalty=0.3,
                             repetition_penalty=1.2)] * 2
    ids = torch.randint(0, VOCAB + 50, (40,), generator=g).tolist()     # ids past the vocabulary clamp
    kept = TokenHistory()
    for step, (length, draft) in enumerate([(20, ()), (21, ()), (21, (5, 5)), (30, (7,)), (12, ()), (40, ())]):
        logits = _rows(1, seed=step).repeat(2, 1)
        both = [History(ids[:length], 8, draft, kept), History(ids[:length], 8, draft)]
        processed = choose(logits, params, [length - 8] * 2, frozenset(), both).logits
        assert torch.equal(processed[0], processed[1]), step
        assert not torch.equal(processed[0], logits[0]), step
    assert kept.count == 40


def test_logit_bias_min_p_and_stop_token_ids_during_min_tokens():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    logits[:, 11] = 4.9
    banned = SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((10, -100.0),))
    assert sample(logits[:1], [banned], [0], frozenset()).token_ids == [11]
    # min_p 0.5: only tokens at least half as likely as the top one remain (10 and 11)
    drawn = {sample(logits[:1], [SamplingParams(max_tokens=8, min_p=0.5, seed=s)], [0], frozenset()).token_ids[0]
             for s in range(40)}
    assert drawn <= {10, 11} and len(drawn) == 2
    held = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2, stop_token_ids=(10,))
    assert sample(logits[:1], [held], [0], frozenset()).token_ids == [11]
    assert sample(logits[:1], [held], [2], frozenset()).token_ids == [10]


def test_logprobs_are_log_softmax_after_temperature_with_the_likeliest_ranked():
    logits = _rows(2, seed=9)
    params = [SamplingParams(max_tokens=8, temperature=0.7, seed=1, logprobs=5),
              SamplingParams(max_tokens=8, temperature=0.7, seed=1)]
    out = sample(logits, params, [0, 0], frozenset())
    want = torch.log_softmax(logits[0] / 0.7, dim=-1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-5)
    assert lp.top_ids == want.topk(5).indices.tolist()
    assert lp.top_logprobs == pytest.approx(want.topk(5).values.tolist(), abs=1e-5)
    assert out.logprobs[1] is None


def test_a_grammar_mask_limits_every_row_it_covers():
    logits = _rows(2, seed=4)

    def only_token_3_in_row_0(x: torch.Tensor) -> None:
        keep = x[0, 3].clone()
        x[0] = float("-inf")
        x[0, 3] = keep
    params = [SamplingParams(max_tokens=8, seed=2), SamplingParams(max_tokens=8, temperature=0.0)]
    with torch.inference_mode():
        frozen = logits.clone()
    out = sample(frozen, params, [0, 0], frozenset(), mask=only_token_3_in_row_0)
    assert out.token_ids == [3, int(logits[1].argmax())]


def test_allowed_token_ids_and_bad_words_ban_what_vllm_bans():
    """allowed_token_ids: the likeliest allowed token, whatever the others; bad words: a
    one-token word never, a longer word's last token only after the rest of it (in the
    output, not the prompt)."""
    logits = _rows(3)
    best = logits.argmax(-1).tolist()
    allowed = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=(7, 9))
    drawn = SamplingParams(max_tokens=4, temperature=1.0, seed=5, allowed_token_ids=(7, 9))
    free = SamplingParams(max_tokens=4, temperature=0.0)
    got = sample(logits, [allowed, drawn, free], [0] * 3, frozenset()).token_ids
    assert got[0] == (7 if logits[0, 7] > logits[0, 9] else 9) and got[1] in (7, 9) and got[2] == best[2]
    words = SamplingParams(max_tokens=4, temperature=0.0, bad_words=((best[0],), (11, best[1])))
    prompt = [1, 2, 11]                                  # the prompt ends in 11: no ban from it
    histories = [History(prompt, 3), History(prompt + [11], 3)]
    got = sample(logits[:2], [words, words], [0, 1], frozenset(), histories).token_ids
    assert got[0] != best[0] and got[1] not in (best[0], best[1])
    assert sample(logits[1:2], [words], [0], frozenset(), [History(prompt, 3)]).token_ids == [best[1]]
    drafted = History(prompt, 3, draft=(11,))            # a verify step's row after a draft of 11
    assert sample(logits[1:2], [words], [1], frozenset(), [drafted]).token_ids != [best[1]]


def test_a_row_whose_constraints_leave_no_token_reads_as_no_token():
    """allowed_token_ids that min_tokens (or a grammar's mask) also rules out leave a row
    no token: the host reads NO_TOKEN there, never a token none of them allows, while the
    device keeps a valid id (a step in flight may take it as its input). A step without
    such a row makes no check."""
    from services.engine.core.sequence import NO_TOKEN
    from services.engine.model.sampler import read_back
    logits = _rows(4)
    eos = frozenset({2})
    greedy = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, allowed_token_ids=(2,))
    drawn = SamplingParams(max_tokens=8, temperature=0.8, seed=3, min_tokens=3, allowed_token_ids=(2,))
    free = SamplingParams(max_tokens=8, temperature=0.0)
    params = [greedy, drawn, free, free]
    chosen = choose(logits, params, [0, 0, 0, 0], eos)
    assert read_back(chosen, params).token_ids == [NO_TOKEN, NO_TOKEN, int(logits[2].argmax()), int(logits[3].argmax())]
    assert all(0 <= t < VOCAB for t in chosen.tokens.tolist())
    # past min_tokens, EOS is allowed again: the only allowed token
    assert sample(logits[:2], [greedy, drawn], [3, 3], eos).token_ids == [2, 2]

    def nothing_in_row_1(x: torch.Tensor) -> None:
        x[1] = float("-inf")
    assert sample(logits[:3], [free] * 3, [0] * 3, eos, mask=nothing_in_row_1).token_ids[1] == NO_TOKEN
    assert choose(logits, [free] * 4, [0] * 4, eos).stuck is None
    # a vocabulary that is no multiple of the draw's blocks (Qwen2's 151936, Phi-3's 32064)
    odd = torch.randn(1, 32064)
    logged = SamplingParams(max_tokens=8, temperature=0.8, seed=1, min_tokens=2, allowed_token_ids=(7,), logprobs=1)
    chosen = choose(odd, [logged], [0], frozenset({7}))
    assert 0 <= int(chosen.tokens[0]) < 32064 and read_back(chosen, [logged]).token_ids == [NO_TOKEN]
