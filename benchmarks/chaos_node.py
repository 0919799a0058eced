"""Chaos: a lost node (issue 54). What becomes of the video jobs of a node that goes away with an H3Replica and an
H3Ingress on it.

    python -m benchmarks.chaos_node [--runs 1] [--replace-after 0 | --spare] [--json PATH]

A two-node Ray cluster on this machine, each node a ``ray start --block`` of its own with a temp dir of its own (not
``ray.cluster_utils.Cluster``: that writes its address where every plain ``ray.init()`` on the machine looks, and
other sessions' tests run here): the head holds Serve's controller, the proxy (``proxy_location: HeadOnly``, one
port) and one H3Ingress replica; the worker node holds the H3Replica and the other H3Ingress replica (custom
resources place them: ``ingress_slot``, one per node; ``h3_replica_slot``, worker nodes only). The served default
(tiny CPU model, one clip at a time) with ``jobs.lease_s`` LEASE_S and the two ingress replicas over one store.

Each run: clips are sent through the proxy until both ingress replicas run some (each record names its runner), their
event streams are read through the proxy (reconnecting with Last-Event-ID after a break, as an EventSource does);
once the first clip steps, the worker node is lost: its ``ray start`` and every process under it (raylet, object
store, the replica, the ingress, idle workers) get SIGKILL at once, a pod or a VM gone. A replacement node with the
same resources joins ``--replace-after`` seconds later (0: at once, a spare node; KubeRay replacing a pod takes
longer). ``--spare``: no replacement; a spare node with the same room (one ingress slot, one replica slot, nothing
placed on it yet) joined once Serve was up, and the lost replicas restart there (a cluster with headroom, or a node
pool that autoscaled earlier); one run. Every job is polled to its end. The table: jobs, outcomes, how many ran again
(taken over from the lost ingress, or re-queued by the surviving one after the replica was lost), event streams that
ended with the record's final status, the time until Ray declared the node dead, and the time to recover: from the
loss to the last job's end.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from .chaos import CLIP, ended_with, outcomes, poll, read_stream, stepping
from .harness import ServedConfig, cli, default_config, descendants, say, table

LEASE_S = 6
RAY = str(Path(sys.executable).parent / "ray")
HEAD = {"ingress_slot": 1}
WORKER = {"ingress_slot": 1, "h3_replica_slot": 1}
MAX_JOBS = 10  # sent until both ingress replicas run some; the proxy's choice cannot be aimed


class Node:
    """One ``ray start --block`` of this machine and every process under it; ``lose`` kills them all by id."""

    def __init__(self, log: Path, *args: str):
        # `ray start` turns token auth on, and a driver joining by address has it off: a cluster of this machine
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        # the one proxy (the head's) spreads requests over both ingress replicas: by default it prefers the one on
        # its own node, and on a real cluster every node's proxy feeds the ingress beside it (so a lost node does
        # hold jobs its ingress accepted); here one proxy stands for them all
        env["RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING"] = "0"
        self.log = open(log, "w")
        command = [RAY, "start", "--block", "--disable-usage-stats", *args]
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def processes(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def lose(self) -> None:
        """SIGKILL to the node's every process at once: nothing on it says goodbye."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.log.close()


def worker_node(temp_dir: str, head: str) -> Node:
    """A worker node: room for the H3Replica and one ingress replica (one logical CPU)."""
    log = Path(temp_dir) / f"node-{uuid.uuid4().hex[:6]}.log"
    return Node(log, f"--address={head}", "--num-cpus=1", f"--resources={json.dumps(WORKER)}")


def alive_nodes() -> dict[str, dict]:
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def wait_nodes(count: int, timeout_s: float = 120) -> dict[str, dict]:
    give_up = time.monotonic() + timeout_s
    while len(nodes := alive_nodes()) != count:
        if time.monotonic() > give_up:
            raise TimeoutError(f"{len(nodes)} Ray nodes alive, not {count}")
        time.sleep(0.5)
    return nodes


