"""The Makefile's GPU targets, dry-run (`make -n`): what they would run, not run.

A fresh copy of the tree has no venv and a pyproject.toml newer than any install stamp,
so `install` would create the venv and run pip. On a GPU machine with no package index
that fails: given GPU_PY, the GPU targets run that python as it is and install nothing.
"""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def dry_run(target: str, tmp_path: Path, *variables: str) -> str:
    """The commands `make TARGET` would run on a fresh copy: no venv (VENV names a folder
    that does not exist) and pyproject.toml newer than everything (-W)."""
    out = subprocess.run(["make", "-n", "-W", "pyproject.toml", target, f"VENV={tmp_path / 'venv'}", *variables],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("target,modules", [
    ("gpu-check", ["bench.gpu_check"]),
    ("gpu-bench", ["bench.gpu_speed", "bench.gpu_cluster"]),
])
def test_gpu_targets_run_the_python_given_and_install_nothing(tmp_path, target, modules):
    commands = dry_run(target, tmp_path, "GPU_PY=/usr/bin/python3")
    for module in modules:
        assert f"/usr/bin/python3 -m {module} " in commands
    assert "pip" not in commands and "install.sh" not in commands and "-m venv" not in commands, commands


def test_gpu_targets_install_into_the_venv_by_default(tmp_path):
    commands = dry_run("gpu-check", tmp_path)
    assert "-m venv" in commands and "deploy/install.sh" in commands
    assert f"{tmp_path / 'venv'}/bin/python -m bench.gpu_check " in commands
