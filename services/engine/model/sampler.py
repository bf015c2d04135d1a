"""Token sampling over a batch of logits, all rows at once.

Greedy rows take the argmax. Sampled rows are scaled by their temperature, cut to their
top-k and top-p, and drawn by inverse CDF: one uniform number per row against the
cumulative probabilities, which costs one pass over the vocabulary instead of a random
number per vocabulary entry (what torch.multinomial draws: a third of a decode step's
time at batch 32 went there). The uniform comes from a
counter-based hash of (request seed, token index), so a request's draws depend only on
its seed, not on which worker, batch or device drew them. Its output does too, up to
floating point: a pass of another shape (other neighbours in the batch, a verify step)
may give logits that differ in their last bits, and the cumulative sum carries that to
the boundaries between tokens; a draw within ~1e-6 of one then takes the neighbouring
token (about 1 in 10^3 draws at positions whose logits differ so, in float32). An
exponential race per vocabulary entry would make that rarer still, at a random number
per entry: the cost this draw avoids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from services.engine.model.device import to_device
from services.engine.core.sampling import SamplingParams, TokenLogprob
from services.engine.core.sequence import NO_TOKEN

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
        temps = to_device([p.temperature for p in params], logits.dtype, logits.device)
        logits = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < logits.shape[-1] else 0 for p in params]
    if any(top_k):
        k = to_device(top_k, torch.long, logits.device)
        kth = torch.topk(logits, max(top_k), dim=-1).values
        cut = kth.gather(1, (k - 1).clamp_(min=0)[:, None])          # each row's k-th largest, in one op
        cut.masked_fill_((k == 0)[:, None], float("-inf"))           # no top-k: keep everything
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return logits


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The index where each row's cumulative probability passes u * its total, in two
    levels (sums of blocks of `block` entries, then the chosen block's own running sum),
    so no pass builds the whole running sum. Running sums are float64 (block sums are
    float32: ~1e-7 of a block's mass); a row never lands on an entry of probability zero.
    A row with no mass (every token ruled out, or a NaN) still gets an index inside the
    vocabulary, never one of the padding's: a step in flight may take it as its input."""
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
    return (b * block + torch.minimum(j, last)).clamp_(max=vocab - 1)


