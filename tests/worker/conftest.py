"""Worker processes a test starts, killed at its end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from services_testbed import Process


@pytest.fixture
def workers() -> Iterator[list[Process]]:
    """The workers a test starts; those still running at its end are killed."""
    started: list[Process] = []
    yield started
    for worker in started:
        worker.stop()
