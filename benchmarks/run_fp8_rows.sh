#!/usr/bin/env bash
# Issue 28, prefill: w8a8's activations quantized by one fused kernel (kernels/fp8_rows.py), in one
# device call: the GPU tests of the FP8 kernels, the kernels against XLA's passes
# (benchmarks/fp8_rows_bench.py), then the served engine's prefill and decode kernels
# (benchmarks/fp8_served_anatomy.py):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && bash benchmarks/run_fp8_rows.sh
# (.whl: bash benchmarks/device_wheels.sh, carried). ANATOMY=0 skips the served part.
source "$(dirname "$0")/gpu_env.sh"
timeout "${TEST_TIMEOUT:-200}" "$PY" -P -m pytest --noconftest -q -p no:cacheprovider -m gpu \
  tests/test_fp8_rows.py tests/test_fp8_gemm.py > "$OUT/pytest_gpu.log" 2>&1
echo "gpu tests: exit $?"; tail -3 "$OUT/pytest_gpu.log"
timeout "${BENCH_TIMEOUT:-200}" "$PY" -P benchmarks/fp8_rows_bench.py --out "$OUT/rows" > "$OUT/rows.log" 2>&1
echo "rows bench: exit $?"; grep -v "^W[0-9]" "$OUT/rows.log" | tail -12
if [ "${ANATOMY:-1}" != 0 ]; then
  QUANTIZATIONS="${QUANTIZATIONS:-fp8}" bash "$(dirname "$0")/run_fp8_anatomy.sh"
fi
