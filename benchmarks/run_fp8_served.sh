#!/usr/bin/env bash
# Issue 28 served on one H200 (benchmarks/fp8_served.py), in one device call:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#     .whl/*.whl && export PYTHONPATH=/tmp/site && DEPLOYMENTS=bf16,fp8,fp8_70b bash benchmarks/run_fp8_served.sh
# (.whl: bash benchmarks/device_wheels.sh, carried). Results under $OUT/served.
source "$(dirname "$0")/gpu_env.sh"
timeout "${SERVED_TIMEOUT:-560}" "$PY" -P benchmarks/fp8_served.py --deployments "${DEPLOYMENTS:-bf16,fp8,fp8_70b}" \
  --out "$OUT/served" > "$OUT/served.log" 2>&1
echo "served: exit $?"; grep -v "^W[0-9]" "$OUT/served.log" | grep -v "starting:" | tail -30
