"""Shared helpers for the CPU benchmarks: arguments, timing, percentiles, tables, JSON, output checks.

No framework: each benchmark is a plain module with ``main(argv) -> int`` and ``run(smoke) -> dict``.
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
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = ([title] if title else []) + [line(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [line(r) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def say(msg: str = "") -> None:
    print(msg, flush=True)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_1m": os.getloadavg()[0]}  # a shared machine: other work skews absolute times


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str))
    say(f"wrote {path}")


def compare_media(got, want, audio_rtol: float = 1e-4, audio_atol: float = 1e-5) -> dict:
    """Decoded outputs of the same seed from two schedulers.

    fp32 GEMMs over different row counts round differently (~1e-6 in the latents), so a pixel may
    cross a uint8 rounding boundary: frames agree when no pixel differs by more than 1.
    """
    same_shape = tuple(got.frames.shape) == tuple(want.frames.shape)
    diff = (got.frames.int() - want.frames.int()).abs() if same_shape else None
    result = {
        "shape_ok": same_shape,
        "max_pixel_diff": int(diff.max()) if same_shape else None,
        "frac_pixels_differ": float((diff > 0).float().mean()) if same_shape else None,
        "audio_max_diff": None,
        "audio_ok": (got.audio is None) == (want.audio is None),
    }
    if got.audio is not None and want.audio is not None:
        same = got.audio.shape == want.audio.shape
        result["audio_max_diff"] = float((got.audio - want.audio).abs().max()) if same else None
        result["audio_ok"] = same and torch.allclose(got.audio, want.audio, rtol=audio_rtol, atol=audio_atol)
    result["agree"] = bool(same_shape and result["max_pixel_diff"] <= 1 and result["audio_ok"])
    return result


def summarize_agreement(comparisons: Sequence[dict]) -> dict:
    """Worst case over many per-seed comparisons."""
    pixel = [c["max_pixel_diff"] for c in comparisons if c["max_pixel_diff"] is not None]
    frac = [c["frac_pixels_differ"] for c in comparisons if c["frac_pixels_differ"] is not None]
    audio = [c["audio_max_diff"] for c in comparisons if c["audio_max_diff"] is not None]
    return {"agree": all(c["agree"] for c in comparisons), "requests": len(comparisons),
            "max_pixel_diff": max(pixel, default=None), "max_frac_pixels_differ": max(frac, default=None),
            "audio_max_diff": max(audio, default=None)}


def cpu_resolution():
    """The driver's admission decision for the tiny model on this CPU (what a ReplicaSpec carries)."""
    from attention import Platform, resolve
    from pipelines.h3 import REQUIREMENTS

    return resolve(REQUIREMENTS, "auto", Platform.cpu(), model="h3-tiny")


class StepLog:
    """EngineObserver: every packed forward's stats."""

    def __init__(self):
        self.steps = []

    def on_step(self, stats, seconds: float) -> None:
        self.steps.append({"requests": stats.requests, "rows": stats.rows, "padding_rows": stats.padding_rows, "s": seconds})

    def on_queue(self, waiting: int, active: int) -> None:
        pass


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
