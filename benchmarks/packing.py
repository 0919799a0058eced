"""Packed continuous batching vs sglang's baselines on a mixed-size workload (tiny preset, CPU).

    python -m benchmarks.packing [--smoke] [--rounds N] [--json PATH]

The same pipeline, requests and seeds go through three schedulers, one after the other:
  (a) sequential: one request per forward, FIFO, each runs alone to completion;
  (b) bucketed: arrived requests of identical shape (size, frames, steps, CFG, audio) run in
      lockstep until done; new arrivals wait for the next batch;
  (c) packed: h3serve's replicas.Engine on an sp=1 WorkerGroup (any size, any step, one forward).
Arrivals are simulated in real time with asyncio; latency = completion - arrival.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import sys

from pipelines.h3 import GenerationRequest, H3Pipeline
from replicas import Engine, EngineLimits, ReplicaSpec, WorkerGroup

from .common import (StepLog, compare_media, cpu_resolution, machine, median, now, parser, percentile, say,
                     summarize_agreement, table, write_json)
from .packing_report import cost_model, judge

PROMPTS = ["a red fox", "a lighthouse at dusk, oil painting", "waves on a beach",
           "a city street at night in the rain, neon reflections", "a bowl of fruit", "mountains under snow"]


def workload(smoke: bool, seed: int = 0) -> list[tuple[float, GenerationRequest]]:
    """(arrival offset s, request): a burst of half at t=0, then the rest staggered, seeded."""
    rng = random.Random(seed)
    n = 6 if smoke else 16
    sizes = [(64, 64), (128, 128)] if smoke else [(64, 64), (128, 128), (256, 128), (256, 256)]
    steps = (2, 3) if smoke else (4, 8)
    out, t = [], 0.0
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        frames, audio = (9, True) if (i == n - 3 and not smoke) else (1, None)  # one small video with sound
        if i >= n // 2:
            t += rng.uniform(0.02, 0.04) if smoke else rng.uniform(0.05, 0.1)
        out.append((t, GenerationRequest(
            prompt=rng.choice(PROMPTS), width=w, height=h, num_frames=frames, audio=audio,
            steps=rng.choice(steps), guidance_scale=1.0 if i % 5 == 4 else 4.0, seed=1000 + i)))
    return out


def shape_key(r: GenerationRequest) -> tuple:
    return r.width, r.height, r.num_frames, r.steps, r.uses_cfg, r.with_audio


class Scheduler:
    """Runs model work on one thread (as the Engine does) and counts forwards, rows and padding."""

    def __init__(self, pipe: H3Pipeline):
        self.pipe, self.forwards, self.rows, self.padding = pipe, 0, 0, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    async def call(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def step(self, states) -> None:
        s = await self.call(self.pipe.step, states)
        self.forwards, self.rows, self.padding = self.forwards + 1, self.rows + s.rows, self.padding + s.padding_rows

    async def until_arrival(self, t0: float, offset: float) -> None:
        await asyncio.sleep(max(0.0, t0 + offset - now()))


async def sequential(pipe, work, done: dict) -> Scheduler:
    sched, t0 = Scheduler(pipe), now()
    for i, (arrival, request) in enumerate(work):  # work is in arrival order: FIFO
        await sched.until_arrival(t0, arrival)
        state = await sched.call(pipe.prepare, request)
        while not state.done:
            await sched.step([state])
        done[i] = (await sched.call(pipe.decode, state), now() - t0)
    return sched


async def bucketed(pipe, work, done: dict, max_batch: int = 16) -> Scheduler:
    sched, t0, pending = Scheduler(pipe), now(), list(range(len(work)))
    while pending:
        arrived = [i for i in pending if work[i][0] <= now() - t0]
        if not arrived:
            await sched.until_arrival(t0, work[pending[0]][0])
            continue
        key = shape_key(work[arrived[0]][1])  # the oldest request picks the bucket
        batch = [i for i in arrived if shape_key(work[i][1]) == key][:max_batch]
        pending = [i for i in pending if i not in batch]
        states = [await sched.call(pipe.prepare, work[i][1]) for i in batch]
        while not states[0].done:  # same steps: lockstep
            await sched.step(states)
        for i, state in zip(batch, states):
            done[i] = (await sched.call(pipe.decode, state), now() - t0)
    return sched


async def packed(group, work, done: dict) -> Engine:
    engine, t0 = Engine(group, EngineLimits(max_queue=64, max_active=16), StepLog()), now()

    async def one(i, arrival, request):
        await asyncio.sleep(max(0.0, t0 + arrival - now()))
        done[i] = (await engine.generate(request), now() - t0)

    await asyncio.gather(*(one(i, a, r) for i, (a, r) in enumerate(work)))
    await engine.close("benchmark done")
    return engine


def summary(name, work, done, forwards, rows, padding) -> dict:
    latency = [done[i][1] - work[i][0] for i in range(len(work))]
    makespan = max(t for _, t in done.values())
    return {"scheduler": name, "requests": len(work), "makespan_s": makespan, "throughput_rps": len(work) / makespan,
            "p50_s": percentile(latency, 50), "p99_s": percentile(latency, 99), "forwards": forwards,
            "rows": rows, "padding_rows": padding, "padding_frac": padding / rows}


def compare(pipe, group, work, rounds: int) -> dict:
    """Run (a), (b), (c) on the same requests ``rounds`` times; medians, output checks, engine steps."""
    per_round, comparisons, steps = [], [], []
    for k in range(rounds):
        done = {"a": {}, "b": {}, "c": {}}
        sa = asyncio.run(sequential(pipe, work, done["a"]))
        sb = asyncio.run(bucketed(pipe, work, done["b"]))
        ec = asyncio.run(packed(group, work, done["c"]))
        rows = [summary("(a) sequential", work, done["a"], sa.forwards, sa.rows, sa.padding),
                summary("(b) bucketed", work, done["b"], sb.forwards, sb.rows, sb.padding),
                summary("(c) packed engine", work, done["c"], ec.stats.forwards, ec.stats.rows, ec.stats.padding_rows)]
        for r in rows:
            r["ratio_vs_a"] = r["throughput_rps"] / rows[0]["throughput_rps"]
        per_round.append(rows)
        steps += ec.observer.steps
        for other in ("b", "c"):
            comparisons += [dict(compare_media(done[other][i][0], done["a"][i][0]), pair=f"{other}-vs-a", seed=r.seed)
                            for i, (_, r) in enumerate(work)]
        say(f"  round {k + 1}/{rounds}: throughput vs (a): b {rows[1]['ratio_vs_a']:.2f}x, c {rows[2]['ratio_vs_a']:.2f}x")
    keys = ["makespan_s", "throughput_rps", "p50_s", "p99_s", "forwards", "padding_frac", "ratio_vs_a"]
    med = [{"scheduler": per_round[0][j]["scheduler"], **{k: median([r[j][k] for r in per_round]) for k in keys}}
           for j in range(3)]
    agreement = {p: summarize_agreement([c for c in comparisons if c["pair"] == p]) for p in ("b-vs-a", "c-vs-a")}
    table(["scheduler", "makespan s", "req/s", "p50 s", "p99 s", "forwards", "padding %", "vs (a)"],
          [[m["scheduler"], m["makespan_s"], m["throughput_rps"], m["p50_s"], m["p99_s"], m["forwards"],
            100 * m["padding_frac"], m["ratio_vs_a"]] for m in med],
          title=f"median of {rounds} round(s); p99 of {len(work)} requests is ~the max")
    table(["outputs", "requests", "agree", "max |pixel diff|", "max frac px differ", "audio max diff"],
          [[p, a["requests"], a["agree"], a["max_pixel_diff"], a["max_frac_pixels_differ"], a["audio_max_diff"]]
           for p, a in agreement.items()], title="outputs per seed (frames: |diff| <= 1; audio: allclose 1e-4/1e-5)")
    return {"rounds": per_round, "median": med, "agreement": agreement, "comparisons": comparisons, "engine_steps": steps}


def run(smoke: bool = False, rounds: int | None = None) -> dict:
    rounds = rounds or (1 if smoke else 5)
    work = workload(smoke)
    group = WorkerGroup.create(ReplicaSpec(resolution=cpu_resolution(), sp_degree=1))
    # (a) and (b) call pipeline.step on a twin that shares the group's model (same weights, same kernels)
    pipe = H3Pipeline(group.pipeline.config, group.pipeline.model, group.pipeline.device)
    say(f"{len(work)} requests (WxHxframes/steps/cfg): "
        + ", ".join(f"{r.width}x{r.height}x{r.num_frames}/{r.steps}/{'cfg' if r.uses_cfg else '-'}" for _, r in work))
    for _, r in work:  # warm up every shape once, and one big pack
        pipe.step([pipe.prepare(r)])
    pipe.step([pipe.prepare(r) for _, r in work])
    scenarios = {"staggered": work} if smoke else {"staggered": work, "burst": [(0.0, r) for _, r in work]}
    results = {}
    for name, w in scenarios.items():
        say(f"\n== {name}: arrivals (s) {', '.join(f'{a:.2f}' for a, _ in w)}")
        results[name] = compare(pipe, group, w, rounds)
    say("(b) runs pipeline.step on each bucket: the same varlen kernel path as (c); sglang would pad a\n"
        "    same-shape batch to [B, S] instead, which costs (b) more than here.")

    cost = cost_model(pipe, work, reps=3 if smoke else 9)
    targets = judge(results, cost, work, smoke)
    ok = all(pair["agree"] for r in results.values() for pair in r["agreement"].values())
    say(f"\noutputs agree across schedulers: {'YES' if ok else 'NO'}")
    return {"benchmark": "packing", "smoke": smoke, "machine": machine(), "scenarios": results, "cost": cost,
            "targets": targets, "ok": ok, "workload": [{"arrival_s": t, **r.model_dump()} for t, r in work]}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, help="repeat a, b, c this many times (default 5; smoke 1)")
    args = ap.parse_args(argv)
    result = run(args.smoke, args.rounds)
    write_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
