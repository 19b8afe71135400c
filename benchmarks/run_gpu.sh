#!/usr/bin/env bash
# The GPU measurements of benchmarks/README.md, by named parts, in one run:
#   COMMIT=$(git rev-parse HEAD) bash benchmarks/run_gpu.sh tests ceilings kernels anatomy served
#   SMOKE=1 PY=.venv/bin/python OUT=/tmp/o bash benchmarks/run_gpu.sh ceilings kernels   # the CPU
# Each part is a function below; each script runs in its own process under its own time limit
# (STEP_TIMEOUT, default 560 s), so a failure or a timeout keeps the other parts' results.
# Results go under $OUT (default ./bench_out): one folder or log per step, env.txt (the
# commit, the GPUs, the git blob id of every file that ran) and steps.txt ("NAME: exit RC").
# SMOKE=1 runs every script with --smoke: tiny shapes on the CPU, the same code paths.
#
#   wheels        (run where there is network, before copying the checkout to a GPU machine
#                 that has none) the wheels such a machine's image may lack, into .whl/;
#                 install them there with  PRE=1 bash benchmarks/run_gpu.sh ...
#   tests         the GPU tests (-m gpu; the two-GPU collectives' tests where there are two)
#   ceilings      roofline.py: read-only stream, copy, bf16 matmul
#   kernels       attention_bench.py (--quick unless ATTENTION_ARGS), fp8_gemm_bench.py (FP8_ARGS)
#   anatomy       decode_anatomy.py (the decode step kernel by kernel), served_anatomy.py for
#                 QUANTIZATIONS (default "none fp8") under an HLO dump, hlo_fusions.py on its
#                 top kernels
#   served        served.py: TPOT at 1 and 64 requests, TTFT of 4,096 tokens (DEPLOYMENTS,
#                 default bf16,fp8)
#   before_after  served.py, this tree against BEFORE (a folder holding an earlier tree:
#                 git archive <commit> pyproject.toml shiftjax kernels layouts serving checkpoints
#                 | tar -x -C DIR; a tree from 5835ffb on, which imports from its root)
#   compare       shiftjax bench compare of configs/compare/${PREFIX}_*.json, one deployment
#                 per step (STEPS: WORKLOADS:DEPLOYMENT, WORKLOADS one of all, load, trace;
#                 default every deployment on all),
#                 merged at the end; a deployment whose PYTHONPATH names /tmp/shiftjax_before
#                 serves BEFORE's tree (h200_before_after)
#   x2            shift_x2.py (X2_PARTS, X2_ARGS) and startup.py (STARTUP_PAGES, STARTUP_GEMM): two GPUs
#   restore       restore_gpu.py: peak memory of the sharded restore and the dummy load (PHASES)
#   x8            x8_checks.py, then compare of configs/compare/h200x8_llama70b_* (8 GPUs)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ "$#" -gt 0 ] || { sed -n '2,/^set /p' "$0" | sed '$d'; exit 2; }
for p in "$@"; do
  [ "$p" = wheels ] || grep -q "^part_$p() {" "$0" || { echo "unknown part $p (see the header of $0)" >&2; exit 2; }
done
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT
SMOKE="${SMOKE:-0}"
if [ "$SMOKE" = 1 ]; then export JAX_PLATFORMS=cpu PY="${PY:-.venv/bin/python}"; fi
if [ "${1:-}" = wheels ]; then  # before gpu_env.sh: this runs on the machine with network
  cd "$HERE/.." && rm -rf .whl
  grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude  # not a file of the tree
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
    grpcio-reflection==1.85.1 llguidance==1.9.1 gguf==0.19.0
  ls .whl; exit
fi
if [ "${PRE:-0}" = 1 ]; then  # the wheels of the part "wheels", copied along with the checkout
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$HERE"/../.whl/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
source "$HERE/gpu_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast (NVLS) off, as in every figure of benchmarks/README.md
S=""; [ "$SMOKE" = 1 ] && S="--smoke"

# step NAME SECONDS CMD...: CMD under min(SECONDS, STEP_TIMEOUT), its output in $OUT/NAME.log,
# "NAME: exit RC after Ss" in steps.txt (124: timed out)
step() {
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt "${STEP_TIMEOUT:-560}" ] && limit=${STEP_TIMEOUT:-560}
  local t0=$SECONDS
  timeout -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/steps.txt"
  grep -v "^WARNING\|^I0000\|^W0000\|^W[0-9]" "$OUT/$name.log" | tail -5
}

