#!/usr/bin/env bash
# One device call: the FP8 GEMM benchmark (benchmarks/fp8_gemm_bench.py), then the GPU tests
# of tests/test_fp8_gemm.py (--noconftest: the device image has no beartype), logs and JSON
# under $OUT. Extra arguments go to the benchmark (e.g. --probe, --shapes 8b.o --ms 16).
#   bash benchmarks/run_fp8_gemm.sh          # on the H200
# SKIP_TESTS=1 skips the tests; BENCH_TIMEOUT / TEST_TIMEOUT bound each part (seconds).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia_smi.txt"
timeout "${BENCH_TIMEOUT:-420}" $PY -P benchmarks/fp8_gemm_bench.py --out "$OUT" "$@"
echo "bench rc=$?"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" $PY -P -m pytest --noconftest -q -p no:cacheprovider tests/test_fp8_gemm.py -m gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  echo "pytest rc=$?"
fi
