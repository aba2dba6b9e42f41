#!/usr/bin/env bash
# The GPU checks: `pass` (the pending stages in order of value within a budget, docs/gpu_ledger.json), `record`,
# or one stage by name. See scripts/gpu_check.py.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
