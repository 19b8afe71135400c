#!/usr/bin/env bash
# One device call: the FP8 GEMM benchmark (benchmarks/fp8_gemm_bench.py) and the GPU tests of
# tests/test_fp8_gemm.py, logs and JSON under $OUT. Extra arguments go to the benchmark
# (e.g. --probe, --shapes 8b.o --ms 16).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia_smi.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 $PY -P -m pytest -q -p no:cacheprovider tests/test_fp8_gemm.py -m gpu 2>&1 | tee "$OUT/pytest_gpu.log"
  echo "pytest rc=$?"
fi
timeout "${BENCH_TIMEOUT:-420}" $PY -P benchmarks/fp8_gemm_bench.py --out "$OUT" "$@"
echo "bench rc=$?"
