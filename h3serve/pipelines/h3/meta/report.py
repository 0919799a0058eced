"""What ``h3serve plan`` prints: the released step counted on meta and checked, and the **projected** seconds.

``placement``: a deployment's step (its Ulysses degree) per rank: FLOPs, all-to-all and elementwise bytes, memory,
projected seconds. ``paths``: every path a replica steps, held to its budgets (``step.check``). ``end_to_end``: every
stage of a released T2VA and FL2VA, projected on 8 and 4 H200s and the H100 staged config beside the peers'
published seconds, and the projected start. Every projected figure is printed with its assumptions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from h3serve.pipelines.h3.memory import GiB

from . import projection as pj
from .step import PACKS, PATHS, RELEASED, Ask, MetaReplica, UlyssesFactory, check, measure_path, sync_budget
from .tables import table


def assumptions(extra: dict[str, str] | None = None) -> None:
    for assumption, replaced_by in {**pj.ASSUMPTIONS, **(extra or {})}.items():
        print(f"  assumed {assumption}: a GPU run replaces it with {replaced_by}")


def projection_table(rows: list[dict], efficiency: float = 0.6) -> None:
    table(
        ["pack", "rows", "GPUs (sp)", "GPU", "fits", "GEMM s", "attention s", "all-to-all s", "elementwise s",
         "s / step", "s / clip (49 fwd)", "floor s / clip"],
        [[r["pack"], r["rows"], r["sp_degree"], r["gpu"], r["fits"], r["gemm"], r["attention"], r["all_to_all"],
          r["elementwise"], r["total"], r["clip_s"], r["floor_clip_s"]]
         for r in rows if r["gemm_efficiency"] == efficiency],
        f"== PROJECTED (not measured): GEMMs at {efficiency:.0%} of {pj.BF16_DENSE_TFLOPS:g} TFLOP/s, attention at "
        f"{pj.ATTENTION_TFLOPS:g} TFLOP/s (FlashAttention-3), all-to-all {pj.ALL_TO_ALL_GBPS:g} GB/s, elementwise at "
        f"{pj.HBM_EFFICIENCY:.0%} of HBM, nothing overlapped",
    )  # fmt: skip


def placement(replica: MetaReplica, sp_degree: int, max_rows: int) -> dict:
    """One released clip and the row budget's pack at ``sp_degree``: rank 0's counts, memory and projected seconds."""
    packs: dict[str, Sequence[Ask]] = {"one released clip": PACKS["one"]}
    if max_rows >= 79932:  # the budget pack: two released clips and a small one
        packs["row budget (79,932 rows)"] = PACKS["budget"]
    rows = pj.project(replica, packs, degrees=(sp_degree,))
    table(
        ["pack", "rows", "TFLOP / rank", "all-to-all GB / rank", "elementwise GB", "weights GiB", "activations GiB",
         "requests GiB"],
        [[r["pack"], r["rows"], r["flops"] / 1e12, r["all_to_all_bytes"] / 1e9, r["memory_bytes"] / 1e9,
          r["weight_bytes"] / GiB, r["activation_bytes"] / GiB, r["request_bytes"] / GiB]
         for r in rows if (r["gpu"], r["gemm_efficiency"]) == ("H200", 0.6)],
        f"== counted on meta: one step at sp_degree {sp_degree}, rank 0's share (memory: the plan for the pack)",
    )  # fmt: skip
    projection_table(rows)
    assumptions()
    return {"projection": rows, "assumptions": pj.ASSUMPTIONS}


def paths(replica: MetaReplica) -> dict:
    """Every step path measured and checked against its budgets (``step.PATHS``)."""
    results = {name: measure_path(replica, path) for name, path in PATHS.items()}
    table(
        ["path", "rows (text)", "TFLOP counted", "/ formula", "syncs (mid-fwd)", "activations GiB", "/ plan",
         "requests' tensors MiB", "/ plan"],
        [[name, f"{r['rows']} ({r['text_rows']})", r["flops"] / 1e12,
          f"{r['flops_ratio']:.4f}" if r.get("flops_ratio") is not None else "-",
          f"{len(r['syncs'])} ({r['mid_forward_syncs']})", r["activation_peak_bytes"] / GiB,
          f"{r['plan']['activation_ratio']:.3f}", r["resident_bytes"] / 2**20, f"{r['plan']['request_ratio']:.3f}"]
         for name, r in results.items()],
        "== measured on meta: one step of the released transformer (bf16, fp32 where diffusers keeps it)",
    )  # fmt: skip
    for name, r in results.items():
        print(f"-- {name}: host syncs (kind, op, shape, before/mid-forward, where)")
        print("\n".join(f"   {line}" for line in r["syncs"]))
    checks = {name: check(name, r) for name, r in results.items()}
    model = replica.model
    return {
        "ok": all(problems == [] for problems in checks.values()),
        "checks": checks,
        "paths": results,
        "sync_budgets": {name: sync_budget(path.parts) for name, path in PATHS.items()},
        "model": {
            "keep_in_fp32_modules": sorted(model._keep_in_fp32_modules or []),
            "rope_inv_freq_dtype": str(model.rope.inv_freq.dtype),
            "parameter_bytes": replica.weight_bytes,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    }


def peers(replica: MetaReplica) -> list[dict]:
    """The peers' published seconds beside the projected denoising of the same clips."""
    rows = pj.project(replica, {k: pj.PROJECTED_PACKS[k] for k in ("one", "fast")}, degrees=(4, 8))
    out = []
    for label, seconds, pack, gpus, forwards in pj.PEERS:
        ours = next(
            r for r in rows if (r["pack"], r["sp_degree"], r["gpu"], r["gemm_efficiency"]) == (pack, gpus, "H200", 0.6)
        )
        out.append(dict(peer=label, published_s=seconds, projected_denoise_s=ours["total"] * forwards,
                        floor_s=pj.floor_seconds(ours["pack_flops"], gpus, forwards)))  # fmt: skip
    table(["published", "s", "projected denoise s (60%)", "floor s"],
          [[p["peer"], p["published_s"], p["projected_denoise_s"], p["floor_s"]] for p in out],
          "== the peers' published seconds per clip beside h3serve's PROJECTED denoising time")  # fmt: skip
    return out


