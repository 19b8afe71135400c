#!/usr/bin/env bash
# Issue 29 served, in ONE device call: this tree's `shiftjax serve` (8B shape, dummy weights)
# under `bench compare` with the same random prompts without and with a JSON schema, at 1 and
# 64 concurrent, twice (benchmarks/configs/compare/h200_structured_*.json).
#   bash benchmarks/device_wheels.sh                         # here; carry .whl
#   bash benchmarks/run_structured_served.sh                 # on the H200 (PYTHONPATH=/tmp/site with the wheels)
#   DRY_RUN=1 PREFIX=cpu_structured OUT=/tmp/s bash benchmarks/run_structured_served.sh   # the mechanism on the CPU
set -uo pipefail
cd "$(dirname "$0")/.."
shim=/tmp/shiftjax_shim_after  # this tree importable under its installed names (as run_before_after.sh)
rm -rf "$shim"; mkdir -p "$shim/shiftjax"
for f in "$PWD"/shiftjax/*; do ln -s "$f" "$shim/shiftjax/"; done
for d in kernels layouts serving checkpoints; do ln -s "$PWD/$d" "$shim/shiftjax/$d"; done
COMPARE_ARGS="${COMPARE_ARGS:---tokenizer benchmarks/configs/smollm2-tokenizer}" PREFIX="${PREFIX:-h200_structured}" \
  STEPS="${STEPS:-all:after all:after-2}" TOTAL="${TOTAL:-$((570 - SECONDS))}" bash benchmarks/run_compare.sh
