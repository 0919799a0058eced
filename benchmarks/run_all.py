"""Run every CPU benchmark in sequence (``make bench``), each in its own process.

    python -m benchmarks.run_all [--smoke] [--json-dir DIR]

packing, admission, serving, sp; then gpu_kernels when CUDA is visible (otherwise its command is
printed). Exits non-zero if any benchmark's correctness check failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import say, table

CPU_BENCHMARKS = ("packing", "admission", "serving", "sp")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds each")
    ap.add_argument("--json-dir", help="write <name>.json for each benchmark here")
    args = ap.parse_args(argv)
    commands = {}
    for name in CPU_BENCHMARKS:
        cmd = [sys.executable, "-m", f"benchmarks.{name}"] + (["--smoke"] if args.smoke else [])
        commands[name] = cmd + (["--json", str(Path(args.json_dir) / f"{name}.json")] if args.json_dir else [])
    gpu = [sys.executable, "-m", "benchmarks.gpu_kernels"] + (["--quick"] if args.smoke else [])
    gpu += ["--out", str(Path(args.json_dir) / "gpu_kernels.json")] if args.json_dir else []
    if torch.cuda.is_available():
        commands["gpu_kernels"] = gpu
    results = []
    for name, cmd in commands.items():
        say(f"\n{'=' * 100}\n$ {' '.join(cmd[1:])}\n{'=' * 100}")
        t0 = time.perf_counter()
        code = subprocess.run(cmd).returncode
        results.append([name, "ok" if code == 0 else f"FAILED (exit {code})", time.perf_counter() - t0])
    say()
    table(["benchmark", "result", "wall s"], results, title="summary")
    if "gpu_kernels" not in commands:
        say("gpu_kernels: skipped, no CUDA device here; on a GPU node run:\n"
            "  python -m benchmarks.gpu_kernels --out gpu_kernels.json")
    return 0 if all(r[1] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
