"""Latency histograms shared by the routers (which fill them) and the autoscaler (which
reads percentiles from them). Pure: no I/O.

A histogram is a tuple of counts, one per bucket of LATENCY_BOUNDS (upper bounds in
seconds, growing by 10 %, 1 ms to about 10 min) and a last one for anything slower.
Routers publish cumulative counts per worker; `CumulativeDeltas` turns successive
reports into the samples that are new since the last read.
"""
from __future__ import annotations

import bisect
from typing import Hashable, Sequence

LATENCY_BOUNDS: tuple[float, ...] = tuple(round(0.001 * 1.1 ** i, 9) for i in range(140))
NUM_BUCKETS = len(LATENCY_BOUNDS) + 1

Histogram = tuple[int, ...]
EMPTY: Histogram = (0,) * NUM_BUCKETS


def bucket_of(seconds: float) -> int:
    return bisect.bisect_left(LATENCY_BOUNDS, seconds)


def histogram(samples: Sequence[float]) -> Histogram:
    counts = [0] * NUM_BUCKETS
    for s in samples:
        counts[bucket_of(s)] += 1
    return tuple(counts)


def merge(a: Sequence[int], b: Sequence[int]) -> Histogram:
    return tuple(x + y for x, y in zip(a, b))


def quantile(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile (0..1), interpolated linearly inside its bucket as Prometheus'
    histogram_quantile does; None when there are no samples."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= rank:
            if i == len(LATENCY_BOUNDS):            # beyond the last bound
                return LATENCY_BOUNDS[-1]
            lo = LATENCY_BOUNDS[i - 1] if i else 0.0
            return lo + (LATENCY_BOUNDS[i] - lo) * (rank - seen) / c
        seen += c
    return LATENCY_BOUNDS[-1]


class CumulativeDeltas:
    """Samples added since the last call, from counters that only grow per source (a
    router): a source seen for the first time gives nothing (its past is unknown), a
    source whose counts went down restarted, and its new counts are all new."""

    def __init__(self) -> None:
        self._last: dict[Hashable, Histogram] = {}

    def delta(self, key: Hashable, counts: Sequence[int]) -> Histogram:
        counts = tuple(counts)
        previous = self._last.get(key)
        self._last[key] = counts
        if previous is None:
            return EMPTY
        diff = tuple(c - p for c, p in zip(counts, previous))
        return counts if any(d < 0 for d in diff) else diff

    def forget_except(self, keys: set) -> None:
        for k in [k for k in self._last if k not in keys]:
            del self._last[k]
