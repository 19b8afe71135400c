#!/usr/bin/env bash
# The model end to end on one GPU (benchmarks/model_gpu.py), in one device call:
#   bash benchmarks/run_gpu_model.sh      # logs and model_gpu.json go to $OUT (or ./bench_out)
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda JAX_DEFAULT_MATMUL_PRECISION=highest
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
# The checkout's folders under their installed names, without installing (see run_gpu_kernels.sh).
SHIM=$(mktemp -d)
mkdir -p "$SHIM/shiftjax"
for f in shiftjax/*; do ln -s "$PWD/$f" "$SHIM/shiftjax/"; done
for d in kernels layouts serving checkpoints; do ln -s "$PWD/$d" "$SHIM/shiftjax/$d"; done
export PYTHONPATH="$SHIM"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
timeout "${MODEL_TIMEOUT:-420}" python3 -P benchmarks/model_gpu.py 2>&1 | tee "$OUT/model_gpu.log"
