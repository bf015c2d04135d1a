"""The engine's scheduler: which tokens of which sequences the next forward pass runs.
Plain Python: no torch, no I/O.

Each step fills a token budget (`max_num_batched_tokens`) the way vLLM v1 does: first
every running sequence's next token (decode, or the next chunk of a prompt already
started), then new prompts from the waiting queue, oldest first within the most urgent
priority. A prompt started in an earlier step goes on before a new one starts, so long
prompts are never starved, and several short prompts share one forward pass with the
decode tokens: the whole plan runs as one forward over a ragged batch. New prompts of
one step share a priority: a more urgent prompt is not slowed by less urgent ones
computed beside it (another tenant's, under a flood: the router's fair share). A step
that decodes takes at most `max_mixed_prefill` prompt tokens, all prompts together
(Sarathi-Serve's stall-free batching): the running sequences then see their next token
a bounded time later while prompts are computed beside them, instead of waiting out
whole prompts. A new prompt of at most `mixed_whole_prompt` tokens may still take such
a step whole, as its only prompt tokens (one step for a chat prompt, chunks for a
long one).

A sequence's life here:
  add()            -> waiting -> blocks for its prompt (a cached prefix is reused)
                   -> running: prompt chunks until computed, then a token per step
  reserve()        -> waiting for remote KV: blocks held for a prompt another worker
                      computes and writes into them (vLLM's WAITING_FOR_REMOTE_KVS);
                      cancel() or expire() give them back
  add_prefilled()  -> ready (its prompt's KV is in its reserved blocks and its first
                      token was sampled elsewhere) -> running
  a fork           -> another choice of a request whose prompt KV is complete: it
                      shares the full prompt blocks (reference counted) and gets a copy
                      of the last one (copy on write), then computes the last prompt
                      token itself to sample its own first token
  out of blocks    -> the newest running sequence is preempted: its blocks go back
                      (computed full prompt blocks stay cached) and it waits to be
                      recomputed
  finish / abort   -> its blocks go back; with `retain_finished` (the prefill worker,
                      whose transfers may still read them) they are held until
                      `release()`

A step samples a token for every chunk that reaches the end of its sequence's tokens:
a prompt's last chunk samples the first token, a decode step the next one, and the
recompute of a preempted sequence the token after its last. The scheduler owns every
block a sequence uses; the runner never allocates.

With async scheduling (the engine's), a step is planned while the one before it still
runs on the device: `launched()` counts the running step's tokens as computed and
stands a PENDING token in for each it samples, and `resolve()` writes the sampled
tokens in once they are read. Meanwhile nothing is preempted (a sequence short of a
block sits a step out), and blocks given back wait in `_held` until every step that
may still write them has landed (`landed()`): a reservation could take them at once,
and a transfer could then write them before the device does. So do both ends of a
fork's block copy, queued on the device ahead of the next step, until that step lands.

With a speculator (speculative decoding, core/speculation.py), a decoding sequence may
be planned as a verify chunk: its last token and the tokens drafted after it, each
sampled in the step. `resolve()` keeps the drafts up to the first that differs from its
position's sample, then that sample: 1 to k + 1 tokens. The rejected drafts' KV is
left behind num_computed, to be written over, and blocks holding nothing but rejected
drafts go back. A sequence is drafted for only when its blocks can grow without
preempting anyone, and never while its last token is PENDING: under async scheduling
the engine reads the step in flight first when the speculator would draft
(`drafts_need_tokens`), and runs a step that verifies drafts without overlap.
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from services.engine.core.block_manager import BlockManager
from services.engine.core.block_pool import NoFreeBlocks
from services.engine.core.sequence import (NO_TOKEN, NO_TOKEN_LEFT, PENDING, Chunk, Reservation, SeqStatus,
                                          SeqUpdate, Sequence, StepPlan)
from services.engine.core.speculation import Speculator

log = logging.getLogger(__name__)

# Blocks kept free when a new prompt is admitted, as a share of the pool, so that the
# running sequences can grow without preempting the newcomer at once (vLLM's watermark).
WATERMARK = 0.01
# Prompt positions whose log probabilities one step computes at most (prompt_logprobs),
# all sequences together: each is a row of the whole vocabulary through the head, then
# in float32 and its log-softmax (~12 bytes a token of it: 1.5 GB for 1,024 rows of a
# 128k vocabulary), which a step of the whole token budget would not fit beside the KV
# pool. The runner reserves memory for this many (ModelRunner.activation_bytes).
PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64              # sequences running at once
    max_num_batched_tokens: int = 2048  # tokens in one forward pass
    max_prefill_chunk: int = 0          # most tokens of one prompt in a step (0: the budget)
    # Most prompt tokens, all prompts together, in a step that also decodes (0: the
    # budget). A prompt chunk lengthens the step every running sequence waits on for its
    # next token; this bounds that gap while prompts are computed alongside.
    max_mixed_prefill: int = 0
    # A new prompt of at most this many tokens (0: none) may still go whole into a step
    # that decodes when no other prompt tokens are in it: short prompts are not cut into
    # many steps, each re-reading the weights for the batch, while a long one is still
    # computed a bounded chunk a step.
    mixed_whole_prompt: int = 0
    # Attending one token of context, as a share of one token's linear layers (the
    # runner's `context_cost`). With it, max_mixed_prefill counts a prompt chunk's cost,
    # not its tokens: a chunk late in a long prompt, which attends to all before it,
    # takes fewer tokens, so every step that decodes beside a prompt costs about alike.
    context_cost: float = 0.0
    prefill_only: bool = False          # each sequence ends with its first token (prefill worker)
    retain_finished: bool = False       # finished sequences keep their blocks until release()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"the token budget ({self.max_num_batched_tokens}) must cover one decode token "
                             f"of each of the {self.max_num_seqs} running sequences")
        if self.max_prefill_chunk < 0:
            raise ValueError("max_prefill_chunk must be 0 (the budget) or more")
        if self.max_mixed_prefill < 0:
            raise ValueError("max_mixed_prefill must be 0 (the budget) or more")
        if self.mixed_whole_prompt < 0:
            raise ValueError("mixed_whole_prompt must be 0 (none) or more")
        if self.context_cost < 0:
            raise ValueError("context_cost must be 0 or more")


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig = SchedulerConfig(),
                 speculator: Speculator | None = None) -> None:
        self.blocks = blocks
        self.config = config
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.retained: dict[str, Sequence] = {}
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_sat_out = 0                # steps a sequence waited out for a block (async scheduling)
        self._watermark = int(WATERMARK * blocks.num_blocks)
        self._logprob_rows = PROMPT_LOGPROB_ROWS    # what the step being planned has left
        # (source, destination) block copies the engine makes before the next forward
        # pass; both hold a reference until that pass lands (copies_made()).
        self.copies: list[tuple[int, int]] = []
        # Choices that were waiting on a sequence that ended before its prompt was done
        # (aborted, failed): the engine reports them ended too.
        self.orphans: list[Sequence] = []
        # Steps launched on the device and landed so far (the engine numbers each), and
        # blocks given back while a step was running (or queued copies' ends), with the
        # number of the step that must land first.
        self.launches = 0
        self.landed_upto = 0
        self._held: list[tuple[int, list[int], list[int], int]] = []
        self.remote: dict[str, Reservation] = {}        # waiting for remote KV, by request id
        self.failed_drafts = 0                          # steps whose proposer raised

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready)

    def has_work(self) -> bool:
        return bool(self.running or self.ready or self.waiting)

    @property
    def in_flight(self) -> bool:
        """A launched step has not landed yet."""
        return self.launches > self.landed_upto

    def add(self, seq: Sequence) -> str | None:
        """Admit a sequence whose prompt is computed here. With a first token given
        (sampled on an earlier try) that token may already end it: then its finish
        reason, and it is not admitted."""
        reason = seq.check_finished()
        if reason:
            return reason
        self._register(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        return None

    def reserve(self, request_id: str, num_tokens: int, expires: float) -> Reservation:
        """Blocks for `num_tokens` of prompt KV that another worker computes and writes,
        held for `request_id` until `add_prefilled` admits it, `cancel` or `expire`.
        NoFreeBlocks if the pool cannot hold them now; ValueError for an id already here."""
        if request_id in self.remote or request_id in self._by_id:
            raise ValueError(f"request {request_id} is already here")
        r = Reservation(request_id, self.blocks.allocate(self.blocks.blocks_for(num_tokens)), num_tokens, expires)
        self.remote[request_id] = r
        return r

    def cancel(self, request_id: str) -> Reservation | None:
        """Give back a reservation's blocks (its KV never came); returns it if it was held."""
        r = self.remote.pop(request_id, None)
        if r is not None:
            self.blocks.release(r.block_ids)
        return r

    def expire(self, now: float, claimed: Callable[[str], bool] = lambda request_id: False) -> list[Reservation]:
        """Give back every reservation past its expiry (its writer's lease ran out) that
        no decode has `claimed` (one whose sequence is on its way to `add_prefilled`)."""
        gone = [r for r in self.remote.values() if now > r.expires and not claimed(r.request_id)]
        for r in gone:
            self.cancel(r.request_id)
        return gone

    def add_prefilled(self, seq: Sequence) -> str | None:
        """Admit a sequence whose prompt KV fills the blocks reserved for it (`reserve`)
        and whose first token was sampled elsewhere. Returns a finish reason if that token
        already ends it. ValueError without a reservation, or one for another length."""
        r = self.remote.get(seq.request_id)
        if r is None:
            raise ValueError(f"request {seq.request_id} holds no reservation (cancelled or expired)")
        if r.num_tokens != seq.prompt_len:
            raise ValueError(f"the reservation covers {r.num_tokens} tokens, the prompt has {seq.prompt_len}")
        self._register(seq)                         # first: a refused id leaves the reservation as it was
        del self.remote[seq.request_id]
        seq.block_ids = list(r.block_ids)           # the sequence owns them from here
        seq.num_computed = seq.prompt_len
        self._fork(seq)
        reason = seq.check_finished()
        if reason:
            self._finish(seq, reason)
            return reason
        seq.status = SeqStatus.READY
        self.ready.append(seq)
        return None

    def _register(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id or seq.request_id in self.retained:
            raise ValueError(f"request {seq.request_id} is already in the engine")
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")
            return seq
        # a choice not started yet, waiting on its parent's prompt (n > 1): it never starts
        for parent in list(self._by_id.values()):
            child = next((c for c in parent.forks if c.request_id == request_id), None)
            if child is not None:
                parent.forks.remove(child)
                child.status, child.finish_reason = SeqStatus.FINISHED, "abort"
                return child
        return None

    def release(self, request_id: str) -> None:
        """Give back the blocks of a finished sequence kept by `retain_finished`."""
        seq = self.retained.pop(request_id, None)
        if seq is not None:
            self._free_blocks(seq)

    # ---- one step ----
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        self._logprob_rows = PROMPT_LOGPROB_ROWS
        while self.ready and len(self.running) < self.config.max_num_seqs:
            seq = self.ready.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.joined.append(seq)
        preempted = False
        # Prompt tokens this step may take: all the budget leaves, unless it decodes too
        # (then what max_mixed_prefill tokens at a prompt's start cost, each chunk counted
        # at its cost: `_prompt_cost`).
        prompts, capped, weight = budget, None, 0.0
        if self.config.max_mixed_prefill and any(s.num_computed == len(s.token_ids) - 1 for s in self.running):
            weight = self.config.context_cost
            prompts = capped = _prompt_cost(0, self.config.max_mixed_prefill, weight)
        drafts, room = self._drafts(budget)
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:        # preempted earlier in this pass
                continue
            n = self._chunk_len(seq, budget, prompts, weight)
            if n == 0 and prompts == capped and capped is not None:
                # a running prompt so far in that one token costs more than a step's
                # allowance takes one anyway, rather than wait for every decode to end
                n = min(1, budget)
            if n == 0:
                continue
            draft = self._fit_draft(seq, drafts.get(seq, ()), room) if n == 1 else ()
            n += len(draft)
            if self.in_flight and self._short(seq, seq.num_computed + n):
                # no preemption under a running step: this one waits a step, and no
                # newcomer takes the blocks it waits for
                self.num_sat_out += 1
                preempted = True
                continue
            freed = self._make_room(seq, seq.num_computed + n, plan)
            preempted = preempted or freed is not None
            budget += freed or 0
            if seq.status is SeqStatus.RUNNING:
                self._add(plan, Chunk(seq, seq.num_computed, n, draft))
                budget -= n
                prompts -= _prompt_cost(seq.num_computed, n, weight) if n > 1 and not draft else 0
        priority = None                                 # of the new prompts this step
        while (not preempted and self.waiting and min(budget, prompts) > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self._next_waiting()
            if priority is not None and seq.priority != priority:
                break
            if self._chunk_len(seq, budget, prompts, weight) == 0 and (
                    prompts != capped or seq.params.prompt_logprobs is not None):
                break                   # what the step has left affords none of its tokens
            if not self._admit(seq):
                break
            priority = seq.priority
            # capped, and no prompt tokens in the step yet: a short prompt may go whole
            whole = prompts == capped and len(seq.token_ids) - seq.num_computed <= self.config.mixed_whole_prompt
            start = seq.num_computed
            n = self._start(seq, plan, budget, budget if whole else prompts, 0.0 if whole else weight)
            budget -= n
            prompts -= _prompt_cost(start, n, weight) if n > 1 else 0
            if n == 0:                  # a cached prefix left its first chunk a dearer start
                break
        return plan

    def schedule_ahead(self, below: int) -> StepPlan:
        """A step of waiting prompts more urgent than `below` alone (the most urgent
        priority among them, oldest first), planned while another step's forward pass
        is paused between two layers: the running sequences, that step's among them,
        are not touched (none is preempted, none joins), and only free blocks are
        taken."""
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        self._logprob_rows = PROMPT_LOGPROB_ROWS
        urgent = sorted((s for s in self.waiting if s.priority < below), key=lambda s: s.priority)
        for seq in urgent:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs or seq.priority != urgent[0].priority:
                break
            if not self._admit(seq):
                break
            budget -= self._start(seq, plan, budget, budget)
        return plan

    def _start(self, seq: Sequence, plan: StepPlan, budget: int, prompts: float, weight: float = 0.0) -> int:
        """An admitted waiting sequence starts running with its first chunk in `plan`
        (`_chunk_len`'s tokens under `budget` and `prompts`); returns the chunk's tokens."""
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        n = self._chunk_len(seq, budget, prompts, weight)
        if n:                       # none: a cached prefix made its first chunk dearer; it runs next step
            self._add(plan, Chunk(seq, seq.num_computed, n))
        return n

    def _add(self, plan: StepPlan, chunk: Chunk) -> None:
        plan._add(chunk)
        if chunk.seq.params.prompt_logprobs is not None and chunk.num_tokens > 1:
            self._logprob_rows -= chunk.num_tokens

    def _next_waiting(self) -> Sequence:
        """The oldest waiting sequence of the most urgent priority (lowest; 0 is the
        default and the most urgent the router gives, so the head is usually it)."""
        head = self.waiting[0]
        if head.priority <= 0:
            return head
        return min(self.waiting, key=lambda s: s.priority)

    def _drafts(self, budget: int) -> tuple[dict[Sequence, list[int]], list[int]]:
        """The speculator's drafts for the decoding sequences, each at most the tokens its
        max_tokens leaves after this step's own; and the room drafts have, [tokens,
        blocks]: what is left once every running sequence has its own next token and
        the block for it, and every running prompt the most its chunk may take, so a
        draft never starves or preempts another sequence, nor takes the step past its
        budget."""
        if self.speculator is None:
            return {}, [0, 0]
        decoding = self._decoding()
        if not decoding:
            return {}, [0, 0]
        own_blocks = sum(max(0, self._needed(s, len(s.token_ids))) for s in self.running)
        chunks = sum(min(len(s.token_ids) - s.num_computed, self.config.max_mixed_prefill or budget,
                         self.config.max_prefill_chunk or budget) - 1
                     for s in self.running if len(s.token_ids) - s.num_computed > 1)
        room = [budget - len(self.running) - chunks, max(0, self.blocks.num_available - own_blocks)]
        if room[0] <= 0:
            return {}, room
        try:
            return self.speculator.drafts(decoding), room
        except Exception:       # a proposer that fails (a draft model out of memory) costs its drafts only
            self.failed_drafts += 1
            if self.failed_drafts == 1 or self.failed_drafts % 1000 == 0:
                log.exception("drafting failed (%d times so far); this step verifies no drafts", self.failed_drafts)
            return {}, room

    def _decoding(self) -> list[tuple[Sequence, int]]:
        """The sequences a draft may follow (decoding, their last token not yet computed),
        each with the most tokens its max_tokens leaves after this step's own."""
        return [(s, s.params.max_tokens - s.num_generated - 1) for s in self.running
                if s.num_computed == len(s.token_ids) - 1 and s.num_generated > 0]

    def drafts_need_tokens(self) -> bool:
        """Whether the next step's drafting needs a token still on the device (async
        scheduling: the engine reads the step in flight first)."""
        return self.speculator is not None and self.speculator.needs_tokens(self._decoding())

    def _fit_draft(self, seq: Sequence, draft: list[int], room: list[int]) -> tuple[int, ...]:
        """`draft` cut to the room drafts have left (`_drafts`), which it then takes."""
        tokens, blocks = room
        bs = self.blocks.block_size
        # tokens that fit in the blocks the sequence has and those it may take
        fits = (self.blocks.blocks_for(seq.num_computed + 1) + blocks) * bs - seq.num_computed - 1
        draft = draft[:max(0, min(tokens, fits))]
        if draft:
            room[0] -= len(draft)
            room[1] -= (self.blocks.blocks_for(seq.num_computed + 1 + len(draft))
                        - self.blocks.blocks_for(seq.num_computed + 1))
        return tuple(draft)

    def _chunk_len(self, seq: Sequence, budget: int, prompts: float, weight: float = 0.0) -> int:
        """Tokens of `seq` in this step: its next token, or as much of its prompt as the
        budget, the prompt allowance `prompts` (tokens, or with a context `weight` their
        `_prompt_cost`) and the chunk limit leave."""
        n = min(len(seq.token_ids) - seq.num_computed, budget)
        if n > 1:
            n = max(min(n, _affordable(seq.num_computed, prompts, weight), self.config.max_prefill_chunk or n), 0)
            if seq.params.prompt_logprobs is not None:
                n = max(min(n, self._logprob_rows), 0)
        return n

    def _admit(self, seq: Sequence) -> bool:
        """Blocks for a waiting sequence's tokens, a cached prefix reused; False if the
        pool cannot hold it now (it stays first in line)."""
        need = self.blocks.blocks_for(len(seq.token_ids))
        if self.running and self.blocks.num_available - need < self._watermark and (
                seq.params.prompt_logprobs is not None
                or self.blocks.num_available - need + self.blocks.shared_prefix(seq.token_ids, seq.params.cache_salt)
                < self._watermark):     # a prefix the running sequences hold is shared, not taken
            return False
        try:
            hit = self.blocks.acquire(seq.token_ids, reuse=seq.params.prompt_logprobs is None,
                                     salt=seq.params.cache_salt)
        except NoFreeBlocks:
            return False
        seq.block_ids, seq.keys, seq.num_computed = hit.block_ids, hit.keys, hit.cached_tokens
        if seq.num_generated == 0 and seq.num_preemptions == 0:
            seq.num_cached = hit.cached_tokens      # not its own chunks, cached when it was preempted
        return True

    def _needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` lacks for its first `num_tokens` tokens."""
        return self.blocks.blocks_for(num_tokens) - len(seq.block_ids)

    def _short(self, seq: Sequence, num_tokens: int) -> bool:
        return self._needed(seq, num_tokens) > self.blocks.num_available

    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> int | None:
        """Blocks for `seq`'s first `num_tokens` tokens, preempting the newest running
        sequences while the pool is short (`seq` itself, if it is the newest). Returns
        the planned tokens the preemptions took back, or None when none happened."""
        need = self._needed(seq, num_tokens)
        freed = None
        while need > self.blocks.num_available:
            victim = self.running[-1]
            freed = (freed or 0) + plan._drop(victim)
            self._preempt(victim)
            if victim is seq:
                return freed
        if need > 0:
            seq.block_ids.extend(self.blocks.allocate(need))
        return freed

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free_blocks(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def launch(self) -> int:
        """A step goes to the device and may not have run yet when this returns: its
        number, for `landed()`. Blocks given back from now on are held until it lands."""
        self.launches += 1
        return self.launches

    def launched(self, plan: StepPlan, rows: list[Chunk]) -> None:
        """The tokens of `plan` count as computed; each of its sampling chunks `rows`
        (`plan.sampling()`, taken before this call) gets a PENDING token until
        `resolve()`."""
        for c in plan.chunks:
            seq = c.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed = c.start + c.num_tokens - len(c.draft)
            if c.start < len(seq.keys) * self.blocks.block_size:     # full prompt blocks: shareable now
                self.blocks.cache(seq.block_ids, seq.keys, seq.num_computed)
        for c in rows:
            if c.seq.status is SeqStatus.RUNNING:
                c.seq.token_ids.append(PENDING)

    def resolve(self, rows: list[Chunk], sampled: list[list[int]]) -> list[SeqUpdate]:
        """The tokens sampled for `rows` (a launched step's sampling chunks; one list per
        chunk, a token per position it samples) take their PENDING places; a drafted
        chunk keeps its drafts up to the first its samples differ from, then that sample.
        A sequence that ended meanwhile (aborted, or finished by the step before) ignores
        its tokens; one that ends on a token ignores those after it."""
        out: list[SeqUpdate] = []
        for c, tokens in zip(rows, sampled, strict=True):
            seq = c.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            if c.draft:
                tokens = self._verified(c, tokens)
            taken: list[int] = []
            reason = None
            for token in tokens:
                if token == NO_TOKEN:               # its constraints left no token: it ends here
                    self._no_token(seq, c, taken)
                    reason = NO_TOKEN_LEFT
                    break
                if taken:
                    seq.token_ids.append(token)
                else:
                    seq.token_ids[c.start + c.num_tokens - len(c.draft)] = token
                taken.append(token)
                if seq.constraint is not None:
                    seq.constraint.accept(token)    # a token no grammar path takes ends it ("stop")
                if seq.num_generated == 1:
                    self._fork(seq)
                reason = seq.check_finished() or ("prefilled" if self.config.prefill_only else None)
                if reason:
                    break
            if reason:
                self._finish(seq, reason)
            elif c.draft:
                self._roll_back(seq)
            out.append(SeqUpdate(seq, taken, reason))
        return out

    def _no_token(self, seq: Sequence, c: Chunk, taken: list[int]) -> None:
        """Before `seq` ends where no token was left: its token list and computed KV
        stop at the tokens it has (a step launched since may have computed the place)."""
        end = c.start + c.num_tokens - len(c.draft) + len(taken)
        del seq.token_ids[end:]
        seq.num_computed = min(seq.num_computed, end)

    def _verified(self, c: Chunk, tokens: list[int]) -> list[int]:
        """A drafted chunk's tokens to keep: the drafts its samples agree with, then the
        first sample that differs (or the one after the last draft)."""
        m = 0
        while m < len(c.draft) and tokens[m] == c.draft[m]:
            m += 1
        self.speculator.accepted(c.seq, len(c.draft), m)
        return tokens[:m + 1]

    def _roll_back(self, seq: Sequence) -> None:
        """After a verify step: the KV of every kept token but the newest is computed;
        blocks past the tokens go back (they held only rejected drafts)."""
        seq.num_computed = len(seq.token_ids) - 1
        keep = self.blocks.blocks_for(len(seq.token_ids))
        spare, seq.block_ids = seq.block_ids[keep:], seq.block_ids[:keep]
        if spare and self.in_flight:
            self._held.append((self.launches, spare, [], 0))
        elif spare:
            self.blocks.release(spare)

    def landed(self, number: int) -> None:
        """Step `number` (and every one before it) is done on the device: the blocks held
        for it go back."""
        self.landed_upto = max(self.landed_upto, number)
        held, self._held = self._held, []
        for launches, block_ids, keys, num_computed in held:
            if launches <= self.landed_upto:
                self.blocks.release(block_ids, keys, num_computed)
            else:
                self._held.append((launches, block_ids, keys, num_computed))

    def _fork(self, parent: Sequence) -> None:
        """Start the choices waiting on `parent`, whose prompt KV is now complete. Each
        shares the blocks before the one holding the last prompt token and gets a copy of
        that one, since it writes that token's KV again (its own first sample needs the
        logits there). With no block to spare, a choice waits and computes its prompt."""
        forks, parent.forks = parent.forks, []
        last = (parent.prompt_len - 1) // self.blocks.block_size
        for child in forks:
            child.token_ids = list(parent.token_ids[:parent.prompt_len])
            self._register(child)
            try:
                (fresh,) = self.blocks.allocate(1)
            except NoFreeBlocks:
                child.status = SeqStatus.WAITING
                self.waiting.append(child)
                continue
            src = parent.block_ids[last]
            # Both ends of the copy stay referenced until it is made, whatever happens
            # to either sequence before the next forward pass.
            self.blocks.share(parent.block_ids[:last + 1] + [fresh])
            self.copies.append((src, fresh))
            child.block_ids = parent.block_ids[:last] + [fresh]
            child.num_computed = parent.prompt_len - 1
            child.status = SeqStatus.READY
            self.ready.append(child)

    def copies_made(self, done: bool = False) -> None:
        """The engine queued every pending copy on the device, ahead of the next step it
        launches. On a GPU the copy may not have run when this returns, so both ends stay
        held until that step lands: a source given back now (its sequence has ended) could
        be handed to a reservation and written by a transfer before the copy reads it.
        `done`: the copies have run (no step follows them to land): both ends go back now."""
        copies, self.copies = self.copies, []
        ends = [b for pair in copies for b in pair]
        if done and ends:
            self.blocks.release(ends)
        elif ends:
            self._held.append((self.launches + 1, ends, [], 0))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.READY:
            self.ready.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self.speculator is not None:
            self.speculator.finished(seq)
        self.orphans.extend(seq.forks)
        seq.forks = []
        self._by_id.pop(seq.request_id, None)
        if self.config.retain_finished and seq.block_ids:
            self.retained[seq.request_id] = seq
        else:
            self._free_blocks(seq)

    def _free_blocks(self, seq: Sequence) -> None:
        """Its blocks go back, every full block of computed tokens cached: its output's
        too (a conversation's next turn begins with this prompt and this output), and a
        preempted sequence's, remote KV and a fork's copied prompt included, so that its
        return finds them. Keys known from its admission are not hashed again."""
        seq.keys = self.blocks.keys_of(seq.token_ids[:seq.num_computed], seq.params.cache_salt, seq.keys) \
            or seq.keys
        if seq.block_ids and self.in_flight:
            self._held.append((self.launches, seq.block_ids, seq.keys, seq.num_computed))
        elif seq.block_ids:
            self.blocks.release(seq.block_ids, seq.keys, seq.num_computed)
        seq.block_ids, seq.keys = [], []


def _prompt_cost(start: int, n: int, weight: float) -> float:
    """Prompt tokens start..start + n as tokens at position 0 cost: each also attends to
    the tokens before it, `weight` a token of context."""
    return n * (1.0 + weight * (start + (n - 1) / 2))


def _affordable(start: int, allowance: float, weight: float) -> int:
    """The most prompt tokens from `start` on whose `_prompt_cost` fits `allowance`."""
    if allowance <= 0:
        return 0
    if weight <= 0:
        return int(allowance)
    b = 1.0 + weight * (start - 0.5)                    # cost = n * b + weight / 2 * n^2
    n = int((math.sqrt(b * b + 2 * weight * allowance) - b) / weight)
    while _prompt_cost(start, n + 1, weight) <= allowance * (1 + 1e-12):   # float rounding at the edge
        n += 1
    while n > 0 and _prompt_cost(start, n, weight) > allowance * (1 + 1e-12):
        n -= 1
    return n
