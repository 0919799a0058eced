"""Step-cache tiers against no caching on the same requests (CPU, tiny checkpoint).

    python -m benchmarks.step_cache [--quick | --smoke | --gpu] [--json PATH] [--checkpoint DIR]

Each request of a fixed set runs alone under every tier of the deployment default (``off``, ``high``,
``medium``, ``low``: ``h3serve.pipelines.h3.step_cache.BUILTIN_TIERS``), the tiers interleaved rep by rep so
load drift on a shared machine hits them alike. Per tier: the fraction of block-rows skipped (rows x
transformer blocks a request did not run, over all it would have run), the denoising wall time against
``off`` (medians; the VAE decode, which caching does not touch, is timed apart), and per request the PSNR
and SSIM of the decoded frames and the SNR of the decoded audio against the same request under ``off``.
Then one mixed pack, every request on a different tier, against the same pack all ``off`` and against the
sum of its parts (each request alone on its tier): its wall ratios, and whether each request's output in
the mixed pack equals its output alone on its tier.

Without ``--checkpoint`` it is the built-in tiny checkpoint, trained on the demo world, and the prompts are
scenes of that world (held-out combinations), so the fidelity numbers are a trained model's; a checkpoint
with random weights (``h3serve weights``) says how the policy behaves on that signal only. SSIM is
Wang et al.'s (11x11 Gaussian window, sigma 1.5, K1 0.01, K2 0.03) on the luma of each frame, written
here in torch: no image-quality library is a dependency of h3serve.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np
import torch

from h3serve.demo.world import held_out_scenes
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
from h3serve.pipelines.h3.checkpoint import resolve_checkpoint
from h3serve.pipelines.h3.step_cache import BUILTIN_TIERS, OFF, StepCachePolicy

from .harness import cli, machine, median, now, say, table

TIERS: list[str] = [OFF, "high", "medium", "low"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    requests: int
    steps: int
    reps: int


FULL, QUICK = Sizes(requests=4, steps=40, reps=3), Sizes(requests=3, steps=16, reps=2)
SMOKE = Sizes(requests=2, steps=10, reps=1)  # run_all --smoke: every table, a fraction of a minute


def requests(sizes: Sizes) -> list[GenerationRequest]:
    prompts = [scene.prompt for scene in held_out_scenes(4)]
    canvases = [(128, 64), (64, 64), (64, 128), (96, 64)]
    return [
        GenerationRequest(prompt=p, width=w, height=h, seed=i, num_inference_steps=sizes.steps)
        for i, (p, (w, h)) in enumerate(zip(prompts[: sizes.requests], canvases[: sizes.requests], strict=True))
    ]


def policy(tier: str) -> StepCachePolicy | None:
    return None if tier == OFF else BUILTIN_TIERS[tier]


def denoise(
    pipeline: H3Pipeline, reqs: list[GenerationRequest], policies: list[StepCachePolicy | None]
) -> tuple[list, float, int, int]:
    """Every request in one pack per step until all are done: the states, seconds, block-rows run and skipped."""
    states = [pipeline.prepare(r, p) for r, p in zip(reqs, policies, strict=True)]
    blocks = len(pipeline.denoiser.transformers["transformer"].transformer_blocks)
    total, skipped = 0, 0
    started = now()
    while not all(s.done for s in states):
        for stats in pipeline.step([s for s in states if not s.done]):
            total += (stats.rows - stats.padding_rows) * blocks
            skipped += stats.skipped_block_rows
    return states, now() - started, total, skipped


def luma(frames: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float64 [F, 1, H, W] in [0, 255] (BT.601)."""
    rgb = torch.from_numpy(frames.astype(np.float64))
    return (rgb @ torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64, device=rgb.device))[:, None]


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM of the frames' luma (Wang et al. 2004, Gaussian 11x11 window, sigma 1.5, valid region)."""
    x, y = luma(a), luma(b)  # [F, 1, H, W]
    size, sigma = min(11, x.shape[-1], x.shape[-2]), 1.5
    coords = torch.arange(size, dtype=torch.float64, device=x.device) - (size - 1) / 2
    g = torch.exp(-(coords**2) / (2 * sigma**2))
    window = (g[:, None] * g[None, :] / g.sum() ** 2)[None, None]  # [1, 1, size, size]

    def blur(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(t, window)

    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = blur(x), blur(y)
    vx, vy, cxy = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(s.mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255**2 / mse)


def snr_db(signal: np.ndarray, test: np.ndarray) -> float:
    noise = float(np.sum((signal.astype(np.float64) - test.astype(np.float64)) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(signal.astype(np.float64) ** 2)) / noise)


def run(sizes: Sizes, checkpoint: str | None = None) -> dict:
    torch.manual_seed(0)
    pipeline = H3Pipeline.load(resolve_checkpoint(checkpoint), "torch_sdpa")
    reqs = requests(sizes)
    reps = sizes.reps
    say(f"{len(reqs)} requests x {reqs[0].num_inference_steps} steps, {reps} interleaved reps per tier")

    # 1. each request alone under each tier, tiers interleaved per rep
    seconds: dict[str, list[float]] = {t: [] for t in TIERS}
    request_s: dict[tuple[str, int], list[float]] = {(t, i): [] for t in TIERS for i in range(len(reqs))}
    final: dict[str, list] = {}
    rows: dict[str, tuple[int, int]] = {}
    denoise(pipeline, reqs[:1], [None])  # warm-up
    for _ in range(reps):
        for tier in TIERS:
            took, total, skipped, states = 0.0, 0, 0, []
            for i, r in enumerate(reqs):
                (state,), s, t, k = denoise(pipeline, [r], [policy(tier)])
                took, total, skipped = took + s, total + t, skipped + k
                request_s[tier, i].append(s)
                states.append(state)
            seconds[tier].append(took)
            final[tier], rows[tier] = states, (total, skipped)
    decode_s = []
    media: dict[str, list] = {}
    for tier in TIERS:
        started = now()
        media[tier] = [pipeline.decode(s) for s in final[tier]]
        decode_s.append((now() - started) / len(reqs))
    off_s = median(seconds[OFF])
    result_tiers, table_rows = [], []
    for tier in TIERS:
        total, skipped = rows[tier]
        per_request = [
            {
                "prompt": r.prompt,
                "psnr_db": psnr(got.frames, want.frames),
                "ssim": ssim(got.frames, want.frames),
                "audio_snr_db": snr_db(want.audio, got.audio),
                "skipped_steps": sum(s.step_cache.skipped) if s.step_cache else 0,
            }
            for r, got, want, s in zip(reqs, media[tier], media[OFF], final[tier], strict=True)
        ]
        ratio = off_s / median(seconds[tier])
        worst = min(per_request, key=lambda p: p["ssim"])
        table_rows.append(
            [
                tier,
                skipped / total,
                median(seconds[tier]),
                ratio,
                min(p["psnr_db"] for p in per_request),
                worst["ssim"],
                min(p["audio_snr_db"] for p in per_request),
            ]
        )
        result_tiers.append(
            {
                "tier": tier,
                "policy": None if tier == OFF else BUILTIN_TIERS[tier].model_dump(),
                "skipped_block_rows_fraction": skipped / total,
                "denoise_s_median": median(seconds[tier]),
                "speedup_vs_off": ratio,
                "requests": per_request,
            }
        )
    table(
        ["tier", "block-rows skipped", "denoise s", "x faster", "min PSNR dB", "min SSIM", "min audio SNR dB"],
        table_rows,
        title="step-cache tiers vs off, each request alone (denoising loop; PSNR/SSIM/SNR vs off)",
    )
    say(f"VAE decode per request (untouched by caching): {median(decode_s):.3f} s")

    # 2. one mixed pack (every request on another tier) against the same pack all off
    mixed_tiers = [TIERS[i % len(TIERS)] for i in range(len(reqs))]
    mixed_s, off_pack_s = [], []
    for _ in range(reps):
        mixed, s, total, skipped = denoise(pipeline, reqs, [policy(t) for t in mixed_tiers])
        mixed_s.append(s)
        off_pack_s.append(denoise(pipeline, reqs, [None] * len(reqs))[1])
    alone = {r.prompt: final[t][i] for i, (r, t) in enumerate(zip(reqs, mixed_tiers, strict=True))}
    parts_s = sum(median(request_s[t, i]) for i, t in enumerate(mixed_tiers))  # each alone on its tier
    same = [
        bool(s.step_cache is None or s.step_cache.skipped == alone[r.prompt].step_cache.skipped)
        and torch.allclose(s.video_rows, alone[r.prompt].video_rows, atol=1e-4)
        for r, s in zip(reqs, mixed, strict=True)
    ]
    table(
        [
            "pack",
            "tiers",
            "denoise s",
            "x faster than all-off",
            "sum of parts / pack",
            "block-rows skipped",
            "each = alone on its tier",
        ],
        [
            ["all off", ",".join([OFF] * len(reqs)), median(off_pack_s), 1.0, "-", 0.0, "-"],
            [
                "mixed",
                ",".join(mixed_tiers),
                median(mixed_s),
                median(off_pack_s) / median(mixed_s),
                parts_s / median(mixed_s),
                skipped / total,
                all(same),
            ],
        ],
        title="one pack, tiers differing per request",
    )
    return {
        "ok": all(same),
        "machine": machine(),
        "requests": len(reqs),
        "steps": reqs[0].num_inference_steps,
        "reps": reps,
        "tiers": result_tiers,
        "decode_s_per_request": median(decode_s),
        "mixed": {
            "tiers": mixed_tiers,
            "denoise_s_median": median(mixed_s),
            "all_off_s_median": median(off_pack_s),
            "sum_of_parts_s": parts_s,
            "skipped_block_rows_fraction": skipped / total,
            "each_equals_alone": same,
        },
    }


def options(ap: argparse.ArgumentParser) -> None:  # --smoke: 2 requests x 10 steps, 1 rep (run_all --smoke)
    ap.add_argument("--quick", action="store_true", help="3 requests x 16 steps, 2 reps: a few minutes on a loaded CPU")
    ap.add_argument("--gpu", action="store_true", help="CUDA, the released width: benchmarks.step_cache_step --gpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    ap.add_argument("--checkpoint", metavar="DIR", help="a tiny checkpoint directory (default: the built-in, trained)")


def run_args(args: argparse.Namespace) -> dict | int:
    if args.gpu:  # no released checkpoint on the lent machine: the per-step cost at the released width, random weights
        from . import step_cache_step

        return step_cache_step.main(["--gpu", *(["--json", args.json] if args.json else [])])
    torch.set_num_threads(args.threads)
    return run(SMOKE if args.smoke else QUICK if args.quick else FULL, args.checkpoint)


main = cli(__doc__, run_args, options, __name__)
