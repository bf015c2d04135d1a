"""Token sampling over a batch of logits: greedy rows at once, sampled rows one by one.

Every sampled token draws from a generator seeded by (request seed, token index), so a
request's output depends only on its seed, not on which worker or batch drew it.
"""
from __future__ import annotations

import torch

from services.engine.sampling import SamplingParams

_MASK64 = (1 << 63) - 1


def _generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + index) & _MASK64)
    return g


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop = (cum - sorted_probs) >= p.top_p          # keep the smallest set reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=_generator(p.seed, index, probs.device)))


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_token_ids: frozenset[int]) -> list[int]:
    """One new token per row of `logits` ([batch, vocab]); `num_generated` is how many
    tokens each row's sequence has produced so far (its next token's index)."""
    logits = logits.float()
    held = [row for row, (p, n) in enumerate(zip(params, num_generated)) if n < p.min_tokens]
    if held and eos_token_ids:
        logits = logits.clone()     # the model's output may be an inference tensor: no writes into it
        for row in held:
            logits[row, list(eos_token_ids)] = float("-inf")
    out = torch.argmax(logits, dim=-1).tolist()
    for row, (p, n) in enumerate(zip(params, num_generated)):
        if not p.greedy:
            out[row] = _sample_row(logits[row], p, n)
    return out
