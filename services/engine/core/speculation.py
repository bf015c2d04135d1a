"""Speculative decoding's host side: what to draft, and how much. Plain Python, like the
scheduler that asks it.

    each step:  Speculator.drafts(sequences) -> proposer.propose(seq, most) per sequence
                -> the adaptive cut: how many drafted tokens this step is worth
                -> the scheduler plans each drafted sequence as one verify chunk
    landed:     Speculator.accepted(proposed, accepted)   (per sequence, per position)
                Speculator.observe(rows, seconds)         (a decode step's cost)

A proposer drafts tokens as a point mass: the tokens it believes come next, no
probabilities. Verification samples the target's own token at each drafted position
(the same sampler, the same uniform number a step without speculation would draw there)
and keeps the drafts while they agree. For a point-mass draft that is the rejection rule
of Leviathan et al. and Chen et al. (accept a draft d with probability p(d), else draw from
p with d removed), so the output's distribution is the target's, whatever the sampling
parameters; greedy and seeded requests draw the very numbers they draw without it. A
verify step scores a position in a pass of another shape, whose logits may differ from a
one-row step's in their last bits (~1e-5): a draw that falls that close to the boundary
between two tokens, or a greedy near-tie, can then take the other, as a seeded request
batched with different neighbours can (sampler.py).

Proposers:
  ngram   prompt lookup (vLLM's `ngram`): the longest n-gram (prompt_lookup_max down to
          prompt_lookup_min) ending the sequence that occurred before in its own tokens,
          and the tokens that followed it there;
  draft   a smaller model with the same tokenizer, run greedily over its own paged KV
          on the decode worker (model/draft.py: the worker builds it, this module holds
          no model);
  suffix  a frequency index of continuations (SuffixDecoding's idea, a trie of depth
          `suffix_decoding_max_tree_depth` kept as counts per context): one over each
          sequence's prompt and output, and one over the worker's recent outputs of the
          same prefix-cache salt, each API key's own (`suffix_decoding_max_cached_requests`
          of them in all, the oldest forgotten). It follows
          the likeliest continuation of the longest matched context while the product of
          its frequencies stays above `suffix_decoding_min_token_prob`, and for at most
          `suffix_decoding_max_spec_factor` tokens per matched one, so it drafts more
          where the match is long and confident and nothing where it is not. As in vLLM,
          it drafts up to `suffix_decoding_max_tree_depth` tokens unless told fewer.

The adaptive cut: a verify step runs every drafted token as one more decode row (the
engine's `pack`), so it costs what a decode step of that many rows costs, and a row
whose draft is rejected is work thrown away. From the decode steps measured so far (a
least-squares line of seconds over rows, recent steps weighing most) and the measured
chance that a drafted token is kept once the drafts before it were, by its position in
the draft, by how long a context the proposer matched to find it (a draft copied after
a 20-token match is kept far more often than one after a single token) and by whether
the occurrences of that context agreed on it (past a fork in the source the draft is
the majority's guess), the speculator keeps the drafted tokens in order of their chance
of being accepted while the expected tokens per second rise, and drafts nothing when a
plain step wins. Kept drafts come in runs (a copied passage is accepted whole until the
model departs from it), which these conditional chances follow and one rate per
sequence does not. A sequence's first draft is always verified (so one early rejection
elsewhere does not keep it from drafting), and one step in EXPLORE_EVERY drafts anyway,
so the estimates follow the traffic.
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from services.common.speculative_config import SpeculativeConfig
from services.engine.core.sequence import PENDING, Sequence

__all__ = ["SpeculativeConfig", "Speculator", "NgramProposer", "SuffixProposer"]
# Steps that draft although the estimates say a plain step is faster: one in this many.
EXPLORE_EVERY = 50
# A step's cost as the lines fit it forgets older steps at this rate per step.
COST_DECAY = 0.98
# The acceptance of a match-length bucket forgets older drafts at this rate per draft.
ACCEPT_DECAY = 0.99
# The suffix proposer's matches start from this many of the latest occurrences of a
# sequence's last token, at most (a bound on a step's work whatever the history).
MATCH_CANDIDATES = 256
# Between the outputs a suffix index keeps: no token id is negative, so no match runs across.
SEP = -1


class Draft(list):
    """Drafted tokens, and the length of the context at the sequence's end the proposer
    matched to find them (0: it matches none, as a draft model); `split`: for each token,
    whether the occurrences of that context disagreed on it or on a token before it (a
    copy where the source forks is kept far less often than one where it does not)."""

    def __init__(self, tokens: Iterable[int] = (), match: int = 0, split: Iterable[bool] = ()) -> None:
        super().__init__(tokens)
        self.match = match
        self.split = list(split)

    def classes(self) -> list[int]:
        """The acceptance class of each token: 1 where `split`, else 0."""
        return [int(s) for s in self.split] + [0] * (len(self) - len(self.split))


class Proposer(Protocol):
    def propose(self, seq: Sequence, most: int) -> list[int]:
        """Up to `most` tokens likely to follow `seq.token_ids` (a `Draft` where the
        proposer knows the length of its match)."""

    def finished(self, seq: Sequence) -> None:
        """`seq` ended: what it made may help others.

    A proposer may also have `propose_all([(seq, most), ...]) -> {seq: draft}`, asked
    instead of `propose` for a step's sequences together (a draft model's batch)."""


class _ContextIndex:
    """Where each n-gram of a growing token list last occurred, for n in a range:
    n-gram -> the index of the token after it."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0            # n-grams ending before this index are in

    def update(self, ids: list[int]) -> None:
        # an n-gram goes in once the token after it is known (it must not match itself)
        for end in range(max(self.indexed, 1), len(ids)):
            for n in self.sizes:
                if end >= n:
                    self.last[tuple(ids[end - n:end])] = end
        self.indexed = max(self.indexed, len(ids))


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)
        self._index: weakref.WeakKeyDictionary[Sequence, _ContextIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, most: int) -> list[int]:
        ids = seq.token_ids
        index = self._index.get(seq)
        if index is None:
            index = self._index[seq] = _ContextIndex(self.sizes)
        index.update(ids)
        for n in self.sizes:                   # longest first
            if len(ids) > n:
                at = index.last.get(tuple(ids[-n:]))
                if at is not None:
                    return Draft(ids[at:at + most], n)
        return []

    def finished(self, seq: Sequence) -> None:
        self._index.pop(seq, None)


