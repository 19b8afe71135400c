#!/usr/bin/env bash
# The GPU tests of this tree, then this tree and an earlier one served alternately on the
# same GPU (before, after, before-2, after-2) in ONE device call: a change meant to keep
# behaviour and speed (a restructuring) shows it in TTFT and TPOT at 1 and 64 concurrent.
#   git archive <commit> shiftjax kernels layouts serving checkpoints | tar -x -C before_tree   # here, untracked
#   bash benchmarks/run_before_after.sh          # on the H200 (the device copies before_tree/ along)
#   DRY_RUN=1 PREFIX=... bash benchmarks/run_before_after.sh   # the mechanism on the CPU
# BEFORE (default before_tree) is the earlier tree's root; PREFIX (default h200_before_after)
# names benchmarks/configs/compare/PREFIX_{deployments,workloads}.json, whose deployments
# take their tree from PYTHONPATH=/tmp/shiftjax_shim_{before,after} (then /tmp/site, where the
# carried wheels of device_wheels.sh go). TESTS=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE="${BEFORE:-before_tree}"
[ -d "$BEFORE/serving" ] || { echo "no earlier tree at $BEFORE (see the header)" >&2; exit 2; }
# one shim package per tree: the folders importable under their installed names (gpu_env.sh)
for tree in before after; do
  root=$PWD; [ "$tree" = before ] && root=$(cd "$BEFORE" && pwd)
  shim=/tmp/shiftjax_shim_$tree
  rm -rf "$shim"; mkdir -p "$shim/shiftjax"
  for f in "$root"/shiftjax/*; do ln -s "$f" "$shim/shiftjax/"; done
  for d in kernels layouts serving checkpoints; do ln -s "$root/$d" "$shim/shiftjax/$d"; done
done
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY="${PY:-python3}"
if [ "${TESTS:-1}" != 0 ] && [ "${DRY_RUN:-0}" != 1 ]; then
  # tests/conftest.py (CPU devices, beartype) is not loaded on the device: its precision setting here
  JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=/tmp/shiftjax_shim_after timeout "${TEST_TIMEOUT:-200}" \
    "$PY" -P -m pytest --noconftest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_collectives_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -3 "$OUT/gpu_tests.log"
fi
COMPARE_ARGS="${COMPARE_ARGS:---tokenizer benchmarks/configs/smollm2-tokenizer}" \
  PREFIX="${PREFIX:-h200_before_after}" STEPS="${STEPS:-all:before all:after all:after-off all:before-2 all:after-2 all:after-off-2}" \
  TOTAL="${TOTAL:-$((570 - SECONDS))}" OUT="$OUT" bash benchmarks/run_compare.sh
