#!/usr/bin/env bash
# The model end to end on one GPU (benchmarks/model_gpu.py), in one device call:
#   bash benchmarks/run_gpu_model.sh      # logs and model_gpu.json go to $OUT (or ./bench_out)
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export JAX_DEFAULT_MATMUL_PRECISION=highest  # float32 comparisons in full precision (not TF32)
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
timeout "${MODEL_TIMEOUT:-420}" "$PY" -P benchmarks/model_gpu.py ${MODEL_ARGS:-} 2>&1 | tee "$OUT/model_gpu.log"
