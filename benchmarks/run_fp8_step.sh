#!/usr/bin/env bash
# Issue 28's step times on one H200 (benchmarks/fp8_step.py), one device call; results under $OUT/step.
# LAYERS (4) sets the depth, STEP_ARGS more arguments (e.g. --w8a16).
source "$(dirname "$0")/gpu_env.sh"
timeout "${STEP_TIMEOUT:-200}" "$PY" -P benchmarks/fp8_step.py --layers "${LAYERS:-4}" ${STEP_ARGS:-} --out "$OUT/step" \
  > "$OUT/step.log" 2>&1
echo "step: exit $?"; grep -v "^W[0-9]" "$OUT/step.log" | tail -12
