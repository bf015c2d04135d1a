"""Medians over each system's repeated runs, and every system's ratio to the best peer
(the peer with the highest median output tok/s). Pure: run documents in, table out."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Metric:
    label: str
    key: str                            # in a run's summary
    stat: str | None                    # of a latency distribution, or None for a plain number
    scale: float                        # to the unit shown
    higher_is_better: bool

    def of(self, summary: dict) -> float | None:
        value = summary.get(self.key)
        if self.stat is not None:
            value = (value or {}).get(self.stat)
        return None if value is None else value * self.scale


METRICS = (
    Metric("output tok/s", "output_throughput", None, 1, True),
    Metric("TTFT p50 ms", "ttft", "p50", 1000, False),
    Metric("TTFT p99 ms", "ttft", "p99", 1000, False),
    Metric("ITL p50 ms", "itl", "p50", 1000, False),
    Metric("ITL p99 ms", "itl", "p99", 1000, False),
    Metric("goodput req/s", "goodput", None, 1, True),
)
RANKED_BY = METRICS[0]


@dataclass
class SystemResult:
    name: str
    peer: bool                          # a system pdserve is measured against
    runs: int = 0
    failed_requests: int = 0
    values: dict[str, list[float]] = field(default_factory=dict)    # metric -> one value per run
    medians: dict[str, float | None] = field(default_factory=dict)
    ratios: dict[str, float | None] = field(default_factory=dict)   # median / the best peer's
    request_errors: dict[str, int] = field(default_factory=dict)    # failed requests' messages, over the runs
    error: str | None = None            # why it has no runs (it did not start, ...)


def system_result(name: str, peer: bool, summaries: list[dict], error: str | None = None) -> SystemResult:
    r = SystemResult(name, peer, runs=len(summaries), error=error,
                     failed_requests=sum(s.get("failed", 0) for s in summaries))
    for s in summaries:
        for message, count in (s.get("errors") or {}).items():
            r.request_errors[message] = r.request_errors.get(message, 0) + count
    for m in METRICS:
        values = [v for v in (m.of(s) for s in summaries) if v is not None]
        r.values[m.label] = values
        r.medians[m.label] = statistics.median(values) if values else None
    return r


def best_peer(results: list[SystemResult]) -> SystemResult | None:
    ranked = [r for r in results if r.peer and r.medians.get(RANKED_BY.label) is not None]
    return max(ranked, key=lambda r: r.medians[RANKED_BY.label], default=None)


def add_ratios(results: list[SystemResult]) -> SystemResult | None:
    best = best_peer(results)
    for r in results:
        for m in METRICS:
            mine, theirs = r.medians.get(m.label), best.medians.get(m.label) if best else None
            r.ratios[m.label] = mine / theirs if mine is not None and theirs else None
    return best


def _cell(value: float | None, ratio: float | None) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}" if value < 10 else f"{value:.1f}"
    return f"{text} ({ratio:.2f}x)" if ratio is not None else text


def format_table(results: list[SystemResult], best: SystemResult | None) -> str:
    metrics = [m for m in METRICS if any(r.medians.get(m.label) is not None for r in results)]
    rows = [["system", "runs", "failed", *(m.label for m in metrics)]]
    for r in results:
        name = r.name + (" *" if best is r else "")
        rows.append([name, str(r.runs), str(r.failed_requests),
                     *(_cell(r.medians.get(m.label), r.ratios.get(m.label)) for m in metrics)])
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    lines.append("medians over the runs; (x) = the system's median / the best peer's"
                 + (f" (* {best.name}, the peer with the highest median output tok/s)" if best else
                    " (no peer measured: no ratios)")
                 + "; higher is better for tok/s and goodput, lower for latencies")
    for r in results:
        lines += [f"{r.name}: {count} x {message}" for message, count in r.request_errors.items()]
        lines += [f"{r.name}: {r.error}"] if r.error else []
    return "\n".join(lines)


def summary_document(results: list[SystemResult], best: SystemResult | None, config: dict) -> dict:
    return {"config": config, "best_peer": best.name if best else None,
            "metrics": [m.label for m in METRICS], "systems": [asdict(r) for r in results]}


def plot_summary(path, results: list[SystemResult], title: str) -> None:
    """One panel per metric: each system's median as a bar, each run as a dot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in METRICS if any(r.values.get(m.label) for r in results)]
    cols = 3
    rows = max(1, -(-len(metrics) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    names = [r.name for r in results]
    for ax, m in zip(axes.flat, metrics):
        medians = [r.medians.get(m.label) or 0.0 for r in results]
        ax.bar(range(len(results)), medians, color=["tab:orange" if r.peer else "tab:blue" for r in results])
        for i, r in enumerate(results):
            ax.plot([i] * len(r.values[m.label]), r.values[m.label], "k.", markersize=5)
        ax.set_title(m.label + (" (higher is better)" if m.higher_is_better else " (lower is better)"), fontsize=9)
        ax.set_xticks(range(len(results)), names, rotation=20, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle(title + "\nbars: medians; dots: runs; blue: pdserve, orange: peers", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
