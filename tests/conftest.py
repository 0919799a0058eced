import os
import tempfile
from pathlib import Path

import pytest

# Keep generated tiny checkpoints out of the user's home, shared by every test (and the Ray
# workers and subprocesses they start, which inherit the environment).
os.environ.setdefault("H3SERVE_CACHE", str(Path(tempfile.gettempdir()) / "h3serve-test-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The tiny preset with random weights in the released layout, written by h3serve's writer."""
    from pipelines.h3.checkpoint import random_tiny_checkpoint

    return random_tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_checkpoint):
    from pipelines.h3 import H3Pipeline

    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for one test module (2 CPUs, as on CI)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
