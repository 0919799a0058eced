"""``make readme-images``: what the default server returns for the README's own example prompts, as PNGs.

The README's examples ask for a clip ("a red circle moving left with a high beep") and a still ("a blue
square"). Both are generated as the default server makes them: the checkpoint and default steps of the
default serve config (``h3serve/deploy/serve_config.yaml``), the API's default seed (0), through the worker group and
packing engine a replica runs (``h3serve.demo.evaluate``'s path, no Ray). The still is the images endpoint's answer
(the shortest clip's middle frame); the clip becomes a strip of evenly spaced frames, its time left to right.
Everything is deterministic, so a regenerated image changes only when the model or the serving path does.

    python -m tools.readme_images [--config h3serve/deploy/serve_config.yaml] [--out docs/images]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from pathlib import Path
from typing import Literal

import numpy as np

from h3serve.demo.evaluate import EvalSettings, build_group, generate_all
from h3serve.pipelines.h3 import GenerationRequest

# (file name, prompt, what is kept): the README's curl/openai examples
EXAMPLES = (
    ("readme-clip.png", "a red circle moving left with a high beep", "strip"),
    ("readme-still.png", "a blue square", "still"),
)
STRIP_FRAMES = 8
ZOOM = 2  # the tiny canvas is 128x64: each pixel drawn as ZOOM x ZOOM
GAP = 4  # background pixels between a strip's frames


@dataclasses.dataclass(frozen=True)
class DefaultServer:
    """What a serve config's application generates with: its checkpoint, default steps, device and dtype."""

    checkpoint: str | None
    steps: int
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str | None = None

    @classmethod
    def of(cls, config: str | Path) -> DefaultServer:
        """From the config's one H3 application, read as `h3serve serve` reads it."""
        from h3serve.deploy.common.args import DeployArgs
        from h3serve.deploy.driver.cli import h3_apps, load_config

        ((_, raw),) = h3_apps(load_config(str(config)))
        args = DeployArgs.model_validate(raw)
        return cls(args.checkpoint, args.limits.default_steps, args.device, args.dtype)


def frame_strip(frames: np.ndarray, count: int = STRIP_FRAMES) -> np.ndarray:
    """uint8 [H*ZOOM, count*(W*ZOOM + GAP) - GAP, 3]: ``count`` evenly spaced frames of [F, H, W, 3], first to last."""
    picks = np.linspace(0, len(frames) - 1, count).round().astype(int)
    tiles = [frames[i].repeat(ZOOM, axis=0).repeat(ZOOM, axis=1) for i in picks]  # [H*ZOOM, W*ZOOM, 3] each
    gap = np.zeros((tiles[0].shape[0], GAP, 3), dtype=np.uint8)
    return np.concatenate([part for tile in tiles for part in (tile, gap)][:-1], axis=1)


def write_images(config: str | Path, out: str | Path, threads: int | None = None) -> list[Path]:
    from h3serve.pipelines.h3.media import encode_png

    if threads:
        import torch

        torch.set_num_threads(threads)
    server = DefaultServer.of(config)
    settings = EvalSettings(checkpoint=server.checkpoint, steps=server.steps, device=server.device, dtype=server.dtype)
    group = build_group(settings)
    try:
        requests = [GenerationRequest(prompt=prompt, num_inference_steps=server.steps) for _, prompt, _ in EXAMPLES]
        for request in requests:
            group.pipeline.validate(request)
        media = asyncio.run(generate_all(group, requests, pack=len(requests)))
    finally:
        group.shutdown()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (name, _, kind), clip in zip(EXAMPLES, media, strict=True):
        path = out / name
        path.write_bytes(clip.png() if kind == "still" else encode_png(frame_strip(clip.frames)))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="h3serve/deploy/serve_config.yaml", help="the serve config whose server to show"
    )
    parser.add_argument("--out", default="docs/images", help="directory the PNGs are written to")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = parser.parse_args(argv)
    for path in write_images(ns.config, ns.out, ns.threads):
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
