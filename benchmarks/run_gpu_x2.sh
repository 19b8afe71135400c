#!/usr/bin/env bash
# Issue 8 on two H200s in one device call (kind nvidia-h200-x2): ceilings, correctness, the
# step table and the engine loop (benchmarks/shift_x2.py), each part in its own process
# so that one failure or timeout keeps the others' numbers; the part "tests" runs the two-GPU
# tests (tests/test_collectives_gpu.py; not a default part); the part "anatomy" names every kernel of the
# engine's TP decode step (benchmarks/decode_anatomy.py --tp 2; not a default part); the part "startup" is target 5,
# `serve`'s default ladder started cold and from the executable store (benchmarks/startup.py,
# GEMMs by $STARTUP_GEMM, default cublas; $STARTUP_PAGES KV-cache pages, 0: sized from memory as
# serve's default, default 4096).
#   COMMIT=<sha> bash benchmarks/run_gpu_x2.sh     # JSON + logs under $OUT; X2_ARGS: more shift_x2.py arguments
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on these shared hosts
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
for part in ${PARTS:-ceilings correct steps_mesh steps_1gpu engine startup}; do
  mkdir -p "$OUT/$part"
  if [ "$part" = tests ]; then  # the two-GPU tests (tests/conftest.py would make the devices CPUs)
    timeout "${PART_TIMEOUT:-240}" python3 -P -m pytest --noconftest -q -p no:cacheprovider tests/test_collectives_gpu.py \
      2>&1 | tee "$OUT/tests.log" | tail -5
    continue
  fi
  if [ "$part" = anatomy ]; then  # every kernel of the engine's TP decode step on both GPUs (GPU 0's table)
    timeout "${PART_TIMEOUT:-240}" python3 -P benchmarks/decode_anatomy.py --shape llama8b --tp 2 --sections anatomy \
      --seqs 8,64,8,64 --out "$OUT/anatomy" 2>&1 | tee "$OUT/anatomy.log" | grep "^\[anatomy\|^  by kind"
    continue
  fi
  if [ "$part" = startup ]; then
    timeout "${PART_TIMEOUT:-240}" python3 -P benchmarks/startup.py --model benchmarks/configs/Llama-3.1-8B \
      --load-format dummy --tokenizer benchmarks/configs/smollm2-tokenizer --dtype bfloat16 --sp 2 \
      --num-pages "${STARTUP_PAGES:-4096}" --token-buckets 16,64,128 --seq-buckets 8 --gemm "${STARTUP_GEMM:-cublas}" \
      --conditions "cold,executable store,executable store" --repeats 1 --out "$OUT/startup" 2>&1 \
      | tee "$OUT/startup.log" | grep -v "^WARNING\|^I0000\|^W0000"
    continue
  fi
  timeout "${PART_TIMEOUT:-240}" python3 -P benchmarks/shift_x2.py --parts "$part" --out "$OUT/$part" ${X2_ARGS:-} \
    2>&1 | tee "$OUT/$part.log" | grep -v "^WARNING\|^I0000\|^W0000"
done