# The peers' published end-to-end seconds for one released T2VA (1344x768, 5 s, 50 steps), by placement
E2E_PEERS = {
    "8 H200 (sp=8, decode on 8)": "sglang 39.67 (lossless); diffusers 74.3",
    "4 H200 (sp=4, decode on 4)": "sglang 75.10; vLLM-Omni 85.5",
    "H100 staged (sp=4, 2 decoders)": "none published at this size",
}


def end_to_end(replica: MetaReplica, clips: Sequence[Any] = (RELEASED, dataclasses.replace(RELEASED,
               keyframes=("first", "last")))) -> dict:  # fmt: skip
    """Every stage of each clip counted on meta, and the **projected** end to end per placement."""
    from .stages import stage_counts

    rows = [row for clip in clips for row in pj.end_to_end(replica, clip)]
    names = list(rows[0]["stages"])
    table(
        ["clip", "stage", "TFLOP", "GB read (weights, or frames)"],
        [[r["clip"], name, st["flops"] / 1e12, st["bytes"] / 1e9] for r in rows
         if r["placement"] == pj.PLACEMENTS[0].name for name, st in r["stages"].items()],
        "== counted on meta: every stage of one request (diffusers' and transformers' classes, released configs)",
    )  # fmt: skip
    table(
        ["placement", "clip", *(f"{n} s" for n in names), *(f"end to end s, {w}" for w in rows[0]["totals"]),
         "published end to end s"],
        [[r["placement"], r["clip"], *(r["stages"][n]["s"] for n in names), *r["totals"].values(),
          "none published" if "FL2VA" in r["clip"] else E2E_PEERS[r["placement"]]] for r in rows],
        "== PROJECTED (not measured): one request end to end; denoising at GEMMs 60% (section 12's assumptions)",
    )  # fmt: skip
    assumptions(pj.E2E_ASSUMPTIONS)
    counts = stage_counts(clips[0])
    processes = {"denoiser rank": replica.weight_bytes, "conditioner": counts[0].weight_bytes,
                 "decoder": counts[1].weight_bytes + counts[2].weight_bytes}  # fmt: skip
    warm_up = rows[0]["stages"]["denoising"]["s"] / pj.FORWARDS_PER_CLIP  # one step at the served resolution
    start = pj.start_seconds(processes, warm_up)
    table(["process", "GB"], [[k, v / 1e9] for k, v in processes.items()],
          f"== PROJECTED start: largest process {start['largest process GB']:.1f} GB at {pj.HOST_READ_GBPS} GB/s "
          f"read, then pageable {start['pageable s']:.0f} s / pinned {start['pinned s']:.0f} s (warm-up "
          f"{warm_up:.1f} s); sglang loads in 112-124 s plus 26-39 s of warm-up on 8xB300")  # fmt: skip
    return {"end_to_end": rows, "start": start, "processes": processes, "assumptions": pj.E2E_ASSUMPTIONS}


def plan(sp_degree: int, max_rows: int, ulysses: UlyssesFactory, with_paths: bool, with_end_to_end: bool) -> dict:
    """``h3serve plan``: the placement's step; with ``with_paths`` every path checked (~1 min), with
    ``with_end_to_end`` the whole clip and the peers (~3 min on 2 cores)."""
    from .step import ADAPTERS

    replica = MetaReplica(adapters=ADAPTERS if with_paths else (), ulysses=ulysses)
    print(f"built the released transformer on meta: {replica.weight_bytes / GiB:.1f} GiB of weights")
    out: dict = {"placement": placement(replica, sp_degree, max_rows)}
    out["ok"] = True
    if with_paths:
        out.update(paths(replica))
    if with_end_to_end:
        out["peers"] = peers(replica)
        out.update(end_to_end(replica))
    return out
