#!/usr/bin/env bash
# Issue 28: the served engine's kernels with bf16 and with FP8 weights (benchmarks/fp8_served_anatomy.py),
# one process per deployment, in one device call:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/run_fp8_anatomy.sh
# (.whl: bash benchmarks/device_wheels.sh, carried). Results under $OUT/anatomy.
source "$(dirname "$0")/gpu_env.sh"
for quantization in ${QUANTIZATIONS:-none fp8}; do
  timeout "${ANATOMY_TIMEOUT:-280}" "$PY" -P benchmarks/fp8_served_anatomy.py --quantization "$quantization" \
    --out "$OUT/anatomy" > "$OUT/anatomy_$quantization.log" 2>&1
  echo "$quantization: exit $?"; grep -v "^W[0-9]" "$OUT/anatomy_$quantization.log" | tail -4
done
