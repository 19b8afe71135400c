# Sourced by the run_gpu_*.sh scripts on the device machine: unbuffered output, $OUT, the
# repository root as working directory, and the checkout's folders importable under their
# installed names (shiftjax.kernels is kernels/, ...) without installing: a shim package of
# symlinks on PYTHONPATH. Run python as `python3 -P` so the checkout's own shiftjax/ folder
# does not shadow the shim. JAX_PLATFORMS and PY (the interpreter) may be set beforehand:
# the CPU smoke test runs the same scripts with JAX_PLATFORMS=cpu PY=.venv/bin/python.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
PY="${PY:-python3}"
OUT="${OUT:-./bench_out}"
mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SHIM=$(mktemp -d)
mkdir -p "$SHIM/shiftjax"
for f in shiftjax/*; do ln -s "$PWD/$f" "$SHIM/shiftjax/"; done
for d in kernels layouts serving checkpoints; do ln -s "$PWD/$d" "$SHIM/shiftjax/$d"; done
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
