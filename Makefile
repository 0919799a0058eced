# One command to serve, one to test. Both set up .venv on first use.
PY      ?= python3
VENV    ?= .venv
# The CPU build pinned in .ci/torch-cpu.txt; on a CUDA box set TORCH=torch.
TORCH   ?= -r .ci/torch-cpu.txt
CONFIG  ?= deploy/serve_config.yaml
PYTEST_ARGS ?=

BIN := $(VENV)/bin

.PHONY: serve test test-fast lint setup weights bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml .ci/torch-cpu.txt | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/h3serve serve $(CONFIG)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# No Ray, no processes, no GPU: the library layers in well under a minute.
test-fast: setup
	$(BIN)/python -m pytest -m "not ray and not e2e and not slow and not gpu" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

weights: setup
	$(BIN)/h3serve weights

bench: setup
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
