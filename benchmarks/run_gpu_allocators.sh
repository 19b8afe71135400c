#!/usr/bin/env bash
# Issue 8, target 4 on one GPU (kind nvidia-h200): the engine's TP decode loop for one GPU's
# share of the 8B model over two (decode_anatomy.py --shape tp2_shard), each phase twice,
# in one process per allocator and command-buffer update mode: JAX's default (BFC) allocator;
# XLA_PYTHON_CLIENT_ALLOCATOR=vmm; vmm with SKIP_TEMP and, where this XLA has the flag, VA
# remapping (stable temporary addresses for the step's CUDA graph). Whether XLA knows the flags
# is read from its plugin's strings first (an unknown flag in XLA_FLAGS is fatal).
#   bash benchmarks/run_gpu_allocators.sh           # JSON and logs under $OUT
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
SITE=$("$PY" -c "import jax, os; print(os.path.dirname(os.path.dirname(jax.__file__)))")
for flag in xla_gpu_command_buffer_update_mode xla_gpu_enable_command_buffer_va_remapping; do
  found=$(find "$SITE" -name "*.so" \( -path "*jax*plugin*" -o -path "*jaxlib*" \) -exec strings {} \; 2>/dev/null | grep -c "^$flag")
  echo "$flag: $found" | tee -a "$OUT/flags.txt"
done
REMAP=""
if grep -q "va_remapping: [1-9]" "$OUT/flags.txt"; then REMAP=" --xla_gpu_enable_command_buffer_va_remapping=true"; fi
ARGS=(--shape tp2_shard --seqs "${SEQS:-8,64,8,64}" --sections anatomy --out)
run() {  # name, then the environment
  local name=$1; shift
  env "$@" timeout "${PART_TIMEOUT:-150}" "$PY" -P benchmarks/decode_anatomy.py "${ARGS[@]}" "$OUT/$name" 2>&1 \
    | grep -v "^WARNING\|^I0000\|^W0000" > "$OUT/$name.log"
  echo "$name: exit ${PIPESTATUS[0]}"; grep "^\[anatomy" "$OUT/$name.log"
}
run default XLA_PYTHON_CLIENT_ALLOCATOR=default
run vmm XLA_PYTHON_CLIENT_ALLOCATOR=vmm
run vmm_skip_temp XLA_PYTHON_CLIENT_ALLOCATOR=vmm "XLA_FLAGS=--xla_gpu_command_buffer_update_mode=SKIP_TEMP$REMAP"
