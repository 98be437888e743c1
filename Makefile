# Two commands on a fresh machine: `make up` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= .cache/tiny-bench

CONFIG ?= configs/local.yaml

.PHONY: setup up down status demo test test-fast bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch that pip finds locally; a bare `torch` pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[engine,dev]'
	touch $@

setup: $(VENV)/.installed

$(MODEL_DIR)/config.json: | setup
	$(PY) -m disagg make-tiny-model $(MODEL_DIR) --size bench

up: setup
	$(VENV)/bin/disagg up $(CONFIG)

down: setup
	$(VENV)/bin/disagg down

status: setup
	$(VENV)/bin/disagg status

demo: setup $(MODEL_DIR)/config.json
	$(PY) -m disagg generate $(MODEL_DIR) --max-tokens 24

test: setup
	$(PY) -m pytest -q

# The suite without the end-to-end tests marked slow (tens of seconds each); CI runs them all.
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

bench: setup
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .cache
