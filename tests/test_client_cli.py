"""`h3serve video` against the session's `h3serve serve` (its "cli" application, the default's args), as a user
runs it: the installed console script in a subprocess, and in a real terminal (tmux) for Ctrl-C."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import av
import httpx
import pytest

from h3serve.client import FINISHED
from tests.harness import H3SERVE, wait_for
from tests.served_apps import CLI_STEPS

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PROMPT = "a red circle moving left with a high beep"  # the README's


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def video(server, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "H3SERVE_SERVER": server.url}
    return subprocess.run(
        [*H3SERVE, "video", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def frames(path: Path) -> int:
    with av.open(str(path)) as container:
        return sum(1 for _ in container.decode(video=0))


def test_create_watch_writes_the_clip_and_the_other_commands_agree(server, tmp_path):
    out = tmp_path / "clip.mp4"
    run = video(server, "create", "--prompt", PROMPT, "--steps", "6", "--watch", "-o", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    video_id = run.stdout.strip()
    assert video_id.startswith("video_"), run.stdout
    # the bar, fed by the event stream: the job's 5 steps (6 grid points) counted to their end, then the download
    assert "step" in run.stderr and "5/5" in run.stderr and "download" in run.stderr, run.stderr[-2000:]
    assert frames(out) > 0

    listed = video(server, "ls", "--limit", "5")
    assert listed.returncode == 0 and video_id in listed.stdout and "completed" in listed.stdout, listed
    got = video(server, "get", video_id)
    assert got.returncode == 0 and '"status": "completed"' in got.stdout, got
    again = tmp_path / "again.mp4"
    downloaded = video(server, "download", video_id, "-o", str(again))
    assert downloaded.returncode == 0, downloaded.stderr
    assert again.read_bytes() == out.read_bytes()
    assert not list(tmp_path.glob("*.part")), "a finished download leaves no partial file"


def test_a_bad_request_prints_the_servers_error(server):
    run = video(server, "create", "--prompt", PROMPT, "--steps", "1")
    assert run.returncode == 1 and run.stdout == ""
    assert "HTTP 400" in run.stderr and "num_inference_steps" in run.stderr, run.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux: Ctrl-C goes through a real terminal")
def test_ctrl_c_while_watching_asks_and_cancels_the_job(server, tmp_path):
    """Ctrl-C in a real terminal (tmux: an interactive shell, the command typed at its prompt), answered y: the job
    is cancelled on the server and the command exits 130."""
    session, status_file = f"h3cli-{uuid.uuid4().hex[:8]}", tmp_path / "exit"
    command = (
        f"H3SERVE_SERVER={server.url} {H3SERVE[0]} video create --prompt '{PROMPT}' --steps {CLI_STEPS} --watch "
        f"> {tmp_path / 'id'}; echo $? > {status_file}"
    )
    # a tmux server of its own (-L): it starts with this process's environment, whatever other tmux servers run
    tmux = ["tmux", "-L", session]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMUX")}
    subprocess.run([*tmux, "new-session", "-d", "-x", "200", "-y", "20", "bash", "--norc", "-i"], check=True, env=env)
    subprocess.run([*tmux, "send-keys", command, "Enter"], check=True)
    try:

        def pane() -> str:
            return subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True, check=True).stdout

        def shown(pattern: str, timeout: float, what: str) -> None:
            try:
                wait_for(lambda: re.search(pattern, pane()), timeout, 0.2, what)
            except TimeoutError as error:
                raise AssertionError(f"{what} not shown; the terminal:\n{pane()}") from error

        shown(r"step: +\d+%", 120, "the job stepping under the bar")
        subprocess.run([*tmux, "send-keys", "C-c"], check=True)
        shown(r"\[y/N\]", 30, "the cancel question")
        subprocess.run([*tmux, "send-keys", "y", "Enter"], check=True)
        wait_for(status_file.exists, 30, 0.2, "the command's exit")
        assert status_file.read_text().strip() == "130", pane()
        video_id = (tmp_path / "id").read_text().strip()
        start = time.monotonic()
        job = wait_for(
            lambda: (j := httpx.get(f"{server.url}/v1/videos/{video_id}").json())["status"] in FINISHED and j,
            30,
            0.2,
            "the job's final status",
        )
        assert job["status"] == "cancelled", (job, pane(), time.monotonic() - start)
        assert "cancelled" in pane()
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
