#!/usr/bin/env bash
# Both layer benchmarks in one device call (issue 3, "Benchmark"; DESIGN.md "Weights live once").
#   bash benchmarks/run_gpu_layers.sh            # on the H200; logs go to $OUT (or ./bench_out)
# Budgets (seconds of measuring per script) keep the call short: WL_BUDGET, LAYER_BUDGET.
# XLA's Triton GEMM autotuning is switched off (cuBLAS GEMMs only) to keep compile time inside
# the device budget; override with XLA_FLAGS=... if wanted.
set -uo pipefail
export PYTHONUNBUFFERED=1
export XLA_FLAGS="${XLA_FLAGS---xla_gpu_enable_triton_gemm=false}"
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
# ceilings first, measured once and handed to both scripts (skipped if COPY_BW/MATMUL_RATE are set)
if [ -z "${COPY_BW:-}" ] || [ -z "${MATMUL_RATE:-}" ]; then
eval "$($PY - <<'PY' 2>&1 | tee "$OUT/ceilings.txt" | grep '^export'
import sys, jax
sys.path.insert(0, "benchmarks")
from roofline import copy_bandwidth, matmul_rate
bw, rate = copy_bandwidth(), matmul_rate()
bw2, rate2 = copy_bandwidth(), matmul_rate()
print(f"# jax {jax.__version__} {jax.devices()[0].device_kind}", file=sys.stderr)
print(f"# copy bandwidth (read+write bytes/s): {bw/1e12:.3f} / {bw2/1e12:.3f} TB/s (two runs); "
      f"bf16 8192^3 matmul: {rate/1e12:.0f} / {rate2/1e12:.0f} TFLOP/s", file=sys.stderr)
print(f"export COPY_BW={max(bw, bw2):.6e}")
print(f"export MATMUL_RATE={max(rate, rate2):.6e}")
PY
)"
cat "$OUT/ceilings.txt"
fi
echo "COPY_BW=$COPY_BW MATMUL_RATE=$MATMUL_RATE XLA_FLAGS=$XLA_FLAGS"
$PY benchmarks/weight_layout_bench.py --reps "${REPS:-7}" --budget-s "${WL_BUDGET:-140}" ${WL_ARGS:-} 2>&1 | tee "$OUT/weight_layout.log"
$PY benchmarks/layer_bench.py --reps "${REPS:-5}" --budget-s "${LAYER_BUDGET:-60}" ${LAYER_ARGS:-} 2>&1 | tee "$OUT/layer.log"
