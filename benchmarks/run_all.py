"""Run every CPU benchmark in sequence (``make bench``), each in its own process.

    python -m benchmarks.run_all [--smoke] [--json-dir DIR] [--dry-run [--cuda]]

packing, admission, serving, sp, trace, default_clip, step_cache, lora (``--smoke``: its co-batching trace), stages
(the one-replica app against the staged app), preview (its cost to the step loop);
then gpu_kernels and gpu_pipeline when CUDA is visible (otherwise their commands, and the one-command GPU session
script, are printed). Exits
non-zero if any benchmark's correctness check failed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .harness import say, table

CPU_BENCHMARKS = (
    "packing",
    "admission",
    "serving",
    "sp",
    "trace",
    "default_clip",
    "step_cache",
    "lora",
    "stages",
    "preview",
)
GPU_BENCHMARKS = ("gpu_kernels", "gpu_pipeline")


def commands(smoke: bool, json_dir: str | None, cuda: bool) -> dict[str, list[str]]:
    """The command line of every benchmark to run here, by name."""
    out = {}
    for name in CPU_BENCHMARKS:
        cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--smoke"] if smoke else [])
        out[name] = cmd + (["--json", str(Path(json_dir) / f"{name}.json")] if json_dir else [])
    if cuda:
        kernels = [sys.executable, "-m", "benchmarks.gpu_kernels"] + (["--quick"] if smoke else [])
        out["gpu_kernels"] = kernels + (["--out", str(Path(json_dir) / "gpu_kernels.json")] if json_dir else [])
        pipeline = [sys.executable, "-m", "benchmarks.gpu_pipeline"]
        pipeline += ["--skip", "packing", "compile"] if smoke else []
        out["gpu_pipeline"] = pipeline + (["--json", str(Path(json_dir) / "gpu_pipeline.json")] if json_dir else [])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds each")
    ap.add_argument("--json-dir", help="write <name>.json for each benchmark here")
    ap.add_argument("--dry-run", action="store_true", help="print the commands as JSON (name -> argv), run none")
    ap.add_argument("--cuda", action="store_true", help="with --dry-run: the commands of a node with CUDA")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() or (args.dry_run and args.cuda)
    if args.dry_run:  # exit 1 if a command names no benchmark module with a callable main
        todo = commands(args.smoke, args.json_dir, cuda)
        print(json.dumps(todo, indent=1))
        runnable = [callable(getattr(importlib.import_module(cmd[2]), "main", None)) for cmd in todo.values()]
        return 0 if all(runnable) else 1
    results = []
    for name, cmd in commands(args.smoke, args.json_dir, cuda).items():
        say(f"\n{'=' * 100}\n$ {' '.join(cmd[1:])}\n{'=' * 100}")
        t0 = time.perf_counter()
        code = subprocess.run(cmd).returncode
        results.append([name, "ok" if code == 0 else f"FAILED (exit {code})", time.perf_counter() - t0])
    say()
    table(["benchmark", "result", "wall s"], results, title="summary")
    if not cuda:
        say(
            "gpu_kernels, gpu_pipeline: skipped, no CUDA device here. On a GPU node, in one command (see its header\n"
            "  for carrying diffusers and pydantic to a machine without them):  bash benchmarks/gpu_session.sh"
        )
    return 0 if all(r[1] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
