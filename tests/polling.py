"""Waiting on real components in tests: poll until something holds, or fail saying what and what was last seen."""

from __future__ import annotations

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
