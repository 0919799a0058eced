"""Loading is offline by construction (local_files_only on every from_pretrained), not by a process-wide switch."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import os, sys
import h3serve.pipelines.h3.checkpoint as checkpoint
assert "HF_HUB_OFFLINE" not in os.environ, "importing h3serve changed the process's environment"
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
pipeline = H3Pipeline.load(sys.argv[1], "torch_sdpa")
media = pipeline.generate(GenerationRequest(prompt="x", width=64, height=64, num_inference_steps=2))
assert "HF_HUB_OFFLINE" not in os.environ
print("frames", media.frames.shape)
"""


@pytest.mark.slow  # a fresh interpreter imports the model libraries and loads (`make test-fast` leaves it out)
def test_import_leaves_the_environment_alone_and_loading_never_reaches_a_hub(tiny_checkpoint):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # Any hub request would go to a closed local port and fail at once, instead of being switched off.
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_checkpoint)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "frames (124, 64, 64, 3)" in done.stdout
