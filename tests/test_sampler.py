"""Batched sampling: one pass over the batch, per-row temperature, top-k, top-p and seed,
and a seeded row draws the same token whatever it is batched with, on any device."""
from __future__ import annotations

import pytest
import torch

from services.engine.sampler import sample
from services.engine.sampling import SamplingParams

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
        together = sample(logits, PARAMS, [step] * len(PARAMS), frozenset())
        alone = [sample(logits[i:i + 1], [p], [step], frozenset())[0] for i, p in enumerate(PARAMS)]
        assert together == alone, step
        shuffled = [4, 2, 0, 3, 1]
        again = sample(logits[shuffled], [PARAMS[i] for i in shuffled], [step] * 5, frozenset())
        assert again == [together[i] for i in shuffled]


def test_a_seeded_row_draws_the_same_token_whatever_its_batch():
    _check_batch_independence("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_seeded_row_draws_the_same_token_whatever_its_batch_on_a_gpu():
    _check_batch_independence("cuda")
    logits = _rows(len(PARAMS))
    assert sample(logits.cuda(), PARAMS, [0] * 5, frozenset()) == sample(logits, PARAMS, [0] * 5, frozenset())


def test_each_row_keeps_to_its_own_top_k_and_top_p():
    logits = _rows(len(PARAMS), seed=3)
    order = logits.argsort(dim=-1, descending=True)
    probs = torch.softmax(logits / torch.tensor([max(p.temperature, 1e-6) for p in PARAMS])[:, None], dim=-1)
    for step in range(40):
        out = sample(logits, PARAMS, [step] * len(PARAMS), frozenset())
        assert out[0] == int(logits[0].argmax())                       # greedy
        assert out[1] in order[1, :5].tolist()                          # top_k 5
        assert out[3] in order[3, :50].tolist()                         # top_k 50 (and top_p)
        ranked = probs[2][order[2]]                                     # top_p 0.8: within the nucleus
        nucleus = int((ranked.cumsum(0) - ranked < 0.8).sum())
        assert out[2] in order[2, :nucleus].tolist()
