"""A seeded arrival trace over HTTP against real `h3serve serve` apps, configs interleaved on fresh servers (issue 44).

    python -m benchmarks.served_trace [--runs 5] [--requests 12] [--configs before,max_active=1,default]
                                      [--load 0.8] [--seed 0] [--service still=..,clip5=..,clip10=..] [--json PATH]
    python -m benchmarks.served_trace --smoke          # one config, one short run (CI): counts and fields only

What a user meets: stills through POST /v1/images/generations, 5 s and 10 s clips through POST /v1/videos polled
(every ``POLL_S``) to completion, then GET .../content and DELETE, every request at the server's default canvas
and ``limits.default_steps``. The trace (``--requests``, half stills, a quarter of each clip, shuffled; Poisson
gaps) is drawn once from ``--seed``; its rate is ``--load`` times the request-level capacity of the class mix,
from each class's service time measured alone first (two of each class one after another over HTTP on the first
server, after a warm-up of each; each class's best) and reused for every run (``--service`` gives them instead).

Configs are overlays on h3serve/deploy/serve_config.yaml's H3 application args (``CONFIGS``): ``before`` (the engine
settings the default shipped before issue 44, written out), ``max_active=1`` (the same with one request at a
time: request-level FCFS), ``default`` (the shipped file as it is). Every run starts a fresh `h3serve serve` of
one config on this process's Ray cluster (2 CPUs) and replays the trace; the configs take turns, A/B/C/A/B/C,
``--runs`` each, so a slow stretch of a shared machine lands on every config.

Per run: mean latency (arrival to the PNG / the MP4 downloaded), P99, stills' P99, throughput (requests / first
arrival to last done), the load average (/proc/loadavg) at its start and end; per request a timeline from the
replica's stage marks (``H3Replica.timelines``: queue wait, prepare, first step, the other steps, the wait for the
stage worker, decode, PNG/MP4, and HTTP: everything else, the ingress, the job store, polling, the download); CPU
seconds per replica thread (step loop, stage worker, encoders, the rest: torch's and Ray's native threads) and per
process of this cluster (ingress, proxy, controller, raylet, GCS, the `h3serve serve` command, this client) from
/proc. Per config: the median and the min-max of each over the runs. Against ``max_active=1`` (request-level):
issue 44's targets, judged for ``default``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from h3serve.client import AsyncH3Client
from h3serve.replicas.worker_group import free_port

from .harness import (
    Attached,
    ServedConfig,
    at_times,
    by_shares,
    cli,
    columns,
    default_config,
    descendants,
    judge_targets,
    machine,
    percentile,
    say,
    table,
    unit_gaps,
)

POLL_S = 0.1  # a video client's poll interval
REQUEST_LEVEL = "max_active=1"
# the engine settings the CPU default shipped with before issue 44 (every knob issue 44 added at its old value)
BEFORE_ENGINE = {
    "policy": "fcfs",
    "max_active": 8,
    "max_rows_per_step": 16384,
    "stage_nice": 0,
    "encode_threads": 0,
    "step_events_every_s": 0.0,
    "preview": {"every_steps": 2, "every_s": 1.0},
}
CONFIGS: dict[str, dict] = {
    "before": {"engine": BEFORE_ENGINE},
    REQUEST_LEVEL: {"engine": {**BEFORE_ENGINE, "max_active": 1}},
    "default": {},  # h3serve/deploy/serve_config.yaml as shipped
    # diagnostics: one change each on top of `before`
    "before+srpt": {"engine": {**BEFORE_ENGINE, "policy": "srpt"}},
    "before+nice": {"engine": {**BEFORE_ENGINE, "stage_nice": 10, "encode_threads": 1}},
    "before-previews": {"engine": {**BEFORE_ENGINE, "preview": {"every_steps": None, "every_s": None}}},
    "before+events": {"engine": {**BEFORE_ENGINE, "step_events_every_s": 1.0}},
    "srpt1": {"engine": {**BEFORE_ENGINE, "policy": "srpt", "max_active": 1}},
    "srpt2": {"engine": {**BEFORE_ENGINE, "policy": "srpt", "max_active": 2}},
    "srpt1+nice": {
        "engine": {**BEFORE_ENGINE, "policy": "srpt", "max_active": 1, "stage_nice": 10, "encode_threads": 1}
    },
}
TARGETS = {"mean": 0.8, "stills_p99": 0.5, "throughput": 0.98, "spread": 1.5}
PHASES = ("to_engine", "queue", "prepare", "first_step", "steps", "decode_wait", "decode", "encode", "http")


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    seconds: float | None  # None: a still (POST /v1/images/generations)
    share: float


KINDS = (Kind("still", None, 1 / 2), Kind("clip5", 5.0, 1 / 4), Kind("clip10", 10.0, 1 / 4))


# -- the client -----------------------------------------------------------------------------------
def body(kind: Kind, seed: int, steps: int | None) -> dict:
    out: dict[str, Any] = {"prompt": "a red circle moving left with a high beep", "seed": seed}
    if kind.seconds is not None:
        out["seconds"] = kind.seconds
    if steps is not None:
        out["num_inference_steps"] = steps
    return out


async def one(api: AsyncH3Client, kind: Kind, rid: str, payload: dict) -> dict:
    """One request as a user makes it; its replica request id and its client-side times (time.monotonic())."""
    sent = time.monotonic()
    headers = {"X-Request-Id": rid}
    if kind.seconds is None:
        await api.image(payload, headers)
        return {"id": f"{rid}-0", "sent": sent, "done": time.monotonic()}
    done: list[float] = []  # the MP4 is in: the clock stops before the DELETE
    _, mp4 = await api.video_job(payload, POLL_S, math.inf, headers, on_content=lambda: done.append(time.monotonic()))
    return {"id": rid, "sent": sent, "done": done[0], "mp4_bytes": len(mp4)}


async def replay(url: str, arrivals: list[tuple[float, Kind, dict]], tag: str) -> list[dict]:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with AsyncH3Client(url, timeout=900, limits=limits) as api:

        async def send(i: int, item: tuple[Kind, dict]) -> dict:
            kind, payload = item
            return {**(await one(api, kind, f"{tag}-{i}", payload)), "kind": kind.name}

        return await at_times([(when, (kind, payload)) for when, kind, payload in arrivals], send)


# -- CPU from /proc -------------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(path: str) -> float:
    """utime + stime of /proc/.../stat, seconds (0 for one that is gone)."""
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5), after pid and comm


def process_role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    for needle, role in (
        ("H3Replica", "replica"),
        ("H3Ingress", "ingress"),
        ("ProxyActor", "proxy"),
        ("ServeController", "controller"),
        ("raylet", "raylet"),
        ("gcs_server", "gcs"),
        ("h3serve serve", "h3serve command"),
    ):
        if needle in cmd:
            return role
    return "client (this process)" if pid == os.getpid() else "ray other"


def cluster_root() -> int:
    """The process that started this Ray cluster: this one, or (``--address``) the one it joined, whose pid ends the
    session's name (``session_<date>_<time>_<pid>``). The cluster's processes are its descendants."""
    try:
        return int(ray._private.worker._global_node.session_name.rsplit("_", 1)[1])
    except (AttributeError, IndexError, ValueError):
        return os.getpid()


def cpu_snapshot(replica_pid: int) -> tuple[dict[str, float], dict[int, float]]:
    """CPU seconds by role of this cluster's processes (the descendants of the process that started it, and this
    process's own), and of the replica's threads by native id."""
    out: dict[str, float] = {}
    root = cluster_root()
    for pid in dict.fromkeys([os.getpid(), *descendants(os.getpid()), *descendants(root)]):
        role = process_role(pid)
        out[role] = out.get(role, 0.0) + cpu_of(f"/proc/{pid}/stat")
    tids = {}
    try:
        for t in os.listdir(f"/proc/{replica_pid}/task"):
            tids[int(t)] = cpu_of(f"/proc/{replica_pid}/task/{t}/stat")
    except OSError:
        pass
    return out, tids


def thread_cpu(replica: dict, tids: dict[int, float]) -> dict[str, float]:
    """The replica's threads' CPU seconds (``tids``: native id -> seconds) by role, from their Python names."""
    out: dict[str, float] = {}
    names = {tid: name for name, tid in replica["threads"].items()}
    for tid, seconds in tids.items():
        name = names.get(tid, "")
        role = (
            "thread: step loop"
            if name.startswith("h3-engine")
            else "thread: stage worker"
            if name.startswith("h3-stages")
            else "thread: encode"
            if name.startswith(("h3-encode", "asyncio"))
            else "thread: other Python"
            if name
            else "thread: native (torch, Ray core)"
        )
        out[role] = out.get(role, 0.0) + seconds
    return out


# -- a run ----------------------------------------------------------------------------------------
def timeline(client: dict, marks: dict[str, float]) -> dict[str, float]:
    """Where one request's latency went (seconds); ``http``: all of it outside the replica's marks."""
    end = marks.get("encoded", marks["decoded"])
    out = {
        "to_engine": marks["submitted"] - client["arrival"],
        "queue": marks["prepare"] - marks["submitted"],
        "prepare": marks["prepared"] - marks["prepare"],
        "first_step": marks["first_step"] - marks["prepared"],
        "steps": marks["last_step"] - marks["first_step"],
        "decode_wait": marks["decode"] - marks["last_step"],
        "decode": marks["decoded"] - marks["decode"],
        "encode": end - marks["decoded"],
    }
    out["http"] = client["done"] - client["arrival"] - sum(out.values())
    return out


def serve_replica_threads() -> dict:
    handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
    return handle.threads.remote().result()


def run_once(name: str, overlay: dict, arrivals, tag: str, running: Attached | None = None) -> dict:
    """One run of ``arrivals`` through a server of ``overlay``, started for it; ``running`` (a server of the default
    config already up, the caller's) serves the default config's run instead, without a start of its own."""
    shared = running is not None and not overlay
    server = contextlib.nullcontext(running) if shared else ServedConfig(default_config(free_port(), overlay))
    with server as served:
        replica = serve_replica_threads()
        load0, (procs0, tids0) = os.getloadavg()[0], cpu_snapshot(replica["pid"])
        started = time.monotonic()
        done = asyncio.run(replay(served.url, arrivals, tag))
        wall = time.monotonic() - started
        # the executors start their threads on first use: name them as they are at the end
        (procs1, tids1), load1 = cpu_snapshot(replica["pid"]), os.getloadavg()[0]
        replica = serve_replica_threads()
        cpu0, cpu1 = procs0 | thread_cpu(replica, tids0), procs1 | thread_cpu(replica, tids1)
        handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
        marks = handle.timelines.remote([d["id"] for d in done]).result()
        startup = served.startup_s
    latency = [d["done"] - d["arrival"] for d in done]
    stills = [d["done"] - d["arrival"] for d in done if d["kind"] == "still"]
    first = min(d["arrival"] for d in done)
    requests = [
        {
            "index": d["index"],
            "kind": d["kind"],
            "latency_s": d["done"] - d["arrival"],
            "timeline": timeline(d, marks[d["id"]]) if d["id"] in marks else None,
        }
        for d in sorted(done, key=lambda d: d["index"])
    ]
    return {
        "config": name,
        "startup_s": startup,
        "wall_s": wall,
        "loadavg": [load0, load1],
        "mean_s": statistics.fmean(latency),
        "p99_s": percentile(latency, 99),
        "stills_p99_s": percentile(stills, 99),
        "throughput_rps": len(done) / (max(d["done"] for d in done) - first),
        "cpu_s": {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in sorted(set(cpu0) | set(cpu1))},
        "torch_threads": replica["torch_threads"],
        "requests": requests,
        "timelines_missing": sum(r["timeline"] is None for r in requests),
    }


def measure_service(steps: int | None) -> dict[str, float]:
    """Each kind alone over HTTP (request-level config): a warm-up of each, then two of each, each kind's best."""
    port = free_port()
    best: dict[str, float] = {}
    with ServedConfig(default_config(port, CONFIGS[REQUEST_LEVEL])):

        async def alone() -> None:
            async with AsyncH3Client(f"http://127.0.0.1:{port}", timeout=900) as http:
                for round_ in range(3):
                    for k in KINDS:
                        t = time.monotonic()
                        await one(http, k, f"service-{round_}-{k.name}", body(k, 1, steps))
                        if round_:  # the first round warms every path up
                            best[k.name] = min(best.get(k.name, float("inf")), time.monotonic() - t)

        asyncio.run(alone())
    return best


# -- the numbers ----------------------------------------------------------------------------------
def queue_model(service: dict[str, float], load: float, jobs: int = 3000, seed: int = 1) -> dict[str, dict]:
    """**Projected**: one server at ``load`` with Poisson arrivals of the KINDS mix, each kind's service time fixed
    at ``service``: mean latency and stills' P99 under FCFS, preemptive SRPT (least remaining first) and processor
    sharing (every request in one pack, a forward's time growing with its rows, as on CPU). Exact event simulation
    of one long trace; what scheduling alone could buy where packing saves no compute."""
    rng = random.Random(seed)
    mean = sum(k.share * service[k.name] for k in KINDS)
    t, arrivals = 0.0, []
    for _ in range(jobs):
        t += rng.expovariate(load / mean)
        kind = rng.choices(KINDS, [k.share for k in KINDS])[0]
        arrivals.append((t, kind.name, service[kind.name]))

    def run_queue(discipline: str) -> list[tuple[str, float]]:
        done: list[tuple[str, float]] = []
        active: list[list] = []  # [arrival, kind, remaining]
        now, i = 0.0, 0
        while i < len(arrivals) or active:
            if not active:  # idle until the next arrival
                now = arrivals[i][0]
                active.append(list(arrivals[i]))
                i += 1
                continue
            if discipline == "ps":  # every one at 1/n of the server
                share, served = 1.0 / len(active), active
            else:
                head = active[0] if discipline == "fcfs" else min(active, key=lambda a: (a[2], a[0]))
                share, served = 1.0, [head]
            finish = now + min(a[2] for a in served) / share
            until = min(finish, arrivals[i][0] if i < len(arrivals) else math.inf)
            for a in served:
                a[2] -= (until - now) * share
            now = until
            for a in [a for a in served if a[2] <= 1e-9]:
                active.remove(a)
                done.append((a[1], now - a[0]))
            if i < len(arrivals) and arrivals[i][0] <= now:
                active.append(list(arrivals[i]))
                i += 1
        return done

    out = {}
    for discipline in ("fcfs", "srpt", "ps"):
        done = run_queue(discipline)
        out[discipline] = {
            "mean_s": statistics.fmean(v for _, v in done),
            "stills_p99_s": percentile([v for k, v in done if k == "still"], 99),
        }
    return out


def summary(runs: list[dict]) -> dict:
    def of(key: str) -> dict:
        values = [r[key] for r in runs]
        return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}

    phases: dict[str, dict[str, float]] = {}
    for kind in [k.name for k in KINDS]:
        per_run = []
        for r in runs:
            rows = [q["timeline"] for q in r["requests"] if q["kind"] == kind and q["timeline"]]
            if rows:
                per_run.append({p: statistics.fmean(t[p] for t in rows) for p in PHASES})
        if per_run:
            phases[kind] = {p: statistics.median(x[p] for x in per_run) for p in PHASES}
    roles = sorted({k for r in runs for k in r["cpu_s"]})
    return {
        "runs": len(runs),
        "mean_s": of("mean_s"),
        "p99_s": of("p99_s"),
        "stills_p99_s": of("stills_p99_s"),
        "throughput_rps": of("throughput_rps"),
        "spread": max(r["mean_s"] for r in runs) / min(r["mean_s"] for r in runs),
        "loadavg": [min(min(r["loadavg"]) for r in runs), max(max(r["loadavg"]) for r in runs)],
        "timeline_s": phases,  # per kind: the median over runs of each phase's mean
        "cpu_s": {k: statistics.median(r["cpu_s"].get(k, 0.0) for r in runs) for k in roles},
    }


