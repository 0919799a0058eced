"""Serving overhead: requests over HTTP through Ray Serve (`h3serve serve`, default config) vs in-process.

    python -m benchmarks.serving [--smoke] [--json PATH]

Starts a local cluster (``ray.init(num_cpus=2)``), runs ``h3serve serve h3serve/deploy/serve_config.yaml``
against it (only the port changed), builds an in-process ``replicas.Engine`` on an sp=1 WorkerGroup
in this driver, then sends the same request, one at a time (no concurrency: this measures overhead,
not batching), all paths interleaved:
  in-process engine          engine.generate(request) here, then the PNG / the MP4 encoded here
  handle                     DeploymentHandle -> H3Replica.generate_image (engine + PNG in the replica)
  HTTP image                 POST /v1/images/generations: the middle frame of the clip, PNG in base64 JSON
  HTTP video job             POST /v1/videos, poll GET /v1/videos/{id} every 50 ms, GET .../content (MP4)
The request is the server's default (no size, no seconds, no steps: the tiny canvas, the shortest
clip, ``limits.default_steps``); smoke uses 64x64 and 2 steps. The in-process side uses as many torch
threads as the replica gets (Ray sets OMP_NUM_THREADS from the actor's CPUs), so the difference is
serving overhead, not compute.
"""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import ray
import torch
from PIL import Image
from ray import serve

from h3serve.client import H3Client
from h3serve.pipelines.h3 import GenerationRequest
from h3serve.pipelines.h3.checkpoint import resolve_checkpoint
from h3serve.pipelines.h3.media import probe_media
from h3serve.replicas import Engine, WorkerGroup

from .harness import (
    cli,
    default_args,
    interleaved,
    machine,
    median,
    percentile,
    say,
    served_default,
    startup,
    table,
    tiny_spec,
)

TARGET = 1.2


@ray.remote
def replica_threads() -> int:
    return torch.get_num_threads()


