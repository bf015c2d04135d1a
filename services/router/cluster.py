"""The router's request path: a request's choices go through the workers and come back
as text.

    admit (bounded: admission.py) -> Cluster.generate
      -> Handoff (handoff.py): pick decode worker -> plan: remote or local prefill
         (policy.py) -> Reserve -> Prefill -> Decode stream -> every release
      -> OutputProcessor (output.py): detokenize, stop strings, schema guard -> Deltas

The workers themselves, their load as this router sees it and the choice among them are
the WorkerSet's (workers.py).
"""
from __future__ import annotations

from contextlib import aclosing
from typing import AsyncIterator

from services.common.metrics import RouterMetrics
from services.common.settings import RouterSettings
from services.router.generation import Delta, Generation
from services.router.handoff import Handoff
from services.router.latency import LatencyLedger
from services.router.output import OutputProcessor
from services.router.policy import CostModel
from services.router.workers import WorkerSet


class Cluster:
    def __init__(self, settings: RouterSettings, tokenizer, metrics: RouterMetrics,
                 end_ids: frozenset[int] = frozenset()) -> None:
        """`end_ids`: the model's end-of-sequence tokens (eos_token_ids)."""
        self.settings = settings
        self.tokenizer = tokenizer
        self.end_ids = end_ids
        self.metrics = metrics
        self.cost = CostModel()
        self.latency = LatencyLedger()
        self.workers = WorkerSet(settings, metrics, self.latency, self.cost)

    async def start(self) -> None:
        await self.workers.start()

    async def stop(self) -> None:
        await self.workers.stop()

    # ---- what the front ends ask ----
    def ready(self) -> bool:
        return self.workers.ready()

    def awaited(self) -> str:
        """What `ready` waits for, in words."""
        return self.workers.awaited()

    def pool_sizes(self) -> dict[str, int]:
        return self.workers.pool_sizes()

    def capacity(self) -> tuple[int, int, int]:
        """(sequences, prompts still prefilling, headroom) the router dispatches at once
        (admission.py)."""
        return self.workers.capacity()

    # ---- one generation ----
    async def generate(self, gens: list[Generation]) -> AsyncIterator[Delta]:
        """Yields text deltas of every choice (`gens`: one per choice, the first leading:
        its prompt, workers and route are the request's); raises APIError on failure.
        Closing the iterator early (client gone) cancels the request on every worker."""
        handoff = Handoff(gens[0], len(gens), self.workers, self.settings, self.metrics, self.cost, self.end_ids)
        output = OutputProcessor(self.tokenizer, gens, handoff.end_choice)
        async with aclosing(handoff.tokens()) as tokens:
            async for index, token_ids, finish, logprobs in tokens:
                delta = await output.feed(index, token_ids, finish, logprobs)
                if delta is None:
                    continue
                yield delta
                if output.finished:
                    return