env_txt() {
  echo "commit: ${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  smoke: $SMOKE  date: $(date -u '+%F %T UTC')"
  echo "parts: $*"
  if [ "$SMOKE" = 1 ]; then nproc; else
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
    nvidia-smi topo -m
  fi
  "$PY" - <<'EOF'
import glob, hashlib, jax
print("jax", jax.__version__, jax.devices())
# git blob ids: `git ls-tree -r <commit>` of the same files shows whether they match
for path in sorted(glob.glob("benchmarks/*.py") + glob.glob("benchmarks/*.sh") + glob.glob("shiftjax/*.py")
                   + glob.glob("kernels/*.py") + glob.glob("serving/engine/*.py")):
    data = open(path, "rb").read()
    print("blob", hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest(), path)
EOF
}

part_tests() {
  # tests/conftest.py (virtual CPU devices, the beartype hook) is not loaded on the GPU; its
  # float32 matmul precision is set here instead
  local files=(tests/test_kernels_gpu.py tests/test_fp8_gemm.py tests/test_fp8_rows.py tests/test_fp8_kv_cache.py)
  [ "$("$PY" -c 'import jax; print(len(jax.devices()))' 2>/dev/null)" -ge 2 ] 2>/dev/null \
    && files+=(tests/test_collectives_gpu.py)
  JAX_DEFAULT_MATMUL_PRECISION=highest step tests 400 "$PY" -m pytest --noconftest -q -p no:cacheprovider \
    -m gpu "${files[@]}" ${TEST_ARGS:-}
}

part_ceilings() { step ceilings 120 "$PY" benchmarks/roofline.py $S --json "$OUT/ceilings.json"; }

part_kernels() {
  # shellcheck disable=SC2086  # the *_ARGS are lists of arguments
  step attention_bench 300 "$PY" benchmarks/attention_bench.py $S ${ATTENTION_ARGS:---quick}
  step fp8_gemm 420 "$PY" benchmarks/fp8_gemm_bench.py $S --out "$OUT/fp8_gemm" ${FP8_ARGS:-}
}

part_anatomy() {
  local seqs="8,64,8,64"; [ "$SMOKE" = 1 ] && seqs="8 --gemm-rows 8"
  # shellcheck disable=SC2086
  step decode_anatomy 300 "$PY" benchmarks/decode_anatomy.py $S --shape "${SHAPE:-llama8b}" --seqs $seqs \
    --out "$OUT/decode_anatomy"
  for quantization in ${QUANTIZATIONS:-none fp8}; do
    local dump; dump=$(mktemp -d)
    local args="--decode-steps 24 --profiled 4 --top 400"; [ "$SMOKE" = 1 ] && args="--decode-steps 5 --profiled 2"
    # shellcheck disable=SC2086
    XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$dump --xla_dump_hlo_as_text" step "served_anatomy_$quantization" 280 \
      "$PY" benchmarks/served_anatomy.py $S --quantization "$quantization" $args --out "$OUT/served_anatomy"
    if [ "$SMOKE" = 1 ]; then  # a CPU profile names no fusion kernels: the reader on its own dump
      step "fusions_$quantization" 60 "$PY" benchmarks/hlo_fusions.py --smoke --out "$OUT/fusions_$quantization"
    else
      step "fusions_$quantization" 60 "$PY" benchmarks/hlo_fusions.py "$dump" \
        --anatomy "$OUT/served_anatomy/anatomy_$quantization.json" --top "${FUSIONS:-60}"
    fi
    rm -rf "$dump"
  done
}

# before_tree: /tmp/shiftjax_before, a link to BEFORE (an earlier tree, importable from its
# root: at or after the commit that made the checkout importable, 5835ffb)
before_tree() {
  local root; root=$(cd "${BEFORE:?BEFORE names a folder holding an earlier tree}" && pwd)
  ln -sfn "$root" /tmp/shiftjax_before
}

part_served() {
  local deployments="${DEPLOYMENTS:-bf16,fp8}"; [ "$SMOKE" = 1 ] && deployments="${DEPLOYMENTS:-bf16,fp8_kv}"
  step served 560 "$PY" benchmarks/served.py $S --deployments "$deployments" --out "$OUT/served"
}

part_before_after() {
  before_tree
  step before_after 560 "$PY" benchmarks/served.py $S --deployments "${DEPLOYMENTS:-bf16@before,bf16,fp8@before,fp8}" \
    --before-path /tmp/shiftjax_before --out "$OUT/before_after"
}

