"""``h3serve video``: video jobs from a terminal, through ``H3Client`` (no server module, no torch).

h3serve video create --server URL --prompt TEXT [--watch] [-o clip.mp4]   submit; --watch: a live progress bar
h3serve video ls | get ID | wait ID | cancel ID | download ID -o FILE      the job's other calls
h3serve video remix ID --prompt TEXT | extend ID --prompt TEXT [--watch]   a new job from a completed one

The server is ``--server`` or ``$H3SERVE_SERVER``; its key, when it has one, ``$H3SERVE_API_KEY`` (or the variable
``--api-key-env`` names: a key is never a command-line argument, where ``ps`` shows it to everyone). ``--watch`` draws
one bar from the job's event stream (queue position and ETA, step k of n, decoding), then the download's. Ctrl-C
while watching asks whether to cancel the job; answering no (or no terminal to ask) leaves it running and says how
to pick it up again. A failed job exits 1 with its error; an API error prints the server's message and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

import httpx
from tqdm import tqdm

from h3serve.client.http import H3Client

SERVER_ENV, KEY_ENV = "H3SERVE_SERVER", "H3SERVE_API_KEY"
EXIT_FAILED, EXIT_INTERRUPTED = 1, 130  # 130: the shell's code for a command ended by Ctrl-C


class JobProgress:
    """One job's events drawn as one tqdm bar on ``out``: its description says where the job is (queued at position
    p, step, decoding), the bar counts steps, the postfix is the server's ETA."""

    def __init__(self, video_id: str, out: TextIO):
        self.bar = tqdm(desc="submitted", unit="step", file=out, dynamic_ncols=True, leave=True)
        self.video_id = video_id

    def update(self, event: dict[str, Any]) -> None:
        kind, data = event["event"], event["data"]
        done, total = (data.get("progress") or [None, None])[:2]
        if total and self.bar.total != total:
            self.bar.reset(total=total)
        if done is not None:
            self.bar.n = done
        if kind == "queued":
            position = data.get("position")
            # position 1: the next to start
            self.bar.set_description("queued" + (f" #{position}" if isinstance(position, int) else ""))
        elif kind in ("started", "step", "progress"):
            self.bar.set_description("step")
        elif kind == "decoding":
            self.bar.set_description("decoding")
        elif kind == "requeued":
            self.bar.write(
                f"{self.video_id}: its replica was lost ({data.get('reason')}); queued again, attempt "
                f"{data.get('attempt')} of {data.get('max_attempts')}"
            )
        eta = data.get("eta_s")
        self.bar.set_postfix_str(f"eta {eta:.0f}s" if isinstance(eta, (int, float)) else "", refresh=False)
        self.bar.refresh()

    def close(self, status: str) -> None:
        self.bar.set_description(status)
        self.bar.close()


def ask_to_cancel(video_id: str, out: TextIO) -> bool:
    """Ctrl-C while watching: ask on the terminal (no terminal: no, the job goes on). The question goes to ``out``
    (stderr), not stdout: stdout holds the job's id alone, often redirected by a script."""
    if not sys.stdin.isatty():
        return False
    print(f"\ncancel video job {video_id}? [y/N] ", end="", file=out, flush=True)
    try:
        answer = input()
    except (EOFError, KeyboardInterrupt):
        return False
    return answer.strip().lower() in ("y", "yes")


def watch(api: H3Client, video_id: str, output: str | None, out: TextIO) -> int:
    """Follow the job to its end with a progress bar, then download it to ``output``; the exit code."""
    progress = JobProgress(video_id, out)
    final: dict[str, Any] = {}
    try:
        for event in api.follow(video_id):
            progress.update(event)
            final = event
    except KeyboardInterrupt:
        progress.close("interrupted")
        if ask_to_cancel(video_id, out):
            job = api.cancel(video_id)
            print(f"{video_id}: {job['status']}", file=out)
        else:
            print(f"{video_id} goes on: `h3serve video wait {video_id}` follows it again", file=out)
        return EXIT_INTERRUPTED
    status = final.get("event", "unknown")
    progress.close(status)
    if status != "completed":
        print(f"{video_id}: {status}: {json.dumps(final.get('data', {}).get('error'))}", file=out)
        return EXIT_FAILED
    if output:
        download(api, video_id, output, out)
    return 0


def download(api: H3Client, video_id: str, output: str, out: TextIO, variant: str = "video") -> None:
    with tqdm(desc="download", unit="B", unit_scale=True, file=out, dynamic_ncols=True) as bar:

        def on_bytes(received: int, total: int | None) -> None:
            if total is not None and bar.total != total:
                bar.reset(total=total)
            bar.update(received - bar.n)

        size = api.download(video_id, output, on_bytes, variant)
    print(f"{output}: {size} bytes", file=out)


def request_body(ns: argparse.Namespace) -> dict[str, Any]:
    """The POST /v1/videos body from the flags given (the server's defaults for the rest)."""
    fields = {
        "prompt": ns.prompt,
        "seconds": ns.seconds,
        "size": ns.size,
        "num_inference_steps": ns.steps,
        "seed": ns.seed,
        "cache": ns.cache,
        "priority": ns.priority,
        "timeout_s": ns.timeout,
        "model": ns.model,
        "webhook": ns.webhook,
    }
    return {name: value for name, value in fields.items() if value is not None}


