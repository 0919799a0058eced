"""Helpers for tests that run h3serve the way a user does: a local Ray cluster, subprocesses, HTTP."""

import copy
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
H3SERVE = [str(BIN / "h3serve")]  # the installed console script, as users run it
SERVE = [str(BIN / "serve")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(metrics_port: int | None = None, logical_gpus: int = 0):
    """A local cluster for one test module. ``logical_gpus`` only lets GPU-shaped actors schedule."""
    import ray

    # the dashboard serves the state API (list_actors) that tests use to prove what never ran
    ray.init(num_cpus=2, num_gpus=logical_gpus, namespace="serve", include_dashboard=True, dashboard_port=free_port(),
             log_to_driver=False, _metrics_export_port=metrics_port)
    return ray.get_runtime_context().gcs_address


def default_config() -> dict:
    return yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())


def write_config(tmp_path: Path, config: dict, port: int, name: str = "config.yaml") -> Path:
    config = copy.deepcopy(config)
    config["http_options"]["port"] = port
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def h3serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*H3SERVE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


class ServeProcess:
    """`h3serve serve CONFIG --address ...` running in the background, like a user's terminal."""

    def __init__(self, config: Path, address: str, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(config.with_suffix(".log"), "w+")
        self.proc = subprocess.Popen([*H3SERVE, "serve", str(config), "--address", address], cwd=REPO,
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_serving(self, apps: int = 1, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.output().count("is serving at") >= apps:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"h3serve serve exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(1)
        raise TimeoutError(f"not serving after {timeout}s:\n{self.output()[-5000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def client(url: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=timeout)


def scrape(metrics_port: int) -> dict[str, list]:
    """Ray's metrics export endpoint, parsed with prometheus-client: name -> samples."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def wait_for(predicate, timeout: float, interval: float = 1.0, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not met within {timeout}s")
