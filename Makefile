# The two commands of the README: `make demo` and `make test`. Both set up .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-unit test-integration setup clean-venv bench

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -U pip==26.3
	# torch first: the CPU build (a bare `torch` would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c requirements/lock.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/sdpo run configs/demo.yaml

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

test-integration: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/integration -q

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/storage_bench.py

clean-venv:
	rm -rf $(VENV)