class _Occurrences:
    """Where each token occurs in a token list, once the token after it is known: the
    earlier occurrences of a sequence's end are found from those of its last token,
    extended backwards. One int per token: a trie of every context of 1..depth tokens
    made ~24 objects a token, ~2.9 MB per 300-token output kept and a 325 ms pause of
    the collector at 200 of them, and took 13 ms to count a 256-token prompt."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.where: dict[int, deque[int]] = {}
        self.indexed = 0                    # positions before it are in `where`

    def note(self, begin: int, end: int) -> None:
        """Index positions [begin, end) (each followed by a token of its own list)."""
        for q in range(begin, end):
            self.where.setdefault(self.tokens[q], deque()).append(q)
        self.indexed = max(self.indexed, end)

    def longest(self, ids: list[int], depth: int) -> tuple[int, list[int]]:
        """The longest context (1..depth tokens) ending `ids` that occurred here: its
        length, and where each of its occurrences ends, the most recent first (of the
        last MATCH_CANDIDATES occurrences of its last token)."""
        found = self.where.get(ids[-1])
        best, ends = 0, []
        if not found:
            return best, ends
        tokens, last = self.tokens, len(ids) - 1
        for p in itertools.islice(reversed(found), MATCH_CANDIDATES):
            n = 1
            while n < depth and n <= p and n <= last and tokens[p - n] == ids[last - n]:
                n += 1
            if n > best:
                best, ends = n, [p]
            elif n == best:
                ends.append(p)
        return best, ends

    def follow(self, ends: list[int], most: int, floor: float) -> tuple[list[int], list[bool]]:
        """From the occurrences ending at `ends`, the token that followed most of them,
        again and again over the occurrences that still agree (SuffixDecoding's walk down
        its tree), while the product of each token's share stays at or above `floor`; and
        for each token whether that product is below 1 (the occurrences disagreed)."""
        tokens, out, split, confidence = self.tokens, [], [], 1.0
        while len(out) < most and ends:
            counts: dict[int, int] = {}
            for p in ends:
                if p + 1 < len(tokens) and (t := tokens[p + 1]) != SEP:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)
            confidence *= counts[token] / len(ends)
            if confidence < floor:
                break
            out.append(token)
            split.append(confidence < 1.0)
            ends = [p + 1 for p in ends if p + 1 < len(tokens) and tokens[p + 1] == token]
        return out, split


class _Outputs:
    """Recent outputs, joined (each followed by SEP) and indexed, the oldest forgotten first."""

    def __init__(self) -> None:
        self.index = _Occurrences([])
        self.spans: deque[tuple[int, int]] = deque()    # each output's [begin, end) in the index's tokens

    def add(self, output: list[int]) -> None:
        tokens = self.index.tokens
        begin = len(tokens)
        tokens += output
        tokens.append(SEP)
        self.index.note(begin, begin + len(output) - 1)
        self.spans.append((begin, begin + len(output)))

    def forget(self) -> None:
        """The oldest output."""
        begin, end = self.spans.popleft()
        where, tokens = self.index.where, self.index.tokens
        for q in range(begin, end - 1):         # the oldest positions: first in each token's queue
            queue = where[tokens[q]]
            queue.popleft()
            if not queue:
                del where[tokens[q]]
        if not self.spans or 2 * self.spans[0][0] > len(tokens):
            self._compact()

    def _compact(self) -> None:
        """Drop the forgotten outputs' tokens (once they are half the list)."""
        shift = self.spans[0][0] if self.spans else len(self.index.tokens)
        self.index = _Occurrences(self.index.tokens[shift:])
        self.spans = deque((b - shift, e - shift) for b, e in self.spans)
        for b, e in self.spans:
            self.index.note(b, e - 1)


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._own: weakref.WeakKeyDictionary[Sequence, _Occurrences] = weakref.WeakKeyDictionary()
        # The worker's recent outputs, an index per prefix-cache salt (the router gives each
        # API key its own, as for cached blocks): a draft from another key's output would
        # not change what a request gets, but how fast it streams would tell whether
        # another key's answers said the same. `suffix_decoding_max_cached_requests`
        # bounds the outputs of all salts together, the oldest forgotten first.
        self.recent: dict[str, _Outputs] = {}
        self._kept: deque[str] = deque()            # the salt of each output kept, oldest first

    def propose(self, seq: Sequence, most: int) -> list[int]:
        ids = seq.token_ids
        own = self._own.get(seq)
        if own is None or own.tokens is not ids:        # indexes the sequence's own list, in place
            own = self._own[seq] = _Occurrences(ids)
        own.note(own.indexed, len(ids) - 1)
        depth = self.config.suffix_decoding_max_tree_depth
        recent = self.recent.get(seq.params.cache_salt)
        mine, at = own.longest(ids, depth)
        theirs, there = recent.index.longest(ids, depth) if recent is not None else (0, [])
        source, n, ends = (own, mine, at) if mine >= theirs else (recent.index, theirs, there)
        most = min(most, int(self.config.suffix_decoding_max_spec_factor * n))
        if most <= 0:
            return []
        tokens, split = source.follow(ends, most, self.config.suffix_decoding_min_token_prob)
        return Draft(tokens, n, split)

    def finished(self, seq: Sequence) -> None:
        self._own.pop(seq, None)
        capacity = self.config.suffix_decoding_max_cached_requests
        if capacity <= 0 or seq.num_generated < 2:
            return
        salt = seq.params.cache_salt
        self.recent.setdefault(salt, _Outputs()).add(seq.token_ids[seq.prompt_len:])
        self._kept.append(salt)
        while len(self._kept) > capacity:
            gone = self._kept.popleft()
            self.recent[gone].forget()
            if not self.recent[gone].spans:
                del self.recent[gone]


