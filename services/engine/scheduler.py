"""Continuous-batching scheduler of a decode worker. Plain Python: no torch, no I/O.

A sequence's life here:
  remote prefill:  add_prefilled() -> ready -> running -> finished
  local prefill:   add_waiting()   -> waiting -> (prefill step) -> running -> finished
  out of blocks:   running -> preempted -> waiting (its KV is recomputed locally)

Each engine step asks `schedule()` for at most one prefill chunk and every running
sequence's next decode token; blocks for the new tokens are taken from the pool here,
so the runner never allocates. Sequences join and leave the running batch at any step.
With `prefill_chunk` set, a long local prompt is computed a chunk per step, so the
running sequences keep getting tokens while it fills (chunked prefill).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from services.engine.block_pool import BlockPool
from services.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    READY = "ready"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    eos_token_ids: frozenset[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0               # leading tokens whose KV is in block_ids
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def tokens_to_prefill(self) -> list[int]:
        """Tokens whose KV is missing before decoding can go on.

        With no generated token yet the whole prompt runs and its last logits are
        sampled; after a preemption everything but the last token is recomputed."""
        end = len(self.token_ids) if self.num_generated == 0 else len(self.token_ids) - 1
        return self.token_ids[self.num_computed:end]

    def check_finished(self) -> str | None:
        """The finish reason after the newest token, or None."""
        if self.num_generated == 0:
            return None
        if (not self.params.ignore_eos and self.num_generated > self.params.min_tokens
                and self.last_token in self.eos_token_ids):
            return "stop"
        if self.num_generated >= self.params.max_tokens:
            return "length"
        return None


@dataclass
class StepPlan:
    prefill: Sequence | None
    decode: list[Sequence]
    prefill_len: int = 0                # tokens of `prefill` to compute in this step

    def __bool__(self) -> bool:
        return self.prefill is not None or bool(self.decode)


class Scheduler:
    def __init__(self, pool: BlockPool, max_batch: int = 64, prefill_chunk: int = 0) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk  # 0: a whole prompt per step
        self.prefilling: Sequence | None = None
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def add_prefilled(self, seq: Sequence) -> str | None:
        """Admit a sequence whose prompt KV already fills `seq.block_ids` and whose first
        token was sampled elsewhere. Returns a finish reason if that token already ends it."""
        seq.num_computed = seq.prompt_len
        self._by_id[seq.request_id] = seq
        reason = self._finish_if_done(seq)
        if reason is None:
            seq.status = SeqStatus.READY
            self.ready.append(seq)
        return reason

    def add_waiting(self, seq: Sequence) -> None:
        """Admit a sequence whose prompt must be prefilled on this worker."""
        seq.status = SeqStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")
        return seq

    def schedule(self) -> StepPlan:
        while self.ready and len(self.running) < self.max_batch:
            seq = self.ready.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        decode = [seq for seq in list(self.running) if self._grow(seq)]
        seq = self._pick_prefill()
        if seq is None:
            return StepPlan(None, decode)
        todo = len(seq.tokens_to_prefill())
        return StepPlan(seq, decode, min(todo, self.prefill_chunk) if self.prefill_chunk else todo)

    def _grow(self, seq: Sequence) -> bool:
        """Give `seq` a slot for its next token, preempting newer sequences if needed."""
        if seq.status is not SeqStatus.RUNNING:       # preempted earlier in this pass
            return False
        need = self.pool.blocks_for(len(seq.token_ids)) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return seq.status is SeqStatus.RUNNING

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.pool.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _pick_prefill(self) -> Sequence | None:
        if self.prefilling is not None:                 # the next chunk of a started prompt
            return self.prefilling
        if not self.waiting or len(self.running) >= self.max_batch:
            return None
        seq = self.waiting[0]
        need = self.pool.blocks_for(len(seq.token_ids)) - len(seq.block_ids)
        if need > self.pool.num_free:
            return None
        self.waiting.popleft()
        seq.block_ids.extend(self.pool.allocate(need))
        self.prefilling = seq
        return seq

    def on_prefilled(self, seq: Sequence, computed: int, sampled: int | None) -> str | None:
        """After a local prefill step over `computed` tokens; `sampled` is the first
        token if the prompt is complete and one was drawn. None while chunks remain."""
        if seq.status is SeqStatus.FINISHED:
            return seq.finish_reason
        seq.num_computed += computed
        if seq.tokens_to_prefill():
            return None
        self.prefilling = None
        if sampled is not None:
            seq.token_ids.append(sampled)
        reason = self._finish_if_done(seq)
        if reason is None:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return reason

    def on_decoded(self, seqs: list[Sequence], tokens: list[int]) -> list[tuple[Sequence, str | None]]:
        """Append each sequence's new token; returns (sequence, finish reason or None)."""
        out = []
        for seq, tok in zip(seqs, tokens):
            if seq.status is not SeqStatus.RUNNING:   # aborted during the step
                continue
            seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(tok)
            out.append((seq, self._finish_if_done(seq)))
        return out

    def _finish_if_done(self, seq: Sequence) -> str | None:
        reason = seq.check_finished()
        if reason:
            self._finish(seq, reason)
        return reason

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.READY:
            self.ready.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if self.prefilling is seq:
            self.prefilling = None
        if seq.block_ids:
            self.pool.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)
