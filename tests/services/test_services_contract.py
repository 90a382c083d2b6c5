"""The committed gRPC modules match the .proto, and settings come from flags, then PREFIXGROVE_*."""

from __future__ import annotations

import argparse
import filecmp
import os
from pathlib import Path

import pytest

from prefixgrove.planner import settings as cfg
from prefixgrove.planner.settings import PlannerSettings, SecuritySettings, WorkerSettings

PROTO_DIR = Path(__file__).resolve().parents[2] / "proto"


def test_generated_grpc_modules_match_the_proto(tmp_path: Path) -> None:
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("grpcio-tools is missing: pip install -e .[dev]")
        pytest.skip("grpcio-tools is missing")
    from prefixgrove.proto.generate import generate

    generated = generate(tmp_path)
    assert generated, "protoc wrote nothing"
    for path in generated:
        committed = PROTO_DIR / path.name
        assert committed.exists(), (
            f"{path.name} is not committed: run python -m prefixgrove.proto.generate"
        )
        assert filecmp.cmp(path, committed, shallow=False), (
            f"proto/{path.name} is out of date: run python -m prefixgrove.proto.generate"
        )


def test_generated_modules_import_as_package_modules() -> None:
    from prefixgrove.proto import planner_pb2, planner_pb2_grpc

    assert planner_pb2_grpc.planner__pb2 is planner_pb2
    assert planner_pb2.DESCRIPTOR.package == "prefixgrove.v1"


def test_flags_win_over_environment_over_defaults() -> None:
    parser = argparse.ArgumentParser()
    cfg.add_arguments(parser, WorkerSettings)
    args = parser.parse_args(["--lease-timeout-s", "9"])
    env = {"PREFIXGROVE_LEASE_TIMEOUT_S": "5", "PREFIXGROVE_MAX_GROUPS_IN_FLIGHT": "3"}
    settings = cfg.load(WorkerSettings, args, env)
    assert settings.lease_timeout_s == 9.0
    assert settings.max_groups_in_flight == 3
    assert settings.model == WorkerSettings().model


def test_bad_setting_says_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="PREFIXGROVE_PORT='http' is invalid: expected int"):
        cfg.load(PlannerSettings, {}, {"PREFIXGROVE_PORT": "http"})
    with pytest.raises(ValueError, match="device='tpu' is invalid"):
        cfg.load(WorkerSettings, {"device": "tpu"}, {})


def test_token_never_shows_in_the_settings_repr() -> None:
    settings = cfg.load(SecuritySettings, {}, {"PREFIXGROVE_AUTH_TOKEN": "s3cret"})
    assert settings.auth_token == "s3cret"
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
