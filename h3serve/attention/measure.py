"""Measure and rank this node's attention backends: what ``h3serve rank-attention`` writes a ranking file with.

Each backend's own ``forward_varlen`` is checked against an fp32 reference on one pack of mixed-length documents,
then timed on packs of mixed-length documents and on one long document; the backends that passed and ran every
pack are ranked, fastest first, into a ``Ranking`` for this platform (see ranking.py for how ``auto`` uses it).
``benchmarks/gpu_kernels.py`` runs the same measurement as its Part 1, then times a full-size block.
torch and this package only: a node with a plain pip install can write the file the config asks for.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .platform import Platform
from .ranking import Ranking
from .registry import get_backend

BACKENDS = ("flash_attn", "torch_varlen", "torch_sdpa", "flex_attn")
# Part 1's sizes: totals are the timed pack sizes (rows), check_total the checked pack's; documents are drawn
# log-uniform in doc_range rows. full/quick run on CUDA in bf16 at the released heads; cpu is tiny, in fp32.
SIZES: dict[str, dict[str, Any]] = {
    "full": dict(
        totals=[4096, 8192, 16384, 32768, 65536],
        check_total=8192,
        doc_range=(256, 16384),
        heads=56,
        head_dim=128,
        warmup=2,
        reps=5,
        matmul_n=8192,
    ),
    "quick": dict(
        totals=[4096, 8192],
        check_total=4096,
        doc_range=(256, 16384),
        heads=56,
        head_dim=128,
        warmup=1,
        reps=3,
        matmul_n=4096,
    ),
    "cpu": dict(
        totals=[256, 512],
        check_total=512,
        doc_range=(16, 256),
        heads=2,
        head_dim=32,
        warmup=1,
        reps=2,
        matmul_n=256,
    ),
}
PACK_ALIGN = 1  # packs for one rank carry no padding; Ulysses pads only to T % sp_degree

Table = Callable[[Sequence[str], Sequence[Sequence]], object]  # prints headers and rows (meta.tables.table)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


class Budget:
    """Wall-clock budget: once spent, remaining cases are skipped and listed.

    ``checkpoint`` (when set) runs before each case is weighed: the numbers so far reach their JSON before the next
    case starts, so a step killed at its hard timeout loses only the case it was in.
    """

    def __init__(self, seconds: float, checkpoint: Callable[[], None] | None = None):
        self.t0, self.seconds, self.skipped = time.monotonic(), seconds, list[str]()
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


def matmul_tflops(device: str, dtype: torch.dtype, n: int, warmup: int, reps: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))  # [n, n] each
    return tflops(2 * n**3, median_ms(lambda: a @ b, device, warmup, 2 * reps))


def sdpa_fused_backends(device: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Which fused SDPA kernels accept the torch_sdpa loop's per-document [1, H, L, D] slices."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randn(1, 2, 64, head_dim, device=device, dtype=dtype)  # [1, H, L, D]
    usable = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                F.scaled_dot_product_attention(x, x, x)
            usable.append(backend.name.lower())
        except RuntimeError:
            pass
    return usable


def environment(platform: Platform) -> dict:
    return {
        "device": platform.device_name,
        "compute_capability": platform.compute_capability,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flash_attn": platform.kernel_libraries.get("flash_attn"),
        "kernel_libraries": dict(platform.kernel_libraries),
        "platform": platform.describe(),
    }


# -- packs and the reference ---------------------------------------------------------------------


def mixed_lengths(total: int, rng: random.Random, lo: int, hi: int) -> list[int]:
    """Log-uniform document lengths in [lo, hi] (H3 serves short clips to long videos),
    drawn until the next document would not fit in ``total`` rows."""
    lengths, left = [], total
    while left >= lo:
        lengths.append(int(math.exp(rng.uniform(math.log(lo), math.log(min(hi, left))))))
        left -= lengths[-1]
    return lengths


def make_pack(lengths, heads, head_dim, dtype, device, align, seed) -> dict:
    """q, k, v [T, H, D] laid out as the packer does: documents back to back, then one
    padding segment up to a multiple of ``align`` rows."""
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    padded = -(-bounds[-1] // align) * align
    if padded > bounds[-1]:
        bounds.append(padded)
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(padded, heads, head_dim, device=device, dtype=dtype, generator=gen) for _ in range(3))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)  # [documents + 1] (+1 with a padding segment)
    max_len = max(b - a for a, b in itertools.pairwise(bounds))
    return dict(q=q, k=k, v=v, cu=cu, max_len=max_len, bounds=bounds, lengths=lengths)


def attention_flops(lengths, heads, head_dim) -> int:
    return 4 * sum(n * n for n in lengths) * heads * head_dim


def run_varlen(impl, p):
    return impl.forward_varlen(p["q"], p["k"], p["v"], cu_seqlens=p["cu"], max_seqlen=p["max_len"])  # [T, H, D]


def reference_fp32(p, head_chunk: int = 8) -> torch.Tensor:
    """fp32 attention per segment (padding segment too, as the kernels do), in plain matmuls."""
    q, k, v = p["q"], p["k"], p["v"]  # [T, H, D]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # [T, H, D]
    scale = q.shape[-1] ** -0.5
    for a, b in itertools.pairwise(p["bounds"]):
        for h in range(0, q.shape[1], head_chunk):  # chunks of heads bound the L x L scores' memory
            qs, ks, vs = (t[a:b, h : h + head_chunk].float().transpose(0, 1) for t in (q, k, v))  # [h, L, D]
            probs = torch.softmax(qs @ ks.transpose(1, 2) * scale, dim=-1)  # [h, L, L]
            out[a:b, h : h + head_chunk] = (probs @ vs).transpose(0, 1)
    return out


# -- check, time, rank ---------------------------------------------------------------------------


def part1_varlen(s, device, dtype, platform, budget, res, *, peak_tflops: float, table: Table) -> dict:
    """Check and time every available backend (``s``: one of SIZES); fills ``res``'s availability, correctness
    and varlen lists and its tables print through ``table``. Returns {backend: "PASS" | "FAIL" | error}."""
    H, D = int(s["heads"]), int(s["head_dim"])
    lo, hi = s["doc_range"]
    align, mm = PACK_ALIGN, res["matmul_tflops"]
    say(f"\n== Part 1: varlen attention, {H} heads x head_dim {D}, {dtype_name(dtype)}, {device}")
    impls = {}
    for name in BACKENDS:
        backend = get_backend(name)
        ok = backend.availability(platform, dtype=dtype, head_dim=D)
        reason = ok.reason or ("" if backend.supports_packed_varlen() else "no forward_varlen")
        res["availability"][name] = {"ok": not reason, "reason": reason}
        say(f"  {name:13s} {'SKIP: ' + reason if reason else 'available'}")
        if not reason:
            impls[name] = backend.make_impl()

    # Correctness against fp32, on one mixed pack; the bf16 sdpa loop's error sets the bar.
    p = make_pack(mixed_lengths(s["check_total"], random.Random(0), lo, hi), H, D, dtype, device, align, 0)
    ref = reference_fp32(p)
    base = (run_varlen(get_backend("torch_sdpa").make_impl(), p).float() - ref).abs().max().item()
    limit, status, rows = 2 * base + 1e-3, {}, []
    for name, impl in impls.items():
        out, error = attempt(lambda impl=impl, p=p: run_varlen(impl, p))
        err = None if out is None else (out.float() - ref).abs().max().item()
        status[name] = error or ("PASS" if err <= limit else "FAIL")
        res["correctness"].append(
            {
                "backend": name,
                "rows": p["bounds"][-1],
                "docs": len(p["lengths"]),
                "max_abs_err": err,
                "sdpa_loop_err": base,
                "limit": limit,
                "result": status[name],
            }
        )
        rows.append([name, p["bounds"][-1], len(p["lengths"]), err, limit, status[name]])
        del out
    say(f"\n  correctness vs fp32 reference (torch_sdpa loop in {dtype_name(dtype)}: max abs err {base:.3g})")
    table(["backend", "rows", "docs", "max_abs_err", "limit", "result"], rows)
    del p, ref

    rows = []
    for total in s["totals"]:
        for case, lengths in (("mixed", mixed_lengths(total, random.Random(total), lo, hi)), ("single", [total])):
            if budget.over(f"varlen {case} {total}"):
                continue
            p = make_pack(lengths, H, D, dtype, device, align, total)
            flops = attention_flops(lengths, H, D)
            for name, impl in impls.items():
                if budget.over(f"varlen {case} {total} {name}"):
                    continue

                def varlen(impl=impl, p=p):
                    return run_varlen(impl, p)

                ms, error = attempt(lambda varlen=varlen: median_ms(varlen, device, s["warmup"], s["reps"]))
                tf = None if ms is None else tflops(flops, ms)
                r = {
                    "case": case,
                    "rows": p["bounds"][-1],
                    "docs": len(lengths),
                    "max_len": max(lengths),
                    "backend": name,
                    "flops": flops,
                    "ms": ms,
                    "tflops": tf,
                    "error": error,
                    "pct_peak": tf and 100 * tf / peak_tflops,
                    "pct_matmul": tf and 100 * tf / mm,
                }
                res["varlen"].append(r)
                columns = ("case", "rows", "docs", "max_len", "backend", "ms", "tflops", "pct_peak", "pct_matmul")
                rows.append([r[c] for c in columns] + [error or status.get(name, "")])
            del p
    say("")
    table(["case", "rows", "docs", "max_len", "backend", "ms", "TFLOP/s", "% peak", "% matmul", "note"], rows)
    return status


def measured_ranking(res, status, platform, dtype, s, mode, source: str = "h3serve rank-attention") -> Ranking | None:
    """Part 1's backends that passed the check and ran every pack without error, fastest first.

    One that failed or errored is left out: auto then tries it after the ranked ones, in declared order.
    """
    failed = {r["backend"] for r in res["varlen"] if r["error"]}
    ranked = [n for n in BACKENDS if status.get(n) == "PASS" and n not in failed]
    times: dict[object, dict[str, float]] = {}  # (case, rows) -> backend -> ms
    for r in res["varlen"]:
        if r["backend"] in ranked:
            times.setdefault((r["case"], r["rows"]), {})[r["backend"]] = r["ms"]
    left_out = sorted(set(status) - set(ranked))
    return Ranking.from_times(
        platform,
        times,
        dtype=dtype,
        head_dim=s["head_dim"],
        measured=f"{source} {mode}, forward_varlen, {s['heads']} heads"
        + (f", left out (failed or errored): {', '.join(left_out)}" if left_out else ""),
    )


def rank(
    platform: Platform,
    device: str,
    dtype: torch.dtype,
    mode: str,
    *,
    peak_tflops: float,
    table: Table,
    budget: Budget | None = None,
) -> tuple[Ranking | None, dict]:
    """Part 1 alone on ``device`` at SIZES[mode]: (the ranking or None when nothing passed every pack, every number)."""
    s, budget = SIZES[mode], budget or Budget(math.inf)
    res: dict = {"env": environment(platform), "mode": mode, "settings": s, "availability": {}}
    res |= {"correctness": [], "varlen": [], "skipped": budget.skipped}
    torch.set_float32_matmul_precision("highest")  # the fp32 reference must not use TF32
    with torch.inference_mode():
        res["matmul_tflops"] = matmul_tflops(device, dtype, s["matmul_n"], s["warmup"], s["reps"])
        say(f"measured {dtype_name(dtype)} matmul {s['matmul_n']}^3: {res['matmul_tflops']:.4g} TFLOP/s")
        status = part1_varlen(s, device, dtype, platform, budget, res, peak_tflops=peak_tflops, table=table)
    ranking = measured_ranking(res, status, platform, dtype, s, mode)
    res["ranking"] = ranking and ranking.model_dump(mode="json")
    return ranking, res