def judge(summaries: dict[str, dict], candidate: str, load: float) -> list[dict]:
    """Issue 44's targets for ``candidate`` against ``max_active=1`` (request-level), printed; none without both."""
    if REQUEST_LEVEL not in summaries or candidate not in summaries:
        return []
    base, new = summaries[REQUEST_LEVEL], summaries[candidate]

    def ratio(key: str) -> float:
        return new[key]["median"] / base[key]["median"]

    checks = [
        ("median mean latency", ratio("mean_s"), "<=", TARGETS["mean"]),
        ("median stills P99", ratio("stills_p99_s"), "<=", TARGETS["stills_p99"]),
        ("median throughput", ratio("throughput_rps"), ">=", TARGETS["throughput"]),
        (f"spread (max/min mean latency) of {candidate}", new["spread"], "<=", TARGETS["spread"]),
    ]
    return judge_targets(checks, load, f"issue 44's targets: {candidate} / {REQUEST_LEVEL}")


def print_tables(summaries: dict[str, dict]) -> None:
    base = summaries.get(REQUEST_LEVEL)

    def ratio(name: str, key: str) -> float | None:
        return None if base is None else summaries[name][key]["median"] / base[key]["median"]

    columns(
        [dict(s, config=name) for name, s in summaries.items()],
        [
            ("config", "config"),
            ("runs", "runs"),
            ("mean s: median", "mean_s.median"),
            ("min-max", lambda s: f"{s['mean_s']['min']:.2f}-{s['mean_s']['max']:.2f}"),
            ("vs max_active=1", lambda s: ratio(s["config"], "mean_s")),
            ("P99 s", "p99_s.median"),
            ("stills P99 s", "stills_p99_s.median"),
            ("vs max_active=1", lambda s: ratio(s["config"], "stills_p99_s")),
            ("req/s", "throughput_rps.median"),
            ("vs max_active=1", lambda s: ratio(s["config"], "throughput_rps")),
            ("spread", "spread"),
            ("load avg", lambda s: f"{s['loadavg'][0]:.1f}-{s['loadavg'][1]:.1f}"),
        ],
        "per config, over its runs: median (and min-max) of each run's mean latency, the medians of P99, "
        "stills' P99 and throughput; spread = max/min of mean latency; load avg: /proc/loadavg's range",
    )
    table(
        ["config", "kind", *PHASES],
        [[name, kind, *(t[p] for p in PHASES)] for name, s in summaries.items() for kind, t in s["timeline_s"].items()],
        title="where a request's latency went, seconds (each phase's mean per kind, median over runs): to_engine = "
        "arrival to the engine's submit (HTTP, ingress, job record); queue = to its prepare; first_step = prepared "
        "to its first forward's end; steps = to its last; decode_wait = to its decode's start; encode = PNG/MP4; "
        "http = the rest (the job record, polling, the download)",
    )
    roles = sorted({k for s in summaries.values() for k in s["cpu_s"]})
    table(
        ["role", *summaries],
        [[role, *(s["cpu_s"].get(role, 0.0) for s in summaries.values())] for role in roles],
        title="CPU seconds in a run by process and, in the replica, by thread (median over runs)",
    )


