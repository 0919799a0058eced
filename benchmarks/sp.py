"""Ulysses sequence parallelism on CPU: sp=2 vs sp=1 for one packed forward of a mixed pack (gloo).

    python -m benchmarks.sp [--smoke] [--json PATH]

The same requests are packed for an sp=1 WorkerGroup (no padding) and for an sp=2 one (rank 0
here, rank 1 a Ray actor, torch.distributed over gloo on loopback; padded only to T % 2), and one
packed forward of each runs; the video and audio velocities must be allclose (1e-5). Each rank runs
one torch thread (a Ray actor with 1 CPU gets OMP_NUM_THREADS=1), so sp=2 uses 2 cores for what
sp=1 does on one; sp=1 with both cores (2 threads) is shown too.

Step caching's own cost under Ulysses (issue 24): the same requests denoised with a policy that never skips
(threshold 0: every document computes every block, the outputs equal no caching bit for bit) against no
caching, at sp=1 and sp=2, interleaved. At sp=2 a caching pack all-gathers [T, hidden] at its transitions (the
blocks' input, the decision block, the middle's end), so the difference is what the gathers and the kept
residuals cost when caching buys nothing.

Bytes rank 0 gathers per packed forward, from the shapes: before issue 22 every rank sent its rows of the
final hidden state ([T/W, hidden] fp32); now each rank applies norm_out and the output heads to its own
rows and sends [T/W, max(C_video, C_audio)] fp32. Shown for each tiny pack and for the released size
(two T2VA requests at 1344x768, 124 and 141 frames: ~81k rows).
"""

from __future__ import annotations

import logging
import math

import ray
import torch

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.pipelines.h3.shapes import Clip, clip_rows, human_bytes, transformer_config
from h3serve.pipelines.h3.step_cache import StepCachePolicy
from h3serve.replicas import WorkerGroup

from . import packing
from .harness import columns, machine, median, say, smoke_main, table, time_ms, tiny_spec
from .packing import one_pack
from .step_cache import denoise

RELEASED_PACK = (Clip(1344, 768, 124), Clip(1344, 768, 141))  # two T2VA requests at the released canvas


def gathered_bytes(config: dict, rows: int) -> dict:
    """Bytes rank 0 gathers in one packed forward of ``rows`` rows (all ranks' rows, fp32 as the heads run)."""
    c_video = config["in_channels"] * math.prod(config["patch_size"])  # proj_out: hidden -> C * pt * ph * pw
    c_audio = config["audio_in_channels"]  # audio_proj_out: hidden -> C_audio
    before = rows * config["hidden_size"] * 4  # the hidden state after norm_out
    after = rows * max(c_video, c_audio) * 4  # video rows through proj_out, audio rows through audio_proj_out
    return {
        "rows": rows,
        "columns_before": config["hidden_size"],
        "columns_after": max(c_video, c_audio),
        "bytes_before": before,
        "bytes_after": after,
        "reduction": before / after,
    }


def batches(smoke: bool) -> dict[str, list[GenerationRequest]]:
    mixed = [r for _, r in packing.workload(smoke)]
    out = {
        "1 request 64x64x124": [GenerationRequest(prompt="a red fox", width=64, height=64, seed=1)],
        f"mixed {len(mixed)} requests (T2VA + FL2VA)": mixed,
    }
    if not smoke:
        out["4 x 128x64x158"] = [
            GenerationRequest(prompt=f"waves {i}", width=128, height=64, num_frames=158, seed=i) for i in range(4)
        ]
    return out


def allclose(got, want) -> tuple[bool, float]:
    diffs = [float((g - w).abs().max()) for g, w in zip(got, want, strict=True)]  # video, audio
    return all(torch.allclose(g, w, rtol=1e-5, atol=1e-5) for g, w in zip(got, want, strict=True)), max(diffs)


NEVER_SKIPS = StepCachePolicy(threshold=0.0, warmup_steps=1, max_consecutive_skips=10**6)


