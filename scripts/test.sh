#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what the tests run against (redis-server, helm and
# kubectl, docker compose, etcd and a kube-apiserver built once and cached), then lint and pytest.
# Tests that need one of these fail, not skip, when CI=true. GPU tests skip without a GPU.
# Usage: scripts/test.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/ci/install-redis.sh
scripts/ci/install-helm.sh
scripts/ci/install-compose.sh
scripts/ci/build-kube-apiserver.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports
.venv/bin/mypy services kernels operator proto
# Two pytest workers, a test file each at a time (its module fixtures stay with it): most of the suite
# waits on the processes it starts (redis-server, planners, workers, the API server), so the two cores
# overlap one file's waits with another's work. PYTEST_WORKERS=0 runs it in one process.
.venv/bin/pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
