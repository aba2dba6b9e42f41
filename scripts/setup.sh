#!/usr/bin/env bash
# Installs what the two README commands need, on a fresh machine or an existing one.
# torch is pinned to the local CPU build first: an open range would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
# Always (re)install: an editable install left by another checkout would shadow this one.
"$PY" -m pip install --quiet -e ".[dev]"
