"""The driver's admission check: what it costs, and proof that it is not on the request path.

    python -m benchmarks.admission [--smoke] [--json PATH]

Part 1 times ``h3serve.deploy.driver.preflight.admit(args, stage, platform)`` (``validate_deployment(model=...,
geometry=...,
...)``: the SP layout against the preset's heads, the device, then ``attention.resolve``) and the raw
``attention.resolve``, with the selector cache cleared before every call (cold, as a fresh driver sees
it), for the default CPU args and for ``h3serve/deploy/serve_config.gpu.yaml``'s args against
``h3serve/deploy/platforms/h200-flash-attn.json`` (rank 0 does not fit an H100). Part 2 serves requests through
``replicas.Engine`` in-process and shows the selector never runs there: its call counter stays
equal, and a profile of every Python call on the request path (event loop and the engine's model
thread) finds no frame in the admission or selector modules.
"""

from __future__ import annotations

import asyncio
import collections
import sys
import threading
from pathlib import Path

import torch
import yaml

from h3serve import attention
from h3serve.attention import Platform, probe_platform
from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.driver.preflight import admit
from h3serve.pipelines.h3 import REQUIREMENTS, GenerationRequest, preset
from h3serve.replicas import Engine, WorkerGroup

from .harness import machine, median, percentile, say, smoke_main, table, time_ms, tiny_spec

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "h3serve" / "deploy" / "platforms" / "h200-flash-attn.json"
# modules whose code is admission: none of their functions may run while serving
PACKAGES = tuple(("h3serve", p) for p in ("attention", "pipelines", "replicas", "deploy"))
LIBRARIES = "(libraries: diffusers, transformers, torch, asyncio, stdlib)"
ADMISSION_FILES = (
    "h3serve/attention/selector.py",
    "h3serve/deploy/driver/preflight.py",
    "h3serve/pipelines/h3/admission.py",
    "h3serve/attention/platform.py",
)


GPU_CONFIG = REPO / "h3serve" / "deploy" / "serve_config.gpu.yaml"


def configs() -> dict[str, tuple[DeployArgs, Platform]]:
    gpu = Platform.model_validate_json(H200.read_text())
    (app,) = yaml.safe_load(GPU_CONFIG.read_text())["applications"]
    full = DeployArgs.model_validate(app["args"])  # the released model, flash_attn, bf16, sp_degree 4
    return {
        "cpu tiny auto": (DeployArgs(), probe_platform("cpu")),
        f"gpu full {full.attention_backend} (h200 json)": (full, gpu),
        "gpu full auto (h200 json)": (full.model_copy(update={"attention_backend": "auto"}), gpu),
    }


def cold(fn):
    def call():
        attention.clear_cache()
        return fn()

    return call


def part1(reps: int) -> list[dict]:
    rows = []
    for name, (args, platform) in configs().items():

        def decide(args=args, platform=platform):  # the driver's whole decision, not counted anywhere
            return admit(args, "bench", platform, record=lambda tags: None)

        def raw(args=args, platform=platform):
            return attention.resolve(
                REQUIREMENTS,
                args.attention_backend,
                platform,
                model=args.served_model_name,
                dtype=args.dtype,
                head_dim=preset(args.model).geometry().head_dim,
            )

        resolution = decide().resolution
        for what, fn in (("admit (cold)", cold(decide)), ("resolve (cold)", cold(raw)), ("resolve (cached)", raw)):
            ms = time_ms(fn, reps=reps, warmup=3)
            rows.append(
                {
                    "config": name,
                    "call": what,
                    "backend": resolution.backend,
                    "median_ms": median(ms),
                    "p90_ms": percentile(ms, 90),
                    "reps": reps,
                }
            )
    ms = time_ms(lambda: probe_platform("cpu"), reps=max(5, reps // 10))
    rows.append(
        {
            "config": "this node",
            "call": "probe_platform (local)",
            "backend": "-",
            "median_ms": median(ms),
            "p90_ms": percentile(ms, 90),
            "reps": len(ms),
        }
    )
    return rows


def serve_requests(n: int) -> dict:
    """N requests through the in-process engine, with every Python call of every thread recorded."""
    spec = tiny_spec(sp=1)  # the driver's decision, made before anything is counted
    group = WorkerGroup.create(spec)
    requests = [
        GenerationRequest(prompt=f"request {i}", width=64 + 32 * (i % 2), height=64, num_inference_steps=3, seed=i)
        for i in range(n)
    ]
    calls: collections.Counter[str] = collections.Counter()

    def record(frame, event, arg):
        if event == "call":
            calls[frame.f_code.co_filename] += 1

    results = []

    async def serve() -> None:  # returns nothing: asyncio.run's teardown reprs its main task's result
        engine = Engine(group)  # created inside the profile: its model thread starts profiled
        results.extend(await asyncio.gather(*(engine.generate(r) for r in requests)))
        await engine.close("benchmark done")

    before = attention.selector_calls()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the default config's replica runs
    threading.setprofile(record)
    sys.setprofile(record)
    try:
        asyncio.run(serve())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        torch.set_num_threads(threads)
    after = attention.selector_calls()
    per_file = collections.Counter()
    for filename, count in calls.items():
        path = Path(filename).resolve()
        ours = path.is_relative_to(REPO) and path.relative_to(REPO).parts[:2] in PACKAGES
        per_file[path.relative_to(REPO).as_posix() if ours else LIBRARIES] += count
    admission_frames = {f: per_file.get(f, 0) for f in ADMISSION_FILES}
    return {
        "requests": n,
        "completed": len(results),
        "selector_calls_before": before,
        "selector_calls_after": after,
        "admission_frames": admission_frames,
        "calls_per_file": dict(per_file.most_common()),
        "ok": before == after and not any(admission_frames.values()) and len(results) == n,
    }


def run(smoke: bool = False) -> dict:
    say(f"machine: {machine()}")
    rows = part1(reps=20 if smoke else 300)
    table(
        ["config", "call", "backend", "median ms", "p90 ms", "reps"],
        [[r["config"], r["call"], r["backend"], r["median_ms"], r["p90_ms"], r["reps"]] for r in rows],
        title="Part 1: admission cost in the driver (cold = selector cache cleared before each call)",
    )
    say(
        "  admit = H3's rule (sp_degree divides the preset's heads, device) + resolve; once per deployment, before\n"
        "  any replica. The gpu rows use h3serve/deploy/serve_config.gpu.yaml's args.\n"
        "  In Serve the platform comes from a probe task shaped like one SP rank (a Ray task, ~ms to s),\n"
        "  also once per deployment."
    )
    path = serve_requests(2 if smoke else 8)
    say()
    table(
        ["evidence", "before", "after"],
        [["attention.selector_calls()", path["selector_calls_before"], path["selector_calls_after"]]],
        title=f"Part 2: {path['requests']} requests served through replicas.Engine in-process",
    )
    table(
        ["module (request path, all threads)", "python calls"],
        [[f, n] for f, n in path["admission_frames"].items()]
        + [[f, n] for f, n in path["calls_per_file"].items() if f not in path["admission_frames"]],
        title="Python calls on the request path, by module (admission modules first)",
    )
    say(f"\nadmission stays off the request path: {'YES' if path['ok'] else 'NO'}")
    return {
        "benchmark": "admission",
        "smoke": smoke,
        "machine": machine(),
        "cost": rows,
        "request_path": path,
        "ok": path["ok"],
    }


main = smoke_main(__doc__, run, __name__)
