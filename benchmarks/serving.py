"""Serving overhead: one image request over HTTP through Ray Serve vs the same request in-process.

    python -m benchmarks.serving [--smoke] [--json PATH]

Starts a local cluster (``ray.init(num_cpus=2)``) and ``serve.run(build_app(DeployArgs()))``, builds
an in-process ``replicas.Engine`` on an sp=1 WorkerGroup in this driver, then sends the same request,
one at a time (no concurrency: this measures overhead, not batching), interleaved:
  in-process   engine.generate(request) in this process
  handle       DeploymentHandle -> H3Replica.generate_image (engine + PNG in the replica)
  http         POST /v1/images/generations (proxy -> H3Ingress -> handle -> replica; JSON + base64)
The in-process side uses as many torch threads as a Serve replica of this shape gets (Ray sets
OMP_NUM_THREADS from the actor's CPUs), so the difference is serving overhead, not compute.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import socket
import sys

import httpx
import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from deploy.app import build_app
from deploy.args import DeployArgs
from pipelines.h3 import GenerationRequest
from replicas import Engine, ReplicaSpec, WorkerGroup

from .common import cpu_resolution, machine, main_for, median, now, percentile, say, table

TARGET = 1.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@ray.remote
def replica_threads() -> int:
    return torch.get_num_threads()


def run(smoke: bool = False) -> dict:
    size, steps, reps = (64, 2, 2) if smoke else (256, 8, 20)
    body = {"prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "num_inference_steps": steps, "seed": 7}
    request = GenerationRequest(prompt=body["prompt"], width=size, height=size, steps=steps, seed=7)
    args = DeployArgs(rank_resources={"CPU": 1.0})  # H3Ingress takes Serve's default 1 CPU: 2 in all
    port, own_threads, started_ray = free_port(), torch.get_num_threads(), not ray.is_initialized()
    if started_ray:  # else: reuse the caller's cluster (it needs 2 free CPUs)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    try:
        threads = ray.get(replica_threads.options(num_cpus=args.rank_resources["CPU"]).remote())
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = now()
        serve.run(build_app(args), name="h3serve", route_prefix="/")
        say(f"Serve app up in {now() - t0:.1f} s on port {port}; a replica of {args.rank_resources} runs "
            f"torch with {threads} thread(s), so this process uses {threads} too")
        torch.set_num_threads(threads)
        say(f"machine: {machine()}")
        handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
        engine = Engine(WorkerGroup.create(ReplicaSpec(resolution=cpu_resolution(), sp_degree=1)), args.engine.limits())
        loop = asyncio.new_event_loop()
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        out: dict = {}

        def in_process():
            out["media"] = loop.run_until_complete(engine.generate(request))

        def encode():  # what the replica and ingress add to the result: PNG, then base64 in JSON
            out["b64"] = base64.b64encode(out["media"].png()).decode()

        def via_handle():
            out["handle_png"] = handle.generate_image.remote(request.model_dump()).result()

        def via_http():
            response = http.post("/v1/images/generations", json=body)
            response.raise_for_status()
            out["http_png"] = base64.b64decode(response.json()["data"][0]["b64_json"])

        def ping_handle():  # the hop alone: a replica method that does no model work
            handle.diagnostics.remote().result()

        def ping_ingress():  # HTTP + proxy + ingress, no replica hop
            http.get("/v1/models").raise_for_status()

        paths = {"in-process engine": in_process, "PNG + base64 (in-process)": encode,
                 "Serve handle -> replica": via_handle, "HTTP -> proxy -> ingress -> replica": via_http,
                 "ping: handle -> replica.diagnostics": ping_handle, "ping: HTTP GET /v1/models (ingress)": ping_ingress}
        times = {k: [] for k in paths}
        warmup = 1 if smoke else 2
        for i in range(warmup + reps):  # interleaved; the first rounds warm up every path
            for name, fn in paths.items():
                t0 = now()
                fn()
                if i >= warmup:
                    times[name].append((now() - t0) * 1e3)
        frames = out["media"].frames[0].numpy().astype(int)
        diffs = {k: int(np.abs(np.asarray(Image.open(io.BytesIO(out[k]))).astype(int) - frames).max())
                 for k in ("handle_png", "http_png")}
        http.close()
        loop.run_until_complete(engine.close("benchmark done"))
        loop.close()
    finally:
        torch.set_num_threads(own_threads)
        serve.shutdown()
        if started_ray:
            ray.shutdown()

    base = median(times["in-process engine"])
    rows = [{"path": k, "median_ms": median(v), "p90_ms": percentile(v, 90),
             "vs_in_process": None if k.startswith("ping") else median(v) / base} for k, v in times.items()]
    say()
    table(["path", "median ms", "p90 ms", "vs in-process"],
          [[r["path"], r["median_ms"], r["p90_ms"], r["vs_in_process"]] for r in rows],
          title=f"{size}x{size}, {steps} steps, CFG on, sequential requests, {reps} each, interleaved")
    ms = {r["path"]: r["median_ms"] for r in rows}
    full, encode_ms = ms["HTTP -> proxy -> ingress -> replica"], ms["PNG + base64 (in-process)"]
    hop, ingress = ms["ping: handle -> replica.diagnostics"], ms["ping: HTTP GET /v1/models (ingress)"]
    ratio, ratio_same_work = full / base, full / (base + encode_ms)
    say(f"  HTTP / (in-process + PNG + base64), the same work on both sides: {ratio_same_work:.2f}x\n"
        f"  the HTTP path's {full - base:.1f} ms over in-process, by where it goes:\n"
        f"    PNG encode (replica) + base64 (ingress)   ~{encode_ms:.1f} ms (timed in-process)\n"
        f"    handle hop to the replica                 ~{hop:.1f} ms (ping)\n"
        f"    HTTP + proxy + ingress                    ~{ingress:.1f} ms (ping)\n"
        f"    rest: {len(out['b64']) / 1e3:.0f} kB JSON, the replica's loop  "
        f"~{full - base - encode_ms - hop - ingress:.1f} ms")
    ok = all(d <= 1 for d in diffs.values())
    say(f"  same pixels over Serve as in-process (max |diff| <= 1): {'YES' if ok else 'NO'} {diffs}")
    met = ratio <= TARGET
    say(f"\ntarget HTTP / in-process <= {TARGET}x: {ratio:.2f}x, {'met' if met else 'NOT met'}"
        + (" (smoke size: judged at 256x256, 8 steps)" if smoke else ""))
    return {"benchmark": "serving", "smoke": smoke, "machine": machine(), "replica_threads": threads,
            "request": body, "paths": rows, "samples_ms": times, "ratio": ratio, "ratio_same_work": ratio_same_work,
            "target": TARGET, "met": met,
            "pixel_diff_vs_in_process": diffs, "ok": ok}


main = main_for(__doc__, run)


if __name__ == "__main__":
    sys.exit(main())
