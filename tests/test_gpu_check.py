"""`python -m bench.gpu_check`, the check a CUDA machine runs, here on the CPU: no GPU is
on this machine, so it runs with --device cpu --quick, which takes every step the GPU run
takes (a random-weight model with its own tokenizer, a real cluster with NIXL, parity
against `generate`, concurrent long prompts, NIXL bandwidth, host-only transports refused
for a device pool, a prefill pass pausing for an urgent prompt) on host memory instead of
device memory."""
import json
import subprocess
import sys

import pytest
import torch

from tests.processes import ROOT


# The scripts for a GPU day, run on a CPU: the CUDA path's kernels and graph runner are
# test_gpu_kernels' (in Triton's interpreter) by default.
@pytest.mark.slow
def test_gpu_check_passes_its_checks_on_the_cpu(model_dir, tmp_path):
    out = tmp_path / "gpu-check.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--quick", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["parity"]["identical"] == doc["parity"]["prompts"] and doc["parity"]["transports"] == ["nixl"]
    assert doc["race"]["identical"] == doc["race"]["prompts"]
    assert doc["api"]["choices_identical"] and doc["api"]["logprob_max_error"] < 1e-4 and doc["api"]["ok"]
    assert all(b["bitwise"] for b in doc["bandwidth"].values())
    assert doc["host_only"]["ok"]
    assert doc["spec"]["identical"] == doc["spec"]["prompts"] and doc["spec"]["accepted_tokens"] > 0, doc["spec"]
    assert doc["pause"]["first_tokens_identical"] and doc["pause"]["ok"], doc["pause"]


def test_gpu_check_without_a_gpu_says_so():
    if torch.cuda.is_available():
        return
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no CUDA device" in r.stderr


@pytest.mark.slow
def test_gpu_speed_measures_a_tiny_model_on_the_cpu(tmp_path):
    """`python -m bench.gpu_speed` end to end on a 4-layer shape (its kernel sweep through
    Triton's interpreter): every decode and prefill row is measured against this run's
    copy and GEMM rates. The figures themselves mean something only on a GPU."""
    import importlib.util
    import os
    out = tmp_path / "speed.json"
    sweep = ["--sweep"] if importlib.util.find_spec("triton") else []      # Triton ships for x86-64 Linux only
    r = subprocess.run([sys.executable, "-m", "bench.gpu_speed", "--device", "cpu", "--quick", "--shapes", "tiny",
                        *sweep, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["copy_gbps"] > 0 and doc["gemm_tflops"] > 0 and bool(doc.get("sweep")) == bool(sweep)
    (model,) = doc["models"]
    assert [(d["batch"], d["context"]) for d in model["decode"]] == [(1, 64), (1, 256), (4, 64), (4, 256)]
    assert all(0 < d["roofline_pct"] and d["bytes"] > d["kv_bytes"] for d in model["decode"])
    assert [p["tokens"] for p in model["prefill"]] == [64, 256] and all(p["gemm_pct"] > 0 for p in model["prefill"])
    assert model["engine"]["sync_tok_s"] > 0 and model["engine"]["async_tok_s"] > 0
    assert [sp["batch"] for sp in model["speculation"]] == [1, 4]
    assert all(sp["ngram_tok_s"] > 0 and sp["drafts"] >= 0 for sp in model["speculation"])
    assert "% of the memory roofline" in r.stdout and "with async scheduling" in r.stdout


def test_gpu_speed_and_cluster_without_a_gpu_say_so():
    if torch.cuda.is_available():
        return
    for module in ("bench.gpu_speed", "bench.gpu_cluster"):
        r = subprocess.run([sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "no CUDA device" in r.stderr, module


@pytest.mark.slow          # the cluster on a CPU is what every cluster test runs; this keeps the script working
def test_gpu_cluster_runs_its_three_ways_on_the_cpu(tmp_path):
    """`python -m bench.gpu_cluster` end to end on the tiny shape in float32: generate's
    baseline, `pdserve bench` through a disaggregated cluster (every prompt prefilled
    remotely, KV through NIXL) and the long-prompt TTFT through an aggregated one."""
    out = tmp_path / "cluster.json"
    r = subprocess.run([sys.executable, "-m", "bench.gpu_cluster", "--device", "cpu", "--quick", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["generate"]["output_tok_s"] > 0
    assert doc["disaggregated"]["completed"] == 8 and doc["disaggregated"]["failed"] == 0
    assert doc["throughput_ratio"] > 0
    assert all("decision=remote" in r and "transport=nixl" in r for r in doc["ttft_disaggregated"]["routes"])
    assert all("decision=local" in r for r in doc["ttft_aggregated"]["routes"])
    assert doc["ttft_overhead"] > -1
