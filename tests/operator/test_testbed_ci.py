"""The API-server test bed never passes silently in CI: missing binaries fail there and skip locally."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROBE = f"{HERE / 'test_schema.py'}::test_schema_accepts_a_sound_batchjob"


def run_without_apiserver(ci: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CI": ci, "PREFIXGROVE_K8S_BIN": str(tmp_path / "no-such-bin")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", PROBE, "-q", "-rsx", "-p", "no:cacheprovider"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("ci", "rc", "word"), [("true", 1, "error"), ("", 0, "skipped")])
def test_missing_kube_apiserver(ci: str, rc: int, word: str, tmp_path: Path) -> None:
    done = run_without_apiserver(ci, tmp_path)
    assert done.returncode == rc, done.stdout + done.stderr
    assert word in done.stdout
    assert "no kube-apiserver in" in done.stdout
