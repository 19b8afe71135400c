#!/usr/bin/env bash
# FP8 KV cache on the H200 in one device call: the decode attention benchmark (bf16 cache
# against float8_e4m3fn), then the gpu-marked tests of tests/test_fp8_kv_cache.py.
#   bash benchmarks/run_fp8_kv.sh      # logs and JSON go to $OUT (or ./bench_out)
#   BENCH_ARGS=--smoke TESTS=0 JAX_PLATFORMS=cpu PY=.venv/bin/python bash benchmarks/run_fp8_kv.sh  # CPU smoke
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# As run_gpu_kernels.sh: tests/conftest.py is not loaded on the device (no beartype there).
export JAX_DEFAULT_MATMUL_PRECISION=highest
"$PY" -P -c "import jax; print(jax.__version__, jax.devices())" 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$OUT/env.txt"
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-150}" "$PY" -P benchmarks/fp8_kv_attention.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/fp8_kv_attention.log"
fi
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-60}" "$PY" -P -m pytest --noconftest -q -p no:cacheprovider -m gpu tests/test_fp8_kv_cache.py 2>&1 | tee "$OUT/gpu_tests.log"
fi
