"""Cold start on the CPU default, per phase: what a replica does before its first step and its first finished clip.

    python -m benchmarks.cold_start [--smoke] [--steps N] [--no-served] [--json PATH]
    python -m benchmarks.cold_start --group [--layers N] [--cold-cache] [--json PATH]   # an sp=2 replica's start
    python -m benchmarks.cold_start --from-zero [--layers N] [--cold-cache] [--steps N] [--json PATH]   # from zero
    python -m benchmarks.cold_start --clip [--runs N] [--steps N] [--json PATH]   # engine.warmup_clip off and on
    PYTHONPATH=<another checkout> python benchmarks/cold_start.py ...   # the same phases with that checkout's h3serve

What it measures (the phases and served by default, one after the other):
  phases  a new Python process does what a replica's rank 0 does, each phase timed: interpreter start (from the
          parent's spawn to the child's first line), imports (torch, diffusers, transformers, h3serve's pipeline),
          each component's load (``checkpoint.load_model``/tokenizer/processor/schedulers, timed where the pipeline
          calls them), what ``H3Pipeline.load`` spends besides (the blocks, the text encoder's trim and move), then
          the first request (prepare, first step, the other steps, decode) and the same request again, warm;
  served  `h3serve serve` of the default config (``harness.ServedDefault``): until it serves, then the first video
          job (POST to MP4) and a second one, warm.
  group   (``--group``) an sp=2 replica's worker group started on a synthetic checkpoint of the released layout
          whose transformer is several GiB (the tiny preset's VAEs and text encoder, a transformer of hidden 1024 and
          ``--layers`` blocks, fp32, random weights, written once into /tmp): ``WorkerGroup.create`` from its call
          to the group up, and each rank's load (when it was asked for, began and ended: ``LoadReport``; a checkout
          before it reports none, only the whole start). The page cache holds the checkpoint (just written or read), or
          with ``--cold-cache`` none of it (its files dropped with posix_fadvise; mincore says how much stayed).
  zero    (``--from-zero``) `h3serve serve` of the default config with H3Replica scaled to zero (the backlog policy,
          ``min_replicas`` 0, as tests/test_scale_from_zero.py serves it), then one video job POSTed while no replica
          runs: each phase on the wall clock from the POST, read where it happens (Serve's replica states, polled; the
          replica process's start; rank 0's ``LoadReport``; the replica's log lines for its warm-up and readiness;
          the job's own events, followed live: started, each step, decoding, completed, each beside the engine's
          own marks of the request (``H3Replica.timelines``: first_step, last_step, decode...)), then a second job,
          warm. ``started`` comes at the end of the first forward, and ``--steps N`` is N - 1 forwards (sigma
          points, the terminal zero included): with ``--steps 2`` started, step 1/1 and decoding come together.
          ``--layers N``: on the synthetic checkpoint of ``--group`` (``model: auto``) instead of the demo one.
  clip    (``--clip``) `h3serve serve` of the default config with ``engine.warmup_clip`` off and on, alternated:
          the start, the first and second video jobs, each job's decode on the replica and the clip's own.
Run it under another checkout's PYTHONPATH (a ``git archive`` of the commit before) for the "before" column: the
child, the command and the Ray workers all import that checkout's h3serve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "a red circle moving left with a high beep"


def child(steps: int) -> None:
    """The phases, in this (new) process; one JSON line of {phase: seconds} on stdout."""
    born = time.time()
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    import diffusers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    seconds["import torch, diffusers, transformers"] = time.perf_counter() - t
    t = time.perf_counter()
    from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
    from h3serve.pipelines.h3 import checkpoint as ckpt

    seconds["import h3serve.pipelines.h3"] = time.perf_counter() - t

    def timed(fn, label):
        def wrapper(index, name=None, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(index, *([name] if name is not None else []), *args, **kwargs)
            finally:
                key = f"load {label(name)}"
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

        return wrapper

    ckpt.load_model = timed(ckpt.load_model, lambda name: name)
    ckpt.load_scheduler = timed(ckpt.load_scheduler, lambda name: "schedulers")
    ckpt.load_tokenizer = timed(ckpt.load_tokenizer, lambda name: "tokenizer")
    ckpt.load_processor = timed(ckpt.load_processor, lambda name: "processor")
    checkpoint = os.environ.get("COLD_START_CHECKPOINT") or None
    t = time.perf_counter()
    pipeline = H3Pipeline.load(checkpoint, "torch_sdpa")
    loads = sum(v for k, v in seconds.items() if k.startswith("load "))
    seconds["H3Pipeline.load besides the components"] = time.perf_counter() - t - loads
    for label in ("first request", "warm request"):
        request = GenerationRequest(prompt=PROMPT, num_inference_steps=steps, seed=0)
        t = time.perf_counter()
        state = pipeline.prepare(request)
        seconds[f"{label}: prepare"] = time.perf_counter() - t
        t = time.perf_counter()
        pipeline.step([state])
        seconds[f"{label}: first step"] = time.perf_counter() - t
        t = time.perf_counter()
        while not state.done:
            pipeline.step([state])
        seconds[f"{label}: other steps"] = time.perf_counter() - t
        t = time.perf_counter()
        pipeline.decode(state)
        seconds[f"{label}: decode"] = time.perf_counter() - t
    print(json.dumps({"born": born, "seconds": seconds}), flush=True)


def phases(steps: int, checkpoint: str | None) -> dict[str, float]:
    env = {**os.environ, "COLD_START_CHECKPOINT": checkpoint or ""}
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"the phases process failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"interpreter start": out["born"] - spawned, **out["seconds"]}


def served(steps: int) -> dict[str, float]:
    from benchmarks.harness import ServedDefault, now
    from h3serve.client import H3Client

    out = {}
    with ServedDefault() as server, H3Client(server.url, timeout=900) as client:
        out["`h3serve serve` until it serves"] = server.startup_s
        for label in ("first video job (POST to MP4)", "second video job, warm"):
            t0 = now()
            client.video_job({"prompt": PROMPT, "num_inference_steps": steps})
            out[label] = now() - t0
    return out


def clip_warm_up(steps: int, runs: int) -> list[dict]:
    """`h3serve serve` of the default config with ``engine.warmup_clip`` off and on, alternated ``runs`` times each:
    the start, and the first and second video jobs (POST to MP4) at the served size, with the replica's clip."""
    from ray import serve

    from benchmarks.harness import ServedConfig, default_config, now
    from h3serve.client import H3Client
    from h3serve.deploy.driver.cli import BUILDER
    from h3serve.replicas.worker_group import free_port

    out = []
    for run_no in range(runs):
        for enabled in (False, True):
            config = default_config(free_port(), {"engine": {"warmup_clip": {"enabled": enabled}}})
            row: dict = {"run": run_no + 1, "warm-up clip": enabled}
            with ServedConfig(config) as server, H3Client(server.url, timeout=900) as client:
                row["`h3serve serve` until it serves"] = server.startup_s
                for label in ("first video job", "second video job"):
                    t0 = now()
                    client.video_job({"prompt": PROMPT, "num_inference_steps": steps})
                    row[label] = now() - t0
                (name,) = [a["name"] for a in config["applications"] if a.get("import_path") == BUILDER]
                handle = serve.get_deployment_handle("H3Replica", app_name=name)
                row["clip"] = handle.diagnostics.remote().result(timeout_s=60)["warm_up_clip"]
                # each job's decode on the replica (its marks), the one stage whose first call shows on a CPU
                marks = sorted(handle.timelines.remote().result(timeout_s=60).values(), key=lambda m: m["submitted"])
                row["decodes"] = [m["decoded"] - m["decode"] for m in marks]
            out.append(row)
    return out


