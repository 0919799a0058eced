"""One arrival trace through the one-replica app and the staged app (issue 27, item 6), side by side.

    python -m benchmarks.stages [--requests N] [--steps S] [--load 0.8] [--json PATH]
    python -m benchmarks.stages --smoke [--json PATH]         # 4 requests, 2 steps (CI, run_all)
    python -m benchmarks.stages --gpu --checkpoint DIR --rate R   # the released model; 4 CUDA devices, Ray

Two real Serve applications from one ``h3serve serve`` config, on a local Ray cluster (2 CPUs), the tiny
checkpoint with seeded random weights (``random_tiny_checkpoint``: the tiny preset's dims and cost), float32:
  solo     today's app: one H3Replica that prepares (text encoder, layout) and decodes (both VAEs, the MP4)
           on its stage worker thread beside the forwards
  staged   ``args.stages``: one H3Replica that holds the transformer alone, an H3Conditioner and an H3Decoder
           deployment (``h3serve/deploy/model_server/stage_deployments.py``); prepared state and latents cross the Ray
           object store
Both apps' H3Replica have the same engine limits (``max_active`` 8, ``max_rows_per_step`` 2048, policy fcfs),
rank resources {CPU: 0.5} and stages {num_cpus: 0.2}: each process gets one torch thread (Ray's
OMP_NUM_THREADS), so on both sides a prepare or decode can run on a second core beside a forward.

The trace is ``benchmarks.trace``'s (one seed: half stills 64x64x124, a third clips 96x64x192, the rest long
128x64x345, each with its own seed; Poisson arrivals) at ``--load`` (default 0.8) of the request-level capacity,
measured first in this process on the same checkpoint as ``benchmarks.trace`` does (each class twice back to
back, best of two rounds, one torch thread). It is replayed through solo, then through staged, by the
H3Replica's Serve handle (``generate_video``, streamed: the MP4 comes back from the replica; no ingress or job
store in the way).
Each app is fresh for its run and serves nothing else, so what its replica reports (``diagnostics()``) is the
trace's own: the replica's warm-up forward is not counted by the engine.

Reported per app: throughput (requests / makespan from the first arrival), latency (arrival to MP4 received)
mean/P50/P99, the denoiser's duty cycle (the engine's ``EngineStats.duty_cycle``: seconds in packed forwards /
seconds with a request submitted and not finished, i.e. not waiting on a prepare, a decode, an encode or an
arrival), forwards, and the object-store bytes per request: ``prepared`` (a ``PreparedState``, conditioner ->
denoiser), ``latents`` (a ``DecodeHandoff``, denoiser -> decoder), ``media`` (the MP4, decoder -> denoiser;
solo has none of the three) and the MP4 that reaches the caller (both). Checks: every request completed with
an MP4 of its frame count and canvas, each duty cycle in (0, 1], the conditioner served every request once
(and the replica's warm-up) and the decoder every request once, and the bytes the staged replica counted
equal the ``PreparedState``/``DecodeHandoff`` of the same requests prepared in this process, which equal
``handoff_bytes`` built by diffusers' own layout and timestep builders. That same function gives the bytes of a
released-size request (1344x768, the shortest and the longest clip, 50 steps, a 256-token prompt, prompt
embeddings in bfloat16): printed last. The decoded frames of each staged MP4 against solo's are printed
(max |pixel diff|), not judged: the packs differ between runs and tests/test_stages.py compares outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from .harness import (
    cli,
    columns,
    default_config,
    judge_targets,
    machine,
    now,
    percentile,
    say,
    table,
    tiny_spec,
    torch_threads,
    worker_group,
)
from .trace import GPU as TRACE_GPU
from .trace import TINY_CLASSES, Arrival, RequestClass, Sizes, at_rate, capacity, draw_trace, warm_up

SOLO, STAGED = "solo", "staged"
APPS = (SOLO, STAGED)
STAGE_DEPLOYMENTS = {"conditioner": "H3Conditioner", "decoder": "H3Decoder"}
LOAD = 0.8
FULL = Sizes(TINY_CLASSES, requests=20, steps=8, rows_per_step=2048, loads=(LOAD,))
SMOKE = Sizes(
    (RequestClass("still", 64, 64, 124, 1 / 2), RequestClass("clip", 96, 64, 124, 1 / 2)),
    requests=4,
    steps=2,
    rows_per_step=2048,
    loads=(LOAD,),
)
GPU = dataclasses.replace(TRACE_GPU, loads=(LOAD,))


# -- object-store bytes, measured (h3serve.pipelines.h3.shapes.handoff_bytes: the formula) -----------------------------
def prepared_bytes_by_key(prepared) -> dict[str, int]:
    """A measured ``PreparedState``'s bytes by key (its tensors only; the layout sizes are Python ints)."""
    from h3serve.pipelines.h3.handoff import payload_bytes

    return {key: payload_bytes(value) for key, value in prepared.values.items() if payload_bytes(value)}


