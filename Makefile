# `make demo` and `make test` each do the complete set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch==2.13.0 is the CPU build on these machines; a looser pin pulls a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
JOBS ?= auto
DTYPE ?= float32,bfloat16,float16,int64,bool
VARIANTS ?= contiguous,transposed,sliced,expanded,offset,channels_last
CONFORMANCE_JOBS ?= 2

.PHONY: setup demo test lint bench conformance clean

setup: $(VENV)/.ember-installed

$(VENV)/.ember-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev,bench]"
	touch $@

# The demo needs ember and torch only: a venv made by `make demo` alone holds no dev or bench
# extras (no Triton, no transformers); `make test` adds them to the same venv.
$(VENV)/.ember-demo-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e .
	touch $@

demo: $(VENV)/.ember-demo-installed
	$(PY) -m ember.cli demo

test: setup lint
	EMBER_STRICT=1 $(PY) -m pytest -n $(JOBS) tests

lint: setup
	$(VENV)/bin/ruff check ember tests benchmarks
	$(VENV)/bin/ruff format --check ember tests benchmarks
	$(VENV)/bin/mypy ember/uop ember/codegen ember/renderer

bench: setup
	$(PY) -m benchmarks.run

# The OpInfo sweep: every op_db entry, every sample, in every layout and dtype, through ember vs
# eager; prints mismatches, errors, crashes, fallbacks and totals per dtype. Hours on 2 cores:
# CONFORMANCE_ARGS="--results /tmp/sweep.jsonl" resumes, "--slice 0/4" runs a quarter of the ops.
conformance: setup
	$(PY) -m tests.conformance --dtype $(DTYPE) --variants $(VARIANTS) --jobs $(CONFORMANCE_JOBS) $(CONFORMANCE_ARGS)

clean:
	rm -rf $(VENV) ember_debug .pytest_cache
