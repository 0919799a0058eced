"""Chaos on the served default (issue 54): kill -9 the processes a video job depends on, count what becomes of it.

    python -m benchmarks.chaos [--runs 2] [--json PATH]

One `h3serve serve` of h3serve/deploy/serve_config.yaml (the tiny CPU model, ``jobs.lease_s`` LEASE_S so a lost
ingress is noticed in seconds) on a fresh 2-CPU Ray cluster; each scenario ``--runs`` times, over real HTTP:

- ``replica``: two clips, one stepping and one waiting behind it (max_active 1), then kill -9 of the H3Replica;
- ``ingress``: one clip stepping, then kill -9 of the H3Ingress;
- ``retry``: a POST sent twice with one Idempotency-Key (a client retrying after a proxy timeout).

Every job is polled to its end. The table: runs, jobs, outcomes (completed, cancelled, failed by code), jobs
created (a retried POST must make one), and the time to recover: from the kill to the last of its jobs ending.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import uuid
from pathlib import Path

import httpx

from .harness import ServedConfig, cli, default_config, descendants, say, table

LEASE_S = 6
CLIP = {"prompt": "a long one", "seconds": 14, "num_inference_steps": 60}
FINAL = ("completed", "failed", "cancelled")


def actor_pid(kind: str) -> int:
    """The pid of this cluster's one Serve replica of deployment ``kind`` (its process title names it; the cluster is
    this process's own, started without a dashboard, so /proc rather than Ray's state API)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::ServeReplica:") and f":{kind}" in title:
            found.append(pid)
    (pid,) = found
    return pid


def poll(http: httpx.Client, video_id: str, until: str | tuple = FINAL, timeout_s: float = 600) -> dict:
    """The job once its status is in ``until`` (a restarting ingress may refuse a poll or two: retried)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            video = http.get(f"/v1/videos/{video_id}").json()
            if video.get("status") in until:
                return video
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"video job {video_id} not {until} within {timeout_s} s")


def submit(http: httpx.Client, body: dict, headers: dict | None = None) -> str:
    response = http.post("/v1/videos", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def stepping(http: httpx.Client, video_id: str) -> None:
    give_up = time.monotonic() + 300
    while http.get(f"/v1/videos/{video_id}").json()["progress"] < 5:
        if time.monotonic() > give_up:
            raise TimeoutError(f"video job {video_id} never stepped")
        time.sleep(0.2)


def kill(kind: str, http: httpx.Client, jobs: int) -> dict:
    ids = [submit(http, {**CLIP, "prompt": f"{kind} {i}"}) for i in range(jobs)]
    stepping(http, ids[0])
    os.kill(actor_pid(kind), signal.SIGKILL)
    killed = time.monotonic()
    videos = [poll(http, i) for i in ids]
    return {"videos": videos, "created": jobs, "recover_s": time.monotonic() - killed}


def retry(http: httpx.Client) -> dict:
    key, body = {"Idempotency-Key": uuid.uuid4().hex}, {**CLIP, "prompt": f"retried {uuid.uuid4().hex}"}
    first, again = (submit(http, body, key) for _ in range(2))
    started = time.monotonic()
    video = poll(http, first)
    listed = http.get("/v1/videos", params={"limit": 100}).json()["data"]
    created = sum(v["prompt"] == body["prompt"] for v in listed)
    assert again == first, (first, again)
    return {"videos": [video], "created": created, "recover_s": time.monotonic() - started}


SCENARIOS = {
    "replica": ("kill -9 H3Replica: one clip stepping, one waiting", lambda http: kill("H3Replica", http, 2)),
    "ingress": ("kill -9 H3Ingress: one clip stepping", lambda http: kill("H3Ingress", http, 1)),
    "retry": ("a POST retried with its Idempotency-Key", retry),
}


def outcomes(videos: list[dict]) -> str:
    counts: dict[str, int] = {}
    for v in videos:
        name = v["status"] if v["status"] != "failed" else f"failed:{(v.get('error') or {}).get('code')}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def run(args) -> dict:
    config = default_config(0)
    from h3serve.replicas.worker_group import free_port

    config["http_options"]["port"] = free_port()
    app = config["applications"][0]["args"]
    app["jobs"] = {"lease_s": LEASE_S, "store": f"/tmp/h3serve-chaos-{uuid.uuid4().hex}"}
    app["limits"]["max_steps"] = CLIP["num_inference_steps"]  # the default allows fewer
    results: dict[str, list[dict]] = {name: [] for name in SCENARIOS}
    with ServedConfig(config) as served, httpx.Client(base_url=served.url, timeout=60) as http:
        say(f"h3serve serve: up in {served.startup_s:.0f} s")
        for i in range(args.runs):
            for name, (what, scenario) in SCENARIOS.items():
                result = scenario(http)
                results[name].append(result)
                say(f"run {i + 1} {name}: {outcomes(result['videos'])} in {result['recover_s']:.1f} s ({what})")
    rows, out = [], {}
    for name, runs in results.items():
        videos = [v for r in runs for v in r["videos"]]
        times = [r["recover_s"] for r in runs]
        created = sum(r["created"] for r in runs)
        out[name] = {"runs": len(runs), "jobs": len(videos), "created": created, "recover_s": times}
        out[name]["outcomes"] = outcomes(videos)
        rows.append(
            [
                SCENARIOS[name][0],
                len(runs),
                len(videos),
                outcomes(videos),
                created,
                f"{statistics.median(times):.1f} ({max(times):.1f})",
            ]
        )
    table(["scenario", "runs", "jobs", "outcomes", "jobs created", "to recover, s: median (max)"], rows)  # prints it
    lost = [name for name, r in out.items() if "failed" in r["outcomes"] or r["created"] != r["jobs"]]
    return {"scenarios": out, "ok": not lost}


def options(ap) -> None:
    ap.add_argument("--runs", type=int, default=2, help="times each scenario runs (default 2)")


main = cli(__doc__, run, options)

if __name__ == "__main__":
    raise SystemExit(main())
