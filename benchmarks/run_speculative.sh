#!/usr/bin/env bash
# Issue 30 on one GPU, in two device calls of one warm machine (the default model's 98 MB GGUF
# is over the 64 MiB one call carries, so it travels in two parts):
#   here, once:  bash benchmarks/device_wheels.sh; bash benchmarks/run_speculative.sh split
#   call 1 (carry .whl and .gguf_parts/a):  PHASE=step  -> speculative_step.py on the 8B shape
#   call 2 (carry .gguf_parts/b):           PHASE=served -> the parts joined and checked, imported,
#                                           speculative_served.py with and without speculation
# each started with: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#   --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && PHASE=... bash ...
#   SMOKE=1 PHASE=served OUT=/tmp/s bash benchmarks/run_speculative.sh   # the mechanism on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PART_BYTES=47000000
if [ "${1:-}" = split ]; then  # here: the installed GGUF in two parts, git-ignored
  gguf=$(python3 -c "from shiftjax.checkpoints.default_model import default_gguf_path; print(default_gguf_path())")
  mkdir -p .gguf_parts
  grep -qx "/.gguf_parts/" .git/info/exclude 2>/dev/null || echo "/.gguf_parts/" >> .git/info/exclude
  head -c "$PART_BYTES" "$gguf" > .gguf_parts/a && tail -c +"$((PART_BYTES + 1))" "$gguf" > .gguf_parts/b
  ls -la .gguf_parts; exit 0
fi
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY="${PY:-python3}"
shim=/tmp/shiftjax_shim_after  # this tree importable under its installed names (as run_before_after.sh)
rm -rf "$shim"; mkdir -p "$shim/shiftjax"
for f in "$PWD"/shiftjax/*; do ln -s "$f" "$shim/shiftjax/"; done
for d in kernels layouts serving checkpoints; do ln -s "$PWD/$d" "$shim/shiftjax/$d"; done
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
SMOKE_ARGS=(); [ "${SMOKE:-0}" = 1 ] && SMOKE_ARGS=(--smoke)
case "${PHASE:-}" in
  step)
    timeout "${STEP_TIMEOUT:-400}" "$PY" -P benchmarks/speculative_step.py --model benchmarks/configs/Llama-3.1-8B \
      "${SMOKE_ARGS[@]}" --out "$OUT/step" > "$OUT/step.log" 2>&1
    echo "step: exit $?"; grep -v "^W[0-9]" "$OUT/step.log" | tail -25 ;;
  served)
    model=default
    if [ "${SMOKE:-0}" != 1 ]; then
      cat .gguf_parts/a .gguf_parts/b > /tmp/smollm2.gguf
      echo "$GGUF_SHA256  /tmp/smollm2.gguf" | sha256sum -c - || exit 3
      "$PY" -P -m shiftjax.serving.cli import-gguf /tmp/smollm2.gguf /tmp/smollm2 --convert --dtype bfloat16 \
        > "$OUT/import.log" 2>&1 || { tail "$OUT/import.log"; exit 4; }
      model=/tmp/smollm2
    fi
    timeout "${SERVED_TIMEOUT:-500}" "$PY" -P benchmarks/speculative_served.py --model "$model" \
      --dtype "${DTYPE:-bfloat16}" --deployments "${DEPLOYMENTS:-none,ngram,suffix}" --max-tokens "${MAX_TOKENS:-128}" \
      "${SMOKE_ARGS[@]}" --out "$OUT/served" > "$OUT/served.log" 2>&1
    echo "served: exit $?"; grep -v "^W[0-9]" "$OUT/served.log" | grep -v "starting:" | tail -25 ;;
  *) echo "PHASE must be step or served" >&2; exit 2 ;;
esac
