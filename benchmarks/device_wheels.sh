#!/usr/bin/env bash
# Wheels the lent GPU machines lack, for the servers that bench compare starts there: their image
# has grpcio and protobuf, but not grpcio-health-checking / grpcio-reflection, and its protobuf may
# be older than the one this repository's generated gRPC code was made with (gencode 7.35), and
# it has no llguidance (structured outputs) and no gguf (the default model's import). The
# versions are this repository's own (pip list in .venv). Run here, in the repository root; then
# name ".whl" in the device call's carry and start its command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site && ...
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 llguidance==1.9.1 gguf==0.19.0
ls -la .whl
