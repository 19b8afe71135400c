#!/usr/bin/env bash
# Issue 28 served on one H200 (benchmarks/fp8_served.py), in one device call:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && DEPLOYMENTS=bf16,fp8,fp8_70b bash benchmarks/run_fp8_served.sh
# (.whl: bash benchmarks/device_wheels.sh, carried). Results under $OUT/served.
# BEFORE=DIR (an earlier tree: git archive <commit> shiftjax kernels layouts serving checkpoints |
# tar -x -C DIR, carried) serves the NAME@before deployments from it, e.g.
# DEPLOYMENTS=bf16,fp8@before,fp8 BEFORE=before_tree bash benchmarks/run_fp8_served.sh
source "$(dirname "$0")/gpu_env.sh"
before_args=()
if [ -n "${BEFORE:-}" ]; then
  root=$(cd "$BEFORE" && pwd); shim_before=$(mktemp -d); mkdir -p "$shim_before/shiftjax"
  for f in "$root"/shiftjax/*; do ln -s "$f" "$shim_before/shiftjax/"; done
  for d in kernels layouts serving checkpoints; do ln -s "$root/$d" "$shim_before/shiftjax/$d"; done
  before_args=(--before-path "$shim_before")
fi
timeout "${SERVED_TIMEOUT:-560}" "$PY" -P benchmarks/fp8_served.py --deployments "${DEPLOYMENTS:-bf16,fp8,fp8_70b}" \
  "${before_args[@]}" --out "$OUT/served" > "$OUT/served.log" 2>&1
echo "served: exit $?"; grep -v "^W[0-9]" "$OUT/served.log" | grep -v "starting:" | tail -30
