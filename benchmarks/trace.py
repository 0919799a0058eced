"""An arrival trace through request-level FCFS and the engine's policies (issue 23), outputs compared.

    python -m benchmarks.trace [--quick] [--requests N] [--loads 0.5,0.8,0.95] [--json PATH]
    python -m benchmarks.trace --gpu --checkpoint DIR     # the released model on one CUDA device

One seeded trace of ``N`` requests of three classes (tiny preset, CPU; the same for every load):
  still  half of them:   64x64,  124 frames (the shortest clip: what POST /v1/images/generations makes)
  clip   a third:        96x64,  192 frames (8 s) on a larger canvas
  long   the rest:      128x64,  345 frames (14.4 s, the longest) on the largest canvas
every one with the same steps and its own seed; a tenth of them (drawn at random) have priority 5, the
rest 0. Arrivals are Poisson at 0.5, 0.8 and 0.95 of the measured capacity: first the request-level
throughput of the class mix is measured (two of each class one after another, as below; each class's
best of two rounds), then the same unit-rate exponential gaps are scaled to each load. Each load's
trace is replayed, one mode after the other, through:
  request-level FCFS   one request at a time to completion: prepare, every step, decode, on one thread, in
                       arrival order, priority ignored (as diffusers' server guide and FastVideo serve; it is
                       ``benchmarks.packing.sequential``, pipeline calls one by one, no engine)
  engine fcfs          ``replicas.Engine`` on an sp=1 WorkerGroup, engine.policy fcfs (submission order)
  engine srpt          the same, least remaining work (rows x steps left) first
  engine priority      the same, higher priority first
The engines pack at most ``--rows`` rows per step (default 2048: a long clip alone, or a few stills and
clips; on CPU a forward's time grows with its rows, so the budget, not packing, decides how long a still's
steps take; the deployment default 16384 would pack everything together and leave the policies nothing
to choose), ``max_active`` 8. Reported per mode and load: throughput (requests / makespan), mean/P50/P99
latency (arrival to decoded) and time to first step per class, duty cycle (seconds in packed forwards /
seconds with work submitted and not finished: the engine's own ``EngineStats.duty_cycle``, and for
request-level FCFS its forward time over the union of its requests' arrival-to-done intervals),
preemptions; and every request's output against request-level FCFS's at the first load (max |pixel
diff| <= 1, audio allclose). Idle latency: each class alone on the engine (policy priority). One torch
thread (a default Serve replica's), like ``benchmarks.packing``.

Over 600 lines: one scenario end to end (the trace, request-level FCFS as a baseline engine, the replay, the
per-class tables and issue 23's targets); its parts are used by lora and stages, so it stays one module.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
from h3serve.replicas import Engine, EngineLimits, WorkerGroup

from .harness import (
    StepLog,
    by_shares,
    cli,
    columns,
    compare_media,
    judge_targets,
    machine,
    now,
    percentile,
    say,
    summarize_agreement,
    table,
    tiny_spec,
    torch_threads,
    unit_gaps,
    worker_group,
)
from .packing import PROMPTS, sequential

LOADS = (0.5, 0.8, 0.95)
HIGH_PRIORITY, HIGH_SHARE = 5, 0.1
REQUEST_LEVEL = "request-level FCFS"
POLICY_MODES = ("fcfs", "srpt", "priority")
MODES = (REQUEST_LEVEL, *(f"engine {p}" for p in POLICY_MODES))
# issue 23's targets, judged at load 0.8 against request-level FCFS
TARGET_LOAD = 0.8
TARGETS = {"duty_cycle": 0.9, "stills_p99": 0.3, "mean": 0.7, "throughput": 1.0, "high_p99_vs_idle": 1.5}


@dataclasses.dataclass(frozen=True)
class RequestClass:
    name: str
    width: int
    height: int
    num_frames: int
    share: float


@dataclasses.dataclass(frozen=True)
class Sizes:
    classes: tuple[RequestClass, ...]
    requests: int
    steps: int
    rows_per_step: int
    loads: tuple[float, ...]


TINY_CLASSES = (
    RequestClass("still", 64, 64, 124, 1 / 2),
    RequestClass("clip", 96, 64, 192, 1 / 3),
    RequestClass("long", 128, 64, 345, 1 / 6),
)
FULL = Sizes(TINY_CLASSES, requests=20, steps=8, rows_per_step=2048, loads=LOADS)
QUICK = Sizes(TINY_CLASSES, requests=6, steps=3, rows_per_step=2048, loads=(TARGET_LOAD,))
# the released model on one GPU: canvases below the default 768x1344 and few steps, so a trace fits in minutes
GPU = Sizes(
    (
        RequestClass("still", 512, 288, 124, 1 / 2),
        RequestClass("clip", 768, 448, 124, 1 / 3),
        RequestClass("long", 768, 448, 209, 1 / 6),
    ),
    requests=12,
    steps=4,
    rows_per_step=40000,
    loads=(TARGET_LOAD,),
)


@dataclasses.dataclass(frozen=True)
class Arrival:
    index: int
    at: float  # seconds from the trace's start
    kind: str  # the request class's name
    priority: int
    request: GenerationRequest
    adapter: str | None = None  # the LoRA adapter it runs on (None: the base model; benchmarks.lora's trace)


def make_request(cls: RequestClass, steps: int, seed: int, prompt: str) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        width=cls.width,
        height=cls.height,
        num_frames=cls.num_frames,
        num_inference_steps=steps,
        seed=seed,
    )


def draw_trace(sizes: Sizes, seed: int) -> tuple[list[tuple[RequestClass, int, GenerationRequest]], list[float]]:
    """The trace's requests in arrival order (class, priority, request) and its unit-rate exponential gaps.

    Class counts are the shares rounded (the remainder goes to the first class) and shuffled; exactly
    round(N / 10) requests (at least one) get the high priority."""
    rng = random.Random(seed)
    n = sizes.requests
    kinds: list[RequestClass] = by_shares(sizes.classes, n, rng)
    high = set(rng.sample(range(n), max(1, round(n * HIGH_SHARE))))
    requests = [
        (cls, HIGH_PRIORITY if i in high else 0, make_request(cls, sizes.steps, 1000 + i, rng.choice(PROMPTS)))
        for i, cls in enumerate(kinds)
    ]
    return requests, unit_gaps(n, rng)


def at_rate(requests, gaps: list[float], rate: float) -> list[Arrival]:
    """The trace with its gaps scaled to ``rate`` requests per second (Poisson arrivals at that rate)."""
    out, t = [], 0.0
    for i, ((cls, priority, request), gap) in enumerate(zip(requests, gaps, strict=True)):
        t += gap / rate
        out.append(Arrival(i, t, cls.name, priority, request))
    return out


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time with work submitted and not finished."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


# -- the modes ------------------------------------------------------------------------------------
async def engine_replay(
    group: WorkerGroup,
    trace: list[Arrival],
    limits: EngineLimits,
    make_engine: Callable[[WorkerGroup, EngineLimits, StepLog], Engine] = Engine,
):
    """Submit each request at its arrival time; (engine, done {i: (media, t)}, first step {i: t}, last step {i: t}).

    ``make_engine``: the engine to replay through (default h3serve's ``Engine``; benchmarks.lora passes its
    adapter-gated policies over the same engine)."""
    engine, t0 = make_engine(group, limits, StepLog()), now()
    done: dict[int, tuple] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}

    async def one(a: Arrival) -> None:
        await asyncio.sleep(max(0.0, t0 + a.at - now()))
        ticket = engine.submit(a.request, f"trace-{a.index}", priority=a.priority, adapter=a.adapter)
        while not ticket.future.done():  # `changed` is set after each of its forwards
            changed = asyncio.ensure_future(ticket.changed.wait())
            waiters: list[asyncio.Future[Any]] = [changed, ticket.future]
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if ticket.changed.is_set():
                first.setdefault(a.index, now() - t0)
                last[a.index] = now() - t0
            ticket.changed.clear()
        done[a.index] = (await ticket.future, now() - t0)

    try:
        await asyncio.gather(*(one(a) for a in trace))
    finally:
        await engine.close("trace replayed")
    return engine, done, first, last


def engine_run(
    mode: str,
    group: WorkerGroup,
    trace: list[Arrival],
    limits: EngineLimits,
    make_engine: Callable[[WorkerGroup, EngineLimits, StepLog], Engine] = Engine,
) -> tuple[Engine, dict]:
    """``engine_replay`` as one mode's numbers: completion and step times, forward and busy seconds, preemptions."""
    engine, done, first, last = asyncio.run(engine_replay(group, trace, limits, make_engine))
    stats = engine.stats
    numbers = dict(forward_s=stats.forward_s, busy_s=stats.busy_s, duty_cycle=stats.duty_cycle)
    numbers.update(preemptions=stats.preemptions, forwards=stats.forwards, rows=stats.rows)
    return engine, {"mode": mode, "done": done, "first": first, "last": last, **numbers}


