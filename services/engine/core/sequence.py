"""A sequence as the scheduler keeps it, and what the scheduler makes of sequences: the
chunks of a step's plan, a token's update, a reservation for KV another worker writes.
Plain Python, like the scheduler (scheduler.py)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.engine.core.sampling import SamplingParams

# A token sampled by a step still running on the device (async scheduling): it stands in
# a sequence's `token_ids` until the step's tokens are read.
PENDING = -1
# What a step's sampling returns for a row whose constraints left no token at all
# (allowed_token_ids, bad words, min_tokens and a grammar together ruling out every
# one): the sequence ends with the finish reason NO_TOKEN_LEFT, which its worker answers
# as the caller's error (`no_token_left`), never with a token none of them allows.
NO_TOKEN = -2
NO_TOKEN_LEFT = "no_token"

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
    keys: list[int] = field(default_factory=list)   # prefix keys of its first admission's full blocks
    num_computed: int = 0               # leading tokens whose KV is in block_ids
    num_cached: int = 0                 # prompt tokens found in the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Structured output's place in its grammar (structured.Constraint): the engine masks
    # this sequence's logits with it and has it follow every token taken.
    constraint: object | None = None
    # Its tokens as the penalties keep them on the device (sampler.TokenHistory), brought
    # up to date each step with the tokens added since the one before.
    kept_tokens: object | None = None
    # Other choices of the same request (n > 1), waiting for this one's prompt KV: they
    # share its full prompt blocks and recompute only the last prompt token (fork()).
    forks: list["Sequence"] = field(default_factory=list)
    # With params.prompt_logprobs: entry p is prompt token p's (None for the first, and
    # until computed); the engine fills it as the prompt's chunks run.
    prompt_logprobs: list | None = None
    # Its turn among waiting prompts: lower first, arrival order within one (vLLM's
    # priority). The router sets it from the fair share among tenants.
    priority: int = 0

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def check_finished(self) -> str | None:
        """The finish reason after the newest token, or None."""
        if self.num_generated == 0:
            return None
        if self.num_generated > self.params.min_tokens and (
                (not self.params.ignore_eos and self.last_token in self.eos_token_ids)
                or self.last_token in self.params.stop_token_ids):
            return "stop"
        if self.constraint is not None and self.constraint.terminated:
            return "stop"
        if self.num_generated >= self.params.max_tokens:
            return "length"
        return None


@dataclass(frozen=True)
class Chunk:
    """Tokens start .. start + num_tokens of one sequence, computed in this step. With a
    `draft` (speculative decoding), the sequence's last token and the drafted tokens after
    it, each scored in this step: the chunk samples a token at every position, and the
    drafts are kept while they agree with those samples (Scheduler.resolve)."""
    seq: Sequence
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        return self.start + self.num_tokens - len(self.draft) == len(self.seq.token_ids)

    @property
    def num_sampled(self) -> int:
        """Tokens a sampling chunk samples: one, or one per position of a drafted chunk."""
        return 1 + len(self.draft)

    @property
    def token_ids(self) -> list[int]:
        end = self.start + self.num_tokens - len(self.draft)
        return self.seq.token_ids[self.start:end] + list(self.draft)


@dataclass
class StepPlan:
    """One forward pass: single-token chunks (decode) first, then drafted ones (verify:
    a decode token and the drafts after it), then prompt chunks (prefill).
    `joined`: sequences prefilled elsewhere that join the running batch with this step."""
    decode: list[Chunk] = field(default_factory=list)
    verify: list[Chunk] = field(default_factory=list)
    prefill: list[Chunk] = field(default_factory=list)
    joined: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.decode or self.verify or self.prefill)

    @property
    def chunks(self) -> list[Chunk]:
        return self.decode + self.verify + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.num_tokens for c in self.verify + self.prefill)

    def sampling(self) -> list[Chunk]:
        """The chunks that sample a token, in the order of their rows."""
        return [c for c in self.chunks if c.samples]

    def _add(self, chunk: Chunk) -> None:
        (self.verify if chunk.draft else self.decode if chunk.num_tokens == 1 else self.prefill).append(chunk)

    def _drop(self, seq: Sequence) -> int:
        """Take `seq` out of the plan (it was preempted); returns the tokens it had."""
        for chunks in (self.decode, self.verify, self.prefill):
            for i, c in enumerate(chunks):
                if c.seq is seq:
                    del chunks[i]
                    return c.num_tokens
        return 0


@dataclass(frozen=True)
class Reservation:
    """Blocks held for a prompt whose KV another worker computes and writes."""
    request_id: str
    block_ids: list[int]
    num_tokens: int
    expires: float              # past this time (the caller's clock) the blocks go back unless admitted


@dataclass(frozen=True)
class SeqUpdate:
    """A sequence's new tokens after a step (one, or more where drafts were accepted),
    and its finish reason if it ended."""
    seq: Sequence
    token_ids: list[int]
    finish_reason: str | None
