"""The replay simulator (services/autoscaler/replay.py) on the two synthetic traces of
services/autoscaler/traces.py: each pool follows its own kind of load, and the plot is
written. The capacity model is the simulator's own, not a measurement of pdserve."""
from __future__ import annotations

import json

import pytest

from services.autoscaler import replay, traces
from services.autoscaler.core import Limits, PoolBounds, Role
from services.common.histograms import BusyFraction


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for shape in ("prompt-heavy", "output-heavy"):
        path = tmp_path_factory.mktemp("traces") / f"{shape}.json"
        path.write_text(json.dumps(traces.synthesize(shape)))
        policy = replay.Policy(slo_ttft=2.0, slo_itl=0.05, window=30, warmup=30, scale_out_cooldown=30,
                               scale_in_cooldown=60, scale_in_after=60)
        sim = replay.Simulation(replay.load_trace(path), policy, Limits(PoolBounds(1, 6), PoolBounds(1, 6)),
                                replay.Capacity(), tick=10)
        out[shape] = (path, sim, sim.run())
    return out


def peak(rows, role):
    return max(r.replicas[role] for r in rows)


def test_a_prompt_heavy_trace_grows_prefill_and_leaves_decode_alone(runs):
    _, _, rows = runs["prompt-heavy"]
    assert peak(rows, Role.PREFILL) >= 3 and peak(rows, Role.DECODE) == 1
    assert rows[-1].replicas == {Role.PREFILL: 1, Role.DECODE: 1}          # back down once the trace ends


def test_an_output_heavy_trace_grows_decode_and_leaves_prefill_alone(runs):
    _, _, rows = runs["output-heavy"]
    assert peak(rows, Role.DECODE) >= 3 and peak(rows, Role.PREFILL) == 1
    assert rows[-1].replicas == {Role.PREFILL: 1, Role.DECODE: 1}


def test_no_pool_flaps(runs):
    """A pool's direction of change reverses at most a few times over a 20-minute trace
    with one rise and one fall of load."""
    for _, _, rows in runs.values():
        for role in (Role.PREFILL, Role.DECODE):
            steps = [r.replicas[role] for r in rows]
            moves = [b - a for a, b in zip(steps, steps[1:]) if b != a]
            reversals = sum((x > 0) != (y > 0) for x, y in zip(moves, moves[1:]))
            assert reversals <= 2, (role, moves)


def test_the_command_writes_a_plot(runs, tmp_path, capsys):
    path, _, _ = runs["output-heavy"]
    out = tmp_path / "replay.png"
    assert replay.main(["--trace", str(path), "--out", str(out), "--tick", "15"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "decode 1 -> 2" in capsys.readouterr().out


def test_traces_are_bench_files_and_seeded():
    a, b = traces.synthesize("prompt-heavy"), traces.synthesize("prompt-heavy")
    assert a == b and a["format"] == "pdserve-bench/1" and a["config"]["synthesized"] == "prompt-heavy"
    starts = [r["start"] for r in a["requests"]]
    assert starts == sorted(starts) and all(2048 <= r["prompt_len"] <= 4096 for r in a["requests"])


def test_busy_fraction_from_a_cumulative_counter():
    busy = BusyFraction()
    assert busy.update("w", 100.0, 5.0) is None
    assert busy.update("w", 110.0, 12.5) == pytest.approx(0.75)
    assert busy.update("w", 110.0, 12.5) == pytest.approx(0.75)           # the same report, read again
    assert busy.update("w", 120.0, 1.0) is None                            # a restarted counter
