"""The released MiniMax-H3 transformer on one GPU: seconds per denoising step, MFU, regional compile, packing.

    python -m benchmarks.gpu_pipeline --json $OUT/gpu_pipeline.json        # one H200, ~4-5 minutes
    python -m benchmarks.gpu_pipeline --cpu-dry-run --json /tmp/gp.json   # same code paths, tiny dims, CPU

The ``full`` transformer (33.1B parameters: 50 blocks, hidden 5376, 56 heads x 128, SwiGLU 14336)
with random bf16 weights and diffusers' float32 boundary modules, built on the meta device and
materialised on the GPU (no checkpoint), runs h3serve's ``packed_forward`` with one attention backend
(``--backend``; default: auto, which follows ``$H3SERVE_ATTENTION_RANKING`` when set):
  1. one T2VA request at 1344x768 (the issue's 768x1344, H x W), 124 frames (~38k rows), eager:
     seconds per denoising step (the transformer forward), TFLOP/s, MFU by the printed FLOP formula,
     peak memory, and how many rows fit;
  2. packing at real shapes: 1, 2 and 4 (3 if the budget allows) T2VA requests of 124, 141, 158 and 175
     frames in one pack vs one after another (throughput ratio), and how long a joining request waits for
     its first step;
  3. the same single request with ``torch.compile`` of the repeated blocks (diffusers' regional
     compilation, ``compile_repeated_blocks``): compile time, seconds per step, MFU;
  4. (``pack2``) one pack of two requests (124 and 141 frames, ~81k rows), eager, one forward;
  5. (``max_rows``) the warm-up at the row budget: a pack of released-size clips filling ``--max-rows`` (the H200
     config's ``engine.max_rows_per_step``), with ``torch.cuda.mem_get_info`` before and after: the measured
     activations against the memory plan's (``h3serve/pipelines/h3/memory.py``) at the same rows and prompt rows,
     and what the device holds outside torch's allocator (CUDA context, cuBLAS workspaces), each against the
     plan's reserve.
  6. (``reserve``) what the memory plan's 4 GiB reserve (``DEFAULT_RESERVE_BYTES``, **projected** until this runs)
     is made of, by ``torch.cuda.mem_get_info`` at each step of a fresh process: the device in use before it
     (``--used-before-mib``, from nvidia-smi), after the CUDA context (before the model is built), after a cuBLAS
     GEMM in the served dtype (its workspace), after an NCCL communicator of one rank made as a replica makes it
     (``device_id``, a first all-reduce, an all-to-all), then (``max_rows``, after the warm-up at the row budget)
     what the device holds outside torch's allocator and the allocator's slack (reserved, never allocated). One
     GPU: the buffers NCCL keeps for 3-7 peers and NVLS are not measured here and stay projected.
``--parts`` picks and orders them (default: single, packing, compile); ``benchmarks/gpu_session.sh`` runs
``single compile`` in one process and ``reserve pack2 max_rows`` in another.
Targets (issue 15): MFU >= 50%, seconds per step <= 5.7 (sglang's per-GPU rate: 1.43 s/step on 4 H200).
Every part runs under ``attempt`` and a wall-clock budget; the JSON is rewritten after each part.
Needs torch, diffusers and pydantic (no Ray, no checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time

import torch
from torch._dynamo.utils import counters

from h3serve.attention import get_backend, probe_platform, resolve
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.denoiser import REQUIREMENTS, check_capable, check_runs_here
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.memory import DEFAULT_RESERVE_BYTES, activation_row_cost
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.shapes import (
    FLOPS_FORMULA,
    Clip,
    activation_bytes_per_row,
    build_transformer,
    clip_document,
    forward_flops,
    human_bytes,
    parameter_bytes,
    rows_that_fit,
    transformer_config,
)

from .harness import PEAK_TFLOPS, Budget, attempt, cli, columns, median_ms, no_cuda, say, write_json

TARGET_MFU, TARGET_S_PER_STEP = 50.0, 5.7
PARTS = ["single", "packing", "compile", "pack2", "max_rows", "reserve"]
LENGTHS = (124, 141, 158, 175)  # the 17n+5 clip lengths of the packing part, 5.2 to 7.3 s
SETTINGS = {
    "full": dict(
        preset="full",
        device="cuda",
        dtype=torch.bfloat16,
        canvas=(1344, 768),
        text_tokens=256,
        warmup=1,
        reps=2,
        pack_reps=1,
        compiled_reps=1,
        max_rows=80_000,  # engine.max_rows_per_step of h3serve/deploy/serve_config.gpu.yaml
    ),
    "cpu": dict(
        preset="tiny",
        device="cpu",
        dtype=torch.float32,
        canvas=(128, 64),
        text_tokens=32,
        warmup=1,
        reps=1,
        pack_reps=1,
        compiled_reps=1,
        max_rows=4_000,
    ),
}


class Bench:
    """One model, one backend; every measurement goes into ``self.res`` (and the JSON after each part)."""

    def __init__(self, s: dict, backend: str, json_path: str | None, budget: Budget, reserve: dict | None = None):
        self.s, self.json_path, self.budget = s, json_path, budget
        self.device, self.dtype = s["device"], s["dtype"]
        self.cfg = transformer_config(s["preset"])
        self.clips = [Clip(*s["canvas"], n, text_tokens=s["text_tokens"]) for n in LENGTHS]
        check_capable(backend, s["preset"])
        check_runs_here(backend, self.device, self.dtype, self.cfg["attention_head_dim"], s["preset"])
        start = time.perf_counter()
        self.model = build_transformer(self.cfg, self.device, self.dtype)
        install(self.model, get_backend(backend).make_impl())  # h3serve's processor, exactly this backend
        self.sync()
        self.weights = parameter_bytes(self.model)
        self.res = {
            "backend": backend,
            "build_s": time.perf_counter() - start,
            "weights_bytes": self.weights,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "config": self.cfg,
            "flops_formula": FLOPS_FORMULA,
            "peak_tflops": PEAK_TFLOPS,
            "single": {},
            "packing": [],
            "compiled": {},
            "pack2": {},
            "max_rows": {},
            "reserve": reserve or {},  # its first steps measured before the model was built (``reserve_start``)
            "skipped": budget.skipped,
            "errors": {},
        }
        say(
            f"built {self.res['parameters']:,} parameters ({human_bytes(self.weights)}) in "
            f"{self.res['build_s']:.1f} s on {self.device}, backend {backend}"
        )

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def save(self) -> None:
        write_json(self.json_path, self.res, quiet=True)

    def pack(self, clips: list[Clip]):
        return pack_documents([clip_document(self.cfg, c, seed=j) for j, c in enumerate(clips)]).to(self.device)

    def measure(self, pack, reps: int, warmup: int) -> dict:
        """One packed forward (= one denoising step of every request in the pack): time, FLOPs, memory."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = median_ms(lambda: packed_forward(self.model, pack), self.device, warmup, reps)
        flops = forward_flops(self.cfg, pack)
        tflops = flops["total"] / (ms * 1e-3) / 1e12
        peak = torch.cuda.max_memory_allocated() if self.device == "cuda" else None
        return {
            "rows": pack.total_rows,
            "docs": len(pack.lengths),
            "s_per_step": ms / 1e3,
            "flops": flops,
            "tflops": tflops,
            "mfu_pct": 100 * tflops / PEAK_TFLOPS,
            "peak_bytes": peak,
            "activation_bytes_per_row": None if peak is None else (peak - self.weights) / pack.total_rows,
        }

    # -- 1. one released-size request, eager -----------------------------------------------------
    def single(self) -> None:
        pack = self.pack(self.clips[:1])
        r = self.res["single"] = {"request": str(self.clips[0]), **self.measure(pack, self.s["reps"], self.s["warmup"])}
        estimate = activation_bytes_per_row(self.cfg, self.dtype)
        r["activation_bytes_per_row_estimate"] = estimate
        if self.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            per_row = max(r["activation_bytes_per_row"], estimate)
            r["rows_that_fit"] = rows_that_fit(int(0.95 * total) - self.weights, per_row)
            r["device_memory_bytes"] = total
        say(f"\n== 1. one T2VA request {self.clips[0]} ({pack.total_rows} rows), eager")
        say(FLOPS_FORMULA)
        flops = r["flops"]
        say(
            f"  FLOPs per step: matmul {flops['matmul']:.4g} + attention {flops['attention']:.4g} "
            f"= {flops['total']:.4g}"
        )
        self.report([("eager", r)])
        say(
            f"  activations: planned {human_bytes(estimate * pack.total_rows)} ({estimate / 1e3:.0f} kB/row: "
            "h3serve/pipelines/h3/memory.py's ACTIVATION_FORMULA for a media row, checked on the meta device)"
            + (
                f"; measured peak {human_bytes(r['peak_bytes'])} - weights {human_bytes(self.weights)} = "
                f"{r['activation_bytes_per_row'] / 1e3:.0f} kB/row; about {r['rows_that_fit']} rows fit in 95% of "
                f"{human_bytes(r['device_memory_bytes'])}"
                if r["peak_bytes"]
                else ""
            )
        )

    def report(self, rows: list[tuple[str, dict]]) -> None:
        columns(
            [dict(r, mode=mode) for mode, r in rows],
            [
                ("mode", "mode"),
                ("rows", "rows"),
                ("s / step", "s_per_step"),
                ("TFLOP/s", "tflops"),
                ("MFU %", "mfu_pct"),
                ("peak memory", lambda r: r["peak_bytes"] and human_bytes(r["peak_bytes"])),
                (f"MFU >= {TARGET_MFU:.0f}%", lambda r: r["mfu_pct"] >= TARGET_MFU),
                (f"<= {TARGET_S_PER_STEP} s/step", lambda r: r["s_per_step"] <= TARGET_S_PER_STEP),
            ],
        )

    # -- 2. packing at real shapes ------------------------------------------------------------------
    def packing(self) -> None:
        """Each request alone, then packs of 2 and 4 (3 if the budget allows): one timed forward each, no warm-up
        (at seconds per forward, first-call costs are noise; the single request's own warm-up ran in part 1)."""
        say(f"\n== 2. packing: T2VA requests of {', '.join(map(str, self.clips))} in one pack vs one after another")
        singles, packed, measured = {0: self.res["single"]["s_per_step"]}, {1: self.res["single"]["s_per_step"]}, {}
        for j in range(1, len(self.clips)):
            if self.budget.over(f"packing: {self.clips[j]} alone"):
                return
            singles[j] = self.measure(self.pack([self.clips[j]]), self.s["pack_reps"], 0)["s_per_step"]
        for n in (2, 4, 3):  # the 3-pack only serves the 4th request's joining latency: last
            if self.budget.over(f"packing: pack of {n}"):
                continue
            measured[n] = self.measure(self.pack(self.clips[:n]), self.s["pack_reps"], 0)
            packed[n] = measured[n]["s_per_step"]
            self.save()
        for n, r in sorted(measured.items()):
            apart = sum(singles[j] for j in range(n))
            # a request joining a running pack of n-1 waits for the forward in flight, then steps in the pack of n
            join = packed[n - 1] + packed[n] if n - 1 in packed else None
            # one after another (FIFO, 50-step requests, the joiner arriving halfway through the first one's):
            # the rest of the first request, every other waiting request whole, then its own first step
            fifo = 24 * singles[0] + 49 * sum(singles[j] for j in range(1, n - 1)) + singles[n - 1]
            self.res["packing"].append(
                {
                    "requests": n,
                    "rows": r["rows"],
                    "packed_s": packed[n],
                    "apart_s": apart,
                    "throughput_ratio": apart / packed[n],
                    "peak_bytes": r["peak_bytes"],
                    "mfu_pct": r["mfu_pct"],
                    "join_first_step_s": join,
                    "fifo_first_step_s": fifo,
                }
            )
        self.save()
        columns(
            self.res["packing"],
            [
                ("requests", "requests"),
                ("rows", "rows"),
                ("one pack s", "packed_s"),
                ("one after another s", "apart_s"),
                ("throughput ratio", "throughput_ratio"),
                ("MFU %", "mfu_pct"),
                ("peak memory", lambda p: p["peak_bytes"] and human_bytes(p["peak_bytes"])),
                ("joiner's first step s", "join_first_step_s"),
                ("FIFO first step s", "fifo_first_step_s"),
            ],
        )
        say(
            "  joiner's first step: it arrives as the pack of n-1 starts a forward, waits for it, then steps in the\n"
            "  pack of n (prepare, i.e. Qwen3-VL and the layout, comes on top and is not measured here). FIFO: one\n"
            "  request at a time, 50 steps each, the joiner arriving halfway through the first request."
        )

    # -- 3. regional compilation -------------------------------------------------------------------------
    def compiled(self, backend_kw: dict) -> None:
        say(f"\n== 3. torch.compile of the repeated blocks {backend_kw or ''}")
        if hasattr(self.model, "compile_repeated_blocks"):  # diffusers' regional compilation
            self.model.compile_repeated_blocks(dynamic=False, **backend_kw)
            how = "model.compile_repeated_blocks(dynamic=False)"
        else:  # the same by hand: one compiled forward per block class
            for block in [*self.model.transformer_blocks, *self.model.token_refiner.refiner_blocks]:
                block.compile(dynamic=False, **backend_kw)
            how = "block.compile(dynamic=False) per block"
        pack = self.pack(self.clips[:1])
        counters.clear()
        start = time.perf_counter()
        packed_forward(self.model, pack)  # the first call compiles
        self.sync()
        compile_s = time.perf_counter() - start
        breaks = {
            " ".join(k.split("Explanation:")[-1].split("Hint:")[0].split())[:110]: n  # reason -> count
            for k, n in counters["graph_break"].items()
        }
        r = self.res["compiled"] = {
            "how": how,
            "compile_s": compile_s,
            "graph_breaks": breaks,
            "unique_graphs": counters["stats"]["unique_graphs"],
            **self.measure(pack, self.s["compiled_reps"], 0),
        }
        eager = self.res["single"]
        r["speedup_vs_eager"] = eager["s_per_step"] / r["s_per_step"] if eager else None
        say(
            f"  {how}: first call (compiles) {compile_s:.1f} s; {r['unique_graphs']} graphs; graph breaks: "
            + ("; ".join(f"{n}x {k}" for k, n in breaks.items()) or "none")
        )
        self.report([("eager", eager), ("compiled", r)] if eager else [("compiled", r)])

    # -- 4. one pack of two -----------------------------------------------------------------------------
    def pack2(self) -> None:
        """One forward of a pack of two released-size requests (no warm-up: at seconds per forward, first-call costs
        are noise, and this process's first forward is this one)."""
        pack = self.pack(self.clips[:2])
        say(f"\n== 4. one pack of two T2VA requests, {self.clips[0]} + {self.clips[1]} ({pack.total_rows} rows), eager")
        r = self.res["pack2"] = {"requests": [str(c) for c in self.clips[:2]], **self.measure(pack, 1, 0)}
        self.report([("pack of 2", r)])

    # -- 5. the warm-up at the row budget ----------------------------------------------------------------
    def fill(self, max_rows: int) -> list[Clip]:
        """Released-size clips (the packing part's lengths, in turn) while their rows stay within ``max_rows``."""
        clips: list[Clip] = []
        for n in range(64):
            candidate = [*clips, self.clips[n % len(self.clips)]]
            if pack_documents([clip_document(self.cfg, c) for c in candidate]).total_rows > max_rows:
                break
            clips = candidate
        return clips or self.clips[:1]

    def max_rows(self, max_rows: int) -> None:
        """One forward at the row budget, as a replica's warm-up should run it, with the device's free memory before
        and after: what the plan says the activations take at these rows, what they took, and what the device holds
        outside torch's allocator, each against the plan's reserve (CPU: the same forward, no device numbers)."""
        clips = self.fill(max_rows)
        pack = self.pack(clips)
        text_rows = sum(c.text_tokens for c in clips)
        planned = activation_row_cost(self.cfg, self.dtype, text_rows=text_rows).bytes_for(pack.total_rows, 1)
        r: dict = {
            "max_rows": max_rows,
            "rows": pack.total_rows,
            "requests": [str(c) for c in clips],
            "text_rows": text_rows,
            "planned_activation_bytes": planned,
            "reserve_bytes": DEFAULT_RESERVE_BYTES,
        }
        say(f"\n== 5. the warm-up at the row budget: {len(clips)} requests, {pack.total_rows} of {max_rows} rows")
        cuda = self.device == "cuda"
        if cuda:
            self.sync()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            free, total = torch.cuda.mem_get_info()
            allocated = torch.cuda.memory_allocated()
            r |= {
                "device_bytes": total,
                "free_before": free,
                "outside_torch_bytes": total - free - torch.cuda.memory_reserved(),
            }
        start = time.perf_counter()
        packed_forward(self.model, pack)
        self.sync()
        r["s_per_step"] = time.perf_counter() - start
        if cuda:
            measured = torch.cuda.max_memory_allocated() - allocated
            free_after, total = torch.cuda.mem_get_info()
            # after the warm-up: what the reserve must hold, measured (outside the allocator, and its slack)
            self.res["reserve"] |= {
                "outside_torch_after_warm_up_bytes": total - free_after - torch.cuda.memory_reserved(),
                "allocator_slack_after_warm_up_bytes": torch.cuda.memory_reserved() - torch.cuda.max_memory_allocated(),
            }
            held = sum(
                self.res["reserve"][k]
                for k in ("outside_torch_after_warm_up_bytes", "allocator_slack_after_warm_up_bytes")
            )
            self.res["reserve"] |= {"held_after_warm_up_bytes": held, "within_reserve": held <= DEFAULT_RESERVE_BYTES}
            r |= {
                "free_after": torch.cuda.mem_get_info()[0],
                "measured_activation_bytes": measured,
                "plan_error_bytes": measured - planned,
                "within_reserve": abs(measured - planned) <= DEFAULT_RESERVE_BYTES
                and r["outside_torch_bytes"] <= DEFAULT_RESERVE_BYTES,
            }
        self.res["max_rows"] = r
        say(
            f"  planned activations {human_bytes(planned)} at {pack.total_rows} rows ({text_rows} prompt rows); "
            + (
                f"measured {human_bytes(r['measured_activation_bytes'])} (plan off by "
                f"{human_bytes(abs(r['plan_error_bytes']))}); outside torch's allocator "
                f"{human_bytes(r['outside_torch_bytes'])}; free {human_bytes(r['free_before'])} -> "
                f"{human_bytes(r['free_after'])} of {human_bytes(r['device_bytes'])}; within the "
                f"{human_bytes(DEFAULT_RESERVE_BYTES)} reserve: {'YES' if r['within_reserve'] else 'NO'}"
                if cuda
                else "no device memory on CPU (the forward ran; mem_get_info is CUDA's)"
            )
            + f"; {r['s_per_step']:.2f} s"
        )

    def reserve(self) -> None:
        """What the reserve holds beyond the context (measured before the model: ``reserve_start``): a cuBLAS GEMM's
        workspace in the served dtype, then an NCCL communicator of one rank made as a replica makes it (gloo on
        CPU: the same calls, no device numbers), each by the device memory outside torch's allocator before/after."""
        r = self.res["reserve"]
        say("\n== 6. the reserve: cuBLAS workspace, an NCCL communicator (one rank), beside the CUDA context")
        cuda = self.device == "cuda"

        def outside() -> int:  # device bytes in use that torch's allocator does not hold
            if not cuda:
                return 0
            self.sync()
            free, total = torch.cuda.mem_get_info()
            return total - free - torch.cuda.memory_reserved()

        before = outside()
        n = 4096 if cuda else 256  # [n, n]: at 4096 cuBLAS picks its largest workspace; CPU: the call, quickly
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        allocated = torch.cuda.memory_allocated() if cuda else 0
        (a @ a).sum().item()
        r["cublas_outside_torch_bytes"] = outside() - before
        r["cublas_in_allocator_bytes"] = (torch.cuda.memory_allocated() - allocated) if cuda else 0  # workspace
        del a
        before = outside()
        r["nccl_world"] = 1
        r["collectives_backend"] = communicator_of_one(self.device)
        r["nccl_outside_torch_bytes"] = outside() - before
        if cuda:
            context = r.get("context_bytes", 0)
            r["measured_bytes"] = context + r["cublas_outside_torch_bytes"] + r["nccl_outside_torch_bytes"]
            say(
                f"  CUDA context {human_bytes(context)}; cuBLAS workspace "
                f"{human_bytes(r['cublas_outside_torch_bytes'])} outside torch + "
                f"{human_bytes(r['cublas_in_allocator_bytes'])} in its allocator; NCCL (one rank) "
                f"{human_bytes(r['nccl_outside_torch_bytes'])}: {human_bytes(r['measured_bytes'])} of the "
                f"{human_bytes(DEFAULT_RESERVE_BYTES)} reserve (NCCL's buffers to peers, NVLS: not measured on one GPU)"
            )
        else:
            say(f"  CPU: the same calls ran ({r['collectives_backend']}, one rank); no device numbers")
        self.res["reserve"] = r