# -- the two apps ------------------------------------------------------------------------------------------
def apps_config(checkpoint: str, sizes: Sizes, port: int, gpu: bool) -> dict:
    """h3serve/deploy/serve_config.yaml with two H3 applications, "solo" and "staged", on ``port``; one H3Replica
    each."""
    from h3serve.deploy.driver.cli import BUILDER

    engine = dict(max_active=8, max_queue=max(64, sizes.requests), max_rows_per_step=sizes.rows_per_step)
    if gpu:
        where: dict[str, Any] = dict(model="full", device="cuda", rank_resources={"CPU": 4, "GPU": 1})
        stage_options: dict[str, Any] = {"num_cpus": 4, "num_gpus": 1}
    else:
        where, stage_options = dict(rank_resources={"CPU": 0.5}), {"num_cpus": 0.2}
    base = default_config(port, {"checkpoint": checkpoint, "engine": engine, **where})
    ((template,),) = ([a for a in base["applications"] if a.get("import_path") == BUILDER],)

    def app(name: str, extra: dict) -> dict:
        new = copy.deepcopy(template)
        new.update(name=name, route_prefix=f"/{name}")
        new["args"].update(extra, ingress={"h3_replicas": 1})
        new["deployments"] = [
            {"name": "H3Ingress", "ray_actor_options": {"num_cpus": 0.05}},
            {"name": "H3Replica", "num_replicas": 1},
        ]
        return new

    stages = {role: {"ray_actor_options": dict(stage_options)} for role in ("conditioner", "decoder")}
    base["applications"] = [app(SOLO, {}), app(STAGED, {"stages": stages})]
    return base


async def replay(app: str, trace: list[Arrival]) -> dict[int, tuple[bytes, float]]:
    """Each request sent at its arrival time through ``app``'s H3Replica handle (``generate_video``, streamed);
    {index: (MP4 bytes, seconds from the trace's start to the MP4 received)}."""
    from ray import serve

    handle = serve.get_deployment_handle("H3Replica", app_name=app).options(stream=True)
    done: dict[int, tuple[bytes, float]] = {}
    t0 = now()

    async def one(a: Arrival) -> None:
        await asyncio.sleep(max(0.0, t0 + a.at - now()))
        mp4 = b""
        async for chunk in handle.generate_video.remote(a.request, f"{app}-{a.index}", None, a.priority):
            mp4 = chunk.get("mp4", mp4)
        done[a.index] = (mp4, now() - t0)

    await asyncio.gather(*(one(a) for a in trace))
    return done


def mp4_frames(data: bytes):
    """The decoded frames of an MP4, uint8 [F, H, W, 3]."""
    import av
    import numpy as np

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def call(app: str, deployment: str, method: str) -> Any:
    from ray import serve

    return getattr(serve.get_deployment_handle(deployment, app_name=app), method).remote().result(timeout_s=120)


