"""Chaos on the served default (issue 54): kill -9 the processes a video job depends on, count what becomes of it.

    python -m benchmarks.chaos [--runs 2] [--json PATH]

One `h3serve serve` of h3serve/deploy/serve_config.yaml (the tiny CPU model, ``jobs.lease_s`` LEASE_S so a lost
ingress is noticed in seconds) on a fresh 2-CPU Ray cluster; each scenario ``--runs`` times, over real HTTP:

- ``replica``: two clips, one stepping and one waiting behind it (max_active 1), then kill -9 of the H3Replica;
- ``ingress``: one clip stepping, then kill -9 of the H3Ingress;
- ``retry``: a POST sent twice with one Idempotency-Key (a client retrying after a proxy timeout);
- ``update``: one clip stepping, then an in-place update (Serve's deploy of the same config with the ingress's
  ``limits`` changed: Serve rebuilds the application and rolls every replica);
- ``other``: two clips, their status, cancel (of the first) and event streams asked of another ingress replica of the
  application: this process's own ``VideoJobs`` over the same store, the code an ``H3Ingress`` replica runs for jobs.

Every job is polled to its end. The table: runs, jobs, outcomes (completed, cancelled, failed by code), jobs
created (a retried POST must make one), event streams read that ended with the record's final status (over HTTP,
resumed with Last-Event-ID after a break as an EventSource does; and on the other replica), and the time to
recover: from the kill, the update or the cancel to the last of its jobs ending. A lost node (the replica and one of
two ingress replicas on it) needs a cluster of two nodes: ``benchmarks/chaos_node.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from h3serve.client import parse_events

from .harness import ServedConfig, cli, default_config, descendants, say, table

LEASE_S = 6
CLIP = {"prompt": "a long one", "seconds": 14, "num_inference_steps": 60}
FINAL = ("completed", "failed", "cancelled")


def actor_pids(kind: str) -> list[int]:
    """The pids of this cluster's Serve replicas of deployment ``kind`` (its process title names it; the cluster is
    this process's own, started without a dashboard, so /proc rather than Ray's state API)."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if title.startswith("ray::ServeReplica:") and f":{kind}" in title:
            found.append(pid)
    return found


def actor_pid(kind: str) -> int:
    (pid,) = actor_pids(kind)
    return pid


def settled(timeout_s: float = 300) -> None:
    """Wait until one replica of each deployment runs (an update's old replicas have stopped)."""
    give_up = time.monotonic() + timeout_s
    while not all(len(actor_pids(kind)) == 1 for kind in ("H3Replica", "H3Ingress")):
        if time.monotonic() > give_up:
            raise TimeoutError("the update's old replicas did not stop")
        time.sleep(0.5)


def read_stream(url: str, video_id: str, timeout_s: float = 600) -> list[dict]:
    """The job's event stream over HTTP to its final event, reconnecting with Last-Event-ID after a break (an
    ingress stopping or restarting under it), as an EventSource does."""
    events: list[dict] = []
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        headers = {"Last-Event-ID": str(events[-1]["id"])} if events and events[-1]["id"] is not None else {}
        text = ""
        try:
            with (
                httpx.Client(base_url=url, timeout=120) as http,
                http.stream("GET", f"/v1/videos/{video_id}/events", headers=headers) as response,
            ):
                if response.status_code == 200:
                    for chunk in response.iter_text():
                        text += chunk
        except httpx.HTTPError:
            pass
        events += parse_events(text)
        if events and events[-1]["event"] in FINAL:
            return events
        time.sleep(1)
    raise TimeoutError(f"the event stream of {video_id} did not end within {timeout_s} s")


def ended_with(events: list[dict], video: dict) -> bool:
    return bool(events) and events[-1]["event"] == video["status"] == events[-1]["data"]["video"]["status"]


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
    with ThreadPoolExecutor(jobs) as pool:
        streams = [pool.submit(read_stream, str(http.base_url), i) for i in ids]
        os.kill(actor_pid(kind), signal.SIGKILL)
        killed = time.monotonic()
        videos = [poll(http, i) for i in ids]
        recover_s = time.monotonic() - killed
        ended = sum(ended_with(s.result(), v) for s, v in zip(streams, videos, strict=True))
    return {"videos": videos, "created": jobs, "recover_s": recover_s, "streams": (ended, jobs)}


def update(http: httpx.Client, served: ServedConfig) -> dict:
    """An in-place update while a clip steps: the same config, the ingress's limits changed."""
    video_id = submit(http, {**CLIP, "prompt": "updated under"})
    stepping(http, video_id)
    from ray.serve import context
    from ray.serve.schema import ServeDeploySchema

    limits = served.config["applications"][0]["args"]["limits"]
    limits["max_prompt_chars"] = limits.get("max_prompt_chars", 4000) + 1  # read by the ingress alone
    # no stream open meanwhile: one would hold the old ingress for its graceful shutdown (the job then ends there)
    context._check_cached_client_alive()
    context._get_global_client().deploy_apps(ServeDeploySchema.model_validate(served.config), _blocking=False)
    updated = time.monotonic()
    video = poll(http, video_id)
    recover_s = time.monotonic() - updated
    ended = ended_with(read_stream(str(http.base_url), video_id), video)
    settled()  # the next scenarios kill "the" replica
    return {"videos": [video], "created": 1, "recover_s": recover_s, "streams": (int(ended), 1)}


