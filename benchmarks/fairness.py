"""Fair sharing between tenants (issue 55): one tenant floods, another sends a few; the other's latency alone and
beside the flood, with the scheduler's fair sharing on and off, side by side in one run.

    python -m benchmarks.fairness [--flood N] [--others K] [--steps S] [--policy fcfs] [--json PATH]

Engine-level on CPU (tiny preset, one sp=1 WorkerGroup, one torch thread; no HTTP: the tenant rides on the
request, as the ingress sets it from its key file). Tenant "flood" sends ``N`` clips (96x64, 192 frames) at once at
t=0; tenant "other" sends ``K`` stills (64x64, 124 frames) one every ``gap`` seconds from t=0.5 s, ``gap`` being
twice a still's latency alone on the engine (measured first), so alone they never queue behind each other. Modes:
  other alone     the other tenant's trace on an idle engine
  flood, fair off the two traces together, ``engine.fair_share`` false (the policy alone: submission order)
  flood, fair on  the same, ``engine.fair_share`` true (the default)
The engine: ``--policy`` (default fcfs, the deployment default), ``max_active`` 2 and ``max_rows_per_step`` 2048, so
the flood fills every pack and its backlog queues. Reported: the other tenant's latency (arrival to decoded) P50/P99,
its P99 over its P99 alone (issue 55's target: within ``TARGET_FACTOR``), the flood's P99 and makespan, and the
seconds of forwards by tenant (``EngineStats.tenant_forward_s``, the metric ``h3serve_tenant_gpu_seconds``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import torch

from h3serve.replicas import EngineLimits, WorkerGroup

from .harness import cli, judge_targets, machine, percentile, say, table, tiny_spec
from .packing import PROMPTS
from .trace import TINY_CLASSES, Arrival, engine_replay, make_request

STILL, CLIP = TINY_CLASSES[0], TINY_CLASSES[1]
TARGET_FACTOR = 5.0  # the other P99 beside the flood (fair on) over alone: one running clip (~2x its rows) to wait out
MODES = ("other alone", "flood, fair off", "flood, fair on")


def arrivals(flood: int, others: int, steps: int, gap_s: float) -> tuple[list[Arrival], list[Arrival]]:
    """(the flood's, the other tenant's) arrivals; indices unique across both."""
    flooding = [
        Arrival(
            i,
            0.0,
            "flood",
            0,
            make_request(CLIP, steps, 100 + i, PROMPTS[i % len(PROMPTS)]).model_copy(update={"tenant": "flood"}),
        )
        for i in range(flood)
    ]
    other = [
        Arrival(
            flood + k,
            0.5 + k * gap_s,
            "other",
            0,
            make_request(STILL, steps, 500 + k, PROMPTS[k % len(PROMPTS)]).model_copy(update={"tenant": "other"}),
        )
        for k in range(others)
    ]
    return flooding, other


def replay(group: WorkerGroup, trace: list[Arrival], limits: EngineLimits) -> dict:
    engine, done, _, _ = asyncio.run(engine_replay(group, sorted(trace, key=lambda a: a.at), limits))
    latency = {a.index: done[a.index][1] - a.at for a in trace}
    by_kind = {kind: [latency[a.index] for a in trace if a.kind == kind] for kind in ("flood", "other")}
    return {
        "latency": by_kind,
        "makespan_s": max(t for _, t in done.values()),
        "preemptions": engine.stats.preemptions,
        "forward_s_by_tenant": {str(k): v for k, v in engine.stats.tenant_forward_s.items()},
    }


def run(flood: int, others: int, steps: int, policy: str, group: WorkerGroup) -> dict:
    limits = EngineLimits(policy=policy, max_active=2, max_rows_per_step=2048, warmup=False)
    one = Arrival(0, 0.0, "other", 0, make_request(STILL, steps, 1, PROMPTS[0]))
    replay(group, [one], limits)  # warm: first calls allocate and pick kernels
    gap_s = 2 * replay(group, [one], limits)["latency"]["other"][0]
    flooding, other = arrivals(flood, others, steps, gap_s)
    say(f"trace: {flood} clips from 'flood' at t=0, {others} stills from 'other' every {gap_s:.2f} s; {policy}")
    runs = {
        "other alone": replay(group, other, limits),
        "flood, fair off": replay(group, flooding + other, limits.model_copy(update={"fair_share": False})),
        "flood, fair on": replay(group, flooding + other, limits.model_copy(update={"fair_share": True})),
    }
    alone_p99 = percentile(runs["other alone"]["latency"]["other"], 99)
    rows = []
    for mode, r in runs.items():
        mine, theirs = r["latency"]["other"], r["latency"]["flood"]
        r["other_p99_vs_alone"] = percentile(mine, 99) / alone_p99
        seconds = r["forward_s_by_tenant"]
        rows.append(
            [
                mode,
                percentile(mine, 50),
                percentile(mine, 99),
                r["other_p99_vs_alone"],
                percentile(theirs, 99) if theirs else None,
                r["makespan_s"],
                r["preemptions"],
                seconds.get("other", 0.0),
                seconds.get("flood", 0.0),
            ]
        )
    table(
        [
            "mode",
            "other P50 s",
            "other P99 s",
            "P99 / alone",
            "flood P99 s",
            "makespan s",
            "preempt",
            "other fwd s",
            "flood fwd s",
        ],
        rows,
        title="the other tenant beside a flood",
    )
    checks = [("other P99 / alone, fair on", runs["flood, fair on"]["other_p99_vs_alone"], "<=", TARGET_FACTOR)]
    targets = judge_targets(checks, 0.0, "issue 55's target")
    return {
        "machine": machine(),
        "sizes": {"flood": flood, "others": others, "steps": steps, "policy": policy, "gap_s": gap_s},
        "runs": runs,
        "targets": targets,
        "ok": all(t["met"] for t in targets),
    }


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--flood", type=int, default=12, help="clips the flooding tenant sends at once (default 12)")
    ap.add_argument("--others", type=int, default=5, help="stills the other tenant sends (default 5)")
    ap.add_argument("--steps", type=int, default=8, help="num_inference_steps of every request (default 8)")
    ap.add_argument("--policy", default="fcfs", choices=("fcfs", "srpt", "priority"), help="engine.policy")


def run_args(args: argparse.Namespace) -> dict:
    own_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    group = WorkerGroup.create(tiny_spec(sp=1))
    try:
        if args.smoke:
            return run(4, 2, 3, args.policy, group)
        return run(args.flood, args.others, args.steps, args.policy, group)
    finally:
        group.shutdown()
        torch.set_num_threads(own_threads)


main = cli(__doc__, run_args, options)

if __name__ == "__main__":
    sys.exit(main())
