"""Activation memory of one packed forward, measured: what ``tests/test_memory_plan.py`` holds the plan's formula to.

Runs ``packed_forward`` (no grad) on the tiny preset on CPU over packs of 1, 2, 4 copies of one T2VA clip and tracks
the bytes of every live tensor storage created inside it (the pack's inputs included, the weights not) with
``shapes.LiveStorages``. The peak is fitted as ``a + b * rows``; ``b`` is the measured per-row cost, which
``h3serve.pipelines.h3.memory``'s ``ACTIVATION_FORMULA`` at the tiny dims must match. The same packs over 2 Ulysses
ranks (gloo, a process each): each rank's peak per pack row. torch_sdpa runs one document at a time, so its score
matrix is a per-document constant (in ``a``), as flash-attn's workspace is on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from h3serve.attention import get_backend
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.config import preset
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.memory import activation_row_cost
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.shapes import Clip, LiveStorages, build_transformer, clip_document

# Each pack is measured this many times and its least peak kept. Under Ulysses, gloo's worker thread can hold a
# finished collective's buffers a moment after the call returns (the Work still references them, so their Python
# tensors outlive the forward's last use): timing-dependent bytes that only ever add to a peak (seen: +4% on one
# rank of a loaded machine). The least of a few runs is the forward's own need.
REPEATS = 5  # 3 left one rank 5.3% over on a quiet fresh-clone CI run (2026-12-03): the least of more runs
CLIP = Clip(width=128, height=64, num_frames=22)  # the tiny default canvas, one 17n+5 chunk


def _points(copies: tuple[int, ...], sp=None) -> list[dict]:
    """One tracked packed forward per pack size on this rank (``sp``: this rank of a Ulysses group)."""
    config = preset("tiny").transformer_config()
    model = build_transformer(config, "cpu", torch.float32)  # seeded: every rank builds the same weights
    install(model, get_backend("torch_sdpa").make_impl())
    world = sp.sp_degree if sp is not None else 1
    points = []
    for count in copies:
        runs = []
        for _ in range(REPEATS):
            tracked = LiveStorages()
            handles = tracked.watch_attention(model)
            with tracked:
                documents = [clip_document(config, CLIP, seed=j) for j in range(count)]
                pack = pack_documents(documents, row_multiple=world)
                del documents
                packed_forward(model, pack, sp)
                rows, text_rows = pack.total_rows, pack.text_indices.numel()
                del pack
            for handle in handles:
                handle.remove()
            runs.append(tracked)
        least = min(runs, key=lambda run: run.peak)
        points.append({"docs": count, "rows": rows, "text_rows": text_rows, "peak_bytes": least.peak})
        points[-1].update(
            peak_op=least.peak_op,
            attention_peak_bytes=min(run.attention_peak for run in runs),
            peak_bytes_of_repeats=[run.peak for run in runs],
        )
    return points


def _sp_rank(rank: int, world: int, port: int, copies: tuple[int, ...], results) -> None:
    """One Ulysses rank over gloo in its own process; puts its points on ``results``."""
    import datetime

    import torch.distributed as dist

    from h3serve.replicas.sequence_parallel import UlyssesGroup

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(60)
    )
    try:
        heads = preset("tiny").transformer_config()["num_attention_heads"]
        results.put((rank, _points(copies, UlyssesGroup(world, rank, heads))))
    finally:
        dist.destroy_process_group()


def _sp_points(copies: tuple[int, ...], world: int) -> list[list[dict]]:
    """Every rank's points of the same packs split over ``world`` Ulysses ranks (gloo, one process each)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_sp_rank, args=(r, world, port, copies, results)) for r in range(world)]
    for process in processes:
        process.start()
    by_rank = dict(results.get(timeout=300) for _ in processes)
    for process in processes:
        process.join(timeout=60)
        if process.exitcode != 0:
            raise RuntimeError(f"an SP rank exited with {process.exitcode}")
    return [by_rank[r] for r in range(world)]


def _fit(points: list[dict], key: str) -> tuple[float, float]:
    slope, intercept = np.polyfit([p["rows"] for p in points], [p[key] for p in points], 1)
    return float(slope), float(intercept)


def measure(copies: tuple[int, ...] = (1, 2, 4), sp_degree: int = 2) -> dict:
    """Peak live bytes of one packed forward per pack size, the linear fit, and the formula's slope.

    Also the same packs over ``sp_degree`` Ulysses ranks (gloo): each rank's peak per pack row against
    the formula's ``local / W + per_pack_row`` (0: skip).
    """
    config = preset("tiny").transformer_config()
    points = _points(copies)
    slope, intercept = _fit(points, "peak_bytes")
    attention_slope, _ = _fit(points, "attention_peak_bytes")
    text_fraction = points[-1]["text_rows"] / points[-1]["rows"]  # the same clip repeated: one share
    formula = activation_row_cost(config, torch.float32, text_fraction=text_fraction)
    formula_slope = formula.per_row(1)  # one rank: it computes every row
    attention = activation_row_cost(config, torch.float32, text_fraction=text_fraction, phase="attention")
    attention_formula = attention.per_pack_row + attention.local + attention.kept_text * text_fraction
    sp = {}
    if sp_degree > 1:
        ranks = _sp_points(copies, sp_degree)
        sp_cost = activation_row_cost(config, torch.float32, text_fraction=text_fraction, sp_degree=sp_degree)
        sp_formula = sp_cost.per_row(sp_degree)
        per_rank = [_fit(rank_points, "peak_bytes")[0] for rank_points in ranks]
        sp = {
            "sp_degree": sp_degree,
            "points": ranks,
            "measured_bytes_per_pack_row": per_rank,  # each rank's slope against the whole pack's rows
            "formula_bytes_per_pack_row": sp_formula,
            "ratios": [sp_formula / b for b in per_rank],
        }
    return {
        "points": points,
        "measured_bytes_per_row": float(slope),
        "measured_fixed_bytes": float(intercept),
        "attention_phase_bytes_per_row": float(attention_slope),
        "attention_formula_bytes_per_row": attention_formula,
        "attention_ratio": attention_formula / float(attention_slope),
        "text_fraction": text_fraction,
        "formula_bytes_per_row": formula_slope,
        "ratio": formula_slope / float(slope),
        "sp": sp,
    }
