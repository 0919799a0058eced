import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Cluster:
    address: str  # the GCS address `h3serve serve --address` and `serve run --address` join
    metrics_port: int  # Ray's metrics export port, scraped for h3serve's counters


@pytest.fixture(scope="module")
def ray_cluster():
    """The one local Ray cluster of a test module: 2 CPUs as on CI, a logical GPU so GPU-shaped actors
    can be placed (and then fail closed on this CPU node), the dashboard for the state API, and a
    metrics export port that reports every second."""
    import ray
    from ray import serve

    from tests.harness import free_port, start_cluster

    metrics_port = free_port()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_metrics_report_interval_ms", "1000")  # counters reach the export port sooner
        address = start_cluster(metrics_port, logical_gpus=1)
    yield Cluster(address, metrics_port)
    serve.shutdown()
    ray.shutdown()
