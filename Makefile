# One command to serve, one to test. Both set up .venv on first use.
PY      ?= python3
VENV    ?= .venv
# The CPU build pinned in .ci/torch-cpu.txt; on a CUDA box set TORCH=torch.
TORCH   ?= -r .ci/torch-cpu.txt
CONFIG  ?= h3serve/deploy/serve_config.yaml
PYTEST_ARGS ?=
EVAL_ARGS ?=
DEMO_CHECKPOINT ?= h3serve/pipelines/h3/checkpoints/minimax-h3-tiny-demo

BIN := $(VENV)/bin

.PHONY: serve test test-nodes test-fast lint setup weights eval demo-checkpoint readme-images screenshots bench k8s k8s-check clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml .ci/torch-cpu.txt | $(BIN)/python
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/h3serve serve $(CONFIG)

# --durations: the slowest tests and fixtures, printed on every run (tests/README.md: where the suite's time goes).
# -n: two workers (pytest-xdist), a test module or the session server's modules being one unit a worker takes
# whole (tests/conftest.py), in the order conftest sets: most of the suite is processes starting and waiting,
# which two workers overlap on two cores. TEST_WORKERS=0 runs it in one process.
# compileall first: every Ray worker, replica and subprocess the suite starts imports h3serve's packages, and where
# PYTHONDONTWRITEBYTECODE is set (the dev image sets it) each would compile them again (all of them: 1.5 s of CPU).
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m compileall -q h3serve benchmarks tools tests > /dev/null
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --durations=25 $(PYTEST_ARGS)

# the node layer on simulated nodes: autoscaling and a lost node (minutes; outside CI: docs/BENCHMARKS.md 14, 17)
test-nodes: setup
	CI= $(BIN)/python -m pytest -s tests/test_node_autoscaling.py tests/test_lost_node.py $(PYTEST_ARGS)

# No Ray, no processes, no GPU: the four packages' library layers, on two workers as `make test` (53 s here,
# 2026-12-05; issue 42's target is a minute). A test that starts a process is `slow`: `make test` runs it.
test-fast: setup
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope -m "not ray and not e2e and not slow and not gpu" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

weights: setup
	$(BIN)/h3serve weights

# Held-out scenes of the demo world (shape, colour, motion, sound) generated through the packing engine and
# judged per clip: an accuracy table per attribute. EVAL_ARGS="--checkpoint DIR --n 36 --json eval.json".
eval: setup
	$(BIN)/h3serve eval $(EVAL_ARGS)

# Train the tiny MiniMax-H3 on the demo world (both VAEs, then the transformer on the training split), on
# CPU with fixed seeds, into the built-in checkpoint the default config serves (replaced); its recipe, seeds and
# losses land in $(DEMO_CHECKPOINT)/training.json. ~45 min on 2 quiet cores.
demo-checkpoint: setup
	$(BIN)/python -m h3serve.demo.train $(DEMO_CHECKPOINT)

# The README's example prompts as the default server answers them (its checkpoint, default steps, seed 0):
# docs/images/readme-clip.png (a frame strip of the clip) and readme-still.png (the images endpoint's still).
readme-images: setup
	$(BIN)/python -m tools.readme_images --config $(CONFIG) --out docs/images

# The README's picture of the playground page (docs/images/playground.png): the browser test (Debian's chromium,
# headless) on a live server, its screenshot saved there.
screenshots: setup
	H3SERVE_SCREENSHOTS=docs/images $(BIN)/python -m pytest tests/test_events_http.py -k playground $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m benchmarks.run_all

# The RayServices' serveConfigV2 from their serve configs (k8s/generate.py: serve_config.gpu.yaml ->
# k8s/rayservice.yaml, serve_config.h100.yaml -> k8s/rayservice.h100.yaml); k8s-check fails with a diff when a
# committed manifest differs from what generate.py writes.
k8s: setup
	$(BIN)/python k8s/generate.py

k8s-check: setup
	$(BIN)/python k8s/generate.py --check

clean:
	rm -rf $(VENV) .pytest_cache
