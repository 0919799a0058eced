"""One clip's decode at the decoder stage: serial (one H3Decoder replica) against split by whole tiles over two.

Two Serve apps on one Ray cluster, side by side in one run: ``serial`` (1 replica, no split) and ``parallel``
(2 replicas, ``decode_split`` 2: ``h3serve.pipelines.h3.tiled_decode``), each replica one CPU, the tiny checkpoint
(its VAEs have the released temporal chunking and 256-pixel tiles). The same handoff goes to both, on the default
128x64 5 s canvas and on a larger one (the tiny VAE at 640x384, 6 spatial tiles per chunk: the released tiling at
a canvas the tiny model cannot generate, so its latents are random). Frames must be equal bit for bit. Then the
same decodes in this process with the VAEs in fp32 and in bf16 (the CPU default of ``vae_dtype`` rests on it).

    python -m benchmarks.parallel_decode [--smoke] [--reps N] [--json PATH]

On a 2-core machine shared with other work the speedup is bounded by the cores: two replicas of one CPU each are at
most 2x, less the handoff of tiles through the object store and the audio decode beside it.
"""

from __future__ import annotations

import argparse
import logging
import statistics

import numpy as np
import torch

from benchmarks.harness import Phases, cli, say, table

LARGER = (24, 40)  # latent height, width: 384x640 pixels


def handoffs(smoke: bool) -> dict:
    """The default canvas's handoff from a real (2-step) request, and the larger canvas's with random latents."""
    from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint
    from h3serve.pipelines.h3.handoff import DecodeHandoff

    pipeline = H3Pipeline.load(random_tiny_checkpoint(), "torch_sdpa")
    state = pipeline.prepare(GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=0))
    while not state.done:
        pipeline.step([state])
    default = pipeline.decode_handoff(state)
    out = {"128x64": default}
    if not smoke:
        frames, (h, w) = default.layout["num_latent_frames"], LARGER
        rows = torch.randn(frames * (h // 2) * (w // 2), default.video_rows.shape[1], generator=torch.Generator())
        layout = dict(default.layout, latent_height=h, latent_width=w)
        out[f"{w * 16}x{h * 16}"] = DecodeHandoff(video_rows=rows, audio_rows=default.audio_rows, layout=layout)
    return out


def vae_dtypes(work: dict, checkpoint: str, reps: int) -> dict:
    """The whole decode (both VAEs) in this process on one thread, the VAEs in fp32 and in bf16 (diffusers'
    ``_keep_in_fp32_modules`` in fp32): what ``vae_dtype``'s CPU default rests on."""
    from h3serve.pipelines.h3 import H3StageModels

    rows, out = [], {}
    decoders = {d: H3StageModels.load("decoder", checkpoint, vae_dtype=d) for d in ("float32", "bfloat16")}
    for canvas, handoff in work.items():
        times = {}
        for dtype, decoder in decoders.items():
            decoder.decode(handoff)  # first-call costs
            phases = Phases()
            for rep in range(reps):
                with phases(str(rep)):
                    decoder.decode(handoff)
            times[dtype] = statistics.median(phases.seconds.values())
        rows.append([canvas, times["float32"], times["bfloat16"], times["bfloat16"] / times["float32"]])
        out[canvas] = times
    table(["canvas", "fp32 s", "bf16 s", "bf16 / fp32"], rows, f"VAE decode in process, 1 thread, median of {reps}")
    return out


def run(args: argparse.Namespace) -> dict:
    import ray
    from ray import serve

    from h3serve.deploy.model_server.stage_deployments import H3Decoder
    from h3serve.pipelines.h3 import H3StageModels, tiled_decode
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint

    torch.set_num_threads(1)
    work = handoffs(args.smoke)
    checkpoint = str(random_tiny_checkpoint())
    vae = H3StageModels.load("decoder", checkpoint).stages.after.vae
    started_ray = not ray.is_initialized()
    if started_ray:
        quiet = dict(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        ray.init(num_cpus=3, namespace="serve", **quiet)  # 3 replicas of 1 logical CPU each (2 cores here)
    handles = {}
    for mode, replicas in (("serial", 1), ("parallel", 2)):
        deployment = serve.deployment(
            H3Decoder, name=f"H3Decoder_{mode}", num_replicas=replicas, ray_actor_options={"num_cpus": 1}
        )
        app = deployment.bind(checkpoint, "cpu", "float32", "float32", replicas)
        handles[mode] = serve.run(app, name=f"decode-{mode}", route_prefix=None)
    rows, result = [], {"canvases": {}, "ok": True}
    try:
        for canvas, handoff in work.items():
            phases, frames = Phases(), {}
            for rep in range(1 + args.reps):  # the first of each is untimed: first-call costs
                for mode, handle in handles.items():
                    with phases(f"{mode}{rep}"):
                        media = handle.decode.remote(handoff, None, "bench").result(timeout_s=900)
                    frames[mode] = media.frames
            times = {m: [phases.seconds[f"{m}{r}"] for r in range(1, 1 + args.reps)] for m in handles}
            serial, parallel = (statistics.median(times[m]) for m in ("serial", "parallel"))
            equal = bool(np.array_equal(frames["serial"], frames["parallel"]))
            layout = handoff.layout  # the tiles: the VAE's own split of latents of this shape
            z = torch.zeros(1, 8, layout["num_latent_frames"], layout["latent_height"], layout["latent_width"])
            tiles = len(tiled_decode.tiles_of(vae, z))
            rows.append([canvas, frames["serial"].shape[0], tiles, serial, parallel, serial / parallel, equal])
            result["canvases"][canvas] = dict(tiles=tiles, serial_s=times["serial"], parallel_s=times["parallel"])
            result["canvases"][canvas]["equal"] = equal
            tiles_by_replica: dict[str, dict] = {}  # who decoded what, so far: own, for_peers, taken_back
            for _ in range(20):
                report = handles["parallel"].report.remote().result(timeout_s=60)
                tiles_by_replica[report["replica_id"]] = report["tiles"]
            result["canvases"][canvas]["tiles_by_replica"] = tiles_by_replica
            say(f"{canvas}: tiles decoded by each parallel replica so far: {list(tiles_by_replica.values())}")
            result["ok"] &= equal
    finally:
        for mode in handles:
            serve.delete(f"decode-{mode}")
        if started_ray:
            serve.shutdown()
            ray.shutdown()
    headers = ["canvas", "frames", "tiles", "serial s", "2 replicas s", "speedup", "bit-equal"]
    table(headers, rows, f"decode at the H3Decoder stage, median of {args.reps} (fp32, 1 CPU per replica)")
    say("frames equal bit for bit" if result["ok"] else "FRAMES DIFFER")
    result["vae_dtype_cpu"] = vae_dtypes(work, checkpoint, args.reps)
    return result


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--reps", type=int, default=3, help="timed decodes per canvas and mode (median)")


main = cli(__doc__, run, options, __name__)
