#!/usr/bin/env bash
# benchmarks/decode_variants.py twice: plain, and with XLA's dynamic-slice fusion on.
set -uo pipefail
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
SHIM=$(mktemp -d)
mkdir -p "$SHIM/shiftjax"
for f in shiftjax/*; do ln -s "$PWD/$f" "$SHIM/shiftjax/"; done
for d in kernels layouts serving checkpoints; do ln -s "$PWD/$d" "$SHIM/shiftjax/$d"; done
export PYTHONPATH="$SHIM"
timeout 200 python3 -P benchmarks/decode_variants.py 2>&1 | tee "$OUT/decode_variants_plain.log"
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 200 python3 -P benchmarks/decode_variants.py 2>&1 | tee "$OUT/decode_variants_dsfusion.log"
