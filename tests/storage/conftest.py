"""The S3-compatible server every test of this folder works against (object_store_testbed.py)."""

import sys
from pathlib import Path

from object_store_testbed import s3, s3_server  # noqa: F401

# the planner tests' helpers (a planner job answered without a model)
sys.path.insert(0, str(Path(__file__).parents[1] / "planner"))
