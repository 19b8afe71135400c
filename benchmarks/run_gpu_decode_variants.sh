#!/usr/bin/env bash
# benchmarks/decode_variants.py twice: plain, and with XLA's dynamic-slice fusion on.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
timeout 200 python3 -P benchmarks/decode_variants.py 2>&1 | tee "$OUT/decode_variants_plain.log"
XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true timeout 200 python3 -P benchmarks/decode_variants.py 2>&1 \
  | tee "$OUT/decode_variants_dsfusion.log"