def denoise_ms(group: WorkerGroup, requests: list[GenerationRequest], policy: StepCachePolicy | None) -> float:
    """Milliseconds per packed step to denoise ``requests`` together, every one under ``policy``."""
    states, seconds, _, _ = denoise(group.pipeline, requests, [policy] * len(requests))
    return 1000 * seconds / max(s.steps for s in states)  # one packed step per step of the longest


def caching_overhead(solo: WorkerGroup, duo: WorkerGroup, requests: list[GenerationRequest], reps: int) -> dict:
    """Per-step ms without caching and with a policy that never skips, sp=1 and sp=2 (one thread a rank)."""
    runs = {
        (sp, name): (group, policy)
        for sp, group in ((1, solo), (2, duo))
        for name, policy in (("off", None), ("never skips", NEVER_SKIPS))
    }
    times: dict[tuple[int, str], list[float]] = {k: [] for k in runs}
    torch.set_num_threads(1)
    for _ in range(reps + 1):  # interleaved; the first round warms up
        for k, (group, policy) in runs.items():
            times[k].append(denoise_ms(group, requests, policy))
    ms = {k: median(v[1:]) for k, v in times.items()}
    return {
        f"sp={sp}": {"off ms": ms[sp, "off"], "never skips ms": ms[sp, "never skips"]}
        | {"overhead": ms[sp, "never skips"] / ms[sp, "off"]}
        for sp in (1, 2)
    }


