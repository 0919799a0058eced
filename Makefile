# One command to serve, one to test. Both set up .venv on first use.
PY      ?= python3
VENV    ?= .venv
# A CPU build from this machine's wheel cache; on a CUDA box set TORCH=torch.
TORCH   ?= torch==2.13.0
CONFIG  ?= deploy/serve_config.yaml
PYTEST_ARGS ?=

BIN := $(VENV)/bin

.PHONY: serve test setup weights bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/h3serve serve $(CONFIG)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

weights: setup
	$(BIN)/h3serve weights

bench: setup
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) .pytest_cache
