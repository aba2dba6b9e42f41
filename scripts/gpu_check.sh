#!/usr/bin/env bash
# The pending GPU checks in stages (kernels, patterns, opt_in, plan): see scripts/gpu_check.py.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