def runner_of(store: Path, video_id: str) -> dict:
    return json.loads((store / f"{video_id}.json").read_text())["runner"]


def lost_node(
    http: httpx.Client,
    store: Path,
    worker: Node,
    worker_id: str,
    temp_dir: str,
    head: str,
    replace_after_s: float | None,
):
    """One run: jobs on both ingress replicas, the worker node (``worker_id``: the H3Replica's) lost, a replacement
    after ``replace_after_s`` (None: none; a spare node already has room)."""
    ids: list[str] = []
    nodes: dict[str, set[str]] = {}  # node id -> the jobs an ingress replica there accepted
    while len(ids) < MAX_JOBS and not (len(nodes) == 2 and len(ids) >= 3):
        response = http.post("/v1/videos", json={**CLIP, "prompt": f"node {uuid.uuid4().hex[:6]}"})
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
        nodes.setdefault(runner_of(store, ids[-1])["node"], set()).add(ids[-1])
    if len(nodes) != 2:
        raise RuntimeError(f"{len(ids)} jobs through the proxy all landed on one ingress replica")
    stepping(http, ids[0])
    on_lost = sorted(nodes[worker_id], key=ids.index)
    say(f"{len(ids)} jobs: {len(on_lost)} accepted by the ingress on the node to lose, the first one stepping")
    dead_s: list[float] = []
    with ThreadPoolExecutor(len(ids)) as pool:
        streams = [pool.submit(read_stream, str(http.base_url), i) for i in ids]
        time.sleep(1)  # the streams open
        worker.lose()
        lost = time.monotonic()

        def declared_dead():
            while worker_id in alive_nodes():
                time.sleep(0.25)
            dead_s.append(time.monotonic() - lost)

        watcher = threading.Thread(target=declared_dead, daemon=True)
        watcher.start()
        replacement = None
        if replace_after_s is not None:
            time.sleep(replace_after_s)
            replacement = worker_node(temp_dir, head)
        videos = [poll(http, i) for i in ids]
        recover_s = time.monotonic() - lost
        ended = sum(ended_with(s.result(), v) for s, v in zip(streams, videos, strict=True))
        watcher.join(timeout=60)
    records = {i: json.loads((store / f"{i}.json").read_text()) for i in ids}
    taken_over = sum(records[i]["epoch"] > 1 for i in ids)
    requeued = sum(records[i]["epoch"] == 1 and records[i]["attempts"] > 1 for i in ids)
    return {
        "videos": videos,
        "created": len(ids),
        "recover_s": recover_s,
        "dead_s": dead_s[0] if dead_s else None,
        "streams": (ended, len(ids)),
        "taken_over": taken_over,
        "requeued": requeued,
        "on_lost_ingress": len(on_lost),
        "attempts": [records[i]["attempts"] for i in ids],
    }, replacement


