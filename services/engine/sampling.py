"""Sampling parameters as the engine sees them. The router resolves and checks them for
clients; the engine checks them again, since a worker may be called by anyone who
reaches its port, and one bad value must fail its own request, never a batch."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 = off
    seed: int = 0                       # the router assigns one when the client did not
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:                  # NaN fails this too
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 = off)")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
