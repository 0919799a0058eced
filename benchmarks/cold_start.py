"""Cold start on the CPU default, per phase: what a replica does before its first step and its first finished clip.

    python -m benchmarks.cold_start [--smoke] [--steps N] [--no-served] [--json PATH]
    python -m benchmarks.cold_start --group [--layers N] [--json PATH]   # an sp=2 replica's start, large checkpoint
    PYTHONPATH=<another checkout> python benchmarks/cold_start.py ...   # the same phases with that checkout's h3serve

Two measurements, one after the other:
  phases  a new Python process does what a replica's rank 0 does, each phase timed: interpreter start (from the
          parent's spawn to the child's first line), imports (torch, diffusers, transformers, h3serve's pipeline),
          each component's load (``checkpoint.load_model``/tokenizer/processor/schedulers, timed where the pipeline
          calls them), what ``H3Pipeline.load`` spends besides (the blocks, the text encoder's trim and move), then
          the first request (prepare, first step, the other steps, decode) and the same request again, warm;
  served  `h3serve serve` of the default config (``harness.ServedDefault``): until it serves, then the first video
          job (POST to MP4) and a second one, warm.
  group   (``--group``) an sp=2 replica's worker group started on a synthetic checkpoint of the released layout
          whose transformer is several GiB (the tiny preset's VAEs and text encoder, a transformer of hidden 1024 and
          ``--layers`` blocks, fp32, random weights, written once into /tmp): ``WorkerGroup.create`` from its call
          to the group up, and each rank's load (when it was asked for, began and ended: ``LoadReport``; a checkout
          before it reports none, only the whole start). The page cache holds the checkpoint (just written or read).
Run it under another checkout's PYTHONPATH (a ``git archive`` of the commit before) for the "before" column: the
child, the command and the Ray workers all import that checkout's h3serve.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "a red circle moving left with a high beep"


def child(steps: int) -> None:
    """The phases, in this (new) process; one JSON line of {phase: seconds} on stdout."""
    born = time.time()
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    import diffusers  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    seconds["import torch, diffusers, transformers"] = time.perf_counter() - t
    t = time.perf_counter()
    from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
    from h3serve.pipelines.h3 import checkpoint as ckpt

    seconds["import h3serve.pipelines.h3"] = time.perf_counter() - t

    def timed(fn, label):
        def wrapper(index, name=None, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(index, *([name] if name is not None else []), *args, **kwargs)
            finally:
                key = f"load {label(name)}"
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

        return wrapper

    ckpt.load_model = timed(ckpt.load_model, lambda name: name)
    ckpt.load_scheduler = timed(ckpt.load_scheduler, lambda name: "schedulers")
    ckpt.load_tokenizer = timed(ckpt.load_tokenizer, lambda name: "tokenizer")
    ckpt.load_processor = timed(ckpt.load_processor, lambda name: "processor")
    checkpoint = os.environ.get("COLD_START_CHECKPOINT") or None
    t = time.perf_counter()
    pipeline = H3Pipeline.load(checkpoint, "torch_sdpa")
    loads = sum(v for k, v in seconds.items() if k.startswith("load "))
    seconds["H3Pipeline.load besides the components"] = time.perf_counter() - t - loads
    for label in ("first request", "warm request"):
        request = GenerationRequest(prompt=PROMPT, num_inference_steps=steps, seed=0)
        t = time.perf_counter()
        state = pipeline.prepare(request)
        seconds[f"{label}: prepare"] = time.perf_counter() - t
        t = time.perf_counter()
        pipeline.step([state])
        seconds[f"{label}: first step"] = time.perf_counter() - t
        t = time.perf_counter()
        while not state.done:
            pipeline.step([state])
        seconds[f"{label}: other steps"] = time.perf_counter() - t
        t = time.perf_counter()
        pipeline.decode(state)
        seconds[f"{label}: decode"] = time.perf_counter() - t
    print(json.dumps({"born": born, "seconds": seconds}), flush=True)


def phases(steps: int, checkpoint: str | None) -> dict[str, float]:
    env = {**os.environ, "COLD_START_CHECKPOINT": checkpoint or ""}
    spawned = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"the phases process failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"interpreter start": out["born"] - spawned, **out["seconds"]}


def served(steps: int) -> dict[str, float]:
    from benchmarks.harness import ServedDefault, now
    from h3serve.client import H3Client

    out = {}
    with ServedDefault() as server, H3Client(server.url, timeout=900) as client:
        out["`h3serve serve` until it serves"] = server.startup_s
        for label in ("first video job (POST to MP4)", "second video job, warm"):
            t0 = now()
            client.video_job({"prompt": PROMPT, "num_inference_steps": steps})
            out[label] = now() - t0
    return out


def synthetic_checkpoint(layers: int) -> tuple[str, dict]:
    """The released layout with a transformer of hidden 1024 (32 heads of 32, SwiGLU 4096) and ``layers`` blocks:
    ~17.5M parameters a block, fp32 (written once; a later run reads it again)."""
    from pathlib import Path

    from h3serve.pipelines.h3 import checkpoint as ckpt

    dims = {"num_attention_heads": 32, "attention_head_dim": 32, "hidden_size": 1024, "ffn_dim": 4096}
    dims["num_layers"] = layers
    directory = Path(f"/tmp/h3serve-cold-start-h1024-l{layers}")
    if not (directory / ckpt.INDEX_FILE).is_file():
        ckpt.write_tiny_checkpoint(directory, seed=0, transformer=dims)
    return str(directory), dims


def group_start(layers: int) -> dict:
    """``WorkerGroup.create`` of an sp=2 replica on the synthetic checkpoint, on a local Ray cluster of its own."""
    import pathlib

    import ray

    from h3serve.attention import Platform, resolve
    from h3serve.pipelines.h3 import REQUIREMENTS
    from h3serve.replicas import ReplicaSpec, WorkerGroup

    checkpoint, dims = synthetic_checkpoint(layers)
    nbytes = sum(f.stat().st_size for f in pathlib.Path(checkpoint, "transformer").glob("*.safetensors"))
    for f in pathlib.Path(checkpoint).rglob("*.safetensors"):  # into the page cache, as a second start finds it
        f.read_bytes()
    resolution = resolve(REQUIREMENTS, "auto", Platform.cpu(), model="minimax-h3-tiny", head_dim=32)
    spec = ReplicaSpec(
        resolution=resolution,
        checkpoint=checkpoint,
        model_name="cold-start",
        num_heads=dims["num_attention_heads"],
        head_dim=dims["attention_head_dim"],
        num_layers=dims["num_layers"],
        hidden_size=dims["hidden_size"],
        sp_degree=2,
        collective_timeout_s=120.0,
        rank_resources={"CPU": 0.5},
    )
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        started = time.time()
        group = WorkerGroup.create(spec)
        up = time.time()
        loads = {
            rank: {k: round(getattr(load, k) - started, 3) for k in ("requested", "started", "finished")}
            for rank, load in getattr(group, "loads", {}).items()  # none before LoadReport
        }
        group.shutdown()
    finally:
        ray.shutdown()
    return {"transformer_gib": nbytes / 2**30, "layers": layers, "create_s": up - started, "loads": loads}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.harness import say, served_checkpoint, table

    if args.group:
        result = group_start(args.layers)
        say(f"transformer {result['transformer_gib']:.2f} GiB; sp=2 group up in {result['create_s']:.2f} s")
        rows = [[rank, t["requested"], t["started"], t["finished"]] for rank, t in sorted(result["loads"].items())]
        table(["rank", "asked (s)", "load began (s)", "load ended (s)"], rows, "from WorkerGroup.create's call")
        return result

    steps = 2 if args.smoke else args.steps
    import h3serve

    code = os.path.dirname(os.path.dirname(h3serve.__file__))
    say(f"h3serve from {code}; {steps} steps; checkpoint {served_checkpoint() or 'the shipped demo one'}")
    result = {"code": code, "steps": steps, "phases": phases(steps, served_checkpoint())}
    table(["phase", "s"], list(result["phases"].items()), "a replica's rank 0 in a new process (CPU default)")
    if args.served and not args.smoke:
        result["served"] = served(steps)
        table(["served", "s"], list(result["served"].items()), "h3serve serve, the default config")
    return result


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=8, help="steps of each request (default 8)")
    ap.add_argument("--no-served", dest="served", action="store_false", help="only the phases, no `h3serve serve`")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--group", action="store_true", help="an sp=2 replica's start on a several-GiB checkpoint")
    ap.add_argument(
        "--layers", type=int, default=48, help="--group: the synthetic transformer's blocks (default 48: 3.3 GiB)"
    )


if __name__ == "__main__" and "--child" in sys.argv:  # before any import below: the child times its own imports
    child(int(sys.argv[sys.argv.index("--steps") + 1]))
    sys.exit(0)

from benchmarks.harness import cli  # noqa: E402  (after the child's exit, above)

main = cli(__doc__, run, options)

if __name__ == "__main__":
    raise SystemExit(main())