PROPOSERS = {"ngram": NgramProposer, "suffix": SuffixProposer}


class _CostLine:
    """Seconds a step takes as a line over its tokens, fit by least squares with older
    steps weighing less."""

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = COST_DECAY
        self.n, self.x, self.y = d * self.n + 1, d * self.x + tokens, d * self.y + seconds
        self.xx, self.xy = d * self.xx + tokens * tokens, d * self.xy + tokens * seconds

    @property
    def known(self) -> bool:
        return self.n >= 3

    def __call__(self, tokens: int) -> float:
        mean_x, mean_y = self.x / self.n, self.y / self.n
        var = self.xx / self.n - mean_x * mean_x
        slope = max(0.0, (self.xy / self.n - mean_x * mean_y) / var) if var > 1e-9 else 0.0
        return max(1e-6, mean_y + slope * (tokens - mean_x))


class _Acceptance:
    """The chance a drafted token is kept once the drafts before it were, by its position,
    by the bucket of its draft's match length (0, 1, 2-3, 4-7, 8-15, 16+ tokens) and by
    its class (`Draft.classes`: 0 where the matched occurrences agreed on it), recent
    verifications weighing most. Where a bucket has seen few agreed tokens at a position
    its estimate leans on the position before (a run goes on as it went: a prior of one
    half for every position not yet reached kept drafts from growing past the longest
    ever verified), and at the first position on every bucket's; where it has seen few of
    another class at a position, on the agreed tokens' estimate there (split tokens are
    rarer, and a chain of their own, thin at every position, cut good drafts short)."""
    BUCKETS = 6
    CLASSES = 2

    def __init__(self, positions: int) -> None:
        self.tried = [[[0.0] * positions for _ in range(self.CLASSES)] for _ in range(self.BUCKETS)]
        self.hit = [[[0.0] * positions for _ in range(self.CLASSES)] for _ in range(self.BUCKETS)]

    @classmethod
    def bucket(cls, match: int) -> int:
        return min(match.bit_length(), cls.BUCKETS - 1)

    def record(self, bucket: int, classes: list[int], proposed: int, accepted: int) -> None:
        for tried, hit in zip(self.tried[bucket], self.hit[bucket]):
            for j in range(len(tried)):
                tried[j] *= ACCEPT_DECAY
                hit[j] *= ACCEPT_DECAY
        tried, hit = self.tried[bucket], self.hit[bucket]
        for j in range(min(proposed, accepted + 1)):    # the positions reached
            c = classes[j] if j < len(classes) else 0
            tried[c][j] += 1.0
            hit[c][j] += j < accepted

    def chances(self, bucket: int, classes: list[int], n: int) -> list[float]:
        """The chance each of a draft's first `n` tokens (of these classes) is accepted,
        all before it too."""
        hit, tried = self.hit[bucket], self.tried[bucket]
        prior = (sum(b[0][0] for b in self.hit) + 1.0) / (sum(b[0][0] for b in self.tried) + 2.0)
        out, chance = [], 1.0
        for j in range(n):
            prior = (hit[0][j] + 2.0 * prior) / (tried[0][j] + 2.0)
            c = classes[j] if j < len(classes) else 0
            chance *= prior if c == 0 else (hit[c][j] + 2.0 * prior) / (tried[c][j] + 2.0)
            out.append(chance)
        return out

    def best(self, n: int) -> list[float]:
        """`chances` of the bucket whose drafts of agreed tokens are kept most often."""
        return max((self.chances(b, [], n) for b in range(self.BUCKETS)), key=sum)