def replay(mode: str, pipe: H3Pipeline, group: WorkerGroup, trace: list[Arrival], limits: EngineLimits) -> dict:
    """One mode through the trace: completion and first-step times, forward seconds, busy seconds, preemptions."""
    if mode != REQUEST_LEVEL:
        return engine_run(mode, group, trace, limits.model_copy(update={"policy": mode.removeprefix("engine ")}))[1]
    done: dict[int, tuple] = {}
    first: dict[int, float] = {}
    scheduler = asyncio.run(sequential(pipe, [(a.at, a.request) for a in trace], done, first))
    busy = busy_seconds([(a.at, done[a.index][1]) for a in trace])
    return {
        "mode": mode,
        "done": done,
        "first": first,
        "last": {},  # not recorded: one request's steps run back to back, then its decode
        "forward_s": scheduler.forward_s,
        "busy_s": busy,
        "duty_cycle": scheduler.forward_s / busy,
        "preemptions": 0,
        "forwards": scheduler.forwards,
        "rows": scheduler.rows,
    }


def idle_latency(group: WorkerGroup, sizes: Sizes, limits: EngineLimits) -> tuple[dict[str, float], dict[str, dict]]:
    """Each class alone on an idle engine (policy priority): submit to decoded, seconds; and its timeline."""
    out, timelines = {}, {}
    for cls in sizes.classes:
        request = make_request(cls, sizes.steps, seed=1, prompt=PROMPTS[0])
        trace = [Arrival(0, 0.0, cls.name, HIGH_PRIORITY, request)]
        policy = limits.model_copy(update={"policy": "priority"})
        _, done, first, last = asyncio.run(engine_replay(group, trace, policy))
        out[cls.name] = done[0][1]
        timelines[cls.name] = timeline(trace[0], done, first, last)
    return out, timelines