def _draw(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> torch.Tensor:
    probs = torch.softmax(_filter(logits, params), dim=-1)
    if any(p.min_p for p in params):
        min_p = to_device([p.min_p for p in params], probs.dtype, probs.device)
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        # Only the top-p rows are sorted, to find the smallest probability their nucleus
        # keeps; the draw itself runs in vocabulary order for every row, so a row's token
        # does not depend on whether its neighbours in the batch asked for top-p.
        rows = to_device(nucleus, torch.long, probs.device)
        sub = probs.index_select(0, rows)
        ranked = torch.sort(sub, dim=-1, descending=True).values
        top_p = to_device([params[i].top_p for i in nucleus], probs.dtype, probs.device)
        kept = ((ranked.cumsum(-1) - ranked) < top_p[:, None]).sum(-1, keepdim=True)   # the smallest set reaching top_p
        floor = ranked.gather(1, kept.clamp_(min=1) - 1)
        probs.index_copy_(0, rows, sub.masked_fill(sub < floor, 0.0))
    u = to_device([uniform(p.seed, n) for p, n in zip(params, num_generated)], torch.float64, probs.device)
    return _inverse_cdf(probs, u)[:, 0]


class TokenHistory:
    """A sequence's tokens on the device, for the penalties, kept from step to step:
    a step copies over only the tokens added since the one before, not the whole prompt
    and output again, which as Python lists cost every step O(history) of host time
    per row (33-49 ms a step for 32 rows of 2,000 tokens: docs/benchmarks.md)."""

    def __init__(self) -> None:
        self.tokens: torch.Tensor | None = None     # [capacity] int64, the first `count` valid
        self.count = 0

    def of(self, ids: list[int], vocab: int, device: torch.device) -> torch.Tensor:
        """`ids` on the device ([len(ids)], each below `vocab`). `ids` must extend the
        tokens given before; shorter ones start the history afresh."""
        if len(ids) < self.count or (self.tokens is not None and self.tokens.device != device):
            self.tokens, self.count = None, 0
        if len(ids) > self.count:
            new = to_device(ids[self.count:], torch.long, device).clamp_(max=vocab - 1)
            size = 0 if self.tokens is None else self.tokens.numel()
            if len(ids) > size:
                grown = torch.empty(max(len(ids), 2 * size, 64), dtype=torch.long, device=device)
                if self.count:
                    grown[:self.count] = self.tokens[:self.count]
                self.tokens = grown
            self.tokens[self.count:len(ids)] = new
            self.count = len(ids)
        return self.tokens[:len(ids)]


@dataclass
class History:
    """A row's tokens, for the penalties and bad words: its sequence's `ids` (the first
    `prompt_len` its prompt), then `draft`, the drafted tokens a verify step's row
    follows; `kept`, the sequence's TokenHistory (None: copied afresh)."""
    ids: list[int]
    prompt_len: int
    draft: tuple[int, ...] = ()
    kept: TokenHistory | None = None

    def output(self) -> list[int]:
        return self.ids[self.prompt_len:] + list(self.draft)

    def on_device(self, vocab: int, device: torch.device) -> torch.Tensor:
        kept = (self.kept or TokenHistory()).of(self.ids, vocab, device)
        if not self.draft:
            return kept
        return torch.cat([kept, to_device(list(self.draft), torch.long, device).clamp_(max=vocab - 1)])


# Applied to the processed logits before any token is chosen (structured output's masks).
LogitsMask = Callable[[torch.Tensor], None]


def _constrained(params: list[SamplingParams], num_generated: list[int], eos_token_ids: frozenset[int]) -> bool:
    """Whether a row's own constraints may rule out every token (a mask may too)."""
    return any(p.allowed_token_ids or p.bad_words or (n < p.min_tokens and (eos_token_ids or p.stop_token_ids))
               for p, n in zip(params, num_generated))


def _process(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
             eos_token_ids: frozenset[int], histories: list[History] | None) -> torch.Tensor:
    """The logits every choice is made from: tokens outside allowed_token_ids and bad
    words' ends banned, end tokens banned until min_tokens, then logit_bias, then the
    penalties (vLLM's order). Returns `logits` itself when nothing applies, else a new
    tensor: the model's output may be an inference tensor."""
    held = [row for row, (p, n) in enumerate(zip(params, num_generated))
            if n < p.min_tokens and (eos_token_ids or p.stop_token_ids)]
    allowed = [row for row, p in enumerate(params) if p.allowed_token_ids]
    worded = [row for row, p in enumerate(params) if p.bad_words]
    biased = [row for row, p in enumerate(params) if p.logit_bias]
    penalized = [row for row, p in enumerate(params) if p.penalized]
    if not (held or allowed or worded or biased or penalized):
        return logits
    if (worded or penalized) and histories is None:
        raise ValueError("penalties and bad words need each row's token history")
    logits = logits.clone(memory_format=torch.contiguous_format)
    vocab = logits.shape[-1]
    flat = logits.view(-1)      # entries by row * vocab + token: one index copied to the device, not one per row
    if allowed:
        _allow_only(logits, [params[r].allowed_token_ids for r in allowed], allowed)
    ends = [row * vocab + t for row in held for t in eos_token_ids.union(params[row].stop_token_ids) if t < vocab]
    ends += [row * vocab + t for row in worded for t in bad_word_ends(params[row].bad_words, histories[row].output())
             if t < vocab]
    if ends:
        flat.index_fill_(0, to_device(ends, torch.long, logits.device), float("-inf"))
    pairs = [(row * vocab + t, b) for row in biased for t, b in params[row].logit_bias if t < vocab]
    if pairs:
        flat.index_add_(0, to_device([i for i, _ in pairs], torch.long, logits.device),
                        to_device([b for _, b in pairs], logits.dtype, logits.device))
    if penalized:
        _penalize(logits, [params[r] for r in penalized], [histories[r] for r in penalized], penalized)
    return logits


def _allow_only(logits: torch.Tensor, allowed: list[tuple[int, ...]], rows: list[int]) -> None:
    """Every token but a row's allowed ones to -inf (vLLM's allowed_token_ids). In place."""
    vocab, device = logits.shape[-1], logits.device
    mask = torch.full((len(rows), vocab), float("-inf"), dtype=logits.dtype, device=device)
    keep = [i * vocab + t for i, ids in enumerate(allowed) for t in ids if t < vocab]
    mask.view(-1).index_fill_(0, to_device(keep, torch.long, device), 0.0)
    logits.index_add_(0, to_device(rows, torch.long, device), mask)


def bad_word_ends(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The tokens a row may not take next: each bad word's last token, where the output
    so far ends in the rest of the word (a one-token word: always). vLLM's rule; the
    prompt does not count."""
    return [w[-1] for w in words
            if len(w) - 1 <= len(output) and (len(w) == 1 or output[len(output) - len(w) + 1:] == list(w[:-1]))]


def _penalize(logits: torch.Tensor, params: list[SamplingParams], histories: list[History], rows: list[int]) -> None:
    """Repetition penalty (CTRL's, as transformers and vLLM apply it: positive logits
    divided, negative ones multiplied) over tokens of the prompt and the output; presence
    and frequency penalties (OpenAI's) over the output only. In place, and only at the
    rows' tokens: a token that comes several times is read at each place before any is
    written, so every place writes the same value, penalized once; a step costs the
    histories' length, not passes over the whole vocabulary."""
    vocab, device = logits.shape[-1], logits.device
    flat = logits.view(-1)
    # Each row's tokens as entries of the flattened logits, all rows in one op.
    tokens = [h.on_device(vocab, device) for h in histories]
    everywhere = torch.cat([t + row * vocab for row, t in zip(rows, tokens)])
    outputs = torch.cat([t[h.prompt_len:] + row * vocab for row, t, h in zip(rows, tokens, histories)])

    def per_row(name: str, default: float) -> torch.Tensor:
        values = [default] * logits.shape[0]
        for row, p in zip(rows, params):
            values[row] = getattr(p, name)
        return to_device(values, logits.dtype, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = per_row("repetition_penalty", 1.0)[everywhere // vocab]
        x = flat[everywhere]
        flat.index_put_((everywhere,), torch.where(x > 0, x / rep, x * rep))
    if len(outputs) and any(p.frequency_penalty or p.presence_penalty for p in params):
        # counted with an index_add (torch.bincount reads its input's maximum back to the host)
        counts = torch.zeros_like(flat).index_add_(0, outputs, torch.ones(len(outputs), dtype=flat.dtype,
                                                                         device=device))[outputs]
        row = outputs // vocab
        flat.index_put_((outputs,), flat[outputs] - (per_row("frequency_penalty", 0.0)[row] * counts
                                                     + per_row("presence_penalty", 0.0)[row]))


# JSON has no -inf: a token the grammar rules out is reported at this log probability (vLLM's).
LOGPROB_FLOOR = -9999.0


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row i's log probability of token_ids[i] ([rows], on the logits' device), and its k
    likeliest tokens' ids and log probabilities ([rows, k]), left on the device."""
    lp = torch.log_softmax(logits, dim=-1).clamp_(min=LOGPROB_FLOOR)
    top = lp.topk(k, dim=-1)
    return lp.gather(1, token_ids[:, None])[:, 0], top.indices, top.values


def as_token_logprobs(token_ids: list[int], found: Sequence[torch.Tensor], tops: list[int]) -> list[TokenLogprob]:
    """`logprob_tensors`' three tensors, read on the host: row i's TokenLogprob, with its
    tops[i] likeliest tokens."""
    chosen, ids, values = (t.tolist() for t in found)
    return [TokenLogprob(t, chosen[i], ids[i][:n], values[i][:n]) for i, (t, n) in enumerate(zip(token_ids, tops))]


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class Chosen:
    """`choose`'s result, on the device: the processed logits, the tokens (int64), and
    where a row's constraints left no token, those rows (bool; None: none could). A
    stuck row keeps a valid token id on the device, where a step in flight may take it
    as its input; the host reads NO_TOKEN there (sequence.py)."""
    logits: torch.Tensor
    tokens: torch.Tensor
    stuck: torch.Tensor | None = None

    def shown(self) -> torch.Tensor:
        """The tokens as the host is to read them: NO_TOKEN on stuck rows."""
        return self.tokens if self.stuck is None else self.tokens.masked_fill(self.stuck, NO_TOKEN)


def choose(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_token_ids: frozenset[int], histories: list[History] | None = None,
           mask: LogitsMask | None = None) -> Chosen:
    """One new token per row of `logits` ([batch, vocab]), with nothing read back to
    the host, so the host may go on while the device computes them (async scheduling).
    The arguments are `sample`'s."""
    logits = _process(logits.float(), params, num_generated, eos_token_ids, histories)
    if mask is not None:
        if logits.is_inference():
            logits = logits.clone()
        mask(logits)
    rows = [row for row, p in enumerate(params) if not p.greedy]
    stuck = None
    if mask is not None or _constrained(params, num_generated, eos_token_ids):
        # one more pass over the logits, only in steps with a row that may need it
        stuck = logits.amax(dim=-1) == float("-inf")
    if rows and len(rows) == len(params):      # every row drawn: no argmax, no copy of the rows
        return Chosen(logits, _draw(logits, params, num_generated), stuck)
    out = logits.max(dim=-1).indices           # the first maximum, as argmax; twice as fast on CPU
    if rows:
        index = to_device(rows, torch.long, logits.device)
        out.index_copy_(0, index, _draw(logits.index_select(0, index), [params[r] for r in rows],
                                        [num_generated[r] for r in rows]))
    return Chosen(logits, out, stuck)


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int],
           eos_token_ids: frozenset[int], histories: list[History] | None = None,
           mask: LogitsMask | None = None) -> Sampled:
    """One new token per row of `logits` ([batch, vocab]); `num_generated` is how many
    tokens each row's sequence has produced so far (its next token's index); `histories`
    each row's tokens, needed when a row asks for penalties; `mask` rules tokens out in
    place (structured output)."""
    return read_back(choose(logits, params, num_generated, eos_token_ids, histories, mask), params)


def to_read(chosen: Chosen, params: list[SamplingParams]) -> list[torch.Tensor]:
    """What the host reads of `choose`'s result, still on the device: the tokens
    (`Chosen.shown`), then
    (when a row asks) the log probabilities of the chosen tokens and each row's
    likeliest, from the processed logits scaled by the row's temperature (greedy rows:
    unscaled), before top-k, top-p and min-p cut the distribution: what OpenAI and vLLM
    report. `read_sampled` turns them, copied to the host, into a Sampled."""
    shown, logits = chosen.shown(), chosen.logits
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return [shown]
    index = to_device(rows, torch.long, logits.device)
    temps = to_device([params[r].temperature or 1.0 for r in rows], logits.dtype, logits.device)
    found = logprob_tensors(logits.index_select(0, index) / temps[:, None], chosen.tokens.index_select(0, index),
                            max(params[r].logprobs for r in rows))
    return [shown, *found]


def read_sampled(params: list[SamplingParams], host: list[torch.Tensor]) -> Sampled:
    """`to_read`'s tensors, on the host, as the tokens and their rows' log probabilities."""
    tokens = host[0].tolist()
    out: list[TokenLogprob | None] = [None] * len(params)
    rows = [r for r, p in enumerate(params) if p.logprobs is not None]
    if rows:
        found = as_token_logprobs([tokens[r] for r in rows], host[1:], [params[r].logprobs for r in rows])
        for r, lp in zip(rows, found):
            out[r] = lp
    return Sampled(tokens, out)


def read_back(chosen: Chosen, params: list[SamplingParams]) -> Sampled:
    """`choose`'s tokens on the host (waiting for all the device's work), with the log
    probabilities their rows asked for."""
    return read_sampled(params, to_read(chosen, params))
