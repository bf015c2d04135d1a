"""Which bfloat16 matmuls and prefill attention a CPU worker runs
(services/engine/model/kernel_choice.py): asked for, the CPU's rule where only one path
runs, or measured at start on the model's own first layer, the rule kept unless the
other path is clearly faster, and the first measurement on a machine kept for every
later start."""
from __future__ import annotations

import json
import time

import pytest
import torch

from services.engine.model import backends, kernel_choice
from services.engine.model.hardware import cpu_flags, cpu_kind
from services.engine.model.runner import ModelRunner


def _measured(ratio: float, calls: list | None = None):
    def measure(rows):
        if calls is not None:
            calls.append(rows)
        return [ratio] * len(rows)
    return measure


def test_asked_for_and_the_rule_where_nothing_is_measured():
    assert kernel_choice.choose("native", False, "decode", _measured(9.0)).native
    assert not kernel_choice.choose("onednn", True, "decode", _measured(0.1)).native
    assert kernel_choice.choose("auto", True, "decode", None).native
    assert not kernel_choice.choose("auto", False, "prefill", None).native
    with pytest.raises(ValueError, match="matmul kernel must be one of"):
        kernel_choice.choose("amx", True, "decode", None)


@pytest.mark.parametrize("rule, ratio, native", [
    (True, 1.05, True), (True, 1.2, False), (True, 0.5, True),
    (False, 0.95, False), (False, 0.8, True), (False, 1.5, False)])
def test_the_rule_stands_unless_the_other_path_is_clearly_faster(rule, ratio, native):
    calls = []
    choice = kernel_choice.choose("auto", rule, "prefill", _measured(ratio, calls))
    assert choice.native is native and choice.ratio == pytest.approx(ratio)
    assert calls == [kernel_choice.ROWS["prefill"]] and "measured" in choice.reason


def test_the_first_measurement_on_a_machine_is_kept(tmp_path):
    calls = []
    first = kernel_choice.choose("auto", True, "decode", _measured(1.3, calls), tmp_path, ((64, 32),))
    again = kernel_choice.choose("auto", True, "decode", _measured(0.5, calls), tmp_path, ((64, 32),))
    assert not first.native and not again.native and len(calls) == 1 and "kept" in again.reason
    other = kernel_choice.choose("auto", True, "decode", _measured(0.5, calls), tmp_path, ((128, 32),))
    assert other.native and len(calls) == 2                 # other shapes: measured
    tiles = kernel_choice.choose("auto", True, "decode", _measured(0.5, calls), tmp_path, ((64, 32),), "amx")
    assert tiles.native and len(calls) == 3                 # our matmuls on other instructions: measured
    (kept,) = [p for p in tmp_path.iterdir() if json.loads(p.read_text())["ratio"] == 1.3]
    kept.write_text("{not json")
    assert kernel_choice.choose("auto", True, "decode", _measured(0.5, calls), tmp_path, ((64, 32),)).native
    assert len(calls) == 4


def test_a_load_that_starts_midway_is_charged_to_neither_path():
    """Both paths take the same time; from the fifth call on, everything takes three
    times as long (another worker starting beside this one). Timing one path after the
    other would call ours 3x theirs; paired rounds see them alike."""
    calls = [0]

    def path():
        calls[0] += 1
        time.sleep(0.004 * (3 if calls[0] > 4 else 1))
    ratio = kernel_choice.paired_ratio(path, path, repeats=7)
    assert 0.75 < ratio < 1.33 and calls[0] == 16


def test_a_worker_with_lent_cores_measures_on_its_own_threads():
    before = torch.get_num_threads()
    seen = backends._on_threads(1, lambda sizes: [float(torch.get_num_threads())] * len(sizes))((1, 8))
    assert seen == [1.0, 1.0] and torch.get_num_threads() == before
    assert backends._on_threads(1, None) is None


def test_prefill_attention_native_is_asked_for_else_measured_at_prompt_lengths():
    calls = []
    assert kernel_choice.choose_prefill_attention("native", False, "prefill", _measured(9.0, calls)).native
    choice = kernel_choice.choose_prefill_attention("auto", False, "prefill", _measured(0.5, calls))
    assert choice.native and "SDPA" in choice.reason and calls == [kernel_choice.PROMPT_TOKENS["prefill"]]
    assert kernel_choice.choose_prefill_attention("auto", True, "decode", None).native


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(),
                    reason=f"pdserve's bfloat16 matmuls need AVX512-BF16; this CPU is {cpu_kind()}")
def test_a_worker_measures_its_own_layers_or_takes_the_path_asked_for(model_dir, fresh_kernel_cache):
    """On the real model in bfloat16: `onednn` leaves pdserve's matmuls and the one-call
    decode step out, `native` takes both, `auto` measures the first layer once (and
    remembers it in the kernel cache)."""
    onednn = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=fresh_kernel_cache, matmul="onednn")
    assert onednn.decoder is None and "native bf16 matmul" not in onednn.fusions
    assert "oneDNN matmuls (asked for)" in onednn.describe()
    native = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=fresh_kernel_cache, matmul="native", role="decode")
    assert native.decoder is not None and "native bf16 matmul" in native.fusions
    auto = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=fresh_kernel_cache, role="prefill")
    assert "measured: ours" in auto.backend.matmul_choice.reason
    assert "measured: ours" in auto.backend.prefill_choice.reason and "prompt tokens" in auto.describe()
    again = ModelRunner(model_dir, "bfloat16", "cpu", kernel_cache=fresh_kernel_cache, role="prefill").backend
    assert "kept from the first start" in again.matmul_choice.reason
    assert "kept from the first start" in again.prefill_choice.reason
    with pytest.raises(ValueError, match="--matmul-kernel native"):
        ModelRunner(model_dir, "float32", "cpu", kernel_cache=fresh_kernel_cache, matmul="native")