def timeline(a: Arrival, done: dict[int, tuple], first: dict[int, float], last: dict[int, float]) -> dict:
    """Where one request's latency went: arrival to its first step's end (queue, prepare, a running forward or
    stage to wait out, its first forward), its other steps, and its last step's end to decoded."""
    return {
        "to_first_step_s": first[a.index] - a.at,
        "steps_s": last[a.index] - first[a.index],
        "to_decoded_s": done[a.index][1] - last[a.index],
    }


def capacity(pipe: H3Pipeline, sizes: Sizes, rounds: int = 2) -> dict:
    """Request-level throughput of the class mix: two of each class one after another (request-level FCFS),
    each class's mean service time weighted by its share; requests per second. Each class's best of
    ``rounds`` rounds: other work on a shared machine only ever slows a round down."""
    sample = [
        (cls, make_request(cls, sizes.steps, seed=2 + k, prompt=PROMPTS[k])) for cls in sizes.classes for k in (0, 1)
    ]
    mean_service: dict[str, float] = {}
    for _ in range(rounds):
        done: dict[int, tuple] = {}
        asyncio.run(sequential(pipe, [(0.0, request) for _, request in sample], done, {}))
        ends = [0.0] + [done[i][1] for i in range(len(sample))]
        service: dict[str, list[float]] = {}
        for i, (cls, _) in enumerate(sample):
            service.setdefault(cls.name, []).append(ends[i + 1] - ends[i])
        for name, seconds in service.items():
            mean_service[name] = min(mean_service.get(name, math.inf), sum(seconds) / len(seconds))
    per_request = sum(cls.share * mean_service[cls.name] for cls in sizes.classes)
    return {"service_s": mean_service, "mean_service_s": per_request, "requests_per_s": 1.0 / per_request}