def reserve_start(used_before_mib: float | None) -> dict:
    """The reserve's first steps, before anything else touches the device: what was in use before this process
    (nvidia-smi's, in MiB), then with the CUDA context made (torch's allocator holds nothing yet)."""
    torch.cuda.init()
    torch.empty(0, device="cuda")  # the context, nothing in the allocator
    free, total = torch.cuda.mem_get_info()
    before = int((used_before_mib or 0) * 2**20)
    return {
        "device_bytes": total,
        "used_before_process_bytes": before if used_before_mib is not None else None,
        "used_after_context_bytes": total - free,
        "context_bytes": total - free - before if used_before_mib is not None else total - free,
    }


def communicator_of_one(device: str) -> str:
    """A one-rank group made as a replica makes its own (NCCL with ``device_id``: the communicator exists at once;
    gloo on CPU), proven by a one-element all-reduce and an all-to-all, then ended; its backend's name."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device == "cuda" else {}
    rendezvous = tempfile.NamedTemporaryFile(prefix="h3-reserve-", delete=False).name  # one rank: no port needed
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=0, world_size=1, **kwargs)
    try:
        flag = torch.ones(1, device=device)
        dist.all_reduce(flag)
        chunks = torch.zeros(1, 1024, device=device)
        dist.all_to_all_single(torch.empty_like(chunks), chunks)
        if device == "cuda":
            torch.cuda.synchronize()
        return backend
    finally:
        dist.destroy_process_group()
        with contextlib.suppress(FileNotFoundError):  # the store removes it once its last rank is gone
            os.unlink(rendezvous)


def choose_backend(name: str, device: str, dtype: torch.dtype, head_dim: int) -> str:
    """``auto`` resolves as a deployment would (a measured ranking first, when one is configured)."""
    if name != "auto":
        return get_backend(name).name
    return resolve(
        REQUIREMENTS, "auto", probe_platform(device), model="minimax-h3", dtype=dtype, head_dim=head_dim
    ).backend


def options(ap: argparse.ArgumentParser) -> None:  # --json: every number, rewritten after each part
    ap.add_argument("--backend", default="auto", help="attention backend (default: auto, as a deployment resolves)")
    ap.add_argument("--max-seconds", type=float, default=230.0, help="skip the remaining parts past this")
    ap.add_argument("--skip", nargs="*", default=[], choices=PARTS, help="parts to leave out")
    ap.add_argument("--parts", nargs="+", default=["single", "packing", "compile"], choices=PARTS, help="in order")
    ap.add_argument("--max-rows", type=int, default=None, help="max_rows's row budget (default: the mode's)")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same code paths at the tiny dims on CPU, fp32")
    ap.add_argument("--used-before-mib", type=float, default=None, help="device MiB in use before (nvidia-smi's)")


def run(args: argparse.Namespace) -> dict:
    mode = "cpu" if args.cpu_dry_run else "full"
    s = SETTINGS[mode]
    if (refused := no_cuda(mode, s["device"])) is not None:
        return refused
    budget = Budget(args.max_seconds)
    say(f"{probe_platform(s['device']).describe()}; torch {torch.__version__}")
    res: dict = {"mode": mode, "skipped": budget.skipped}
    with torch.inference_mode():
        head_dim = transformer_config(s["preset"])["attention_head_dim"]
        backend = choose_backend(args.backend, s["device"], s["dtype"], head_dim)
        reserve = reserve_start(args.used_before_mib) if s["device"] == "cuda" else {}  # before any model
        bench, res["error"] = attempt(lambda: Bench(s, backend, args.json, budget, reserve))
        if bench is not None:
            budget.checkpoint = bench.save  # the numbers so far reach the JSON before each next case
            res = bench.res
            res["mode"] = mode
            parts = {
                "single": bench.single,
                "packing": bench.packing,
                # CPU: dynamo traces (graph breaks show) but inductor's C++ build (~30 s) is left out
                "compile": lambda: bench.compiled({} if mode == "full" else {"backend": "eager"}),
                "pack2": bench.pack2,
                "max_rows": lambda: bench.max_rows(args.max_rows or s["max_rows"]),
                "reserve": bench.reserve,
            }
            for i, name in enumerate(args.parts):
                part = parts[name]
                if name in args.skip or (i > 0 and budget.over(name)):
                    continue
                _, error = attempt(part)
                if error:
                    res["errors"][name] = error
                    say(f"ERROR in {name}: {error}")
                bench.save()
    if budget.skipped:
        say(f"\nskipped: {', '.join(budget.skipped)}")
    say(f"wall {budget.elapsed():.1f} s")
    return res  # the exit status is 0 whatever was measured


main = cli(__doc__, run, options, __name__)
