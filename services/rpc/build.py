"""Generate the gRPC stubs from proto/ into this package (`make proto`).

The stubs are committed: a clean clone, `pip install .` and the container image then
need neither grpc_tools nor a build step, and tests/test_rpc_stubs.py regenerates them
into a temporary folder and fails while the committed ones differ.

grpc_tools writes `import generate_pb2`, a top-level import; the stubs live in
`services.rpc`, so the imports are rewritten to package-relative ones (type stubs too).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = Path(__file__).resolve().parent
STUB_GLOBS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def stubs(directory: Path) -> list[Path]:
    return sorted(p for pattern in STUB_GLOBS for p in directory.glob(pattern))


def generate(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Writes the stubs of every proto_dir/*.proto into out_dir; returns their paths."""
    from grpc_tools import protoc       # here: the test that checks the stubs runs this in a process of its own
    protos = sorted(p.name for p in proto_dir.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    stems = "|".join(re.escape(Path(p).stem) for p in protos)
    pattern = re.compile(rf"^import ({stems})_pb2 as", re.M)
    written = stubs(out_dir)
    for path in written:
        text = path.read_text()
        path.write_text(pattern.sub(r"from . import \1_pb2 as", text))
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="where the stubs go (default: services/rpc)")
    try:
        generate(parser.parse_args().out)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