def warm_up(pipe: H3Pipeline, sizes: Sizes) -> None:
    """Every class once through prepare, a step and decode (first calls allocate and pick kernels)."""
    for cls in sizes.classes:
        state = pipe.prepare(make_request(cls, sizes.steps, seed=0, prompt=PROMPTS[0]))
        pipe.step([state])
        pipe.decode(state)


# -- numbers ----------------------------------------------------------------------------------------
def stats_of(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean": sum(values) / len(values) if values else float("nan"),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
    }


def summarize(run: dict, trace: list[Arrival], idle: dict[str, float], idle_timelines: dict[str, dict]) -> dict:
    latency = {a.index: run["done"][a.index][1] - a.at for a in trace}
    ttfs = {a.index: run["first"][a.index] - a.at for a in trace}
    makespan = max(t for _, t in run["done"].values())  # the trace starts at 0 with its first arrival
    groups = {name: [a for a in trace if a.kind == name] for name in dict.fromkeys(a.kind for a in trace)}
    groups["high priority"] = [a for a in trace if a.priority == HIGH_PRIORITY]
    per_class = {
        name: {
            "latency": stats_of([latency[a.index] for a in members]),
            "ttfs": stats_of([ttfs[a.index] for a in members]),
        }
        for name, members in groups.items()
    }
    high = groups["high priority"]
    slowdown = [latency[a.index] / idle[a.kind] for a in high]  # each against its class alone on an idle engine
    timelines = {  # the engine modes record each forward's end; request-level FCFS does not
        str(a.index): dict(
            timeline(a, run["done"], run["first"], run["last"]), kind=a.kind, idle=idle_timelines[a.kind]
        )
        for a in high
        if run["last"]
    }
    return {
        "mode": run["mode"],
        "requests": len(trace),
        "makespan_s": makespan,
        "throughput_rps": len(trace) / makespan,
        "latency": stats_of(list(latency.values())),
        "per_class": per_class,
        "high_vs_idle_p99": percentile(slowdown, 99),
        "high_idle_p99_s": percentile([idle[a.kind] for a in high], 99),
        "high_timelines": timelines,
        "duty_cycle": run["duty_cycle"],
        "forward_s": run["forward_s"],
        "busy_s": run["busy_s"],
        "preemptions": run["preemptions"],
        "forwards": run["forwards"],
        "rows": run["rows"],
        # how fast the model ran in this mode: on a shared machine other work slows some runs more than others
        "forward_us_per_row": 1e6 * run["forward_s"] / run["rows"],
        "latency_by_request": [latency[a.index] for a in trace],
        "ttfs_by_request": [ttfs[a.index] for a in trace],
    }


def print_tables(load: float, rows: list[dict]) -> None:
    base = rows[0]
    columns(
        rows,
        [
            ("mode", "mode"),
            ("req/s", "throughput_rps"),
            ("vs FCFS", lambda r: r["throughput_rps"] / base["throughput_rps"]),
            ("mean s", "latency.mean"),
            ("vs FCFS", lambda r: r["latency"]["mean"] / base["latency"]["mean"]),
            ("p50 s", "latency.p50"),
            ("p99 s", "latency.p99"),
            ("duty cycle", "duty_cycle"),
            ("preempt", "preemptions"),
            ("forwards", "forwards"),
            ("fwd us/row", "forward_us_per_row"),
            ("max |px diff|", "agreement.max_pixel_diff"),
        ],
        f"load {load:g}: {base['requests']} requests; vs FCFS = / request-level FCFS; duty cycle = forward s / "
        "busy s; fwd us/row = forward s / rows (the same rows in every mode: how fast the model ran); max |px diff| = "
        "against request-level FCFS at the first load",
    )
    stats = ("mean", "p50", "p99")
    table(
        ["mode", "class", "n", "mean s", "p50 s", "p99 s", "TTFS mean s", "TTFS p50 s", "TTFS p99 s"],
        [
            [r["mode"], name, c["latency"]["n"], *(c["latency"][k] for k in stats), *(c["ttfs"][k] for k in stats)]
            for r in rows
            for name, c in r["per_class"].items()
        ],
        title=f"load {load:g}: latency (arrival to decoded) and time to first step (TTFS) per class",
    )
    phases, idle = ("to_first_step_s", "steps_s", "to_decoded_s"), ("idle: to 1st step", "steps", "decoded")
    table(
        ["mode", "request", "class", "to 1st step s", "steps s", "to decoded s", *idle],
        [
            [r["mode"], index, t["kind"], *(t[p] for p in phases), *(t["idle"][p] for p in phases)]
            for r in rows
            for index, t in r["high_timelines"].items()
        ],
        title=f"load {load:g}: where each high-priority request's latency went, beside its class alone on an idle "
        "engine (arrival to its first forward's end; then to its last forward's end; then to decoded)",
    )


