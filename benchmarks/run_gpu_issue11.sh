#!/usr/bin/env bash
# Issue 11, items 1-3, in ONE device call on one H200 (kind nvidia-h200), inside 9 minutes:
# the ceilings (copy and read-only stream, best of several), the layer loop of a
# Llama-3-8B-shaped decode step (scan vs unrolled, greedy vs sampled; the scan again with
# XLA's dynamic-slice fusion), model_gpu.py's HLO report and compile time vs depth, then,
# in what time is left, model_gpu.py's Pallas-vs-reference check.
#   COMMIT=<sha of HEAD> bash benchmarks/run_gpu_issue11.sh      # 8 files under $OUT
#   SMOKE=1 JAX_PLATFORMS=cpu PY=.venv/bin/python bash benchmarks/run_gpu_issue11.sh  # CPU test
# Every step gets at most what is left of TOTAL_S (default 530 s), so the call ends in time
# and keeps what finished. env.txt records the commit and the git blob id of every file that
# ran, so a log can be matched to the committed scripts (`git ls-tree -r <commit>`).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
SMOKE_FLAG=""
[ "${SMOKE:-0}" = 1 ] && SMOKE_FLAG="--smoke"
DEADLINE=$(( $(date +%s) + ${TOTAL_S:-530} ))

# step NAME MAX_SECONDS LOG COMMAND...: runs COMMAND under min(MAX_SECONDS, time left), appending to LOG
step() {
  local name=$1 max=$2 log=$3; shift 3
  local left=$(( DEADLINE - $(date +%s) ))
  local limit=$(( max < left ? max : left ))
  if [ "$limit" -le 5 ]; then echo "## $name: skipped, no time left" | tee -a "$OUT/$log"; return; fi
  echo "## $name (limit ${limit} s): $*" | tee -a "$OUT/$log"
  local start=$(date +%s)
  timeout "$limit" "$@" 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee -a "$OUT/$log"
  echo "## $name: exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" | tee -a "$OUT/$log"
}

{
  echo "commit: ${COMMIT:-unknown (set COMMIT)}  date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')  smoke: ${SMOKE:-0}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  "$PY" -P - <<'PY'
import glob, hashlib, jax
print("jax", jax.__version__, jax.devices())
# git blob ids: `git ls-tree -r <commit>` of the same files shows whether they match
for path in sorted(glob.glob("benchmarks/*.py") + glob.glob("benchmarks/*.sh") + glob.glob("shiftjax/*.py")
                   + glob.glob("kernels/*.py") + glob.glob("serving/engine/*.py")):
    data = open(path, "rb").read()
    print("blob", hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), path)
PY
} > "$OUT/env.txt" 2>&1
head -4 "$OUT/env.txt"

step ceilings 120 env.txt "$PY" -P benchmarks/roofline.py $SMOKE_FLAG --json "$OUT/ceilings.json"
CEIL=""
[ -s "$OUT/ceilings.json" ] && CEIL="--ceilings $OUT/ceilings.json"
step decode_variants 260 decode_variants.log \
  "$PY" -P benchmarks/decode_variants.py $SMOKE_FLAG $CEIL --json "$OUT/decode_variants.json"
XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true" \
  step decode_scan_dsfusion 90 decode_variants_dsfusion.log \
  "$PY" -P benchmarks/decode_variants.py $SMOKE_FLAG $CEIL --loops scan
step model_hlo_depth 90 model_gpu.log "$PY" -P benchmarks/model_gpu.py $SMOKE_FLAG --sections hlo,depth --out "$OUT"
mkdir -p "$OUT/pallas"
JAX_DEFAULT_MATMUL_PRECISION=highest \
  step model_pallas 240 model_gpu.log "$PY" -P benchmarks/model_gpu.py $SMOKE_FLAG --sections pallas --out "$OUT/pallas"
echo "files under $OUT:"; find "$OUT" -type f | sort
