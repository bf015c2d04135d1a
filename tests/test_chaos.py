"""Chaos under load (`make test-slow`): ten minutes of traffic while workers, Redis and
the router are killed and started again, through `python -m bench.chaos`. Nothing may be
lost before its first token, cut short without an error, or left behind (KV blocks,
shared memory)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.processes import ROOT


@pytest.mark.slow
def test_chaos_under_load_loses_nothing(tmp_path, model_dir):
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "bench.chaos", "--minutes", "10", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["kills"], "nothing was killed"
    assert r["failed_before_first_token"] == 0 and r["silently_truncated"] == 0, r
    assert r["kv_blocks_leaked"] == 0 and r["shm_segments_left"] == 0 and r["shm_segments_after_stop"] == 0, r
    assert r["succeeded"] > 0.9 * r["sent"], r
