#!/usr/bin/env bash
# The pending GPU checks in stages (kernels, opt_in, plan, patterns, gpt, masks): see scripts/gpu_check.py.
exec python3 "$(dirname "$0")/gpu_check.py" "$@"
