# Sourced by run_gpu.sh: unbuffered output, $OUT, the repository root as working directory
# and on PYTHONPATH. An uninstalled checkout imports as the installed package does
# (shiftjax/__init__.py adds the root to the package's search path: shiftjax.kernels is
# kernels/, ...). JAX_PLATFORMS and PY (the interpreter) may be set beforehand: SMOKE=1 runs
# the same scripts with JAX_PLATFORMS=cpu PY=.venv/bin/python.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
PY="${PY:-python3}"
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
