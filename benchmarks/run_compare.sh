#!/usr/bin/env bash
# `shiftjax bench compare` in ONE device call, one deployment per step so that each has its own
# time limit and a slow one cannot take the others' results with it; at the end every step's
# report is merged into one (compare.json, compare.md, plots).
#   PREFIX=h200x2_llama8b COMMIT=<sha> bash benchmarks/run_compare.sh     # on the GPUs (2x H200)
#   DRY_RUN=1 PREFIX=cpu_default OUT=/tmp/c PY=.venv/bin/python bash benchmarks/run_compare.sh
# Reads benchmarks/configs/compare/${PREFIX}_{deployments,workloads}.json. STEPS lists the steps
# in order, each WORKLOADS:DEPLOYMENT with WORKLOADS one of all, load (the non-trace workloads),
# trace; a later call can take the steps an earlier call's TOTAL left out. CHECKS, if set, is a
# command run first as the step "checks" (run_x8.sh uses it). The servers share one persistent
# compilation cache, so a deployment whose executables an earlier one compiled starts warm.
# A device call brings back at most 8 files: env.txt, steps.txt, merged/compare.{json,md} and
# one tarball of everything (logs, each step's report and plots).
set -uo pipefail
DRY_RUN="${DRY_RUN:-0}"
if [ "$DRY_RUN" = 1 ]; then export JAX_PLATFORMS=cpu PY="${PY:-.venv/bin/python}"; fi
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT  # absolute: gpu_env.sh cds
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these shared hosts
PREFIX="${PREFIX:?names benchmarks/configs/compare/PREFIX_deployments.json and PREFIX_workloads.json}"
CONFIGS=benchmarks/configs/compare
STEPS="${STEPS:?STEPS lists WORKLOADS:DEPLOYMENT steps, e.g. all:tp all:shift}"
TOTAL="${TOTAL:-570}"  # seconds for the whole call: the device tool stops a command at 600
STEP_TIMEOUT="${STEP_TIMEOUT:-560}"
WORK="$OUT/work"
mkdir -p "$WORK"
START=$SECONDS
{
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  prefix: $PREFIX  dry_run: $DRY_RUN  date: $(date -u)"
  echo "steps: ${CHECKS:+checks }$STEPS  total budget: $TOTAL s"
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
  local left=$((TOTAL - (SECONDS - START) - 30))  # 30 s for the merge and the tar at the end
  if [ "$left" -lt 30 ]; then echo "$name: skipped, no time left" | tee -a "$OUT/steps.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/steps.txt"
  grep -v "^WARNING\|^I0000\|^W0000" "$WORK/$name.log" | tail -15
}

if [ -n "${CHECKS:-}" ]; then step checks "${CHECKS_TIMEOUT:-240}" bash -c "$CHECKS"; fi

# the workloads file split three ways: all, load (no trace), trace
"$PY" -P - "$CONFIGS/${PREFIX}_workloads.json" "$WORK" <<'EOF'
import json, sys
specs = json.load(open(sys.argv[1]))
for name, keep in {"all": lambda s: True, "load": lambda s: s.get("dataset") != "trace",
                   "trace": lambda s: s.get("dataset") == "trace"}.items():
    json.dump([s for s in specs if keep(s)], open(f"{sys.argv[2]}/{name}.json", "w"), indent=1)
EOF
COMPARE=("$PY" -P -m shiftjax.serving.cli bench compare --deployments "$CONFIGS/${PREFIX}_deployments.json" ${COMPARE_ARGS:-})
reports=()
for item in $STEPS; do
  workloads=${item%%:*} deployment=${item#*:}
  case "$workloads" in all|load|trace) ;; *) echo "bad step $item (want all|load|trace:NAME)" >&2; exit 2;; esac
  step "${workloads}_$deployment" "$STEP_TIMEOUT" "${COMPARE[@]}" --workloads "$WORK/$workloads.json" \
    --only "$deployment" --out-dir "$WORK/${workloads}_$deployment"
  [ -f "$WORK/${workloads}_$deployment/compare.json" ] && reports+=("$WORK/${workloads}_$deployment/compare.json")
done

# every step's report (saved after each of its runs) as one, in STEPS order
if [ "${#reports[@]}" -gt 0 ]; then
  "$PY" -P -m shiftjax.serving.cli bench merge "${reports[@]}" --out-dir "$OUT/merged" > "$WORK/merge.log" 2>&1
  echo "merge: exit $? (${#reports[@]} reports)" | tee -a "$OUT/steps.txt"
  mkdir -p "$WORK/merged_plots"; mv "$OUT/merged"/*.png "$WORK/merged_plots/" 2>/dev/null  # in the tarball
fi
cp "$OUT/steps.txt" "$WORK/" 2>/dev/null
tar -czf "$OUT/compare_results.tar.gz" -C "$OUT" work && rm -rf "$WORK"
echo "total $((SECONDS - START)) s; files: $(cd "$OUT" && find . -type f | sort | tr '\n' ' ')"