# -- numbers ------------------------------------------------------------------------------------------------
def summarize(app: str, done: dict, trace: list[Arrival], diagnostics: dict) -> dict:
    latency = [done[a.index][1] - a.at for a in trace]
    makespan = max(t for _, t in done.values())
    completed = len(trace)
    handoff = diagnostics["handoff_bytes"]
    return {
        "app": app,
        "requests": completed,
        "makespan_s": makespan,
        "throughput_rps": completed / makespan,
        "latency": {
            "mean": sum(latency) / completed,
            "p50": percentile(latency, 50),
            "p99": percentile(latency, 99),
        },
        "duty_cycle": diagnostics["duty_cycle"],
        "forwards": diagnostics["forwards"],
        "handoff_bytes": handoff,
        "bytes_per_request": {kind: handoff.get(kind, 0) / completed for kind in ("prepared", "latents", "media")}
        | {"mp4 to caller": sum(len(mp4) for mp4, _ in done.values()) / completed},
        "rank0_parameters": sum(diagnostics["rank0_models"].values()),
        "latency_by_request": latency,
    }


def print_table(rows: list[dict], requests: int, rate: float) -> str:
    bytes_per = [("prepared", "prepared"), ("latents", "latents"), ("media", "media"), ("MP4", "mp4 to caller")]
    return columns(
        rows,
        [
            ("app", "app"),
            ("req/s", "throughput_rps"),
            ("mean s", "latency.mean"),
            ("p50 s", "latency.p50"),
            ("p99 s", "latency.p99"),
            ("denoiser duty", "duty_cycle"),
            ("forwards", "forwards"),
            *((f"{head} B/req", lambda r, k=k: round(r["bytes_per_request"][k])) for head, k in bytes_per),
            ("rank-0 params", "rank0_parameters"),
            ("max |px diff|", "max_pixel_diff_vs_solo"),
        ],
        f"{requests} requests, Poisson at {rate:.3f} requests/s, through each app in turn; latency = arrival "
        "to MP4 received; denoiser duty = the H3Replica engine's forward s / busy s; B/req = object-store bytes "
        "per request (prepared: conditioner -> denoiser, latents: denoiser -> decoder, media: decoder -> "
        "denoiser; MP4: replica -> caller); max |px diff| = decoded frames against solo's",
    )


