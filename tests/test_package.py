"""What a fresh machine gets: the wheel `pip install .` builds, serving from a venv of its
own; the version the command reports; and a clear word when `up --autoscale` has no
redis-server to keep its registry in."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from services.cli import main
from tests.processes import ROOT, terminate, wait_announced


def test_version_prints_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == version("pdserve")


def test_autoscale_without_redis_server_says_how_to_get_it(tmp_path):
    """No redis-server on PATH (an empty folder is the whole PATH): one line, and nothing
    started."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--autoscale", "--http-port", "0",
                           "--grpc-port", "0"], cwd=ROOT, env={**os.environ, "PATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "apt-get install redis-server" in proc.stderr
    assert "--redis URL" in proc.stderr


def _readme_curl() -> tuple[str, dict]:
    """The path and JSON body of the README's curl example."""
    found = re.search(r"curl http://127\.0\.0\.1:8000(/\S+) .*?-d '(.*?)'", (ROOT / "README.md").read_text(), re.S)
    assert found, "README.md has no curl example"
    return found.group(1), json.loads(found.group(2))


def _run(*argv, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_wheel_serves_the_readme_example_from_a_fresh_venv(tmp_path, model_dir):
    """Build the wheel from a copy of the sources (setuptools' build/ folder never goes
    stale), install it with --no-deps into a new venv that borrows this venv's packages
    through a .pth file (torch is not installed twice), then run `pdserve up` from there,
    outside the repository. --attention-kernel native fails the start if the kernels'
    C sources did not ship."""
    src, dist, venv, run = (tmp_path / name for name in ("src", "dist", "venv", "run"))
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for package in ("services", "kv_transfer"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", dist, src)
    (wheel,) = dist.glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"services/engine/kernels/native/{name}.c" for name in ("attention", "layers", "matmul", "decoder")} | {
        f"services/rpc/{stem}{suffix}" for stem in ("generate", "worker", "autoscaler")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")}
    assert shipped <= names, shipped - names
    assert not [n for n in names if n.startswith(("tests/", "bench/"))]

    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    borrowed = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "project-venv.pth").write_text("".join(f"{path}\n" for path in borrowed))
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel)

    run.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = _run(python, "-c", "import services.rpc.worker_pb2 as m, services.engine.kernels.native as n; "
                 "print(m.__file__, n.SOURCE)", cwd=run, env=env).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where
    assert _run(venv / "bin" / "pdserve", "--version", cwd=run, env=env).stdout.strip() == version("pdserve")

    announce, log_path = run / "cluster.json", run / "cluster.log"
    proc = subprocess.Popen([venv / "bin" / "pdserve", "up", "--http-port", "0", "--grpc-port", "0",
                             "--kv-cache-tokens", "16384", "--attention-kernel", "native", "--log-level", "warning",
                             "--announce-file", announce], cwd=run, env=env, stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT)
    try:
        info = wait_announced(proc, announce, log_path, "pdserve up from the wheel")
        path, body = _readme_curl()
        text, done = [], False
        with httpx.stream("POST", info["http"] + path, json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
        assert done and "".join(text).strip()
    finally:
        assert terminate(proc, 60, signal.SIGINT) == 0, log_path.read_text()[-4000:]
