"""Regenerate the checked-in protobuf/gRPC code: ``python -m atoll.protos.generate [OUT_ROOT]``."""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = "atoll/protos/coordinator.proto"
GENERATED = ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


def generate(out_root: Path) -> list[Path]:
    """Compile the proto into ``out_root/atoll/protos/``; return the generated files."""
    from grpc_tools import protoc  # dev-time dependency only

    out_root = Path(out_root)
    (out_root / "atoll" / "protos").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{REPO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return [out_root / "atoll" / "protos" / name for name in GENERATED]


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT)
