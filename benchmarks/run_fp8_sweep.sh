#!/usr/bin/env bash
# One device call: tile variants of the FP8 GEMM kernels (benchmarks/fp8_gemm_bench.py --sweep)
# on every Llama-3.1-8B projection at 16, 64 (w8a16: Mosaic GPU and Triton) and 4,096 tokens
# (w8a8), with the stream and FP8 rates; then the 70B projections at 16 tokens (their fractions
# use the first run's stream rate); then the Triton kernel's GPU tests. Under $OUT/{8b,70b}.
#   bash benchmarks/run_fp8_sweep.sh          # on the H200
# SWEEP_MS: the 8B token counts (default 16,64,4096); SWEEP_70B_ONLY: a regular expression of the
# 70B implementations to run (default all); SWEEP_TESTS=0 skips the GPU tests.
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvidia_smi.txt"
timeout "${SWEEP_8B_TIMEOUT:-330}" $PY -P benchmarks/fp8_gemm_bench.py --sweep --ms "${SWEEP_MS:-16,64,4096}" \
  --shapes 8b.qkv,8b.o,8b.gate_up,8b.down --deadline-s 300 --out "$OUT/8b" > "$OUT/8b.log" 2>&1
echo "8b rc=$?"
timeout "${SWEEP_70B_TIMEOUT:-150}" $PY -P benchmarks/fp8_gemm_bench.py --sweep --no-ceilings --ms 16 \
  --shapes 70b.qkv,70b.o,70b.gate_up,70b.down --deadline-s "${SWEEP_70B_DEADLINE_S:-120}" \
  --only "${SWEEP_70B_ONLY:-}" --out "$OUT/70b" > "$OUT/70b.log" 2>&1
echo "70b rc=$?"
[ "${SWEEP_TESTS:-1}" = 0 ] || timeout "${TEST_TIMEOUT:-70}" $PY -P -m pytest --noconftest -q -p no:cacheprovider tests/test_fp8_gemm.py -m gpu \
  -k "triton or w8a8_kernel_matches" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
echo "pytest rc=$?"
grep -v "^W[0-9]" "$OUT/8b.log" | tail -60
