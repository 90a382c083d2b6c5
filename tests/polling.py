"""Waiting on real components in tests: poll until something holds, or fail saying what and what was
last seen; stop a child process and wait for it to end."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0, every: float = 0.2) -> Any:
    """Polls `probe` until it returns something truthy; fails with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if the process is still there after `grace_s`; reaps it either way."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
