#!/usr/bin/env bash
# The GPU checks still pending (docs/testing.md, docs/performance.md), in stages each meant to fit one
# 10-minute command on a lent GPU machine (not yet timed on one; run from source, nothing installed):
#
#   scripts/gpu_check.sh tests        # pytest -m gpu, then each opt-in kernel through the patterns (bf16, fp16)
#   scripts/gpu_check.sh plan [ARGS]  # cp-bench --modes plan: flash, flash_gqa, cudnn (bshd), flash_varlen (thd)
#
# ARGS go to every cp-bench call (e.g. --plan-seq-lens 16384 131072 to stay within the time limit).
# Logs and cp-bench JSON go to ${OUT:-runs/gpu_check}; the last line of each stage says PASS or FAIL
# per part. A kernel's `verified_on` may be set only after its tests pass here.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-runs/gpu_check}
mkdir -p "$out"
export PYTHONPATH=.
python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')" || exit 2
summary=()
part() {  # part NAME COMMAND...: run, log to $out/NAME.log, record PASS/FAIL
    local name=$1
    shift
    if "$@" >"$out/$name.log" 2>&1; then summary+=("$name=PASS"); else summary+=("$name=FAIL"); fi
    tail -n 3 "$out/$name.log"
}
stage=${1:-}
shift || true
case "$stage" in
    tests)
        part pytest_gpu python -m pytest -m gpu -q -rs -p no:cacheprovider
        for kernel in flash_gqa flash_varlen cudnn; do
            part "patterns_$kernel" env CP_HANDLER_ATTN_KERNEL=$kernel python -m pytest -m gpu -q -p no:cacheprovider \
                -k "bf16 or fp16" tests/test_attn_patterns.py tests/test_thd.py
        done
        ;;
    plan)
        for kernel in flash flash_gqa cudnn; do
            part "plan_$kernel" python -m cp_handler.bench.cli --modes plan --device cuda --attn-kernel $kernel \
                --formats bshd --out-dir "$out/plan_$kernel" "$@"
        done
        part plan_flash_varlen python -m cp_handler.bench.cli --modes plan --device cuda --attn-kernel flash_varlen \
            --formats thd --out-dir "$out/plan_flash_varlen" "$@"
        ;;
    *)
        echo "usage: scripts/gpu_check.sh tests | plan [cp-bench args]" >&2
        exit 2
        ;;
esac
echo "gpu_check $stage: ${summary[*]} ($(python -c 'import torch; print(torch.cuda.get_device_name(), torch.__version__)'))"