def run(
    configs: list[str],
    runs: int,
    requests: int,
    load: float,
    seed: int,
    service: dict[str, float] | None,
    steps: int | None,
    candidate: str,
    project: bool = True,
    running: Attached | None = None,
) -> dict:
    own_ray = not ray.is_initialized()  # else the caller's session (in namespace "serve": ServedConfig checks)
    if own_ray:
        ray.init(
            num_cpus=2, namespace="serve", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING
        )
    try:
        say(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}")
        if service is None:
            service = measure_service(steps)
        mean_service = sum(k.share * service[k.name] for k in KINDS)
        rate = load / mean_service
        rng = random.Random(seed)  # the kinds (half stills, a quarter each clip), shuffled, then Poisson gaps
        kinds: list[Kind] = by_shares(KINDS, requests, rng)
        gaps = unit_gaps(requests, rng)
        arrivals, t = [], 0.0
        for i, (kind, gap) in enumerate(zip(kinds, gaps, strict=True)):
            t += gap / rate
            arrivals.append((t, kind, body(kind, 2000 + i, steps)))
        say(
            "service alone: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in service.items())
            + f" -> {1 / mean_service:.3f} requests/s on the mix; load {load:g}: {rate:.3f} requests/s; "
            + f"{requests} requests ("
            + ", ".join(f"{sum(k.name == x.name for k in kinds)} {x.name}" for x in KINDS)
            + f"), last arrival at {arrivals[-1][0]:.1f} s; configs {configs}, {runs} runs each, interleaved"
        )
        model = queue_model(service, load) if project else None
        if model is not None:
            say(
                "**projected** (one server, the service times above, Poisson at this load, a long trace): mean latency "
                + ", ".join(f"{d} {m['mean_s']:.2f} s" for d, m in model.items())
                + f"; srpt / fcfs {model['srpt']['mean_s'] / model['fcfs']['mean_s']:.2f}x, processor sharing / fcfs "
                + f"{model['ps']['mean_s'] / model['fcfs']['mean_s']:.2f}x; stills P99 srpt / fcfs "
                + f"{model['srpt']['stills_p99_s'] / model['fcfs']['stills_p99_s']:.2f}x"
            )
        results: dict[str, list[dict]] = {name: [] for name in configs}
        for r in range(runs):
            for name in configs:
                tag = f"r{r}-{re.sub('[^A-Za-z0-9]', '', name)}"
                out = run_once(name, CONFIGS[name], arrivals, tag, running)
                results[name].append(out)
                say(
                    f"  run {r + 1} {name}: mean {out['mean_s']:.2f} s, P99 {out['p99_s']:.2f} s, stills P99 "
                    f"{out['stills_p99_s']:.2f} s, {out['throughput_rps']:.3f} req/s; load avg "
                    f"{out['loadavg'][0]:.1f} -> {out['loadavg'][1]:.1f}; server up "
                    + ("before the run" if out["startup_s"] is None else f"in {out['startup_s']:.0f} s")
                )
    finally:
        if own_ray:
            ray.shutdown()
    summaries = {name: summary(rs) for name, rs in results.items()}
    say()
    print_tables(summaries)
    judged = judge(summaries, candidate, load)
    complete = all(not r["timelines_missing"] for rs in results.values() for r in rs)
    return {
        "benchmark": "served_trace",
        "machine": machine(),
        "configs": {name: CONFIGS[name] for name in configs},
        "service_s": service,
        "load": load,
        "rate_rps": rate,
        "projected_queue_model": model,
        "seed": seed,
        "trace": [{"at": a, "kind": k.name} for a, k, _ in arrivals],
        "summaries": summaries,
        "targets": judged,
        "runs": results,
        "ok": complete,
    }


