"""What a fresh machine gets: the version the command reports, and a clear word when
`up --autoscale` has no redis-server to keep its registry in."""
from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from services.cli import main
from tests.conftest import ROOT


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
