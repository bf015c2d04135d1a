"""The gRPC stubs in services/rpc are committed, so `pip install .` and the image ship
them without grpc_tools: they must be exactly what proto/*.proto generates today."""
from __future__ import annotations

from services.rpc.build import OUT_DIR, generate, stubs


def test_committed_stubs_match_the_protos(tmp_path):
    fresh = {p.name: p.read_bytes() for p in generate(tmp_path)}
    committed = {p.name: p.read_bytes() for p in stubs(OUT_DIR)}
    assert fresh, "proto/ holds no .proto file"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, (f"services/rpc is out of date with proto/ ({', '.join(stale)}): "
                       "run `make proto` (python -m services.rpc.build) and commit services/rpc")
