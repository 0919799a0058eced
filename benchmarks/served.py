"""`h3serve serve` with the default config, as a user runs it, for the HTTP benchmarks; and the API's client side.

Not a benchmark of its own. The serve config is deploy/serve_config.yaml with only the HTTP port
changed (a free one on 127.0.0.1), and, in a checkout without the shipped demo checkpoint, the
checkpoint set to the tiny preset with random weights (same architecture, same cost). The command
joins this process's local Ray cluster (``--address``), so the driver can also reach the replica
through a Serve handle.
"""

from __future__ import annotations

import copy
import logging
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import ray
import yaml

from deploy.common.args import DeployArgs
from deploy.driver.cli import BUILDER, h3_apps, load_config
from replicas.worker_group import free_port

H3SERVE = str(Path(sys.executable).parent / "h3serve")  # the installed console script


def served_checkpoint() -> str | None:
    """What the default config serves: None (the shipped demo checkpoint) where it exists; else the tiny
    preset with random weights (the same architecture, so the same cost), which the config then names."""
    from pipelines.h3.checkpoint import CheckpointError, random_tiny_checkpoint, resolve_checkpoint

    try:
        resolve_checkpoint(None)
        return None
    except CheckpointError:
        return str(random_tiny_checkpoint())


def default_args() -> DeployArgs:
    """The args of the default config's one H3 application (limits.default_steps, engine bounds...)."""
    ((_, args),) = h3_apps(load_config(None))
    return DeployArgs.model_validate(args)


class ServedConfig:
    """`h3serve serve CONFIG --address <this cluster>` until ``apps`` applications serve; a context manager.

    Joins the caller's Ray session when there is one (it must be in namespace "serve", where `h3serve serve`
    deploys, for the caller's handles to reach the replicas); else starts a local cluster of ``num_cpus`` CPUs
    (None: all of this node's, and its GPUs)."""

    def __init__(self, config: dict, apps: int = 1, startup_timeout_s: float = 300.0, num_cpus: int | None = 2):
        self.config, self.apps, self.timeout, self.num_cpus = config, apps, startup_timeout_s, num_cpus
        self.dir = tempfile.TemporaryDirectory(prefix="h3serve-bench-")
        self.started_ray = False
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config['http_options']['port']}"  # every config here serves on 127.0.0.1

    def __enter__(self):
        if not ray.is_initialized():  # Serve's controller lives in namespace "serve", where `h3serve serve` puts it
            ray.init(
                num_cpus=self.num_cpus,
                namespace="serve",
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self.started_ray = True
        elif ray.get_runtime_context().namespace != "serve":
            raise RuntimeError(
                "the caller's Ray session must be in namespace 'serve' (where `h3serve serve` "
                "deploys) for this process to reach the replicas through handles"
            )
        path = Path(self.dir.name) / "serve_config.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.log = open(path.with_suffix(".log"), "w+")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [H3SERVE, "serve", str(path), "--address", ray.get_runtime_context().gcs_address],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        while self.output().count("is serving at") < self.apps:
            if self.proc.poll() is not None or time.perf_counter() - started > self.timeout:
                text = self.output()[-4000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"h3serve serve did not start its {self.apps} application(s):\n{text}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - started
        return self

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the command shuts Serve down on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # the command shut Serve down (its controller is gone): forget this driver's cached controller client, or
        # the next Serve app in this Ray session is looked up through the dead one (ActorDiedError)
        from ray.serve.context import _disconnect

        _disconnect()
        if self.started_ray:
            ray.shutdown()
        self.log.close()
        self.dir.cleanup()


class ServedDefault(ServedConfig):
    """`h3serve serve deploy/serve_config.yaml` on a free port of 127.0.0.1 (see the module's docstring)."""

    def __init__(self, startup_timeout_s: float = 300.0):
        self.port, self.checkpoint = free_port(), served_checkpoint()
        config = copy.deepcopy(load_config(None))
        config["http_options"].update(host="127.0.0.1", port=self.port)
        if self.checkpoint is not None:  # no shipped demo checkpoint in this checkout
            for app in config["applications"]:
                if app.get("import_path") == BUILDER:
                    app["args"]["checkpoint"] = self.checkpoint
        super().__init__(config, 1, startup_timeout_s)

    def __enter__(self) -> ServedDefault:
        return super().__enter__()


def video_job(http: httpx.Client, body: dict, poll_s: float = 0.05, timeout_s: float = 600.0) -> tuple[dict, bytes]:
    """POST /v1/videos, poll the job until it finishes, GET its MP4, DELETE it: (final job object, MP4 bytes)."""
    response = http.post("/v1/videos", json=body)
    response.raise_for_status()
    video_id, deadline = response.json()["id"], time.perf_counter() + timeout_s
    while True:
        job = http.get(f"/v1/videos/{video_id}").raise_for_status().json()
        if job["status"] in ("completed", "failed") or time.perf_counter() > deadline:
            break
        time.sleep(poll_s)
    if job["status"] != "completed":
        raise RuntimeError(f"video job {video_id} ended {job['status']}: {job.get('error')}")
    mp4 = http.get(f"/v1/videos/{video_id}/content").raise_for_status().content
    http.delete(f"/v1/videos/{video_id}").raise_for_status()
    return job, mp4
