#!/usr/bin/env bash
# What the served decode step's XLA kernels compute, with bf16 and with FP8 weights, in one
# device call: the anatomy (benchmarks/fp8_served_anatomy.py, --top kernels) under an HLO dump,
# then each top kernel's fusion read off the optimized HLO (benchmarks/hlo_fusions.py):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/run_decode_fusions.sh
# Results under $OUT/anatomy and $OUT/fusions_<quantization>.txt.
source "$(dirname "$0")/gpu_env.sh"
for quantization in ${QUANTIZATIONS:-none fp8}; do
  dump=$(mktemp -d)
  XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text" QUANTIZATIONS=$quantization \
    ANATOMY_ARGS="--decode-steps 24 --profiled 4 --top ${TOP:-400}" bash "$(dirname "$0")/run_fp8_anatomy.sh"
  "$PY" benchmarks/hlo_fusions.py "$dump" --anatomy "$OUT/anatomy/anatomy_$quantization.json" \
    --top "${FUSIONS:-60}" > "$OUT/fusions_$quantization.txt" 2>&1
  echo "fusions_$quantization: exit $? ($(grep -c '^## ' "$OUT/fusions_$quantization.txt") found)"
  rm -rf "$dump"
done
