#!/usr/bin/env bash
# Makes `import prefixgrove` work from this checkout without installing it (the GPU machines have no
# package index): links services/ as the package root in a temp dir and prints the PYTHONPATH to use.
# Usage: export PYTHONPATH=$(scripts/gpu-pythonpath.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d)
ln -s "$root/services" "$dir/prefixgrove"
echo "$dir"