def configs_arg(text: str) -> list[str]:
    configs = text.split(",")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown configs {unknown}; known: {list(CONFIGS)}")
    return configs


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--runs", type=int, default=5, help="runs of each config, interleaved (default 5)")
    ap.add_argument("--requests", type=int, default=12, help="requests in the trace (default 12)")
    ap.add_argument(
        "--configs",
        type=configs_arg,
        default=f"before,{REQUEST_LEVEL},default",
        help=f"comma-separated, of {', '.join(CONFIGS)}",
    )
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the request-level capacity (default 0.8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="num_inference_steps of every request (default: the server's)")
    ap.add_argument("--service", help="kind=seconds,... service times alone (skips measuring them)")
    ap.add_argument("--candidate", default="default", help="the config judged against max_active=1")
    ap.add_argument("--url", help="a server of the default config already up (joined with --address), for its runs")


def run_args(args: argparse.Namespace) -> dict:
    service = {k: float(v) for k, v in (x.split("=") for x in args.service.split(","))} if args.service else None
    configs = args.configs
    if args.smoke:  # one config, one short run: counts and fields (CI), never timings
        configs, runs, requests = ["default"], 1, 4
        service, steps = service or {"still": 0.5, "clip5": 0.5, "clip10": 0.5}, args.steps or 2
    else:
        runs, requests, steps = args.runs, args.requests, args.steps
    running = Attached(args.url) if args.url else None
    return run(configs, runs, requests, args.load, args.seed, service, steps, args.candidate, not args.smoke, running)


main = cli(__doc__, run_args, options, __name__)
