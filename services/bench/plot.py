"""`--plot`: latency CDFs (TTFT, ITL, E2E) and output throughput over time, one PNG."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from services.bench.metrics import RequestRecord, output_timeline, wall_time


def _cdf(ax, values: list[float], title: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of samples")
    ax.grid(alpha=0.3)
    if not values:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        return
    xs = sorted(v * 1000 for v in values)
    ax.step([xs[0], *xs], [0.0, *((i + 1) / len(xs) for i in range(len(xs)))], where="post")


def plot_run(path: str | Path, records: Sequence[RequestRecord], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")               # files only, no display
    import matplotlib.pyplot as plt

    done = [r for r in records if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    _cdf(axes[0][0], [r.ttft for r in done if r.ttft is not None], "TTFT")
    _cdf(axes[0][1], [gap for r in done for gap in r.itl], "ITL (between text chunks)")
    _cdf(axes[1][0], [r.e2e for r in done], "E2E latency")
    ax = axes[1][1]
    bin_s = max(wall_time(records) / 50, 0.1)
    timeline = output_timeline(records, bin_s)
    ax.plot([t for t, _ in timeline], [rate for _, rate in timeline], drawstyle="steps-post")
    ax.set_title(f"output tokens/s ({bin_s:.2g} s bins)")
    ax.set_xlabel("s since first send")
    ax.grid(alpha=0.3)
    failed = len(records) - len(done)
    fig.suptitle(title + (f"  [{failed} failed]" if failed else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
