#!/usr/bin/env bash
# Peak device memory of sharded restore and of dummy loading (issue 8, target 6;
# benchmarks/restore_gpu.py) on nvidia-h200-x2. Two device calls keep each under 10 minutes:
#   PHASES=write,restore,old bash benchmarks/run_gpu_restore.sh   # 8B-shape checkpoint: new vs old path
#   PHASES=dummy70b bash benchmarks/run_gpu_restore.sh             # 70B-shape dummy model at tp = 2
# Results: $OUT/restore_gpu.json and $OUT/restore_gpu.log. SMOKE=1 runs it on the CPU.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these shared hosts
if [ "${SMOKE:-0}" = 1 ]; then SMOKE_FLAG=--smoke; else SMOKE_FLAG=; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt" 2>&1
timeout "${RESTORE_TIMEOUT:-590}" "$PY" -P benchmarks/restore_gpu.py $SMOKE_FLAG --out "$OUT" \
  --phases "${PHASES:-write,restore,old,dummy70b}" 2>&1 | tee "$OUT/restore_gpu.log" | grep -v "^WARNING"
