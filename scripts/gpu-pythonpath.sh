#!/usr/bin/env bash
# Makes the checkout importable without installing it (the GPU machines have no package index): prints
# the four source roots (services/, kernels/, operator/, proto/) as a PYTHONPATH.
# Usage: export PYTHONPATH=$(scripts/gpu-pythonpath.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
echo "$root/services:$root/kernels:$root/operator:$root/proto${PYTHONPATH:+:$PYTHONPATH}"
