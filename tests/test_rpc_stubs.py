"""The gRPC stubs in services/rpc are committed, so `pip install .` and the image ship
them without grpc_tools: they must be exactly what proto/*.proto generates today."""
from __future__ import annotations

import subprocess
import sys

from services.rpc.build import OUT_DIR, stubs
from tests.processes import ROOT


def test_committed_stubs_match_the_protos(tmp_path):
    # In a process of its own: grpc_tools' protoc crashes the interpreter when it loads
    # after NIXL's libraries, which other test modules import.
    subprocess.run([sys.executable, "-m", "services.rpc.build", "--out", str(tmp_path)], cwd=ROOT, check=True,
                   timeout=120)
    fresh = {p.name: p.read_bytes() for p in stubs(tmp_path)}
    committed = {p.name: p.read_bytes() for p in stubs(OUT_DIR)}
    assert fresh, "proto/ holds no .proto file"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, (f"services/rpc is out of date with proto/ ({', '.join(stale)}): "
                       "run `make proto` (python -m services.rpc.build) and commit services/rpc")
