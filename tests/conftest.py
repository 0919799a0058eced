import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import pytest

# Keep generated tiny checkpoints out of the user's home, shared by every test (and the Ray
# workers and subprocesses they start, which inherit the environment).
os.environ.setdefault("H3SERVE_CACHE", str(Path(tempfile.gettempdir()) / "h3serve-test-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# A replica whose constructor refuses (the fail-closed tests) is tried once, not three times, before Serve calls its
# deployment failed: each try is a process importing torch (~7 s on 2 cores), and the refusal is the same every time.
# The Serve controller reads it; the clusters the tests start inherit this environment.
os.environ.setdefault("RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT", "1")
# OpenMP threads that finish a parallel region sleep rather than spin: the suite runs many torch processes at once
# on 2 cores (its two workers, replicas, gloo ranks), and a spinning thread holds a core another process needs. Read
# by libgomp when torch loads it, here and in every process the tests start (they inherit the environment).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One torch thread per test process (and the subprocesses it starts; Ray sets its workers' own from their CPUs): two
# workers already fill the 2 cores, and a second thread each only adds waits. `make test-fast` took 116 s of CPU
# with one thread each, against 130-136 s with two, and no longer on the wall (tests/README.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray's log monitor (it forwards workers' output to drivers) globs the session's log directory every 0.1 s, and that
# holds hundreds of worker logs by mid-suite. The session's drivers take no worker output (log_to_driver=False) and
# tests read only h3serve's own lines from a server's output, so it looks for new files every 5 s instead: with ~370
# log files its CPU was 3.6 s a minute before, 1.2 s after (tests/README.md). Every cluster the tests start reads it.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "5")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """torch's thread count as it was before each test: a test that runs a CLI or the training recipe in process sets
    it for the whole worker, and a CPU kernel's sums depend on it (the audio VAE's last bits differ between 1 and 2
    threads), so a later test comparing its decode with a one-thread replica's failed depending on the test order."""
    torch = sys.modules.get("torch")  # never imported here: the ingress tests check that torch stays out
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if before is None:  # torch loaded during the test: the count it started with, from OMP_NUM_THREADS above
        before = int(os.environ["OMP_NUM_THREADS"])
    if torch is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The tiny preset with random weights in the released layout, written by h3serve's writer."""
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint

    return random_tiny_checkpoint()


@pytest.fixture(scope="session")
def vaes(tiny_checkpoint):
    """The tiny checkpoint's video VAE in fp32 and bf16, by dtype (the decode tests' tiles, chunks and streams)."""
    import torch

    from h3serve.pipelines.h3 import checkpoint as ckpt

    index = ckpt.CheckpointIndex(tiny_checkpoint)
    return {dtype: ckpt.load_model(index, "vae", dtype, "cpu") for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="session")
def tiny_pipeline(tiny_checkpoint):
    from h3serve.pipelines.h3 import H3Pipeline

    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa")


@dataclasses.dataclass(frozen=True)
class Cluster:
    address: str  # the GCS address `h3serve serve --address` and `serve run --address` join
    metrics_port: int  # Ray's metrics export port, scraped for h3serve's counters


class SessionCluster:
    """The one local Ray cluster of the test session (of each xdist worker), started on first use (~5-10 s a start).

    2 CPUs as on CI, a logical GPU so GPU-shaped actors can be placed (and then fail closed on this CPU node), the
    dashboard for the state API, and a metrics export port that reports every second. Modules share it; each
    leaves it as it found it (the Serve apps it ran shut down: ``_serve_apps_end_with_their_module``). A module
    marked ``own_cluster`` starts and restarts clusters of its own: the session's is stopped before it and
    started again by the next module that asks for it (``ray_cluster`` is asked for per module).
    """

    def __init__(self):
        self.cluster: Cluster | None = None
        self.served = None  # the session's `h3serve serve` on it (``served``), a ServeProcess once started

    def get(self) -> Cluster:
        if self.cluster is None:
            from tests.harness import free_port, start_cluster

            metrics_port = free_port()
            with pytest.MonkeyPatch.context() as env:
                env.setenv("RAY_metrics_report_interval_ms", "1000")  # counters reach the export port sooner
                address = start_cluster(metrics_port, logical_gpus=1)
            self.cluster = Cluster(address, metrics_port)
        return self.cluster

    def stop_served(self) -> None:
        """The session's server, stopped (``served``); the cluster goes on."""
        if self.served is not None:
            self.served.stop()
            self.served = None

    def stop(self) -> None:
        import ray
        from ray import serve

        self.stop_served()
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        self.cluster = None


SESSION_CLUSTER = SessionCluster()


@pytest.fixture(scope="module")
def ray_cluster() -> Cluster:
    """The session's local Ray cluster (``SessionCluster``): asked for per module, so a module that runs after an
    ``own_cluster`` one (which stopped it) gets it started again rather than a stopped cluster's address."""
    return SESSION_CLUSTER.get()


@pytest.fixture(scope="session")
def served(request, tiny_checkpoint, tmp_path_factory):
    """The session's one `h3serve serve` (``tests/served_apps.py``), with the applications of the collected modules
    that use it. Those modules run together (one xdist unit, ``pytest_xdist_make_scheduler``); the server stops
    when the last of them ends (``ServedApps.module``), so the modules after them find a cluster without it."""
    from tests import served_apps
    from tests.harness import ServeProcess, free_port, write_config

    cluster = SESSION_CLUSTER.get()
    modules = sorted({module_name(item.nodeid) for item in request.session.items} & set(served_apps.APPS))
    tmp = tmp_path_factory.mktemp("served")
    config, owners = served_apps.serve_config(modules, served_apps.Inputs(tmp, tiny_checkpoint))
    port = free_port()
    process = ServeProcess(write_config(tmp, config, port), cluster.address, port)
    SESSION_CLUSTER.served = process  # stopped before the cluster is
    process.wait_serving(apps=len(config["applications"]), timeout=600)
    return served_apps.ServedApps(
        process, config, owners, tmp / "videos", cluster.metrics_port, SESSION_CLUSTER.stop_served
    )


@pytest.fixture(scope="module", autouse=True)
def _serve_apps_end_with_their_module(request):
    """A module's Serve apps (and its ``h3serve serve`` processes' leftovers) go with it; the cluster stays, and so
    does the session's server (``served``), whose modules delete their own applications. A module marked
    ``own_cluster`` finds no session cluster connected (it runs ``ray.init`` itself)."""
    if request.node.get_closest_marker("own_cluster") is not None:
        SESSION_CLUSTER.stop()
    yield
    import sys

    if "ray" in sys.modules and SESSION_CLUSTER.served is None:
        import ray

        if ray.is_initialized():
            from tests.harness import shutdown_serve

            shutdown_serve()


PROCESS_MARKS = ("ray", "e2e", "slow")  # a module with one of these starts clusters, servers or subprocesses
MODEL_FIXTURES = {"tiny_checkpoint", "tiny_pipeline"}  # a module using one (even through another fixture) loads a model


def module_name(nodeid: str) -> str:
    """``tests/test_x.py::test_y[param]`` -> ``test_x``."""
    return Path(nodeid.split("::", 1)[0]).stem


def pytest_collection_modifyitems(config, items):
    """The order the modules run in: those on the session's server (``served``) first and together (under xdist they
    are one unit, the longest), then the modules that start processes, then the library modules that load a model,
    then those that load none (the shortest: under xdist they fill the tail, so both workers end together),
    ``own_cluster`` modules last (they stop the session's cluster; a module after one would start it again). A
    module's tests stay together and in their order."""
    from tests.served_apps import APPS as SERVED_MODULES

    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(module_name(item.nodeid), []).append(item)

    def rank(name: str) -> int:
        if name in SERVED_MODULES:
            return 0
        if any(item.get_closest_marker("own_cluster") for item in modules[name]):
            return 4
        if any(item.get_closest_marker(mark) for item in modules[name] for mark in PROCESS_MARKS):
            return 1
        return 2 if any(MODEL_FIXTURES.intersection(item.fixturenames) for item in modules[name]) else 3

    items[:] = [item for name in sorted(modules, key=rank) for item in modules[name]]  # sorted is stable


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s two workers (pytest-xdist) take whole units, in the order above: a module (its module fixtures
    made once), or all the modules on the session's server together (so one worker starts that server, once)."""
    from xdist.scheduler import LoadScopeScheduling

    from tests.served_apps import APPS as SERVED_MODULES

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = module_name(nodeid)
            return "served" if module in SERVED_MODULES else module

    config.option.loadscopereorder = False  # the units go out in collection order (``pytest_collection_modifyitems``)
    return ModuleUnits(config, log)


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
    if SESSION_CLUSTER.served is not None:
        SESSION_CLUSTER.served.stop()
    if "ray" in sys.modules:
        import ray

        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
