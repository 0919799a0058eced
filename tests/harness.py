"""Helpers for tests that run h3serve the way a user does: a local Ray cluster, subprocesses, HTTP."""

import contextlib
import copy
import functools
import io
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import NoReturn

import httpx
import pytest
import yaml
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from h3serve.client import parse_events
from h3serve.replicas.worker_group import free_port as free_port  # the tests pick their ports with it

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
H3SERVE = [str(BIN / "h3serve")]  # the installed console script, as users run it
SERVE = [str(BIN / "serve")]
SCHEMATHESIS = [str(BIN / "schemathesis")]


def start_cluster(metrics_port: int | None = None, logical_gpus: int = 0):
    """A local cluster (the session's, ``conftest.SessionCluster``, or an ``own_cluster`` module's). ``logical_gpus``
    only lets GPU-shaped actors schedule."""
    import fcntl

    import ray

    from h3serve.pipelines.h3.paths import cache_dir

    cache_dir().mkdir(parents=True, exist_ok=True)
    # One start at a time on this machine: `make test`'s two workers each start a cluster, and the first local
    # ray.init() writes the token (~/.ray/auth_token) that every later cluster and CLI reads; two at once could
    # each write their own, and one cluster's `serve` subprocesses would then fail to authenticate.
    with open(cache_dir() / ".ray-start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # the dashboard serves the state API (list_actors) that tests use to prove what never ran; its port is
        # Ray's choice (8265 or the next free of 50), retried at bind time, unlike a port picked for it (CI saw one
        # taken)
        ray.init(
            num_cpus=2,
            num_gpus=logical_gpus,
            namespace="serve",
            include_dashboard=True,
            log_to_driver=False,
            _metrics_export_port=metrics_port,
        )
    return ray.get_runtime_context().gcs_address


def default_config() -> dict:
    return yaml.safe_load((REPO / "h3serve" / "deploy" / "serve_config.yaml").read_text())


def write_config(tmp_path: Path, config: dict, port: int, name: str = "config.yaml") -> Path:
    config = copy.deepcopy(config)
    config["http_options"]["port"] = port
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


# A transformer of other dims than the tiny preset's (4 heads of 32, 4 layers, hidden 96), as issue 43 tried it: the
# tiny writer's other components, so the checkpoint is consistent in itself and only ``model: auto`` names it.
FOREIGN_DIMS = dict(attention_head_dim=24, num_layers=3, hidden_size=64)


@functools.cache
def bomb_png() -> bytes:
    """A decompression bomb: a 32000x32000 PNG of ~125 kB (a blank 1-bit image compresses to almost nothing)."""
    return _png(Image.new("1", (32000, 32000)))


def truncated_png() -> bytes:
    """A 64x64 PNG cut before its last chunks: its header reads, its pixels do not."""
    data = _png(Image.new("RGB", (64, 64), (200, 30, 30)))
    return data[: len(data) - 20]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def h3serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*H3SERVE, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def h3serve_inline(*args: str) -> subprocess.CompletedProcess:
    """The same command run by ``h3serve.deploy.driver.cli.main`` in this process: its exit status, stdout and stderr as
    the console script's would be, without a new interpreter importing torch and diffusers again (~6 s a call). For
    commands that start nothing (admit, generate's refusals); what a process boundary shows stays with ``h3serve``."""
    import torch

    from h3serve.deploy.driver.cli import main

    out, err = io.StringIO(), io.StringIO()
    cwd, threads = os.getcwd(), torch.get_num_threads()  # generate and eval set torch's threads for the process
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(list(args))
        code = 0
    except SystemExit as e:  # as the interpreter ends: an int is the status, anything else is printed, status 1
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=err)
            code = 1
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["h3serve", *args], code, out.getvalue(), err.getvalue())


