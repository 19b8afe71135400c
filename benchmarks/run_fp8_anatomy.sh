#!/usr/bin/env bash
# Issue 28: the served engine's kernels with bf16 and with FP8 weights (benchmarks/fp8_served_anatomy.py),
# one process per deployment, in one device call:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/run_fp8_anatomy.sh
# (.whl: bash benchmarks/device_wheels.sh, carried). Results under $OUT/anatomy. ANATOMY_LABEL names
# a variant (its files end in it) and ANATOMY_ARGS passes it more arguments, so one call can run
# several, e.g. one under XLA_FLAGS or TF_CPP_VMODULE set around this script.
source "$(dirname "$0")/gpu_env.sh"
for quantization in ${QUANTIZATIONS:-none fp8}; do
  log="$OUT/anatomy_$quantization${ANATOMY_LABEL:-}.log"
  # shellcheck disable=SC2086  # ANATOMY_ARGS is a list of arguments
  timeout "${ANATOMY_TIMEOUT:-280}" "$PY" -P benchmarks/fp8_served_anatomy.py --quantization "$quantization" \
    --label "${ANATOMY_LABEL:-}" --out "$OUT/anatomy" ${ANATOMY_ARGS:-} > "$log" 2>&1
  echo "$quantization${ANATOMY_LABEL:-}: exit $?"; grep -v "^[WI][0-9]" "$log" | tail -4
done
