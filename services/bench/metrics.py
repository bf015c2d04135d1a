"""What a run measured: one `RequestRecord` per request, and the `Summary` over them.

Definitions (times in seconds; every request's clock starts when it is sent):
- TTFT: send -> first chunk that carries output text.
- ITL: the gaps between consecutive text-bearing chunks. A chunk may carry more than
  one token, so this is the latency a reader of the stream sees, not a per-token one.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one token.
- E2E: send -> end of the stream.
- Wall time: the first send to the last completion of the run, idle time included, so
  throughput is what a client really got, not a sum over busy periods.
- Goodput: requests per second of wall time that succeeded and met every SLO given:
  TTFT <= --slo-ttft, and the request's own p99 ITL <= --slo-itl. A request's p99 (not
  its max) so that one late chunk in a long answer does not fail it; for answers under
  100 chunks it lies between the two largest gaps, close to the max.
Failed requests are counted and their errors kept; latency statistics and token counts
are over the successful ones.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass(frozen=True)
class RequestRecord:
    prompt_len: int                     # tokens of prompt text the benchmark built
    requested_output_len: int           # max_tokens sent
    start: float                        # when it was sent, seconds since the run began
    e2e: float                          # send -> end of stream (or -> the failure)
    output_len: int = 0
    output_len_source: str = ""         # "usage" (the server's count) or "retokenized"
    server_prompt_len: int | None = None  # usage.prompt_tokens (chat templates add tokens)
    ttft: float | None = None
    itl: tuple[float, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end(self) -> float:
        return self.start + self.e2e

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def chunk_times(self) -> list[float]:
        """When each text-bearing chunk arrived, seconds since the run began."""
        if self.ttft is None:
            return []
        times = [self.start + self.ttft]
        for gap in self.itl:
            times.append(times[-1] + gap)
        return times


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks, as
    numpy's default does."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> "Distribution":
        vals = list(values)
        if not vals:
            return cls(count=0)
        return cls(count=len(vals), mean=sum(vals) / len(vals), p50=percentile(vals, 50),
                   p90=percentile(vals, 90), p99=percentile(vals, 99))


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and (r.ttft is None or r.ttft > self.ttft_s):
            return False
        if self.itl_s is not None and r.itl and percentile(r.itl, 99) > self.itl_s:
            return False
        return True


def wall_time(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    return max(r.end for r in records) - min(r.start for r in records)


@dataclass(frozen=True)
class Summary:
    completed: int
    failed: int
    wall_s: float
    input_tokens: int
    output_tokens: int
    request_throughput: float           # successful requests / wall time
    output_throughput: float            # output tokens / wall time
    total_throughput: float             # (input + output tokens) / wall time
    goodput: float | None               # None when no SLO was given
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    errors: dict[str, int] = field(default_factory=dict)   # message -> how many


def summarize(records: Sequence[RequestRecord], slo: SLO = SLO()) -> Summary:
    done = [r for r in records if r.ok]
    wall = wall_time(records)
    per_s = (lambda x: x / wall) if wall > 0 else (lambda x: 0.0)
    # The server's prompt count where it sent one: that is what it processed.
    inputs = sum(r.server_prompt_len if r.server_prompt_len is not None else r.prompt_len for r in done)
    outputs = sum(r.output_len for r in done)
    return Summary(
        completed=len(done), failed=len(records) - len(done), wall_s=wall,
        input_tokens=inputs, output_tokens=outputs,
        request_throughput=per_s(len(done)), output_throughput=per_s(outputs),
        total_throughput=per_s(inputs + outputs),
        goodput=per_s(sum(slo.met_by(r) for r in done)) if slo.given else None,
        ttft=Distribution.of(r.ttft for r in done if r.ttft is not None),
        tpot=Distribution.of(t for t in (r.tpot for r in done) if t is not None),
        itl=Distribution.of(gap for r in done for gap in r.itl),
        e2e=Distribution.of(r.e2e for r in done),
        errors=dict(Counter(r.error for r in records if not r.ok).most_common()),
    )


def output_timeline(records: Sequence[RequestRecord], bin_s: float) -> list[tuple[float, float]]:
    """Output tokens per second in bins of `bin_s` from the run's first send: a chunk's
    tokens are the request's output spread evenly over its chunks."""
    done = [r for r in records if r.ok and r.ttft is not None]
    if not records or bin_s <= 0:
        return []
    t0 = min(r.start for r in records)
    bins = [0.0] * (int(wall_time(records) / bin_s) + 1)
    for r in done:
        times = r.chunk_times()
        for t in times:
            bins[min(int((t - t0) / bin_s), len(bins) - 1)] += r.output_len / len(times)
    return [(i * bin_s, tokens / bin_s) for i, tokens in enumerate(bins)]