def judge(results: dict, sizes: Sizes) -> list[dict]:
    """The issue's targets at TARGET_LOAD (or the highest load measured, with --loads), each with its value."""
    load = TARGET_LOAD if TARGET_LOAD in sizes.loads else max(sizes.loads)
    rows = {r["mode"]: r for r in results[str(load)]}
    base, srpt, prio = rows[REQUEST_LEVEL], rows["engine srpt"], rows["engine priority"]
    duty = min(rows[f"engine {p}"]["duty_cycle"] for p in POLICY_MODES)
    checks = [
        ("duty cycle (lowest of the engine's policies)", duty, ">=", TARGETS["duty_cycle"]),
        (
            "stills P99 / request-level FCFS's (srpt)",
            srpt["per_class"]["still"]["latency"]["p99"] / base["per_class"]["still"]["latency"]["p99"],
            "<=",
            TARGETS["stills_p99"],
        ),
        (
            "mean latency / request-level FCFS's (srpt)",
            srpt["latency"]["mean"] / base["latency"]["mean"],
            "<=",
            TARGETS["mean"],
        ),
        (
            "throughput / request-level FCFS's (srpt)",
            srpt["throughput_rps"] / base["throughput_rps"],
            ">=",
            TARGETS["throughput"],
        ),
        ("high-priority P99 of latency / idle (priority)", prio["high_vs_idle_p99"], "<=", TARGETS["high_p99_vs_idle"]),
    ]
    return judge_targets(checks, load, f"issue 23's targets at load {load:g}")


# -- the run ----------------------------------------------------------------------------------------
def run(sizes: Sizes, group: WorkerGroup, seed: int = 0) -> dict:
    pipe = group.pipeline
    limits = EngineLimits(max_active=8, max_queue=max(64, sizes.requests), max_rows_per_step=sizes.rows_per_step)
    requests, gaps = draw_trace(sizes, seed)
    say(f"machine: {machine()}\nbackend: {group.spec.resolution.backend}")
    say(
        "classes: "
        + ", ".join(
            f"{c.name} {c.width}x{c.height}x{c.num_frames} ({pipe.validate(make_request(c, sizes.steps, 0, 'x'))} rows)"
            for c in sizes.classes
        )
        + f"; {sizes.steps} steps; {sizes.requests} requests: "
        + ", ".join(f"{sum(r[0].name == c.name for r in requests)} {c.name}" for c in sizes.classes)
        + f", {sum(r[1] == HIGH_PRIORITY for r in requests)} of them priority {HIGH_PRIORITY}"
        + f"; engines: max_active {limits.max_active}, max_rows_per_step {limits.max_rows_per_step}"
    )
    warm_up(pipe, sizes)
    cap = capacity(pipe, sizes)
    idle, idle_timelines = idle_latency(group, sizes, limits)
    say(
        "capacity (request-level FCFS, two of each class back to back, best of two rounds): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in cap["service_s"].items())
        + f" -> {cap['requests_per_s']:.3f} requests/s on the mix; idle engine latency: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in idle.items())
    )
    reference: dict[int, object] = {}
    results: dict[str, list[dict]] = {}
    comparisons_all = []
    for load in sizes.loads:
        trace = at_rate(requests, gaps, load * cap["requests_per_s"])
        say(f"\n== load {load:g}: {load * cap['requests_per_s']:.3f} requests/s, last arrival at {trace[-1].at:.1f} s")
        rows = []
        for mode in MODES:
            started = now()
            ran = replay(mode, pipe, group, trace, limits)
            if not reference:  # request-level FCFS at the first load: what every other run is compared with
                reference = {i: media for i, (media, _) in ran["done"].items()}
            comparisons = [
                dict(compare_media(ran["done"][a.index][0], reference[a.index]), index=a.index) for a in trace
            ]
            comparisons_all += comparisons
            row = summarize(ran, trace, idle, idle_timelines)
            row["agreement"] = summarize_agreement(comparisons)
            rows.append(row)
            say(
                f"  {mode}: {now() - started:.1f} s wall, outputs agree: {'yes' if row['agreement']['agree'] else 'NO'}"
            )
        print_tables(load, rows)
        results[str(load)] = rows
    targets = judge(results, sizes)
    agreement = summarize_agreement(comparisons_all)
    say(
        f"\noutputs of every request in every mode and load vs request-level FCFS: max |pixel diff| "
        f"{agreement['max_pixel_diff']}, audio max diff {agreement['audio_max_diff']:.2g}: "
        f"{'AGREE' if agreement['agree'] else 'DIFFER'}"
    )
    return {
        "benchmark": "trace",
        "machine": machine(),
        "backend": group.spec.resolution.backend,
        "sizes": dataclasses.asdict(sizes),
        "limits": limits.model_dump(),
        "capacity": cap,
        "idle_latency_s": idle,
        "idle_timelines": idle_timelines,
        "trace": [
            {"index": i, "class": cls.name, "priority": priority, "seed": request.seed, "unit_gap": gap}
            for i, ((cls, priority, request), gap) in enumerate(zip(requests, gaps, strict=True))
        ],
        "results": results,
        "targets": targets,
        "agreement": agreement,
        "ok": agreement["agree"],
    }


