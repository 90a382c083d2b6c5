#!/usr/bin/env bash
# The services suite as CI runs it: a real redis-server must be there (the tests start their own).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/ci/install-redis.sh
PY="${PYTHON:-.venv/bin/python}"
CI="${CI:-true}" "$PY" -m pytest tests/services -q "$@"