def run(ns: argparse.Namespace) -> int:
    server = ns.server or os.environ.get(SERVER_ENV)
    if not server:
        raise SystemExit(f"h3serve video: no server: pass --server URL or set {SERVER_ENV}")
    api_key = os.environ.get(ns.api_key_env) or None
    out = sys.stderr
    with H3Client(server, timeout=ns.http_timeout, api_key=api_key) as api:
        try:
            return dispatch(api, ns, out)
        except httpx.HTTPStatusError as error:
            print(f"h3serve video: {api_error(error.response)}", file=out)
            return EXIT_FAILED


def api_error(response: httpx.Response) -> str:
    """The server's error message (the API's error shape), or the status line when the body is not one."""
    try:
        error = response.json()["error"]
        field = f" ({error['param']})" if error.get("param") else ""
        return f"HTTP {response.status_code}: {error['message']}{field}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {response.status_code}: {response.text[:200]}"


def dispatch(api: H3Client, ns: argparse.Namespace, out: TextIO) -> int:
    if ns.action == "create":
        job = api.create_video(request_body(ns))
        print(job["id"])  # stdout: the id alone, for scripts (`id=$(h3serve video create ...)`)
        sys.stdout.flush()
        return watch(api, job["id"], ns.output, out) if ns.watch else 0
    if ns.action in ("remix", "extend"):
        fields = {"prompt": ns.prompt, "priority": ns.priority, "webhook": ns.webhook}
        if ns.action == "extend":
            fields.update(seconds=ns.seconds, seed=ns.seed, num_inference_steps=ns.steps)
        body = {name: value for name, value in fields.items() if value is not None}
        derive = api.remix_video if ns.action == "remix" else api.extend_video
        job = derive(ns.id, body)
        print(job["id"])
        sys.stdout.flush()
        return watch(api, job["id"], ns.output, out) if ns.watch else 0
    if ns.action == "ls":
        page = api.list_videos(limit=ns.limit, after=ns.after)
        for job in page["data"]:
            print(f"{job['id']}  {job['status']:<10} {job.get('progress', '')!s:>4}  {job.get('prompt', '')[:60]}")
        if page.get("has_more"):
            print(f"more: --after {page['last_id']}", file=out)
        return 0
    if ns.action == "get":
        print(json.dumps(api.video(ns.id), indent=2))
        return 0
    if ns.action == "cancel":
        print(json.dumps(api.cancel(ns.id), indent=2))
        return 0
    if ns.action == "download":
        download(api, ns.id, ns.output, out, ns.variant)
        return 0
    if ns.action == "wait":
        return watch(api, ns.id, ns.output, out)
    raise AssertionError(ns.action)


def add_commands(sub: argparse._SubParsersAction) -> None:
    """``h3serve video ...`` under the ``h3serve`` command's subparsers."""
    video = sub.add_parser("video", help="video jobs on a running server: create (--watch), ls, get, wait, cancel")
    video.set_defaults(func=lambda ns: sys.exit(run(ns)))
    actions = video.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help)
        p.add_argument("--server", help=f"the server's URL, with its route prefix (default: ${SERVER_ENV})")
        p.add_argument("--api-key-env", default=KEY_ENV, help=f"the variable holding the API key (default: {KEY_ENV})")
        p.add_argument("--http-timeout", type=float, default=600.0, help="seconds per HTTP call")
        return p

    p = action("create", "submit a video job; its id on stdout")
    p.add_argument("--prompt", required=True)
    p.add_argument("--seconds", type=float, help="clip length (default: the server's)")
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the model's canvas)")
    p.add_argument("--steps", type=int, help="num_inference_steps (default: the server's)")
    p.add_argument("--seed", type=int)
    p.add_argument("--cache", help="step-cache tier: off or one the server serves")
    p.add_argument("--priority", type=int)
    p.add_argument("--model", help="the model id, or MODEL:ADAPTER for a LoRA adapter (`GET /v1/models` lists them)")
    p.add_argument("--timeout", type=float, help="the job's deadline, seconds from now")
    p.add_argument("--webhook", help="a URL the server POSTs the finished job to, signed (see verify_webhook)")
    p.add_argument("--watch", action="store_true", help="follow it with a progress bar until it ends")
    p.add_argument("-o", "--output", help="with --watch: write the finished MP4 here")
    for name, help in (
        ("remix", "a new job: a completed one's seed and settings with a new prompt; its id on stdout"),
        ("extend", "a new job starting from a completed one's last frame, with a new prompt; its id on stdout"),
    ):
        p = action(name, help)
        p.add_argument("id", help="the completed source job")
        p.add_argument("--prompt", required=True)
        if name == "extend":
            p.add_argument("--seconds", type=float, help="the new clip's length (default: the source's)")
            p.add_argument("--seed", type=int, help="default: the source's")
            p.add_argument("--steps", type=int, help="num_inference_steps (default: the source's)")
        p.add_argument("--priority", type=int)
        p.add_argument("--webhook", help="a URL the server POSTs the finished job to, signed (see verify_webhook)")
        p.add_argument("--watch", action="store_true", help="follow it with a progress bar until it ends")
        p.add_argument("-o", "--output", help="with --watch: write the finished MP4 here")
    p = action("ls", "list video jobs, newest first")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--after", help="the last id of the previous page")
    for name, help in (("get", "a job as JSON"), ("cancel", "cancel a job")):
        action(name, help).add_argument("id")
    p = action("wait", "follow a job with a progress bar until it ends")
    p.add_argument("id")
    p.add_argument("-o", "--output", help="write the finished MP4 here")
    p = action("download", "download a finished job's MP4 (or an image of it), resuming a <output>.part")
    p.add_argument("id")
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--variant", default="video", choices=("video", "thumbnail", "spritesheet", "joined"))
