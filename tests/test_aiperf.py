"""NVIDIA's aiperf, unchanged, against the cluster: one short profile of streamed chat
completions, 16 requests 2 at a time, synthetic 64-token prompts and 16 tokens out (with
`ignore_eos` and `min_tokens`, as load generators ask for a fixed output length). Its
report counts every request the router answered, none failed, and every stream's usage
says as many tokens as asked. (aiperf's own output lengths come from tokenizing the text
again, which can merge tokens: they may be shorter.)

aiperf pins its own dependencies, so it lives in a virtual environment of its own:
PDSERVE_AIPERF names its executable (or aiperf is on PATH). The test skips when neither
has it:

    python3 -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf
    PDSERVE_AIPERF=/tmp/aiperf/bin/aiperf .venv/bin/python -m pytest -m slow tests/test_aiperf.py

aiperf runs with HF_HUB_OFFLINE unset: with it set, aiperf 0.13 looks every tokenizer
name up in the Hugging Face cache, a local folder's too, and fails. A folder needs no
network either way.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest

MODEL = "SmolLM2-135M-Instruct"
REQUESTS, CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 2, 64, 16
CHAT = "/v1/chat/completions"


def _aiperf() -> str:
    found = os.environ.get("PDSERVE_AIPERF") or shutil.which("aiperf")
    if not found:
        pytest.skip("aiperf is not installed (set PDSERVE_AIPERF to its executable)")
    return found


def _chat_outcomes(http: str) -> dict[str, float]:
    """The router's finished chat calls by outcome, from its pdserve_requests counter."""
    line = re.compile(rf'^pdserve_requests_total{{api="{re.escape(CHAT)}",outcome="([^"]+)"}} (\S+)$', re.M)
    return {outcome: float(n) for outcome, n in line.findall(httpx.get(f"{http}/metrics", timeout=10).text)}


@pytest.mark.slow
def test_aiperf_profile_counts_every_request_the_router_answered(cluster, model_dir):
    aiperf = _aiperf()
    out = Path(tempfile.mkdtemp(prefix="pdserve-aiperf-"))
    before = _chat_outcomes(cluster.http)
    done = subprocess.run([
        aiperf, "profile", "--model", MODEL, "--tokenizer", str(model_dir), "--url", cluster.http,
        "--endpoint-type", "chat", "--streaming", "--request-count", str(REQUESTS),
        "--concurrency", str(CONCURRENCY), "--isl", str(PROMPT_TOKENS), "--isl-stddev", "0",
        "--osl", str(OUTPUT_TOKENS), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{OUTPUT_TOKENS}",
        "--random-seed", "0", "--ui", "none", "--no-gpu-telemetry", "--no-auto-plot",
        "--artifact-dir", str(out)],
        env={**{k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")},
             "TOKENIZERS_PARALLELISM": "false"},
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    report = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())
    after = _chat_outcomes(cluster.http)
    answered = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}

    assert answered == {"200": REQUESTS}                     # every request sent, none refused
    assert report["request_count"]["avg"] == REQUESTS
    assert (report.get("error_request_count") or {}).get("avg", 0) == 0 and not report.get("error_summary")
    usage = report["usage_completion_tokens"]                # from each stream's last chunk
    assert usage["min"] == usage["max"] == OUTPUT_TOKENS
    print("aiperf:", json.dumps({k: report[k]["avg"] for k in (
        "request_count", "request_throughput", "time_to_first_token", "inter_token_latency",
        "request_latency", "output_token_throughput")}))
