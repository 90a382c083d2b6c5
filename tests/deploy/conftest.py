"""Fixtures of the deployment tests: the real API server comes from tests/k8s_fixtures.py."""

from __future__ import annotations

import sys
from pathlib import Path

# NOTE: tests/ is no package (that would shadow the stdlib `operator`), so the shared fixtures
# module and this folder's helpers are put on the path by hand.
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k8s_fixtures import kube_api

__all__ = ["kube_api"]