def gpu_spec(checkpoint: str):
    """The released model on this node's first CUDA device, sp=1, with the backend admission picks here."""
    from h3serve.attention import probe_platform
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.pipelines.h3 import preset, validate_deployment

    full = preset("full")
    resolution = validate_deployment(
        model=full.name,
        geometry=full.geometry(),
        attention_backend="auto",
        platform=probe_platform("cuda"),
        device="cuda",
        dtype="bfloat16",
    )
    args = DeployArgs(model="full", checkpoint=checkpoint, device="cuda", sp_degree=1)
    return args.replica_spec(resolution)


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="6 requests, 3 steps, load 0.8 only (the test's smoke)")
    ap.add_argument("--requests", type=int, help="requests in the trace")
    ap.add_argument("--steps", type=int, help="num_inference_steps of every request")
    ap.add_argument("--rows", type=int, help="the engines' max_rows_per_step")
    ap.add_argument("--loads", help="comma-separated fractions of capacity (default 0.5,0.8,0.95)")
    ap.add_argument("--seed", type=int, default=0, help="the trace's seed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as a default Serve replica)")
    ap.add_argument("--gpu", action="store_true", help="the released model on CUDA (needs --checkpoint)")
    ap.add_argument(
        "--checkpoint",
        default=os.environ.get("H3SERVE_CHECKPOINT"),
        help="the released checkpoint directory for --gpu (default $H3SERVE_CHECKPOINT)",
    )


def run_args(args: argparse.Namespace) -> dict | int:
    if args.gpu:
        if not torch.cuda.is_available():
            say(
                "trace --gpu: CUDA is not available here (torch.cuda.is_available() is False); run it on a GPU "
                "node, or without --gpu for the CPU trace on the tiny preset"
            )
            return 2
        if not args.checkpoint or not Path(args.checkpoint).is_dir():
            say(
                f"trace --gpu: needs the released checkpoint directory (--checkpoint or $H3SERVE_CHECKPOINT); "
                f"got {args.checkpoint!r}"
            )
            return 2
    sizes = GPU if args.gpu else QUICK if (args.quick or args.smoke) else FULL
    sizes = dataclasses.replace(
        sizes,
        requests=args.requests or sizes.requests,
        steps=args.steps or sizes.steps,
        rows_per_step=args.rows or sizes.rows_per_step,
        loads=tuple(float(x) for x in args.loads.split(",")) if args.loads else sizes.loads,
    )
    with torch_threads(args.threads), worker_group(gpu_spec(args.checkpoint) if args.gpu else tiny_spec(sp=1)) as group:
        return run(sizes, group, args.seed)


main = cli(__doc__, run_args, options, __name__)