part_compare() {
  local prefix="${PREFIX:?PREFIX names configs/compare/PREFIX_deployments.json and PREFIX_workloads.json}"
  local steps="${STEPS:-}"  # default: every deployment of the file on all its workloads, in its order
  [ -n "$steps" ] || steps=$("$PY" -c 'import json, sys; print(" ".join("all:" + d["name"] for d in json.load(open(sys.argv[1]))["deployments"]))' \
    "benchmarks/configs/compare/${prefix}_deployments.json")
  [ -n "${BEFORE:-}" ] && before_tree
  local work="$OUT/compare_$prefix"; mkdir -p "$work"
  # the workloads file split three ways: all, load (no trace), trace
  "$PY" - "benchmarks/configs/compare/${prefix}_workloads.json" "$work" <<'EOF'
import json, sys
specs = json.load(open(sys.argv[1]))
for name, keep in {"all": lambda s: True, "load": lambda s: s.get("dataset") != "trace",
                   "trace": lambda s: s.get("dataset") == "trace"}.items():
    json.dump([s for s in specs if keep(s)], open(f"{sys.argv[2]}/{name}.json", "w"), indent=1)
EOF
  # the servers share one persistent compilation cache: a deployment whose steps an earlier
  # one compiled starts warm
  local compare=("$PY" -m shiftjax.serving.cli bench compare
                 --deployments "benchmarks/configs/compare/${prefix}_deployments.json" ${COMPARE_ARGS:-})
  local reports=() item workloads deployment
  for item in $steps; do
    workloads=${item%%:*} deployment=${item#*:}
    case "$workloads" in all|load|trace) ;; *) echo "bad step $item (want all|load|trace:NAME)" >&2; return 2;; esac
    step "compare_${prefix}_${workloads}_$deployment" 560 "${compare[@]}" --workloads "$work/$workloads.json" \
      --only "$deployment" --out-dir "$work/${workloads}_$deployment"
    [ -f "$work/${workloads}_$deployment/compare.json" ] && reports+=("$work/${workloads}_$deployment/compare.json")
  done
  if [ "${#reports[@]}" -gt 0 ]; then
    step "compare_${prefix}_merge" 120 "$PY" -m shiftjax.serving.cli bench merge "${reports[@]}" --out-dir "$work/merged"
  fi
}

part_x2() {
  local parts="${X2_PARTS:-ceilings correct steps_mesh steps_1gpu engine}"
  for p in $parts; do
    # shellcheck disable=SC2086
    step "x2_$p" 240 "$PY" benchmarks/shift_x2.py $S --parts "$p" --out "$OUT/x2_$p" ${X2_ARGS:-}
  done
  if [ "$SMOKE" = 1 ]; then
    step x2_startup 240 "$PY" benchmarks/startup.py --smoke --out "$OUT/x2_startup"
  else
    step x2_startup 240 "$PY" benchmarks/startup.py --model benchmarks/configs/Llama-3.1-8B --load-format dummy \
      --tokenizer benchmarks/configs/smollm2-tokenizer --dtype bfloat16 --sp 2 --num-pages "${STARTUP_PAGES:-4096}" \
      --token-buckets 16,64,128 --seq-buckets 8 --gemm "${STARTUP_GEMM:-cublas}" \
      --conditions "cold,executable store,executable store" --repeats 1 --out "$OUT/x2_startup"
  fi
}

part_restore() {
  step restore 590 "$PY" benchmarks/restore_gpu.py $S --out "$OUT/restore" --phases "${PHASES:-write,restore,old,dummy70b}"
}

part_x8() {
  step x8_checks 240 "$PY" benchmarks/x8_checks.py $S --out "$OUT/x8"
  PREFIX="${X8_PREFIX:-h200x8_llama70b}" STEPS="${X8_STEPS:-load:tp load:shift load:sp load:shift-threshold trace:tp trace:shift}" \
    COMPARE_ARGS="${COMPARE_ARGS:---tokenizer benchmarks/configs/smollm2-tokenizer}" part_compare
}

env_txt "$@" > "$OUT/env.txt" 2>&1
head -3 "$OUT/env.txt"
for p in "$@"; do "part_$p"; done
echo "files under $OUT:"; (cd "$OUT" && find . -maxdepth 2 -type f | sort | tr '\n' ' '); echo
! grep -qv ": exit 0 " "$OUT/steps.txt"
