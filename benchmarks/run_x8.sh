#!/usr/bin/env bash
# Issue 10 on one host of 8 H200s in ONE device call (kind nvidia-h200-x8); see benchmarks/README.md, "The 8-GPU projection".
#   COMMIT=<sha> bash benchmarks/run_x8.sh                          # on the GPUs
#   DRY_RUN=1 OUT=/tmp/x8 PY=.venv/bin/python bash benchmarks/run_x8.sh  # everything on 8 virtual CPU devices
# benchmarks/run_compare.sh with: first the step "checks" (x8_checks.py: devices, collective values
# and times, greedy tokens, 8B-shape logits); then `shiftjax bench compare` of Llama-3.1-70B bf16
# dummy weights, one-request 4k/250 and 512-concurrent peak, one deployment per step (tp, shift, sp,
# shift-threshold); then the Azure code trace for tp and shift. STEPS picks steps for later calls.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${DRY_RUN:-0}" = 1 ]; then
  export PREFIX=cpu_x8_default CHECK_ARGS=--dry-run TOTAL="${TOTAL_DRY:-1800}" PY="${PY:-.venv/bin/python}"
else
  export PREFIX=h200x8_llama70b CHECK_ARGS= PY="${PY:-python3}"
  # the bench client's tokenizer: the GPU machines lack the default model's GGUF package
  export COMPARE_ARGS="${COMPARE_ARGS:---tokenizer benchmarks/configs/smollm2-tokenizer}"
fi
OUT="${OUT:-./bench_out}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export OUT
# SKIP_CHECKS=1 for a later call that only takes compare steps
if [ -z "${SKIP_CHECKS:-}" ]; then export CHECKS="\"$PY\" -P benchmarks/x8_checks.py $CHECK_ARGS --out \"$OUT\""; else export CHECKS=; fi
export STEPS="${STEPS:-load:tp load:shift load:sp load:shift-threshold trace:tp trace:shift}"
export STEP_TIMEOUT="${STEP_TIMEOUT:-300}"
exec bash "$here/run_compare.sh"