def run(smoke: bool = False, url: str | None = None) -> dict:
    """``url``: a server of the default config already up (the caller's, ``--url``), used instead of starting one."""
    args = default_args()
    size, steps, reps = ((64, 64), 2, 1) if smoke else (None, args.limits.default_steps, 3)
    body = {
        "prompt": "a lighthouse at dusk",
        "seed": 7,
        **({"size": f"{size[0]}x{size[1]}", "num_inference_steps": steps} if smoke else {}),
    }
    request = GenerationRequest(
        prompt=body["prompt"], width=size and size[0], height=size and size[1], num_inference_steps=steps, seed=7
    )
    own_threads = torch.get_num_threads()
    out: dict = {}
    with served_default(url) as served:
        threads = ray.get(replica_threads.options(num_cpus=args.rank_resources["CPU"]).remote())
        say(f"checkpoint: {resolve_checkpoint(served.checkpoint)}")
        say(
            f"`h3serve serve` (default config) serving {startup(served)} at {served.url}; a replica of "
            f"{args.rank_resources} runs torch with {threads} thread(s), so this process uses {threads} too"
        )
        torch.set_num_threads(threads)
        say(f"machine: {machine()}")
        handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
        group = WorkerGroup.create(tiny_spec(sp=1, checkpoint=str(resolve_checkpoint(served.checkpoint))))
        engine = Engine(group, args.engine)
        loop = asyncio.new_event_loop()
        api = H3Client(served.url, timeout=600)

        def in_process():
            out["media"] = loop.run_until_complete(engine.generate(request))

        def encode_png():  # what the replica and ingress add to an image: PNG, then base64 in JSON
            out["b64"] = base64.b64encode(out["media"].png()).decode()

        def encode_mp4():  # what the replica adds to a video job
            out["mp4"] = out["media"].mp4()

        def via_handle():
            out["handle_png"] = handle.generate_image.remote(request, "bench-handle").result()

        def via_http_image():
            out["http_png"] = base64.b64decode(api.image(body)["data"][0]["b64_json"])

        def via_http_video():
            out["job"], out["http_mp4"] = api.video_job(body)

        def ping_handle():  # the hop alone: a replica method that does no model work
            handle.diagnostics.remote().result()

        def ping_ingress():  # HTTP + proxy + ingress, no replica hop
            api.models()

        paths = {
            "in-process engine": in_process,
            "PNG + base64 (in-process)": encode_png,
            "MP4 encode (in-process)": encode_mp4,
            "Serve handle -> replica (PNG)": via_handle,
            "HTTP image: POST /v1/images/generations": via_http_image,
            "HTTP video job: POST, poll, GET content": via_http_video,
            "ping: handle -> replica.diagnostics": ping_handle,
            "ping: HTTP GET /v1/models": ping_ingress,
        }
        times = interleaved(paths, 1 + reps)  # the first round warms every path up (its times are kept apart)
        middle = out["media"].frames[len(out["media"].frames) // 2].astype(int)
        diffs = {
            k: int(np.abs(np.asarray(Image.open(io.BytesIO(out[k]))).astype(int) - middle).max())
            for k in ("handle_png", "http_png")
        }
        got, want = probe_media(out["http_mp4"]), probe_media(out["mp4"])
        video_same = (got.frames, got.width, got.height, got.audio_channels) == (
            want.frames,
            want.width,
            want.height,
            want.audio_channels,
        )
        api.close()
        loop.run_until_complete(engine.close("benchmark done"))
        loop.close()
        group.shutdown()
        torch.set_num_threads(own_threads)

    base = median(times["in-process engine"][1:])
    rows = [
        {
            "path": k,
            "first_ms": v[0],
            "median_ms": median(v[1:]),
            "p90_ms": percentile(v[1:], 90),
            "vs_in_process": None if k.startswith("ping") or "in-process)" in k else median(v[1:]) / base,
        }
        for k, v in times.items()
    ]
    shape = f"{request.width}x{request.height}" if size else "default canvas"
    say()
    table(
        ["path", "first (cold) ms", "median ms", "p90 ms", "vs in-process"],
        [[r["path"], r["first_ms"], r["median_ms"], r["p90_ms"], r["vs_in_process"]] for r in rows],
        title=f"{shape}, shortest clip, {steps} steps, sequential requests, {reps} each after one warm-up, interleaved",
    )
    ms = {r["path"]: r["median_ms"] for r in rows}
    image, video = ms["HTTP image: POST /v1/images/generations"], ms["HTTP video job: POST, poll, GET content"]
    ratio_image = image / (base + ms["PNG + base64 (in-process)"])
    ratio_video = video / (base + ms["MP4 encode (in-process)"])
    hop, ingress = ms["ping: handle -> replica.diagnostics"], ms["ping: HTTP GET /v1/models"]
    say(
        f"  HTTP image / (in-process + PNG + base64), the same work on both sides: {ratio_image:.2f}x\n"
        f"  HTTP video job / (in-process + MP4), the same work on both sides: {ratio_video:.2f}x\n"
        f"  fixed hops: handle -> replica ~{hop:.1f} ms, HTTP + proxy + ingress ~{ingress:.1f} ms; a video job adds\n"
        f"  the job store writes, polling every 50 ms and a second GET for the MP4 "
        f"({len(out['http_mp4']) / 1e3:.0f} kB)"
    )
    ok = all(d <= 1 for d in diffs.values()) and video_same and out["job"]["status"] == "completed"
    say(
        f"  same pixels over Serve as in-process (max |diff| <= 1): {diffs}; video job MP4 has the in-process clip's "
        f"frames, size and audio channels: {'yes' if video_same else 'NO'} ({got.frames} frames {got.width}x"
        f"{got.height}, {got.audio_channels} audio channels)"
    )
    met = max(ratio_image, ratio_video) <= TARGET
    say(
        f"\ntarget HTTP / in-process (same work) <= {TARGET}x: image {ratio_image:.2f}x, video {ratio_video:.2f}x, "
        f"{'met' if met else 'NOT met'}" + (" (smoke size: judged on the default request)" if smoke else "")
    )
    say(f"serving checks: {'YES' if ok else 'NO'}")
    return {
        "benchmark": "serving",
        "smoke": smoke,
        "machine": machine(),
        "replica_threads": threads,
        "startup_s": served.startup_s,
        "request": body,
        "steps": steps,
        "paths": rows,
        "samples_ms": times,
        "ratio_image": ratio_image,
        "ratio_video": ratio_video,
        "target": TARGET,
        "met": met,
        "pixel_diff_vs_in_process": diffs,
        "video_same_shape": video_same,
        "ok": ok,
    }


def options(ap) -> None:
    ap.add_argument("--url", help="a server of the default config already up (joined with --address) instead of one")


main = cli(__doc__, lambda args: run(args.smoke, args.url), options, __name__)
