"""Generate the gRPC stubs from proto/ into this package (`make proto`).

grpc_tools writes `import generate_pb2`, a top-level import; the stubs live in
`services.rpc`, so the imports are rewritten to package-relative ones.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent


def main() -> int:
    protos = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={OUT_DIR}",
            f"--pyi_out={OUT_DIR}", f"--grpc_python_out={OUT_DIR}", *protos]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    stems = "|".join(re.escape(Path(p).stem) for p in protos)
    pattern = re.compile(rf"^import ({stems})_pb2 as", re.M)
    for path in OUT_DIR.glob("*_pb2*.py"):
        text = path.read_text()
        path.write_text(pattern.sub(r"from . import \1_pb2 as", text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
