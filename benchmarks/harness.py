"""Shared helpers for the benchmarks: arguments, timing, percentiles, tables, JSON, output checks; GPU timing.

No framework: each CPU benchmark is a plain module with ``main(argv) -> int`` and ``run(smoke) -> dict``.
The GPU scripts (gpu_kernels, gpu_pipeline) use only the torch-only helpers here: nothing at module
level imports Ray, the deploy package or the model pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds long (CI)")
    ap.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    return ap


def main_for(doc: str | None, run: Callable[[bool], dict]) -> Callable[..., int]:
    """The `python -m benchmarks.X [--smoke] [--json PATH]` entry point; exits 1 when a check fails."""

    def main(argv=None) -> int:
        args = parser(doc).parse_args(argv)
        result = run(args.smoke)
        write_json(args.json, result)
        return 0 if result["ok"] else 1

    return main


def width_main(doc: str | None, name: str, what_gpu_measures: str, run: Callable[..., dict]) -> Callable[..., int]:
    """The `python -m benchmarks.NAME [--quick | --smoke | --gpu] [--json PATH]` entry point of a per-step cost
    measured on CPU at a smaller width or, with ``--gpu``, on CUDA at the released width: ``run(quick, gpu, smoke)``.
    """

    def main(argv=None) -> int:
        ap = parser(doc)
        ap.add_argument(
            "--quick", action="store_true", help="CPU: hidden 512 and 1.4k rows (else hidden 1024, 4k rows)"
        )
        ap.add_argument("--gpu", action="store_true", help="CUDA, the released width: " + what_gpu_measures)
        args = ap.parse_args(argv)
        if args.gpu and not torch.cuda.is_available():
            say(f"{name} --gpu: no CUDA device here; nothing measured. It measures: {what_gpu_measures}")
            return 2
        if args.gpu:
            say(f"{name} --gpu measures: {what_gpu_measures}")
        result = run(args.quick or args.smoke, gpu=args.gpu, smoke=args.smoke)
        write_json(args.json, result)
        return 0 if result["ok"] else 1

    return main


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc; ``pid`` itself not included), children before their own children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def now() -> float:
    return time.perf_counter()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Wall times of ``reps`` calls, in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = now()
        fn()
        out.append((now() - t0) * 1e3)
    return out


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence], title: str | None = None) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned. Printed and returned."""
    cells = [list(map(str, headers))] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))

    lines = ([title] if title else []) + [line(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def judge_targets(checks: Sequence[tuple[str, float, str, float]], load: float, title: str) -> list[dict]:
    """Each (target, value, ">=" or "<=", limit) judged, printed as one table; the rows, for the JSON."""
    out = [
        {
            "target": name,
            "load": load,
            "value": value,
            "limit": f"{op} {limit:g}",
            "met": value >= limit if op == ">=" else value <= limit,
        }
        for name, value, op, limit in checks
    ]
    table(["target", "value", "limit", "met"], [[t["target"], t["value"], t["limit"], t["met"]] for t in out], title)
    return out


def say(msg: str = "") -> None:
    print(msg, flush=True)


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0],
    }  # a shared machine: other work skews absolute times


def write_json(path: str | None, result: dict, quiet: bool = False) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
    if not quiet:
        say(f"wrote {path}")


def compare_media(got, want, audio_rtol: float = 1e-4, audio_atol: float = 1e-5) -> dict:
    """Decoded outputs of the same request from two schedulers (``GeneratedMedia``: numpy frames and audio).

    fp32 GEMMs over different row counts round differently (~1e-6 in the latents), so a pixel may
    cross a uint8 rounding boundary: frames agree when no pixel differs by more than 1.
    """
    import numpy as np

    same_shape = got.frames.shape == want.frames.shape
    diff = np.abs(got.frames.astype(np.int16) - want.frames.astype(np.int16)) if same_shape else None
    same_audio = got.audio.shape == want.audio.shape
    result = {
        "shape_ok": same_shape,
        "max_pixel_diff": int(diff.max()) if same_shape else None,
        "frac_pixels_differ": float((diff > 0).mean()) if same_shape else None,
        "audio_max_diff": float(np.abs(got.audio - want.audio).max()) if same_audio else None,
        "audio_ok": bool(same_audio and np.allclose(got.audio, want.audio, rtol=audio_rtol, atol=audio_atol)),
    }
    result["agree"] = bool(same_shape and result["max_pixel_diff"] <= 1 and result["audio_ok"])
    return result