def run(args) -> dict:
    import ray

    from h3serve.replicas.worker_group import free_port

    if args.spare and args.runs != 1:
        raise SystemExit("--spare runs once (--runs 1): after a loss the spare holds the replica")
    temp_dir = tempfile.mkdtemp(prefix="h3chaos-")  # short: Ray's socket paths must fit 107 bytes
    port = free_port()
    head_address = f"{ray.util.get_node_ip_address()}:{port}"
    head_args = [f"--port={port}", "--num-cpus=2", f"--resources={json.dumps(HEAD)}", f"--temp-dir={temp_dir}"]
    head = Node(
        Path(temp_dir) / "head.log",
        "--head",
        "--include-dashboard=false",
        "--object-store-memory=200000000",
        *head_args,
    )
    nodes = [head]
    store = Path(temp_dir) / "videos"
    config = default_config(free_port(), {"limits": {"max_steps": CLIP["num_inference_steps"]}})
    config["proxy_location"] = "HeadOnly"  # one machine: one proxy on the port
    app = config["applications"][0]
    app["args"]["jobs"] = {"lease_s": LEASE_S, "store": str(store)}
    app["args"]["rank_resources"] = {"CPU": 0.5, "h3_replica_slot": 1}
    app["deployments"] = [
        {
            "name": "H3Ingress",
            "num_replicas": 2,
            "ray_actor_options": {"num_cpus": 0.1, "resources": {"ingress_slot": 1}},
        },
        {"name": "H3Replica", "num_replicas": 1},
    ]
    runs: list[dict] = []
    try:
        give_up = time.monotonic() + 120
        while "Ray runtime started" not in (Path(temp_dir) / "head.log").read_text():
            if head.proc.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError((Path(temp_dir) / "head.log").read_text()[-3000:])
            time.sleep(0.5)
        nodes.append(worker_node(temp_dir, head_address))
        ray.init(address=head_address, namespace="serve", log_to_driver=False)
        wait_nodes(2)
        with ServedConfig(config, num_cpus=None) as served, httpx.Client(base_url=served.url, timeout=60) as http:
            say(f"h3serve serve on two nodes: up in {served.startup_s:.0f} s")
            jobs_store = store / app["name"]
            for i in range(args.runs):
                worker = nodes[-1]
                worker_id = next(n for n, node in alive_nodes().items() if node["Resources"].get("h3_replica_slot"))
                if args.spare:  # joins after the replica was placed: it holds nothing until the loss
                    nodes.append(worker_node(temp_dir, head_address))
                    wait_nodes(3)
                    say("a spare node with room for the lost replicas joined")
                replace_after = None if args.spare else args.replace_after
                result, replacement = lost_node(
                    http, jobs_store, worker, worker_id, temp_dir, head_address, replace_after
                )
                if replacement is not None:
                    nodes.append(replacement)
                runs.append(result)
                say(
                    f"run {i + 1}: {outcomes(result['videos'])} in {result['recover_s']:.1f} s "
                    f"(node declared dead after {result['dead_s']:.1f} s; taken over {result['taken_over']}, "
                    f"re-queued {result['requeued']})"
                )
                wait_nodes(2)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for node in reversed(nodes):
            if node.proc.poll() is None:
                node.lose()
    videos = [v for r in runs for v in r["videos"]]
    times, dead = [r["recover_s"] for r in runs], [r["dead_s"] for r in runs if r["dead_s"] is not None]
    ended = f"{sum(r['streams'][0] for r in runs)}/{sum(r['streams'][1] for r in runs)}"
    again = f"{sum(r['taken_over'] for r in runs)} taken over, {sum(r['requeued'] for r in runs)} re-queued"
    row = [
        "lost node (H3Replica + 1 of 2 H3Ingress), "
        + ("no replacement: a spare node had room" if args.spare else f"replacement after {args.replace_after:g} s"),
        len(runs),
        len(videos),
        outcomes(videos),
        sum(r["created"] for r in runs),
        again,
        ended,
        f"{statistics.median(dead):.1f}" if dead else "-",
        f"{statistics.median(times):.1f} ({max(times):.1f})",
    ]
    head_row = [
        "scenario",
        "runs",
        "jobs",
        "outcomes",
        "jobs created",
        "ran again",
        "streams ended with it",
        "node dead after, s",
        "to recover, s: median (max)",
    ]
    table(head_row, [row])
    ok = all(v["status"] == "completed" for v in videos) and len(set(ended.split("/"))) == 1
    replace_after_s = None if args.spare else args.replace_after
    return {"runs": runs, "ok": ok, "replace_after_s": replace_after_s, "spare": args.spare, "lease_s": LEASE_S}


def options(ap) -> None:
    ap.add_argument("--runs", type=int, default=1, help="times the node is lost (default 1)")
    ap.add_argument(
        "--replace-after", type=float, default=0.0, help="seconds from the loss to a replacement node (default 0)"
    )
    ap.add_argument(
        "--spare",
        action="store_true",
        help="no replacement node: a spare node with room joins before the loss and the lost replicas restart there "
        "(with --runs 1)",
    )


main = cli(__doc__, run, options, __name__)
