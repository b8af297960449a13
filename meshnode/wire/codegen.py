"""Regenerate meshnode/proto/ from proto/, or check it has not drifted.

    python -m meshnode.wire.codegen          # regenerate
    python -m meshnode.wire.codegen --check  # exit 1 if the checked-in code differs
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "meshnode" / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")
# The oldest grpcio pyproject.toml accepts. grpc_tools stamps its own patch release
# into the stubs as the least grpcio they run with, so a new grpcio-tools patch would
# both fail --check and refuse an older (supported) grpcio at import: stamp the floor.
GRPC_FLOOR = "1.85.0"
_STAMP = re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.MULTILINE)


def stamp_floor(text: str) -> str:
    """Generated grpc stubs with the supported floor as their required grpcio."""
    return _STAMP.sub(f"GRPC_GENERATED_VERSION = '{GRPC_FLOOR}'", text)


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc  # only needed at development time

    protos = sorted(PROTO_DIR.rglob("*.proto"))
    # mypy-protobuf's plugins live beside this interpreter, which need not be on PATH
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_DIR}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for stub in (out_root / "meshnode" / "proto").glob("*_pb2_grpc.py"):
        stub.write_text(stamp_floor(stub.read_text()))
    return sorted((out_root / "meshnode" / "proto").glob("*_pb2*"))


def drift() -> list[str]:
    """Names of generated files that differ from what proto/ generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        have = {p.name: p for p in OUT_DIR.glob("*_pb2*")}
        names = sorted(set(fresh) | set(have))
        return [
            n for n in names if n not in fresh or n not in have or not filecmp.cmp(fresh[n], have[n], shallow=False)
        ]


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--check", action="store_true")
    ns = ap.parse_args()
    if ns.check:
        bad = drift()
        if bad:
            print("generated code drifted from proto/: " + ", ".join(bad), file=sys.stderr)
            return 1
        return 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