def summarize_agreement(comparisons: Sequence[dict]) -> dict:
    """Worst case over many per-request comparisons."""
    pixel = [c["max_pixel_diff"] for c in comparisons if c["max_pixel_diff"] is not None]
    frac = [c["frac_pixels_differ"] for c in comparisons if c["frac_pixels_differ"] is not None]
    audio = [c["audio_max_diff"] for c in comparisons if c["audio_max_diff"] is not None]
    return {
        "agree": all(c["agree"] for c in comparisons),
        "requests": len(comparisons),
        "max_pixel_diff": max(pixel, default=None),
        "max_frac_pixels_differ": max(frac, default=None),
        "audio_max_diff": max(audio, default=None),
    }


def cpu_resolution():
    """The driver's admission decision for the tiny model on this CPU (what a ReplicaSpec carries)."""
    from attention import Platform
    from pipelines.h3 import preset, validate_deployment

    tiny = preset("tiny")
    return validate_deployment(
        model=tiny.name,
        geometry=tiny.geometry(),
        attention_backend="auto",
        platform=Platform.cpu(),
        device="cpu",
        dtype="float32",
    )


def tiny_spec(sp: int = 1, rank_cpus: float = 1.0, checkpoint: str | None = None):
    """What the driver hands a tiny CPU replica: default deploy args, ``sp`` Ulysses ranks, and ``checkpoint``
    (default: the tiny preset with seeded random weights, ``random_tiny_checkpoint()``: same dims, same cost)."""
    from deploy.args import DeployArgs
    from pipelines.h3.checkpoint import random_tiny_checkpoint

    args = DeployArgs(
        sp_degree=sp, rank_resources={"CPU": rank_cpus}, checkpoint=checkpoint or str(random_tiny_checkpoint())
    )
    return args.replica_spec(cpu_resolution())


def keyframe_png(width: int, height: int, seed: int = 0) -> bytes:
    """An encoded RGB keyframe (FL2VA's first/last frame): a seeded colour with a bright square."""
    import io
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    x, y = rng.randrange(width // 2), rng.randrange(height // 2)
    ImageDraw.Draw(image).rectangle((x, y, x + width // 3, y + height // 3), fill=(250, 250, 250))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class StepLog:
    """EngineObserver: every packed forward's stats, every stage time, every failure, preemptions, duty cycle."""

    def __init__(self):
        self.steps = []
        self.stages: dict[str, list[float]] = {}
        self.failures: list[tuple[str, str]] = []  # (step | request, reason)
        self.preempted = 0
        self.duty_cycle: float | None = None  # the engine's running forward time / busy time

    def on_step(self, stats, seconds: float) -> None:
        self.steps.append(
            {"requests": stats.requests, "rows": stats.rows, "padding_rows": stats.padding_rows, "s": seconds}
        )

    def on_queue(self, waiting: int, active: int) -> None:
        pass

    def on_stage(self, stage: str, seconds: float) -> None:
        self.stages.setdefault(stage, []).append(seconds)

    def on_failed_step(self, reason: str) -> None:
        self.failures.append(("step", reason))

    def on_failed_request(self, reason: str) -> None:
        self.failures.append(("request", reason))

    def on_preempted(self, count: int) -> None:
        self.preempted += count

    def on_duty_cycle(self, fraction: float) -> None:
        self.duty_cycle = fraction


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn) -> int:
    """How many aten ops (each a Python -> C++ dispatch on CPU, a kernel launch on GPU) ``fn`` runs."""
    with _CountOps() as counter:
        counter.n = 0
        fn()
    return counter.n


# -- GPU scripts ----------------------------------------------------------------------------------

PEAK_TFLOPS = 989.0  # H200 SXM bf16 dense, NVIDIA spec


class Budget:
    """Wall-clock budget: once spent, remaining cases are skipped and listed.

    ``checkpoint`` (when set) runs before each case is weighed: the numbers so far reach their JSON before the next
    case starts, so a step killed at its hard timeout loses only the case it was in.
    """

    def __init__(self, seconds: float, checkpoint: Callable[[], None] | None = None):
        self.t0, self.seconds, self.skipped = time.monotonic(), seconds, []
        self.checkpoint = checkpoint

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over(self, what: str) -> bool:
        if self.checkpoint is not None:
            self.checkpoint()
        if self.elapsed() <= self.seconds:
            return False
        self.skipped.append(what)
        say(f"  SKIPPED {what}: over the {self.seconds:.0f} s budget")
        return True


def attempt(fn):
    """(fn(), None), or (None, error) when a kernel fails or runs out of memory: never crash."""
    try:
        return fn(), None
    except Exception as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return None, f"{type(e).__name__}: {first}"


def median_ms(fn, device: str, warmup: int, reps: int) -> float:
    """Median wall ms of ``fn``; on CUDA timed with events around it, so the time covers its kernels."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