def run(sizes: Sizes, seed: int = 0, gpu: bool = False, checkpoint: str | None = None, rate: float | None = None):
    from h3serve.pipelines.h3 import PreparedState
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint
    from h3serve.pipelines.h3.shapes import handoff_bytes, released_bytes
    from h3serve.replicas import EngineLimits
    from h3serve.replicas.worker_group import free_port

    checkpoint = checkpoint or str(random_tiny_checkpoint())
    requests, gaps = draw_trace(sizes, seed)
    say(f"machine: {machine()}\ncheckpoint: {checkpoint}")
    say(
        "classes: "
        + ", ".join(f"{c.name} {c.width}x{c.height}x{c.num_frames}" for c in sizes.classes)
        + f"; {sizes.steps} steps; {sizes.requests} requests: "
        + ", ".join(f"{sum(r[0].name == c.name for r in requests)} {c.name}" for c in sizes.classes)
    )
    expected: list[dict[str, int]] = []  # each trace request's PreparedState bytes by key, prepared here
    formula_ok = True
    cap = None
    if not gpu:  # in this process, on the same checkpoint: the capacity, and each request's hand-off bytes
        # one torch thread: a replica's (Ray sets OMP_NUM_THREADS from its fractional CPUs), as benchmarks.trace
        with torch_threads(1), worker_group(tiny_spec(sp=1, checkpoint=checkpoint)) as group:
            pipe = group.pipeline
            config = json.loads((Path(checkpoint) / "transformer" / "config.json").read_text())  # the checkpoint's
            warm_up(pipe, sizes)
            cap = capacity(pipe, sizes)
            for cls, _, request in requests:
                state = pipe.prepare(request)
                measured = prepared_bytes_by_key(PreparedState.of(state.state))
                embeds = state.state.get("prompt_embeds")  # [1, n_text, text_dim]
                formula = handoff_bytes(
                    config, cls.width, cls.height, cls.num_frames, sizes.steps, embeds.shape[1], embeds.dtype
                )
                formula_ok &= all(formula[k] == v for k, v in measured.items())
                formula_ok &= pipe.decode_handoff(state).nbytes == formula["handoff latents"]
                expected.append({**measured, "handoff latents": pipe.decode_handoff(state).nbytes})
        rate = sizes.loads[0] * cap["requests_per_s"] if rate is None else rate
        say(
            "capacity (request-level FCFS in this process, two of each class back to back, best of two rounds): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in cap["service_s"].items())
            + f" -> {cap['requests_per_s']:.3f} requests/s"
        )
    assert rate is not None
    trace = at_rate(requests, gaps, rate)
    say(f"trace: {rate:.3f} requests/s, last arrival at {trace[-1].at:.1f} s")

    config = apps_config(checkpoint, sizes, free_port(), gpu)
    rows, outputs = [], {}
    reports: dict[str, Any] = {}
    from .harness import ServedConfig  # imports Ray: not for --gpu's refusal on a node without it

    with ServedConfig(config, len(APPS), startup_timeout_s=900 if gpu else 600, num_cpus=None if gpu else 2) as served:
        say(f"both apps serving after {served.startup_s:.1f} s")
        for app in APPS:
            started = now()
            done = asyncio.run(replay(app, trace))
            diagnostics = call(app, "H3Replica", "diagnostics")
            say(f"  {app}: {now() - started:.1f} s wall, {len(done)} of {len(trace)} requests done")
            rows.append(summarize(app, done, trace, diagnostics))
            outputs[app] = {i: mp4 for i, (mp4, _) in done.items()}
        reports = {role: call(STAGED, name, "report") for role, name in STAGE_DEPLOYMENTS.items()}

    frames = {app: {i: mp4_frames(mp4) for i, mp4 in outputs[app].items()} for app in APPS}
    shapes_ok = all(
        frames[app][a.index].shape == (a.request.num_frames, a.request.height, a.request.width, 3)
        for app in APPS
        for a in trace
    )
    for row in rows:
        row["max_pixel_diff_vs_solo"] = max(
            int(abs(frames[row["app"]][a.index].astype("int16") - frames[SOLO][a.index].astype("int16")).max())
            if frames[row["app"]][a.index].shape == frames[SOLO][a.index].shape
            else 255
            for a in trace
        )
    say()
    print_table(rows, len(trace), rate)
    solo, staged = rows
    n = len(trace)
    calls = {role: sum(report["calls"].values()) for role, report in reports.items()}
    # with previews on, the staged denoiser (no VAE of its own) has the conditioner fit its preview map when it loads
    (staged_app,) = [a for a in config["applications"] if a["name"] == STAGED]
    fits = int(EngineLimits(**staged_app["args"]["engine"]).preview.enabled)
    checks = [
        ("requests completed with an MP4 of their frames and canvas (both apps)", float(shapes_ok), ">=", 1.0),
        ("solo denoiser duty cycle", solo["duty_cycle"], "<=", 1.0),
        ("staged denoiser duty cycle", staged["duty_cycle"], "<=", 1.0),
        ("lowest duty cycle", min(solo["duty_cycle"], staged["duty_cycle"]), ">=", 1e-9),
        ("solo object-store bytes (prepared + latents + media)", sum(solo["handoff_bytes"].values()), "<=", 0),
        ("staged prepared bytes per request", staged["bytes_per_request"]["prepared"], ">=", 1.0),
        ("staged latents bytes per request", staged["bytes_per_request"]["latents"], ">=", 1.0),
        ("conditioner calls - (requests + warm-up + preview fit)", abs(calls["conditioner"] - (n + 1 + fits)), "<=", 0),
        ("decoder calls - requests", abs(calls["decoder"] - n), "<=", 0),
    ]
    if expected:  # what crossed the object store = the same requests prepared here = the layout builders' count
        prepared_here = sum(sum(v for k, v in e.items() if k != "handoff latents") for e in expected)
        latents_here = sum(e["handoff latents"] for e in expected)
        crossed = staged["handoff_bytes"]
        checks += [
            (
                "staged prepared bytes - the same requests prepared here",
                abs(crossed["prepared"] - prepared_here),
                "<=",
                0,
            ),
            ("staged latents bytes - their DecodeHandoff here", abs(crossed["latents"] - latents_here), "<=", 0),
            ("handoff_bytes (layout builders) = every measured tensor", float(formula_ok), ">=", 1.0),
        ]
    judged = judge_targets(checks, sizes.loads[0], "checks")
    say(
        f"\nstage calls (staged app): conditioner {calls['conditioner']} (each request, the replica's warm-up"
        f"{' and its preview map fit' if fits else ''}), "
        f"decoder {calls['decoder']}; staged / solo: throughput "
        f"{staged['throughput_rps'] / solo['throughput_rps']:.2f}x, mean latency "
        f"{staged['latency']['mean'] / solo['latency']['mean']:.2f}x, denoiser duty cycle "
        f"{solo['duty_cycle']:.2f} -> {staged['duty_cycle']:.2f}"
    )

    released = released_bytes()
    keys = [k for k in released[0] if k != "request"]
    say()
    table(
        ["bytes", *(r["request"] for r in released)],
        [[k, *(f"{r[k] / 2**20:.2f} MiB" for r in released)] for k in keys],
        title="object-store bytes of one released-size T2VA request (handoff_bytes: diffusers' layout and "
        "timestep builders on the released config; prompt embeddings bf16, latents fp32): prepared = "
        "conditioner -> denoiser, handoff latents = denoiser -> decoder, once each",
    )
    return {
        "benchmark": "stages",
        "machine": machine(),
        "checkpoint": checkpoint,
        "sizes": dataclasses.asdict(sizes),
        "capacity": cap,
        "rate_rps": rate,
        "trace": [{"index": a.index, "class": a.kind, "at": a.at, "seed": a.request.seed} for a in trace],
        "results": rows,
        "stage_reports": reports,
        "preview_fits": fits,  # conditioner calls that fitted the denoiser's preview map
        "expected_prepared_bytes": expected,
        "released_bytes": released,
        "checks": judged,
        "ok": all(c["met"] for c in judged),
    }


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--requests", type=int, help="requests in the trace")
    ap.add_argument("--steps", type=int, help="num_inference_steps of every request")
    ap.add_argument("--load", type=float, help=f"fraction of the measured capacity (default {LOAD})")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed")
    ap.add_argument("--gpu", action="store_true", help="the released model: --checkpoint, --rate, 4 CUDA devices")
    ap.add_argument("--rate", type=float, help="arrivals per second (--gpu: required; CPU: default from --load)")
    ap.add_argument(
        "--checkpoint",
        help="checkpoint directory (default: the tiny preset with random weights; --gpu: $H3SERVE_CHECKPOINT)",
    )