def run(smoke: bool = False) -> dict:
    reps = 2 if smoke else 6
    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    threads = torch.get_num_threads()
    solo, duo = WorkerGroup.create(tiny_spec(sp=1)), WorkerGroup.create(tiny_spec(sp=2))
    rows, ok = [], True
    try:
        say(f"machine: {machine()}\nbackend: {duo.spec.resolution.backend}")
        for name, requests in batches(smoke).items():
            states = [duo.pipeline.prepare(r) for r in requests]
            pack1, pack2 = one_pack(solo.pipeline, states), one_pack(duo.pipeline, states)
            runs = {
                "sp=1, 1 thread": (solo.forward_rank0, pack1, 1),
                "sp=2, 1 thread/rank": (duo, pack2, 1),
                "sp=1, 2 threads": (solo.forward_rank0, pack1, 2),
            }
            times = {k: [] for k in runs}
            for _ in range(reps + 1):  # interleaved; the first round warms up
                for k, (fn, pack, n) in runs.items():
                    torch.set_num_threads(n)
                    times[k] += time_ms(lambda fn=fn, pack=pack: fn(pack), reps=1, warmup=0)
            torch.set_num_threads(threads)
            close, diff = allclose(duo(pack2), solo.forward_rank0(pack1))
            ok &= close
            ms = {k: median(v[1:]) for k, v in times.items()}
            rows.append(
                {
                    "gather": gathered_bytes(transformer_config("tiny"), pack2.total_rows),
                    "batch": name,
                    "docs": len(pack1.lengths),
                    "rows": pack1.total_rows,
                    "sp2_rows": pack2.total_rows,
                    "sp1_padding_rows": pack1.padding_rows,
                    "sp2_padding_rows": pack2.padding_rows,
                    **{f"{k} ms": v for k, v in ms.items()},
                    "sp2_vs_sp1": ms["sp=2, 1 thread/rank"] / ms["sp=1, 1 thread"],
                    "sp2_vs_sp1_2threads": ms["sp=2, 1 thread/rank"] / ms["sp=1, 2 threads"],
                    "max_abs_diff": diff,
                    "allclose_1e-5": close,
                }
            )
        cached_requests = batches(smoke)["1 request 64x64x124"] * (1 if smoke else 2)
        cached_requests = [r.model_copy(update={"num_inference_steps": 4 if smoke else 8}) for r in cached_requests]
        overhead = caching_overhead(solo, duo, cached_requests, reps)
    finally:
        torch.set_num_threads(threads)
        duo.shutdown()
        solo.shutdown()
        if started_ray:
            ray.shutdown()
    say()
    columns(
        rows,
        [
            ("batch", "batch"),
            ("docs", "docs"),
            ("rows", "rows"),
            ("sp=2 pad rows", "sp2_padding_rows"),
            ("sp=1 ms", "sp=1, 1 thread ms"),
            ("sp=2 ms", "sp=2, 1 thread/rank ms"),
            ("sp2/sp1", "sp2_vs_sp1"),
            ("sp=1 2thr ms", "sp=1, 2 threads ms"),
            ("sp2/sp1(2thr)", "sp2_vs_sp1_2threads"),
            ("max |diff|", "max_abs_diff"),
            ("allclose", lambda r: r["allclose_1e-5"]),
        ],
        f"one packed forward, median of {reps}, interleaved (tiny: 4 blocks + 2 refiner blocks, 4 heads x 32)",
    )
    say(
        "  padding: sp=1 packs have none; sp=2 pads only to an even row count (T % 2: 0 or 1 row).\n"
        "  sp2/sp1: one torch thread per rank on both sides, so sp=2 halves each rank's compute (ideal 0.5x).\n"
        "  sp2/sp1(2thr): sp=1 given both cores instead; two OpenMP threads on a shared 2-core box stall\n"
        "  whenever another process runs, so that column swings widely between runs."
    )
    small = rows[0]
    fixed = small["sp=2, 1 thread/rank ms"] - small["sp=1, 1 thread ms"] / 2
    say(
        f"  sp=2 adds ~{fixed:.0f} ms per forward (from the {small['rows']}-row pack: sp=2 - sp=1/2): 4 all-to-alls\n"
        "  per attention (q, k, v to heads, output back to rows) in 4 blocks + 1 gather over gloo on loopback, a\n"
        "  ray.put of the pack and an actor call; every rank also refines all prompts (text is not sharded)."
    )
    full = transformer_config("full")
    released = gathered_bytes(full, sum(clip_rows(full, c) for c in RELEASED_PACK))
    gathers = [(r["batch"] + " (tiny)", r["gather"]) for r in rows] + [(" + ".join(map(str, RELEASED_PACK)), released)]
    say()
    table(
        ["pack", "rows", "before: columns", "before: bytes", "after: columns", "after: bytes", "less"],
        [
            [
                name,
                g["rows"],
                g["columns_before"],
                human_bytes(g["bytes_before"]),
                g["columns_after"],
                human_bytes(g["bytes_after"]),
                f"{g['reduction']:.0f}x",
            ]
            for name, g in gathers
        ],
        title="bytes rank 0 gathers per packed forward (fp32): the hidden state (before) vs the heads' outputs (after)",
    )
    say()
    table(
        ["ranks", "off ms/step", "never skips ms/step", "never skips / off"],
        [[sp, o["off ms"], o["never skips ms"], f"{o['overhead']:.2f}x"] for sp, o in overhead.items()],
        title=f"step caching that skips nothing (threshold 0) vs off: {len(cached_requests)} x "
        f"{cached_requests[0].width}x{cached_requests[0].height}, {cached_requests[0].num_inference_steps} steps, "
        f"median of {reps}, one thread a rank",
    )
    say(
        "  at sp=2 a caching pack all-gathers [T, hidden] at its transitions (block input, decision, middle's end)\n"
        "  and keeps every caching row's residuals on every rank; at sp=1 it keeps them and copies h_Fn."
    )
    say(f"\noutputs allclose (1e-5) sp=2 vs sp=1: {'YES' if ok else 'NO'}")
    return {
        "benchmark": "sp",
        "smoke": smoke,
        "machine": machine(),
        "reps": reps,
        "rows": rows,
        "released_gather": released,
        "caching_overhead": overhead,
        "ok": bool(ok),
    }


main = smoke_main(__doc__, run, __name__)
