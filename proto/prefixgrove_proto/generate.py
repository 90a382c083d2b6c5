"""Generates the gRPC modules in this folder from the .proto files one folder up (proto/).

`python -m prefixgrove_proto.generate` rewrites them in place; `--out DIR` writes elsewhere (the test
that keeps the committed modules in step with the .proto compares the two).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent.parent
OUT_DIR = Path(__file__).resolve().parent
PROTOS = ("planner.proto",)


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency: only generation needs it

    out_dir.mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    written = sorted(out_dir.glob("*_pb2*.py*"))
    for path in written:
        _make_relative(path)
    return written


def _make_relative(path: Path) -> None:
    # NOTE: grpc_tools writes `import planner_pb2`, which only works with the folder on sys.path.
    text = path.read_text()
    fixed = re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)
    path.write_text(fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