class ServeProcess:
    """`h3serve serve CONFIG --address ...` running in the background, like a user's terminal."""

    def __init__(self, config: Path, address: str, port: int, log_name: str | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(config.with_name(log_name) if log_name else config.with_suffix(".log"), "w+")
        self.proc = subprocess.Popen(
            [*H3SERVE, "serve", str(config), "--address", address],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

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


event_stream = parse_events  # text/event-stream -> [{"id", "event", "data"}]: the library client's reader


def error_of(response: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of ``response``, after checking its status and its exact shape."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    assert response.headers["content-type"] == "application/json", response.headers
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"], body
    error = body["error"]
    assert error["code"] == status and isinstance(error["message"], str) and error["message"]
    assert error["type"] == {504: "timeout"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    return error


def wait_video(
    http: httpx.Client, video_id: str, timeout: float = 180, headers: dict | None = None, prefix: str = ""
) -> dict:
    """Poll a video job until it is completed or failed; its progress values seen on the way in ``seen``."""
    seen = []

    def finished():
        response = http.get(f"{prefix}/v1/videos/{video_id}", headers=headers)
        assert response.status_code == 200, response.text
        job = response.json()
        seen.append(job["progress"])
        return job if job["status"] in ("completed", "failed") else None

    job = wait_for(finished, timeout=timeout, interval=0.2, what=f"video job {video_id}")
    return {**job, "seen": seen}


def requests_counted(metrics: int | dict[str, list], **labels: str) -> float:
    """ray_h3serve_requests_total summed over the series whose labels include ``labels``; ``metrics``: the export
    port, or one ``scrape`` of it (a scrape of the session cluster's port reads every module's series: a test that
    counts several label sets reads it once)."""
    samples = (scrape(metrics) if isinstance(metrics, int) else metrics).get("ray_h3serve_requests_total", [])
    return sum(s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items()))


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


def finished_video(api, video_id: str, timeout: float = 180):
    """The openai client's video job once it has finished (completed or failed), polled every half second."""
    return wait_for(
        lambda: (video := api.videos.retrieve(video_id)).status in ("completed", "failed") and video,
        timeout=timeout,
        interval=0.5,
        what=f"video job {video_id}",
    )


def serve_status():
    """``serve.status()``, never through a dead controller's handle: this process caches the controller it
    first reached, and a test that shut Serve down (in any process) leaves that handle pointing nowhere."""
    from ray import serve
    from ray.serve import context

    context._check_cached_client_alive()  # drops a dead controller's handle, so serve reconnects by name
    return serve.status()


def shutdown_serve() -> None:
    """``serve.shutdown()`` of whatever Serve instance the cluster runs, even one whose controller a subprocess
    (``h3serve serve`` on SIGTERM) already shut down."""
    from ray import serve
    from ray.serve import context

    context._check_cached_client_alive()
    serve.shutdown()


def serve_run_until_all_failed(config: Path, address: str, apps: list[str], timeout: float = 180) -> dict:
    """Plain `serve run CONFIG` (no h3serve pre-flight) on the cluster, once for all its applications: each of
    ``apps``' status (name -> status) once every one of them is DEPLOY_FAILED."""
    subprocess.run(
        [*SERVE, "run", str(config), "--non-blocking", "--address", address],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )

    def failed():
        statuses = serve_status().applications
        found = {app: statuses.get(app) for app in apps}
        return found if all(s is not None and s.status == "DEPLOY_FAILED" for s in found.values()) else None

    return wait_for(failed, timeout=timeout, what=f"DEPLOY_FAILED of {', '.join(apps)}")


# -- the playground's browser (test_events_http, test_api_http) -----------------------------------------------
CHROMIUM = ("chromium", "chromium-browser")
CHROMEDRIVER = "chromedriver"


def missing(reason: str) -> NoReturn:
    """A skip that says what is missing; a failure where the browser is required (CI: .ci/run installs it and sets
    H3SERVE_REQUIRE_BROWSER=1, so the browser test can never pass there by skipping)."""
    if os.environ.get("H3SERVE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"H3SERVE_REQUIRE_BROWSER=1 and {reason}")
    pytest.skip(reason)


def browser_or_skip():
    """A headless chromium under selenium (Debian's chromium and chromium-driver: playwright's own browser download
    cannot work here), or a skip that says what is missing (CI installs both: .ci/run)."""
    try:
        from selenium import webdriver
    except ImportError as e:
        missing(f"selenium is not installed ({e}): pip install -e '.[test]'")
    binary = next((path for name in CHROMIUM if (path := shutil.which(name))), None)
    driver = shutil.which(CHROMEDRIVER)
    if binary is None or driver is None:
        missing("Debian's chromium and chromium-driver are not installed: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",  # CI runs as root
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--autoplay-policy=no-user-gesture-required",  # play() with sound, as a click would allow
        "--mute-audio",
    ):
        options.add_argument(flag)
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def wait(driver, condition, timeout: float = 120, what: str = "condition"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d), message=what)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a killed child of the raylet lingers until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read (ESRCH)
        return False


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether process ``pid`` ends within ``timeout_s`` (a killed process takes a moment to release its memory)."""
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