def run_args(args: argparse.Namespace) -> dict | int:
    if args.gpu:
        args.checkpoint = args.checkpoint or os.environ.get("H3SERVE_CHECKPOINT")
        why = gpu_refusal(args.checkpoint, args.rate)
        if why:
            say(f"stages --gpu: {why}")
            return 2
    sizes = GPU if args.gpu else SMOKE if args.smoke else FULL
    sizes = dataclasses.replace(
        sizes,
        requests=args.requests or sizes.requests,
        steps=args.steps or sizes.steps,
        loads=(args.load,) if args.load else sizes.loads,
    )
    return run(sizes, args.seed, args.gpu, args.checkpoint, args.rate)


def gpu_refusal(checkpoint: str | None, rate: float | None) -> str | None:
    """Why --gpu cannot run here (at once, before anything starts), or None."""
    import importlib.util

    if not torch.cuda.is_available():
        return "CUDA is not available here (torch.cuda.is_available() is False)"
    if torch.cuda.device_count() < 4:
        return (
            f"needs 4 CUDA devices (solo's replica; staged's denoiser, conditioner and decoder, each on its own), "
            f"{torch.cuda.device_count()} here"
        )
    if importlib.util.find_spec("ray") is None:
        return "needs Ray (not installed here)"
    if not checkpoint or not Path(checkpoint).is_dir():
        return f"needs the released checkpoint directory (--checkpoint or $H3SERVE_CHECKPOINT); got {checkpoint!r}"
    if rate is None:
        return "needs --rate (arrivals per second): the driver holds no copy of the model to measure capacity"
    return None


main = cli(__doc__, run_args, options, __name__)
