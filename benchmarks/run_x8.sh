#!/usr/bin/env bash
# Issue 10 on one host of 8 H200s in ONE device call (kind nvidia-h200-x8); see benchmarks/x8_README.md.
#   COMMIT=<sha> bash benchmarks/run_x8.sh                          # on the GPUs
#   DRY_RUN=1 OUT=/tmp/x8 PY=.venv/bin/python bash benchmarks/run_x8.sh  # everything on 8 virtual CPU devices
# Steps, in priority order, each under its own timeout (never past the call's TOTAL budget), each
# keeping what it finished: 1-2 x8_checks.py (devices, collective values and times, greedy tokens,
# 8B-shape logits); 3 `shiftjax bench compare` of Llama-3.1-70B bf16 dummy weights, one-request
# 4k/250 and 512-concurrent peak, one deployment per step (tp, shift, sp, shift-threshold); then the
# Azure code trace for tp and shift. A device call brings back at most 8 files: at the end all
# logs and compare outputs go into one x8_results.tar.gz beside env.txt, steps.txt and x8_checks.json.
set -uo pipefail
DRY_RUN="${DRY_RUN:-0}"
if [ "$DRY_RUN" = 1 ]; then export JAX_PLATFORMS=cpu PY="${PY:-.venv/bin/python}"; fi
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT  # absolute: gpu_env.sh cds
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these shared hosts
WORK="$OUT/work"
mkdir -p "$WORK"
START=$SECONDS
TOTAL="${TOTAL:-570}"  # seconds for the whole call: the device tool stops a command at 600
if [ "$DRY_RUN" = 1 ]; then
  TOTAL="${TOTAL_DRY:-1800}"
  CHECK_ARGS=--dry-run; PREFIX=cpu_x8_default
else
  CHECK_ARGS=; PREFIX=h200x8_llama70b
fi
CONFIGS=benchmarks/configs/compare
# which steps run (a later call can take the ones an earlier call's TOTAL left out)
STEPS="${STEPS:-checks compare_tp compare_shift compare_sp compare_shift-threshold trace_tp trace_shift}"
{
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  dry_run: $DRY_RUN  date: $(date -u)"
  echo "steps: $STEPS  total budget: $TOTAL s"
  if [ "$DRY_RUN" = 1 ]; then nproc; else
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    nvidia-smi topo -m 2>&1
  fi
  "$PY" -P -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# step NAME SECONDS CMD...: runs CMD under min(SECONDS, what is left of TOTAL), logs to work/NAME.log,
# records "NAME: exit RC after Ss" in steps.txt (124: timed out)
step() {
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return ;; esac
  local left=$((TOTAL - (SECONDS - START) - 20))  # 20 s for the tar at the end
  if [ "$left" -lt 30 ]; then echo "$name: skipped, no time left" | tee -a "$OUT/steps.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  grep -v "^WARNING\|^I0000\|^W0000" "$WORK/$name.log" | tail -15
}

# 1-2: checks over all devices
step checks "${CHECKS_TIMEOUT:-240}" "$PY" -P benchmarks/x8_checks.py $CHECK_ARGS --out "$OUT"

# 3: the compare workloads split in two files: the 4k/250 ones for every deployment, the trace for tp and shift
"$PY" -P - "$CONFIGS/${PREFIX}_workloads.json" "$WORK" <<'EOF'
import json, sys
specs = json.load(open(sys.argv[1]))
json.dump([s for s in specs if s.get("dataset") != "trace"], open(f"{sys.argv[2]}/load.json", "w"), indent=1)
json.dump([s for s in specs if s.get("dataset") == "trace"], open(f"{sys.argv[2]}/trace.json", "w"), indent=1)
EOF
COMPARE=("$PY" -P -m shiftjax.serving.cli bench compare --deployments "$CONFIGS/${PREFIX}_deployments.json")
for name in tp shift sp shift-threshold; do
  step "compare_$name" "${COMPARE_TIMEOUT:-300}" "${COMPARE[@]}" --workloads "$WORK/load.json" --only "$name" \
    --out-dir "$WORK/compare_$name"
done
for name in tp shift; do
  step "trace_$name" "${TRACE_TIMEOUT:-300}" "${COMPARE[@]}" --workloads "$WORK/trace.json" --only "$name" \
    --out-dir "$WORK/trace_$name"
done

# one file for everything else (a device call brings back at most 8 files)
cp "$OUT/steps.txt" "$WORK/" 2>/dev/null
tar -czf "$OUT/x8_results.tar.gz" -C "$OUT" work && rm -rf "$WORK"
echo "total $((SECONDS - START)) s; files: $(cd "$OUT" && ls)"