def synthetic_checkpoint(layers: int) -> tuple[str, dict]:
    """The released layout with a transformer of hidden 1024 (32 heads of 32, SwiGLU 4096) and ``layers`` blocks:
    ~17.5M parameters a block, fp32 (written once; a later run reads it again)."""
    from h3serve.pipelines.h3 import checkpoint as ckpt

    dims = {"num_attention_heads": 32, "attention_head_dim": 32, "hidden_size": 1024, "ffn_dim": 4096}
    dims["num_layers"] = layers
    directory = Path(f"/tmp/h3serve-cold-start-h1024-l{layers}")
    if not (directory / ckpt.INDEX_FILE).is_file():
        ckpt.write_tiny_checkpoint(directory, seed=0, transformer=dims)
    return str(directory), dims


def page_cache(checkpoint: str, cold: bool) -> float:
    """The checkpoint's files read into the page cache, or (``cold``) dropped from it with posix_fadvise DONTNEED:
    these files only, so the machine's other work keeps its cache; the fraction of their pages resident after,
    by mincore on a private mapping (1.0: warm, 0.0: every byte comes from the disk)."""
    import ctypes
    import mmap

    libc, resident, pages = ctypes.CDLL(None, use_errno=True), 0, 0
    for f in Path(checkpoint).rglob("*.safetensors"):
        with open(f, "rb") as fh:
            if cold:
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                f.read_bytes()
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            n = -(-len(mapped) // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * n)()
            start = ctypes.c_char.from_buffer(mapped)
            if libc.mincore(ctypes.byref(start), ctypes.c_size_t(len(mapped)), vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {f}")
            del start
            mapped.close()
            resident, pages = resident + sum(v & 1 for v in vec), pages + n
    return resident / max(pages, 1)


def group_start(layers: int, cold: bool = False) -> dict:
    """``WorkerGroup.create`` of an sp=2 replica on the synthetic checkpoint, on a local Ray cluster of its own."""
    import pathlib

    import ray

    from h3serve.attention import Platform, resolve
    from h3serve.pipelines.h3 import REQUIREMENTS
    from h3serve.replicas import ReplicaSpec, WorkerGroup

    checkpoint, dims = synthetic_checkpoint(layers)
    nbytes = sum(f.stat().st_size for f in pathlib.Path(checkpoint, "transformer").glob("*.safetensors"))
    resident = page_cache(checkpoint, cold)  # warm: as a second start finds it; cold: as a node's first does
    resolution = resolve(REQUIREMENTS, "auto", Platform.cpu(), model="minimax-h3-tiny", head_dim=32)
    spec = ReplicaSpec(
        resolution=resolution,
        checkpoint=checkpoint,
        model_name="cold-start",
        num_heads=dims["num_attention_heads"],
        head_dim=dims["attention_head_dim"],
        num_layers=dims["num_layers"],
        hidden_size=dims["hidden_size"],
        sp_degree=2,
        collective_timeout_s=120.0,
        rank_resources={"CPU": 0.5},
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        started = time.time()
        group = WorkerGroup.create(spec)
        up = time.time()
        loads = {
            rank: {k: round(getattr(load, k) - started, 3) for k in ("requested", "started", "finished")}
            for rank, load in getattr(group, "loads", {}).items()  # none before LoadReport
        }
        group.shutdown()
    finally:
        ray.shutdown()
    out = {"transformer_gib": nbytes / 2**30, "layers": layers, "create_s": up - started, "loads": loads}
    return out | {"page_cache": "cold" if cold else "warm", "resident_before": resident}


# the backlog policy from zero (tests/served_apps.py's COLD_AUTOSCALING), kept up long after its work: the benchmark
# reads the replica's diagnostics once the jobs are done
FROM_ZERO = {
    "min_replicas": 0,
    "max_replicas": 1,
    "target_wait_s": 30,
    "upscale_delay_s": 0,
    "downscale_delay_s": 600,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "expected_load_s": 60,
}


def _log_time(line: str) -> float:
    """The wall clock of a Serve log line ("INFO 2026-12-05 21:38:44,434 app_H3Replica id -- ..."; local time)."""
    import datetime

    level, day, clock, *_ = line.split()
    stamp = datetime.datetime.strptime(f"{day} {clock}", "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def _replica_log_times(app: str, replica_id: str) -> dict[str, float]:
    """When the replica logged its warm-up and its readiness (its Serve log in this Ray session)."""
    import pathlib

    import ray

    session = pathlib.Path(ray._private.worker._global_node.get_session_dir_path())
    out: dict[str, float] = {}
    for path in (session / "logs" / "serve").glob(f"replica_{app}_H3Replica_{replica_id}*.log"):
        for line in path.read_text(errors="replace").splitlines():
            for key, words in (("warmed up", "H3 replica warmed up"), ("ready", "H3 replica ready")):
                if words in line and key not in out:
                    out[key] = _log_time(line)
    return out


def from_zero(steps: int, layers: int | None, cold: bool = False) -> dict:
    """One video job to the default config's app scaled to zero: every phase, seconds from its POST (wall clock)."""
    import threading

    import psutil
    from ray import serve

    from benchmarks.harness import ServedConfig, default_config
    from h3serve.client import H3Client
    from h3serve.deploy.driver.cli import BUILDER
    from h3serve.replicas.worker_group import free_port

    overlay: dict = {"autoscaling": FROM_ZERO}
    checkpoint, gib = None, None
    if layers:
        checkpoint, _ = synthetic_checkpoint(layers)
        overlay |= {"checkpoint": checkpoint, "model": "auto"}
        gib = sum(f.stat().st_size for f in Path(checkpoint, "transformer").glob("*.safetensors")) / 2**30
        resident = page_cache(checkpoint, cold)  # as --group: warm, or dropped from the page cache
    config = default_config(free_port(), overlay)
    (app,) = [a for a in config["applications"] if a.get("import_path") == BUILDER]
    app["args"].pop("ingress", None)  # sized for autoscaling.max_replicas
    app["deployments"] = [d for d in app["deployments"] if d["name"] != "H3Replica"]  # the builder's, autoscaled
    name = app["name"]
    states: dict[str, float] = {}  # Serve's replica state -> when it was first seen
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                replicas = serve.status().applications[name].deployments["H3Replica"].replica_states
            except Exception:  # the app not deployed yet, or a status call that failed: poll again
                replicas = {}
            for state, count in replicas.items():
                if count:
                    states.setdefault(str(state), time.time())
            stop.wait(0.2)

    body = {"prompt": PROMPT, "num_inference_steps": steps}
    out: dict = {"steps": steps, "checkpoint": checkpoint or "the shipped demo one", "transformer_gib": gib}
    out["page_cache"] = None if not layers else {"cold" if cold else "warm": resident}
    with ServedConfig(config) as server, H3Client(server.url, timeout=900) as client:
        out["`h3serve serve` until it serves"] = server.startup_s
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        time.sleep(1.0)
        replicas_before = dict(states)
        jobs: list[dict] = []
        for n, label in enumerate(("first job (from zero)", "second job (warm)")):
            events: dict[str, float] = {}
            request_id = f"cold-start-{os.getpid()}-{n}"
            posted, clock = time.time(), time.time() - time.monotonic()
            video_id = client.create_video(body, headers={"X-Request-Id": request_id})["id"]
            events["accepted"] = time.time()
            for event in client.follow(video_id):
                kind = event["event"]
                if kind == "queued" and "queued" in events:
                    kind = "queued at the replica"  # the second queued event: the replica took it (its position)
                elif kind in ("step", "preview"):  # every one: they come one a forward, as the forwards end
                    kind = f"{kind} {event['data']['step']}/{event['data']['steps']}"
                events.setdefault(kind, time.time())
            job = client.wait_video(video_id, 0.05, 60)
            if job["status"] != "completed":
                raise RuntimeError(f"the {label} did not complete: {job}")
            # the engine's own marks of the request (time.monotonic() on the replica's node, this one): what each
            # event's arrival is set beside. ``started`` is sent at the end of the first forward (its mark
            # first_step); num_inference_steps N is N - 1 forwards (sigma points, the terminal zero included)
            handle = serve.get_deployment_handle("H3Replica", app_name=name)
            marks = handle.timelines.remote([request_id]).result(timeout_s=60).get(request_id, {})
            jobs.append(
                {
                    "label": label,
                    "posted": posted,
                    "events": {k: t - posted for k, t in events.items()},
                    "engine": {k: t + clock - posted for k, t in marks.items()},
                }
            )
        stop.set()
        watcher.join()
        handle = serve.get_deployment_handle("H3Replica", app_name=name)
        diagnostics = handle.diagnostics.remote().result(timeout_s=60)
        logged = _replica_log_times(name, diagnostics["replica"])  # while this Ray session is up
        pid = diagnostics["pid"]
        process = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else None  # while it runs
    posted = jobs[0]["posted"]
    replica: dict[str, float] = {f"Serve: replica {s}": t - posted for s, t in states.items()}
    if process is not None:
        replica["replica process created"] = process - posted  # < 0: Ray gave the actor a pooled worker
    for rank, load in diagnostics["rank_loads"].items():
        replica[f"rank {rank} load began"] = load["started"] - posted
        replica[f"rank {rank} load ended"] = load["finished"] - posted
    for key, t in logged.items():
        replica[f"replica {key} (its log)"] = t - posted
    out |= {"replicas_before_the_job": replicas_before, "replica": replica, "jobs": jobs}
    return out


def run(args: argparse.Namespace) -> dict:
    from benchmarks.harness import say, served_checkpoint, table

    if args.from_zero:
        result = from_zero(args.steps, args.layers, args.cold_cache)
        say(
            f"`h3serve serve` of the default config, H3Replica scaled to zero, until it serves: "
            f"{result['`h3serve serve` until it serves']:.1f} s; replicas before the job: "
            f"{result['replicas_before_the_job'] or 'none'}; checkpoint {result['checkpoint']}"
        )
        rows = sorted(result["replica"].items(), key=lambda kv: kv[1])
        table(["the first job's replica (s from its POST)", "s"], rows, "from zero: the replica's start")
        for job in result["jobs"]:
            table([f"{job['label']}: event at the client", "s from its POST"], list(job["events"].items()), "")
            table([f"{job['label']}: the engine's mark", "s from its POST"], list(job["engine"].items()), "")
        return result

    if args.clip:
        runs = clip_warm_up(args.steps, args.runs)
        rows = [
            [
                r["run"],
                "on" if r["warm-up clip"] else "off",
                r["`h3serve serve` until it serves"],
                r["first video job"],
                r["second video job"],
                r["decodes"][0],
                r["decodes"][1],
                "-" if r["clip"] is None else r["clip"]["decode_s"],
            ]
            for r in runs
        ]
        heads = ["run", "warm-up clip", "serve until serving", "first job", "second job", "its decode", "its decode"]
        heads += ["clip's decode"]
        table(heads, rows, "the default config, engine.warmup_clip off and on, alternated (seconds)")
        return {"steps": args.steps, "runs": runs}

    if args.group:
        result = group_start(args.layers or 48, args.cold_cache)
        say(
            f"transformer {result['transformer_gib']:.2f} GiB, page cache {result['page_cache']} (resident "
            f"{result['resident_before']:.0%}); sp=2 group up in {result['create_s']:.2f} s"
        )
        rows = [[rank, t["requested"], t["started"], t["finished"]] for rank, t in sorted(result["loads"].items())]
        table(["rank", "asked (s)", "load began (s)", "load ended (s)"], rows, "from WorkerGroup.create's call")
        return result

    steps = 2 if args.smoke else args.steps
    import h3serve

    code = os.path.dirname(os.path.dirname(h3serve.__file__))
    say(f"h3serve from {code}; {steps} steps; checkpoint {served_checkpoint() or 'the shipped demo one'}")
    result = {"code": code, "steps": steps, "phases": phases(steps, served_checkpoint())}
    table(["phase", "s"], list(result["phases"].items()), "a replica's rank 0 in a new process (CPU default)")
    if args.served and not args.smoke:
        result["served"] = served(steps)
        table(["served", "s"], list(result["served"].items()), "h3serve serve, the default config")
    return result


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=8, help="steps of each request (default 8)")
    ap.add_argument("--no-served", dest="served", action="store_false", help="only the phases, no `h3serve serve`")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group", action="store_true", help="an sp=2 replica's start on a several-GiB checkpoint")
    ap.add_argument("--from-zero", action="store_true", help="a video job to the default app scaled to zero")
    ap.add_argument("--clip", action="store_true", help="the first job with engine.warmup_clip off and on")
    ap.add_argument("--runs", type=int, default=2, help="--clip: runs of each, alternated (default 2)")
    ap.add_argument(
        "--cold-cache",
        action="store_true",
        help="--group, --from-zero: the checkpoint's files dropped from the page cache first (they only)",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="--group: the synthetic transformer's blocks (default 48: 3.3 GiB); --from-zero: serve that checkpoint",
    )


if __name__ == "__main__" and "--child" in sys.argv:  # before any import below: the child times its own imports
    child(int(sys.argv[sys.argv.index("--steps") + 1]))
    sys.exit(0)

from benchmarks.harness import cli  # noqa: E402  (after the child's exit, above)

main = cli(__doc__, run, options, __name__)
