#!/usr/bin/env bash
# Both layer benchmarks in one device call (issue 3, "Benchmark"; docs/architecture.md, "weights stored once").
#   COMMIT=<sha> bash benchmarks/run_gpu_layers.sh     # on the H200; logs go to $OUT (or ./bench_out)
#   SMOKE=1 JAX_PLATFORMS=cpu PY=.venv/bin/python bash benchmarks/run_gpu_layers.sh   # CPU test
# Budgets (seconds of measuring per script) keep the call short: WL_BUDGET, LAYER_BUDGET.
# XLA's Triton GEMM autotuning is switched off (cuBLAS GEMMs only) to keep compile time inside
# the device budget; override with XLA_FLAGS=... if wanted. Every timed line of both logs
# names its timer (device span from the profiler, or host wall clock where it failed).
set -uo pipefail
export XLA_FLAGS="${XLA_FLAGS---xla_gpu_enable_triton_gemm=false}"
source "$(dirname "$0")/gpu_env.sh"
SMOKE_FLAG=""
[ "${SMOKE:-0}" = 1 ] && SMOKE_FLAG="--smoke"
{ echo "commit: ${COMMIT:-unknown (set COMMIT)}  date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')  smoke: ${SMOKE:-0}"
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv 2>&1; } | tee "$OUT/env.txt"
# ceilings first (best of several tries), measured once and handed to both scripts
# (skipped if COPY_BW and MATMUL_RATE are set)
if [ -z "${COPY_BW:-}" ] || [ -z "${MATMUL_RATE:-}" ]; then
  eval "$("$PY" -P - "$SMOKE_FLAG" <<'PY' 2>&1 | tee "$OUT/ceilings.txt" | grep '^export'
import sys
sys.path.insert(0, "benchmarks")
from roofline import ceilings, describe
c = ceilings(8 << 20, 1, 128) if "--smoke" in sys.argv else ceilings()
print(f"# {c['device']} jax {c['jax']}\n# " + describe(c).replace("\n", "\n# "))
print(f"export COPY_BW={c['copy']['best']:.6e}")
print(f"export MATMUL_RATE={c['matmul']['best']:.6e}")
PY
)"
  cat "$OUT/ceilings.txt"
fi
echo "COPY_BW=$COPY_BW MATMUL_RATE=$MATMUL_RATE XLA_FLAGS=$XLA_FLAGS"
"$PY" -P benchmarks/weight_layout_bench.py $SMOKE_FLAG --reps "${REPS:-7}" --budget-s "${WL_BUDGET:-140}" ${WL_ARGS:-} 2>&1 \
  | tee "$OUT/weight_layout.log"
"$PY" -P benchmarks/layer_bench.py $SMOKE_FLAG --reps "${REPS:-5}" --budget-s "${LAYER_BUDGET:-60}" ${LAYER_ARGS:-} 2>&1 \
  | tee "$OUT/layer.log"
