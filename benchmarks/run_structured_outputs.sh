#!/usr/bin/env bash
# Issue 29 on one GPU in ONE device call: the GPU tests, then benchmarks/structured_outputs.py
# on the Llama-3.1-8B shape (dummy weights) for the tree before structured outputs (its
# unconstrained runs only) and for this tree (all runs), each in its own process.
#   git archive <commit> shiftjax kernels layouts serving checkpoints | tar -x -C before_tree   # here, untracked
#   bash benchmarks/device_wheels.sh                                   # here; carry .whl
#   bash benchmarks/run_structured_outputs.sh                          # on the H200, OUT=$OUT
#   SMOKE=1 bash benchmarks/run_structured_outputs.sh                  # the mechanism on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE="${BEFORE:-before_tree}"
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY="${PY:-python3}"
for tree in before after; do  # one shim package per tree (as run_before_after.sh)
  root=$PWD; [ "$tree" = before ] && root=$(cd "$BEFORE" 2>/dev/null && pwd)
  [ -d "$root/serving" ] || { echo "no tree at $root" >&2; continue; }
  shim=/tmp/shiftjax_shim_$tree
  rm -rf "$shim"; mkdir -p "$shim/shiftjax"
  for f in "$root"/shiftjax/*; do ln -s "$f" "$shim/shiftjax/"; done
  for d in kernels layouts serving checkpoints; do ln -s "$root/$d" "$shim/shiftjax/$d"; done
done
SITE="${PYTHONPATH:-}"
if [ "${SMOKE:-0}" = 1 ]; then
  ARGS=(--smoke)
else
  ARGS=(--model benchmarks/configs/Llama-3.1-8B --tokenizer benchmarks/configs/smollm2-tokenizer)
  JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=/tmp/shiftjax_shim_after:$SITE timeout 200 \
    "$PY" -P -m pytest --noconftest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py tests/test_collectives_gpu.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -3 "$OUT/gpu_tests.log"
fi
if [ -d /tmp/shiftjax_shim_before ]; then
  PYTHONPATH=/tmp/shiftjax_shim_before:$SITE timeout 280 "$PY" -P benchmarks/structured_outputs.py "${ARGS[@]}" \
    --parts unconstrained --out "$OUT/before" > "$OUT/before.log" 2>&1
  echo "before: exit $?"; tail -2 "$OUT/before.log"
fi
PYTHONPATH=/tmp/shiftjax_shim_after:$SITE timeout 300 "$PY" -P benchmarks/structured_outputs.py "${ARGS[@]}" \
  --out "$OUT/after" > "$OUT/after.log" 2>&1
echo "after: exit $?"; tail -2 "$OUT/after.log"
