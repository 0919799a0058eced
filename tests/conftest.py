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


_exit_status = 0


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without native teardown once the results are reported.

    Tests break gloo process groups and kill or freeze their peers on purpose from this process; the
    native objects left behind (gloo pairs, Ray's core worker) are destroyed by static destructors at
    interpreter exit, which crashed CI once after every test had passed. What is worth tearing down is
    torn down here, while the interpreter is whole, then the process exits with pytest's own status.
    """
    import sys

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # a broken group may refuse; the process is leaving anyway
        print(f"conftest: process group teardown failed: {e}", file=sys.stderr)
    if "ray" in sys.modules:
        import ray

        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
