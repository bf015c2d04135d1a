"""`pdserve up` for a benchmark: started with the flags given, its HTTP address once it
serves, stopped after; and a run's JSON written where asked."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 300


@contextlib.contextmanager
def running_up(*args: str, prefix: str = "pdserve-bench-") -> Iterator[str]:
    """`pdserve up *args` on free ports, its log in a temporary folder; yields its HTTP
    address once it serves, and stops it after."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    announce = work / "cluster.json"
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--http-port", "0", "--grpc-port", "0",
                           "--announce-file", str(announce), "--log-level", "warning", *args],
                          cwd=ROOT, stdout=open(work / "up.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not announce.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve up did not start:\n{(work / 'up.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield json.loads(announce.read_text())["http"]
    finally:
        up.terminate()
        up.wait(timeout=60)


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))
