"""bench.router_stream end to end, small: its cluster serves every stream whole and its
JSON holds a CPU cost per token for the router, the decode worker and the clients."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_router_stream_bench_measures_whole_streams(tmp_path):
    from bench.router_stream import main
    out = tmp_path / "router-stream.json"
    assert main(["--concurrency", "2,4", "--tokens", "16", "--waves", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["rows"]] == [2, 4]
    for row in result["rows"]:
        assert row["clean_streams"] == row["streams"] == row["concurrency"]
        assert row["tokens"] == 16 * row["concurrency"] and row["events"] >= row["tokens"]
        assert all(v > 0 for v in row["cpu_us_per_token"].values()), row
