#!/usr/bin/env bash
# GPU tests and the attention benchmark in one device call (issue 4).
#   bash benchmarks/run_gpu_kernels.sh     # on the H200; logs go to $OUT (or ./bench_out)
# TESTS=0 / BENCH=0 skip the tests / the benchmark; TEST_ARGS and BENCH_ARGS pass flags on.
#   TESTS=0 BENCH_ARGS=--smoke JAX_PLATFORMS=cpu PY=.venv/bin/python bash benchmarks/run_gpu_kernels.sh  # CPU test
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
# tests/conftest.py (CPU devices, the jaxtyping+beartype hook) is not loaded there: the
# device image has no beartype. Its matmul precision setting is repeated here instead.
export JAX_DEFAULT_MATMUL_PRECISION=highest
"$PY" -P -c "import jax, shiftjax.kernels as k; print(jax.__version__, jax.devices(), k.__file__)" 2>&1 | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee -a "$OUT/env.txt"
if [ "${TESTS:-1}" != 0 ]; then
  timeout "${TEST_TIMEOUT:-240}" "$PY" -P -m pytest --noconftest -q -x -p no:cacheprovider tests/test_kernels_gpu.py ${TEST_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
fi
if [ "${BENCH:-1}" != 0 ]; then
  timeout "${BENCH_TIMEOUT:-300}" "$PY" -P benchmarks/attention_bench.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/attention_bench.log"
fi
