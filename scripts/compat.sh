#!/usr/bin/env bash
# Smoke test of cp_handler on one torch release, in a scratch virtualenv (run by hand, not in CI).
#
#   scripts/compat.sh 2.11.0            # venv in ${TMPDIR:-/tmp}/cp_handler-compat/torch-2.11.0
#   scripts/compat.sh 2.15.0 DIR        # venv in DIR (reused when present)
#
# Installs torch==VERSION (releases other than the local CPU build bring their CUDA libraries: a few
# GB) and this package with its test extra, then runs the smoke subset: ParallelLayout at 1..64 ranks
# (fake group) and at 4 and 8 gloo ranks with hierarchical CP levels, the MoE expert groups, every
# attention pattern against the single-process result, the kernels' calls against this torch's op
# schemas, teardown, and two cp-train steps per layout (p2p, a2a+p2p [2 2], MoE ep=4, thd) with
# --check-parity. Prints one line "compat torch=<version> result=PASS|FAIL" at the end.
# PIP_CONFIG_FILE=/dev/null: a machine-wide pip constraint (e.g. torch<=2.14.1) must not pick the version.
set -uo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/compat.sh TORCH_VERSION [VENV_DIR]}
venv=${2:-${TMPDIR:-/tmp}/cp_handler-compat/torch-$version}
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
[ -x "$venv/bin/python" ] || python3 -m venv "$venv" || exit 1
"$venv/bin/pip" install --quiet "torch==$version" || exit 1
"$venv/bin/pip" install --quiet -e ".[test]" || exit 1
installed=$("$venv/bin/python" -c "import torch; print(torch.__version__)")
echo "compat: torch $installed in $venv"

status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_parallel_layout.py tests/test_moe.py \
    tests/test_kernels.py tests/test_teardown.py tests/test_attn_patterns.py -m "not gpu" || status=1
train() { "$venv/bin/cp-train" --steps 2 --seq-len 64 --batch-size 2 --check-parity --max-corpus-bytes 2000000 "$@" \
    || { echo "compat: cp-train $* failed"; status=1; }; }
train --nproc 4 --cp-size 2 --cp-comm-type p2p
train --nproc 4 --cp-size 4 --cp-comm-type a2a+p2p --hierarchical-cp-sizes 2 2
train --nproc 4 --cp-size 2 --moe-experts 8 --expert-parallel-size 4
train --nproc 2 --cp-size 2 --cp-comm-type all_gather --packing thd
result=$([ "$status" = 0 ] && echo PASS || echo FAIL)
echo "compat torch=$installed result=$result"
exit $status
