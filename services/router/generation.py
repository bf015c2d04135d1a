"""What the router keeps of one request, and what it hands its callers: the `Generation`
record (one per choice), the text `Delta`s, and the shape of the workers' token stream.
Plain data; the request path that fills them is cluster.py's."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from services.engine.core.prefix_cache import block_hashes
from services.engine.core.sampling import SamplingParams, TokenLogprob

# What workers stream: (choice, new token ids, finish reason or "", their logprobs or None).
Tokens = tuple[int, list[int], str, "list[TokenLogprob] | None"]


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None      # one per token, when asked for
    index: int = 0                                  # the choice


@dataclass
class Generation:
    """One request's record: what was decided and what happened. `request_id` is the
    router's own; a client's id (gRPC `request_id`) is only echoed back, never sent to a
    worker, so two clients' ids cannot collide there."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    client_id: str = ""                 # the caller's own id, for responses and logs
    priority: int = 0                   # its prompt's turn at the workers (fairness.Ticket's)
    worker_id: str = ""                 # what the workers call the current attempt (handoff.py)
    decision: str = ""
    decode_worker: str = ""
    prefill_worker: str = ""
    decode_epoch: str = ""
    prefill_epoch: str = ""
    transport: str = ""
    transport_fallback: bool = False
    kv_bytes: int = 0
    completion_tokens: int = 0
    thinking: object | None = None      # reasoning.ThinkingTokens, with --reasoning-parser (chat)
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None    # vLLM's: the stop string or stop token id that ended it
    prompt_logprobs: list[TokenLogprob] | None = None    # prompt tokens 1.., when asked for
    structure_param: str | None = None  # the field that asked for its structure: a worker's error in it names it
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    _keys: tuple[int, list[int]] | None = field(default=None, repr=False)

    def prefix_keys(self, block_size: int) -> list[int]:
        """The prompt's chained block keys (computed once per block size)."""
        if self._keys is None or self._keys[0] != block_size:
            self._keys = (block_size, block_hashes(self.prompt_ids, block_size, self.params.cache_salt))
        return self._keys[1]

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def same_route_as(self, leader: "Generation") -> None:
        """Another choice of `leader`'s request went the same way."""
        for name in ("decision", "decode_worker", "prefill_worker", "decode_epoch", "prefill_epoch", "transport",
                     "transport_fallback", "kv_bytes", "cached_tokens"):
            setattr(self, name, getattr(leader, name))

    def route(self) -> str:
        """What happened, for the x-pdserve-route header and gRPC trailing metadata."""
        parts = [f"decision={self.decision}", f"decode={self.decode_worker}"]
        if self.prefill_worker:
            parts += [f"prefill={self.prefill_worker}", f"cached_tokens={self.cached_tokens}",
                      f"transport={self.transport or 'none'}", f"kv_bytes={self.kv_bytes}"]
            if self.transport_fallback:
                parts.append("transport_fallback=1")
        return ";".join(parts)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
