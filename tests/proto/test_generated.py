"""The committed gRPC modules match proto/planner.proto and import as package modules."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path

import pytest

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto" / "prefixgrove_proto"


def test_generated_grpc_modules_match_the_proto(tmp_path: Path) -> None:
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("grpcio-tools is missing: pip install -e .[dev]")
        pytest.skip("grpcio-tools is missing")
    from prefixgrove_proto.generate import generate

    generated = generate(tmp_path)
    assert generated, "protoc wrote nothing"
    for path in generated:
        committed = PROTO_DIR / path.name
        assert committed.exists(), (
            f"{path.name} is not committed: run python -m prefixgrove_proto.generate"
        )
        assert filecmp.cmp(path, committed, shallow=False), (
            f"proto/{path.name} is out of date: run python -m prefixgrove_proto.generate"
        )


def test_generated_modules_import_as_package_modules() -> None:
    from prefixgrove_proto import planner_pb2, planner_pb2_grpc

    assert planner_pb2_grpc.planner__pb2 is planner_pb2
    assert planner_pb2.DESCRIPTOR.package == "prefixgrove.v1"
