"""The GPU session's first minute: h3serve's serving path on the device, failing fast and loudly.

    python -m benchmarks.gpu_smoke                 # on CUDA (about 30 s); exit 1 on any failure
    python -m benchmarks.gpu_smoke --cpu-dry-run   # the same steps at the tiny dims on CPU

Every other GPU benchmark builds its documents on the host and moves whole packs; a replica does not:
diffusers' layout blocks leave a request's tensors on the execution device, and everything h3serve
makes from them (packs and their padding document, request states, the packed forward, attention
bounds) must be made there too. This runs exactly that, on the device:
  1. ``H3Pipeline.generate`` end to end on the tiny checkpoint (written by ``random_tiny_checkpoint``):
     diffusers' prepare blocks, packed steps, decode; then two requests stepped together in packs padded to
     a multiple of 8 rows (a padding document, as under sequence parallelism);
  2. one packed forward of two T2VA requests at the released canvas (1344x768, 124 and 141 frames, ~81k rows)
     at the released widths (hidden 5376, 56 heads x 128, bf16 with fp32 heads) but 2 of the 50 blocks,
     documents built on the device, packed there (padded to a multiple of 8), and checked to stay there.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback

import torch

from h3serve.attention import get_backend
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.shapes import Clip, build_transformer, clip_document, transformer_config

from .harness import cli, say

BACKEND = "torch_sdpa"  # available on CUDA and CPU; the kernels are gpu_kernels' subject, placement is this one's
SETTINGS = {
    "cuda": dict(preset="full", dtype=torch.bfloat16, canvas=(1344, 768), text_tokens=256),
    "cpu": dict(preset="tiny", dtype=torch.float32, canvas=(128, 64), text_tokens=32),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensors_not_on(obj, device: torch.device) -> list[str]:
    """The tensor fields of a dataclass that are not on ``device``."""
    return [
        f"{f.name} on {t.device}"
        for f in dataclasses.fields(obj)
        if isinstance(t := getattr(obj, f.name), torch.Tensor) and t.device != device
    ]


def pipeline_end_to_end(device: str) -> None:
    start = time.perf_counter()
    pipeline = H3Pipeline.load(random_tiny_checkpoint(), BACKEND, device=device)
    media = pipeline.generate(
        GenerationRequest(prompt="a red boat at dawn", width=64, height=64, num_inference_steps=3)
    )
    assert media.frames.shape == (124, 64, 64, 3), media.frames.shape
    assert media.audio.shape[0] == 2 and media.audio.size > 0, media.audio.shape
    say(f"  generate: {media.frames.shape[0]} frames 64x64 + stereo audio in {time.perf_counter() - start:.1f} s")

    pipeline.row_multiple = 8  # as a worker group of 8 ranks would: every pack gets a padding document
    states = [
        pipeline.prepare(GenerationRequest(prompt="waves", width=64, height=64, num_inference_steps=3, seed=1)),
        pipeline.prepare(GenerationRequest(prompt="a lighthouse", width=64, height=128, num_inference_steps=2)),
    ]
    here = torch.device(device, 0) if device == "cuda" else torch.device(device)
    padding = 0
    while any(not s.done for s in states):
        for group, pack in pipeline.packs([s for s in states if not s.done]):
            assert not (misplaced := tensors_not_on(pack, here)), f"pack tensors off {here}: {misplaced}"
            padding += pack.padding_rows
            pipeline.apply(group, pack, pipeline.forward(pack))
    frames = [pipeline.decode(s).frames.shape for s in states]
    sync(device)
    say(f"  two requests in shared packs ({padding} padding rows in all), decoded: {frames}")


def released_size_step(device: str) -> None:
    s = SETTINGS[device]
    config = {**transformer_config(s["preset"]), "num_layers": 2}  # released widths, 2 of the blocks
    start = time.perf_counter()
    model = build_transformer(config, device, s["dtype"])
    install(model, get_backend(BACKEND).make_impl())
    sync(device)
    built = time.perf_counter() - start
    clips = [Clip(*s["canvas"], n, text_tokens=s["text_tokens"]) for n in (124, 141)]
    documents = [clip_document(config, c, seed=j, device=device) for j, c in enumerate(clips)]
    pack = pack_documents(documents, row_multiple=8)
    here = documents[0].position_ids.device
    assert not (misplaced := tensors_not_on(pack, here)), f"pack tensors off {here}: {misplaced}"
    start = time.perf_counter()
    video, audio = packed_forward(model, pack)
    sync(device)
    assert video.shape == pack.video_rows.shape and audio.shape == pack.audio_rows.shape, (video.shape, audio.shape)
    assert video.device == here and bool(torch.isfinite(video).all() and torch.isfinite(audio).all())
    say(
        f"  {' + '.join(map(str, clips))}: {pack.total_rows} rows ({pack.padding_rows} padding), hidden "
        f"{config['hidden_size']}, {config['num_layers']} blocks, {s['dtype']}: built in {built:.1f} s, "
        f"forward {time.perf_counter() - start:.2f} s"
    )


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same steps at the tiny dims on CPU")


def run(args: argparse.Namespace) -> dict | int:
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        say("gpu_smoke: FAILED: no CUDA device (use --cpu-dry-run on CPU)")
        return 1
    failed = []
    for name, part in (("pipeline end to end", pipeline_end_to_end), ("released-size packed step", released_size_step)):
        say(f"== {name} on {device}")
        try:
            with torch.inference_mode():
                part(device)
        except Exception:
            failed.append(name)
            say(f"gpu_smoke: FAILED: {name} on {device}\n{traceback.format_exc()}")
    say(f"gpu_smoke: {'FAILED: ' + ', '.join(failed) if failed else 'ok'}")
    return {"device": device, "failed": failed, "ok": not failed}


main = cli(__doc__, run, options, __name__)
