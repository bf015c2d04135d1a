"""When requests go out: a seeded Poisson schedule and/or a cap on requests in flight.

A request is released at its arrival time; under a concurrency cap it then waits for a
free slot, and its clock (TTFT, E2E) starts when it is actually sent.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence, TypeVar

from services.bench.metrics import RequestRecord

R = TypeVar("R")
Send = Callable[[R, float], Awaitable[RequestRecord]]   # (request, run start on perf_counter) -> record


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf      # mean arrivals per second; inf sends all at once
    max_concurrency: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("--request-rate must be positive (inf: all at once)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")

    def __str__(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"Poisson {self.request_rate:g} req/s"
        cap = f", at most {self.max_concurrency} in flight" if self.max_concurrency else ""
        return rate + cap


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each of n requests is released: the first
    at 0, then exponential gaps of mean 1/rate (a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals")
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


async def drive(requests: Sequence[R], send: Send, shape: LoadShape,
                on_done: Callable[[RequestRecord], None] = lambda r: None) -> list[RequestRecord]:
    """Send every request on the schedule; returns their records in request order.
    `send` turns every failure into a record, so nothing is dropped."""
    gate = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: R) -> RequestRecord:
        if gate is None:
            record = await send(req, t0)
        else:
            async with gate:
                record = await send(req, t0)
        on_done(record)
        return record

    tasks = []
    for req, at in zip(requests, arrival_offsets(len(requests), shape.request_rate, shape.seed)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req)))
    return list(await asyncio.gather(*tasks))
