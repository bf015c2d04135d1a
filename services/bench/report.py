"""How a run is shown and kept: the printed summary, a progress line, the JSON file and
the side-by-side comparison of several runs."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TextIO

from services.bench.metrics import RequestRecord, Summary

FORMAT = "pdserve-bench/1"
LATENCIES = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
STATS = ("mean", "p50", "p90", "p99")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(s: Summary, title: str, slo_note: str = "") -> str:
    lines = [title,
             f"  requests       {s.completed} succeeded, {s.failed} failed",
             f"  wall time      {s.wall_s:.2f} s (first send to last completion)",
             f"  throughput     {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s, "
             f"{s.total_throughput:.1f} total tok/s",
             f"  tokens         {s.input_tokens} in, {s.output_tokens} out"]
    if s.goodput is not None:
        lines.append(f"  goodput        {s.goodput:.2f} req/s ({slo_note})")
    lines.append("  latency (ms)   " + "".join(f"{name:>10}" for name in STATS) + "     count")
    for label, key in LATENCIES:
        dist = getattr(s, key)
        lines.append(f"  {label:<15}" + "".join(f"{_ms(getattr(dist, stat)):>10}" for stat in STATS)
                     + f"{dist.count:>10}")
    if s.errors:
        lines.append("  errors")
        lines += [f"    {count} x {message}" for message, count in s.errors.items()]
    return "\n".join(lines)


class Progress:
    """A progress line on stderr: rewritten in place on a terminal, every tenth of the
    run otherwise (so logs stay short)."""

    def __init__(self, total: int, label: str, stream: TextIO = sys.stderr, enabled: bool = True) -> None:
        self.total, self.label, self.stream, self.enabled = total, label, stream, enabled
        self.done = self.failed = 0
        self._t0 = time.perf_counter()
        self._tty = stream.isatty()
        self._last_shown = -1.0

    def _line(self) -> str:
        width = 24
        filled = width * self.done // max(self.total, 1)
        return (f"[{self.label}] [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} done, "
                f"{self.failed} failed, {time.perf_counter() - self._t0:.1f} s")

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.ok
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._tty:
            if now - self._last_shown >= 0.1 or self.done == self.total:
                self.stream.write("\r" + self._line())
                self.stream.flush()
                self._last_shown = now
        elif self.done * 10 // max(self.total, 1) != (self.done - 1) * 10 // max(self.total, 1):
            self.stream.write(self._line() + "\n")

    def close(self) -> None:
        if self.enabled and self._tty:
            self.stream.write("\r" + self._line() + "\n")


def run_document(config: dict, summary: Summary, records: list[RequestRecord], warmup: dict) -> dict:
    requests = []
    for r in records:
        row = asdict(r)
        row["itl"] = [round(gap, 6) for gap in r.itl]
        row["tpot"] = r.tpot
        requests.append(row)
    return {"format": FORMAT, "config": config, "summary": asdict(summary), "warmup": warmup,
            "requests": requests}


def load_run(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a `pdserve bench --json` file")
    return doc


# (label, key in the summary, statistic or None, scale, format)
COMPARE_ROWS: list[tuple[str, str, str | None, float, str]] = [
    ("succeeded", "completed", None, 1, "{:.0f}"), ("failed", "failed", None, 1, "{:.0f}"),
    ("wall time (s)", "wall_s", None, 1, "{:.2f}"), ("req/s", "request_throughput", None, 1, "{:.2f}"),
    ("output tok/s", "output_throughput", None, 1, "{:.1f}"), ("total tok/s", "total_throughput", None, 1, "{:.1f}"),
    ("goodput req/s", "goodput", None, 1, "{:.2f}"),
    *[(f"{label} {stat} (ms)", key, stat, 1000, "{:.1f}") for label, key in LATENCIES for stat in STATS],
]


def _cell(value: float | None, base: float | None, fmt: str, first: bool) -> str:
    if value is None:
        return "-"
    if first:
        return fmt.format(value)
    return f"{fmt.format(value)} ({value / base:.2f}x)" if base else f"{fmt.format(value)} (-)"


def compare_table(runs: list[tuple[str, dict]]) -> str:
    """Runs side by side, each after the first with its ratio to the first."""
    if not runs:
        raise ValueError("nothing to compare")
    header = ["metric", *(name for name, _ in runs)]
    rows = [header]
    for label, key, stat, scale, fmt in COMPARE_ROWS:
        values = []
        for _, summary in runs:
            v = summary.get(key)
            if stat is not None:
                v = (v or {}).get(stat)
            values.append(None if v is None else v * scale)
        rows.append([label, *(_cell(v, values[0], fmt, i == 0) for i, v in enumerate(values))])
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)


def run_name(path: str, doc: dict) -> str:
    return doc.get("config", {}).get("label") or Path(path).stem


def describe_run(name: str, doc: dict) -> str:
    c = doc.get("config", {})
    return f"{name}: {c.get('workload_description', '?')}, {c.get('load_description', '?')}, " \
           f"{c.get('num_prompts', '?')} prompts -> {c.get('base_url', '?')} ({c.get('model', '?')})"
