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
    """Samples added since the last tick, from counters that only grow per source (a
    router) and key (a worker). A source seen for the first time gives nothing (its
    past is unknown: this reader just started); a new key of a known source is all new;
    counts that went down mean the source restarted, and are all new."""

    def __init__(self) -> None:
        self._last: dict[tuple[Hashable, Hashable], Histogram] = {}
        self._sources: set[Hashable] = set()
        self._fed: set[tuple[Hashable, Hashable]] = set()
        self._fed_sources: set[Hashable] = set()

    def feed(self, source: Hashable, series: dict[Hashable, Sequence[int]]) -> dict[Hashable, Histogram]:
        out = {}
        self._fed_sources.add(source)
        for key, counts in series.items():
            counts = tuple(counts)
            previous = self._last.get((source, key))
            self._last[(source, key)] = counts
            self._fed.add((source, key))
            if previous is None:
                out[key] = counts if source in self._sources else EMPTY
                continue
            diff = tuple(c - p for c, p in zip(counts, previous))
            out[key] = counts if any(d < 0 for d in diff) else diff
        return out

    def end_tick(self) -> None:
        """Forget the sources and keys not fed since the last end_tick."""
        self._last = {k: v for k, v in self._last.items() if k in self._fed}
        self._sources, self._fed, self._fed_sources = self._fed_sources, set(), set()


class BusyFraction:
    """The share of wall time a worker spent busy between two of its reports, from a
    cumulative busy-seconds counter; None until two reports were seen."""

    def __init__(self) -> None:
        self._last: dict[Hashable, tuple[float, float]] = {}
        self._fraction: dict[Hashable, float | None] = {}

    def update(self, key: Hashable, reported_at: float, busy_seconds: float) -> float | None:
        previous = self._last.get(key)
        if previous is not None and reported_at <= previous[0]:
            return self._fraction.get(key)                      # the same report again
        self._last[key] = (reported_at, busy_seconds)
        fraction = None
        if previous is not None and busy_seconds >= previous[1]:
            fraction = (busy_seconds - previous[1]) / (reported_at - previous[0])
        self._fraction[key] = fraction
        return fraction

    def forget_except(self, keys: set) -> None:
        self._last = {k: v for k, v in self._last.items() if k in keys}
        self._fraction = {k: v for k, v in self._fraction.items() if k in keys}
