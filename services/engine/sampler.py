"""Token sampling over a batch of logits, all rows at once.

Greedy rows take the argmax. Sampled rows are scaled by their temperature, cut to their
top-k and top-p, and drawn by inverse CDF: one uniform number per row against the
cumulative probabilities, which costs one pass over the vocabulary instead of a random
number per vocabulary entry (what torch.multinomial draws: a third of a decode step's
time at batch 32 went there). The uniform comes from a
counter-based hash of (request seed, token index), so a request's output depends only
on its seed, not on which worker, batch or device drew it.
"""
from __future__ import annotations

import torch

from services.engine.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def uniform(seed: int, index: int) -> float:
    """A number in [0, 1) from (seed, index): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * (1.0 / (1 << 53))


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows scaled by temperature, with everything outside each row's top-k set to -inf."""
    if any(p.temperature != 1.0 for p in params):
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
        logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
    if any(top_k):
        k = torch.tensor(top_k, device=logits.device)
        kth = torch.topk(logits, max(top_k), dim=-1).values
        cut = kth.gather(1, (k - 1).clamp_(min=0)[:, None])          # each row's k-th largest, in one op
        cut.masked_fill_((k == 0)[:, None], float("-inf"))           # no top-k: keep everything
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return logits


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The index where each row's cumulative probability passes u * its total, in two
    levels (sums of blocks of `block` entries, then the chosen block's own running sum),
    so no pass builds the whole running sum. Running sums are float64 (block sums are
    float32: ~1e-7 of a block's mass); a row never lands on an entry of probability zero."""
    rows, vocab = probs.shape
    pad = -vocab % block
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    blocks = probs.view(rows, -1, block)
    sums = blocks.sum(-1).double().cumsum(-1)                               # [rows, blocks]
    target = (u * sums[:, -1])[:, None]
    b = torch.searchsorted(sums, target, right=True).clamp_(max=sums.shape[1] - 1)
    before = torch.where(b > 0, sums.gather(1, (b - 1).clamp_(min=0)), torch.zeros_like(target))
    inner = blocks[torch.arange(rows, device=probs.device), b[:, 0]]        # [rows, block]
    j = torch.searchsorted(inner.double().cumsum(-1), target - before, right=True)
    last = block - 1 - (inner > 0).flip(-1).int().argmax(-1, keepdim=True)  # the block's last live entry
    return b * block + torch.minimum(j, last)


def _draw(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    probs = torch.softmax(_filter(logits, params), dim=-1)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        # Only the top-p rows are sorted, to find the smallest probability their nucleus
        # keeps; the draw itself runs in vocabulary order for every row, so a row's token
        # does not depend on whether its neighbours in the batch asked for top-p.
        rows = torch.tensor(nucleus, device=probs.device)
        sub = probs.index_select(0, rows)
        ranked = torch.sort(sub, dim=-1, descending=True).values
        top_p = torch.tensor([params[i].top_p for i in nucleus], dtype=probs.dtype, device=probs.device)
        kept = ((ranked.cumsum(-1) - ranked) < top_p[:, None]).sum(-1, keepdim=True)   # the smallest set reaching top_p
        floor = ranked.gather(1, kept.clamp_(min=1) - 1)
        probs.index_copy_(0, rows, sub.masked_fill(sub < floor, 0.0))
    u = torch.tensor([uniform(p.seed, n) for p, n in zip(params, num_generated)], dtype=torch.float64,
                     device=probs.device)
    return _inverse_cdf(probs, u)[:, 0].tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_token_ids: frozenset[int]) -> list[int]:
    """One new token per row of `logits` ([batch, vocab]); `num_generated` is how many
    tokens each row's sequence has produced so far (its next token's index)."""
    logits = logits.float()
    held = [row for row, (p, n) in enumerate(zip(params, num_generated)) if n < p.min_tokens]
    if held and eos_token_ids:
        logits = logits.clone()     # the model's output may be an inference tensor: no writes into it
        logits[torch.tensor(held)[:, None], torch.tensor(sorted(eos_token_ids))[None, :]] = float("-inf")
    out = logits.max(dim=-1).indices.tolist()      # the first maximum, as argmax; twice as fast on CPU
    rows = [row for row, p in enumerate(params) if not p.greedy]
    if rows:
        drawn = _draw(logits[rows], [params[r] for r in rows], [num_generated[r] for r in rows])
        for row, token in zip(rows, drawn):
            out[row] = token
    return out