@dataclass
class SpecStats:
    """Totals, as vLLM's spec_decode metrics count them."""
    drafts: int = 0                     # sequences verified with at least one drafted token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None


class Speculator:
    """The scheduler's source of drafts; the engine tells it what each step cost and
    what was accepted."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        """`proposer`: one built elsewhere (the draft model's); otherwise the method's."""
        if proposer is None and config.method not in PROPOSERS:
            raise ValueError(f"the {config.method} method's proposer is built by the worker")
        self.config = config
        self.proposer: Proposer = proposer or PROPOSERS[config.method](config)
        self._drafting = 0.0                    # seconds a step's drafting takes, recent steps weighing most
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._cost = _CostLine()
        self._acceptance = _Acceptance(config.num_speculative_tokens)
        # the match bucket and token classes of each sequence's draft in flight; a sequence
        # is here once drafted for
        self._bucket: weakref.WeakKeyDictionary[Sequence, tuple[int, list[int]]] = weakref.WeakKeyDictionary()
        self._verified: weakref.WeakSet[Sequence] = weakref.WeakSet()     # a draft of its own verified
        self._unmatched: weakref.WeakSet[Sequence] = weakref.WeakSet()    # asked once, nothing drafted
        self._steps = 0

    # ---- the scheduler ----
    def drafts(self, candidates: list[tuple[Sequence, int]]) -> dict[Sequence, list[int]]:
        """Drafts for some of `candidates` (a decoding sequence, the most tokens it may
        take), as many tokens as are worth verifying this step."""
        self._steps += 1
        if self.config.adaptive and not self._may_pay(candidates, self._steps, [seq for seq, _ in candidates]):
            return {}
        wanted = [(seq, min(most, self.config.num_speculative_tokens)) for seq, most in candidates
                  if most > 0 and seq.last_token != PENDING]
        t0 = time.perf_counter()
        batched = getattr(self.proposer, "propose_all", None)
        if batched is not None:
            found = {seq: d for seq, d in batched(wanted).items() if d}
        else:
            found = {seq: d for seq, most in wanted if (d := self.proposer.propose(seq, most))}
        for seq, draft in found.items():
            self._bucket[seq] = (_Acceptance.bucket(getattr(draft, "match", 0)),
                                 draft.classes() if isinstance(draft, Draft) else [])
        for seq in [s for s in found if s.constraint is not None]:
            found[seq] = seq.constraint.fitting(found[seq])     # structured output: what its grammar allows
            if not found[seq]:
                del found[seq]
        self._drafting = 0.9 * self._drafting + 0.1 * (time.perf_counter() - t0)
        for seq, _ in wanted:
            if seq not in found:
                self._unmatched.add(seq)            # no longer fresh: it waits for explored steps
        if not found or not self.config.adaptive:
            return found
        keep = self._cut(len(candidates), found)
        return {seq: found[seq][:n] for seq, n in keep.items() if n}

    def needs_tokens(self, candidates: list[tuple[Sequence, int]]) -> bool:
        """Whether the next `drafts(candidates)` would ask the proposer about a sequence
        whose last token is still on the device (PENDING, under async scheduling): the
        engine then reads the step in flight before it plans. Where drafting cannot pay,
        it does not, and steps overlap as they do without a speculator."""
        pending = [seq for seq, most in candidates if most > 0 and seq.last_token == PENDING]
        if not pending:
            return False
        return not self.config.adaptive or self._may_pay(candidates, self._steps + 1, pending)

    def _may_pay(self, candidates: list[tuple[Sequence, int]], step: int, asked: list[Sequence]) -> bool:
        """Whether drafting can beat a plain step at step number `step`: with every
        candidate drafting as many tokens, at the acceptance of the best match bucket,
        or for a sequence of `asked` not yet drafted for. When it cannot, the proposers
        are not asked (their indexes catch up when they next are), except on the
        exploring steps."""
        if not self._cost.known or step % EXPLORE_EVERY == 0:
            return True
        if any(self._fresh(seq) for seq in asked):
            return True                             # a sequence not yet drafted for
        batch, gain = len(candidates), 0.0
        plain = batch / self._cost(batch)
        for k, chance in enumerate(self._acceptance.best(self.config.num_speculative_tokens), 1):
            gain += chance
            if batch * (1 + gain) / (self._cost(batch * (1 + k)) + self._drafting) > plain:
                return True
        return False

    def _cut(self, batch: int, found: dict[Sequence, list[int]]) -> dict[Sequence, int]:
        """How many of each sequence's drafted tokens to verify: the most likely first,
        while the expected tokens per second of the step rise."""
        keep = dict.fromkeys(found, 0)
        if not self._cost.known:
            return {seq: len(d) for seq, d in found.items()}        # measure first
        chances = []                # (chance the token is accepted, its sequence)
        for seq, draft in found.items():
            if seq not in self._verified:           # a first draft is verified whole
                keep[seq] = len(draft)
            else:
                chances += [(c, seq) for c in self._acceptance.chances(*self._bucket[seq], len(draft))]
        chances.sort(key=lambda c: -c[0])
        forced = sum(keep.values())
        best = batch / (self._cost(batch + forced) + (self._drafting if forced else 0.0))
        best_n, gain = 0, 0.0
        for n, (chance, _) in enumerate(chances, 1):
            gain += chance
            speed = (batch + gain) / (self._cost(batch + forced + n) + self._drafting)
            if speed > best:
                best, best_n = speed, n
        if best_n == 0 and self._steps % EXPLORE_EVERY == 0:
            best_n = len(chances)
        for _, seq in chances[:best_n]:
            keep[seq] += 1
        return keep

    def _fresh(self, seq: Sequence) -> bool:
        return seq not in self._verified and seq not in self._unmatched

    def finished(self, seq: Sequence) -> None:
        self.proposer.finished(seq)
        self._bucket.pop(seq, None)
        self._verified.discard(seq)
        self._unmatched.discard(seq)

    # ---- the engine, after a step ----
    def accepted(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` drafted tokens of `seq` were kept."""
        s = self.stats
        s.drafts += 1
        s.draft_tokens += proposed
        s.accepted_tokens += accepted
        for pos in range(accepted):
            s.accepted_per_pos[pos] += 1
        self._acceptance.record(*self._bucket.get(seq, (0, [])), proposed, accepted)
        self._verified.add(seq)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prompt chunk) of `rows` rows, drafted ones included, took
        `seconds`."""
        self._cost.add(rows, seconds)
