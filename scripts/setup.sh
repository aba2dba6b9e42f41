#!/usr/bin/env bash
# Installs what the two README commands need, on a fresh machine or an existing one.
# torch is pinned to the local CPU build first: an open range would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet -e ".[dev]"