def other_ingress(http: httpx.Client, store: str) -> dict:
    """Two clips; their status, the first one's cancel and both event streams asked of another ingress replica."""
    from h3serve.deploy.jobs.media_store import MediaStore
    from h3serve.deploy.jobs.store import JobPolicy, JobStore
    from h3serve.deploy.jobs.video_jobs import VideoJobs

    policy = JobPolicy(ttl_s=3600, max_bytes=2**30, lease_s=LEASE_S, max_unfinished=256)
    other = VideoJobs(JobStore(MediaStore(store), policy), None, None)  # type: ignore[arg-type]

    def other_stream(video_id: str) -> list[dict]:
        async def read() -> str:
            video = await other.get(video_id)
            assert video is not None
            return b"".join([c async for c in await other.event_stream(video_id, video, 0)]).decode()

        return parse_events(asyncio.run(read()))

    ids = [submit(http, {**CLIP, "prompt": f"other {i}", "num_inference_steps": 20}) for i in range(2)]
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(read_stream, str(http.base_url), i) for i in ids]
        streams += [pool.submit(other_stream, i) for i in ids]
        stepping(http, ids[0])
        asked = time.monotonic()
        answer = asyncio.run(other.cancel(ids[0]))
        assert answer is not None and answer["status"] == "cancelled", answer
        videos = [poll(http, i) for i in ids]
        recover_s = time.monotonic() - asked
        there = [asyncio.run(other.get(i)) for i in ids]
        assert [v["status"] for v in there] == [v["status"] for v in videos], (there, videos)  # one truth
        ended = sum(ended_with(s.result(), v) for s, v in zip(streams, videos * 2, strict=True))
    return {"videos": videos, "created": 2, "recover_s": recover_s, "streams": (ended, len(streams))}


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
    "replica": ("kill -9 H3Replica: one clip stepping, one waiting", lambda http, _: kill("H3Replica", http, 2)),
    "ingress": ("kill -9 H3Ingress: one clip stepping", lambda http, _: kill("H3Ingress", http, 1)),
    "retry": ("a POST retried with its Idempotency-Key", lambda http, _: retry(http)),
    "update": ("in-place update of the ingress args: one clip stepping", lambda http, served: update(http, served)),
    "other": (
        "two clips, status/cancel/events on the other ingress",
        lambda http, served: other_ingress(http, served.store),
    ),
}


def outcomes(videos: list[dict]) -> str:
    counts: dict[str, int] = {}
    for v in videos:
        name = v["status"] if v["status"] != "failed" else f"failed:{(v.get('error') or {}).get('code')}"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))


def run(args) -> dict:
    from h3serve.replicas.worker_group import free_port

    store = f"/tmp/h3serve-chaos-{uuid.uuid4().hex}"
    config = default_config(free_port(), {"limits": {"max_steps": CLIP["num_inference_steps"]}})  # default: fewer
    config["applications"][0]["args"]["jobs"] = {"lease_s": LEASE_S, "store": store}
    results: dict[str, list[dict]] = {name: [] for name in (args.scenarios.split(",") if args.scenarios else SCENARIOS)}
    with ServedConfig(config) as served, httpx.Client(base_url=served.url, timeout=60) as http:
        say(f"h3serve serve: up in {served.startup_s:.0f} s")
        served.store = f"{store}/{config['applications'][0]['name']}"  # type: ignore[attr-defined]
        chosen = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
        for i in range(args.runs):
            for name in chosen:
                what, scenario = SCENARIOS[name]
                result = scenario(http, served)
                results[name].append(result)
                say(f"run {i + 1} {name}: {outcomes(result['videos'])} in {result['recover_s']:.1f} s ({what})")
    rows, out = [], {}
    for name, runs in results.items():
        videos = [v for r in runs for v in r["videos"]]
        times = [r["recover_s"] for r in runs]
        created = sum(r["created"] for r in runs)
        streams = [r["streams"] for r in runs if "streams" in r]
        ended = f"{sum(e for e, _ in streams)}/{sum(n for _, n in streams)}" if streams else "-"
        out[name] = {"runs": len(runs), "jobs": len(videos), "created": created, "recover_s": times}
        out[name].update(outcomes=outcomes(videos), streams_ended=ended)
        rows.append(
            [
                SCENARIOS[name][0],
                len(runs),
                len(videos),
                outcomes(videos),
                created,
                ended,
                f"{statistics.median(times):.1f} ({max(times):.1f})",
            ]
        )
    head = [
        "scenario",
        "runs",
        "jobs",
        "outcomes",
        "jobs created",
        "streams ended with it",
        "to recover, s: median (max)",
    ]
    table(head, rows)  # prints it
    lost = [
        name
        for name, r in out.items()
        if "failed" in r["outcomes"]
        or r["created"] != r["jobs"]
        or (r["streams_ended"] != "-" and len(set(r["streams_ended"].split("/"))) != 1)
    ]
    return {"scenarios": out, "ok": not lost}


def options(ap) -> None:
    ap.add_argument("--runs", type=int, default=2, help="times each scenario runs (default 2)")
    ap.add_argument("--scenarios", default="", help=f"comma-separated, of {', '.join(SCENARIOS)} (default: all)")


main = cli(__doc__, run, options, __name__)
