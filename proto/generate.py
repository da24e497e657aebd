"""Generates the Python code for worker.proto with grpcio-tools.

The proto is compiled as if it lived at ``graphkeeper/proto/worker.proto`` so that the generated
modules import each other under ``graphkeeper.proto``; a test regenerates into a temporary
directory and fails when the committed code differs.

Usage: ``python -m graphkeeper.proto.generate [OUT_DIR]`` (default: this directory).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = HERE / "worker.proto"
OUTPUTS = ("worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compiles worker.proto into ``out_dir`` and returns the generated files."""
    from grpc_tools import protoc  # test/dev dependency only

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        staged = root / "graphkeeper" / "proto" / "worker.proto"
        staged.parent.mkdir(parents=True)
        shutil.copyfile(PROTO, staged)
        args = [
            "protoc",
            f"-I{root}",
            f"--python_out={root}",
            f"--pyi_out={root}",
            f"--grpc_python_out={root}",
            str(staged.relative_to(root)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on worker.proto")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in OUTPUTS:
            target = out_dir / name
            shutil.copyfile(staged.parent / name, target)
            written.append(target)
        return written


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    for path in generate(out):
        print(path)
