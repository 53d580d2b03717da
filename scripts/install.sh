#!/usr/bin/env bash
# Make .venv and install distlm into it. Usage: scripts/install.sh [extras]
# Why the torch step: a bare `torch>=2.6` lets pip pick a multi-GB CUDA build from PyPI.
# Where a local CPU wheel is on disk (PIP_FIND_LINKS, /opt/wheels), install it first,
# so the range in pyproject.toml is already satisfied and nothing big is downloaded.
set -euo pipefail
extras="${1:-}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=".venv/bin/python -m pip"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  wheel=""
  for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
    [ -d "$d" ] || continue
    wheel=$(ls "$d"/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -n 1 || true)
    [ -n "$wheel" ] && break
  done
  if [ -n "$wheel" ]; then
    $pip install -q "$wheel"
  else
    $pip install -q "torch>=2.6"
  fi
fi
if [ -n "$extras" ]; then
  $pip install -q -e ".[$extras]"
else
  $pip install -q -e .
fi
