"""diffusers' MiniMax-H3 modular blocks, split around the denoising loop that h3serve runs itself.

``before`` is ``MiniMaxH3Blocks`` without its loop and decoders: media preparation, Qwen3-VL
encoding, the packed layout, noise, and the two schedules, for T2VA, FL2VA and Ref2VA alike.
``after`` is after-denoise (rows back to latents) and the video and audio decoders. Between them
h3serve's engine steps many requests in shared packed forwards.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import numpy as np
import torch
from diffusers.modular_pipelines import MiniMaxH3Blocks, PipelineState, SequentialPipelineBlocks
from diffusers.modular_pipelines.minimax_h3 import (
    MiniMaxH3AudioReference,
    MiniMaxH3ImageReference,
    MiniMaxH3VideoReference,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
from diffusers.modular_pipelines.minimax_h3.decoders import (
    MiniMaxH3AfterDenoiseStep,
    MiniMaxH3AudioDecodeStep,
    MiniMaxH3VideoDecodeStep,
)
from PIL import Image

from .checkpoint import ImageOnlyQwen3VLProcessor
from .request import GenerationRequest, ModelRules, Reference, RequestError
from .uploads import image_problem

# The loop and everything after it; each core denoise workflow (t2va, fl2va, ref2va) has both.
_LOOP_AND_AFTER = ("denoise", "after_denoise")


class HostRowTimestepsStep(MiniMaxH3SetTimestepsStep):
    """diffusers' timesteps step, with the row-timestep plan built on the host.

    diffusers' ``build_row_timesteps`` fills a ``torch.full`` row vector made on the default device (the
    CPU) through the layout's indices, which its layout step has already moved to the execution device;
    on a GPU that is a CPU tensor indexed by CUDA indices, which torch refuses. The plan is built from
    host copies of the indices here; ``__call__`` moves it to the execution device as before.
    """

    @staticmethod
    def build_row_timesteps(video_indices: torch.Tensor, audio_indices: torch.Tensor, *args, **kwargs):
        return MiniMaxH3SetTimestepsStep.build_row_timesteps(video_indices.cpu(), audio_indices.cpu(), *args, **kwargs)


def _blocks_before_loop() -> MiniMaxH3Blocks:
    blocks = MiniMaxH3Blocks()
    for workflow in blocks.sub_blocks["denoise"].sub_blocks.values():
        for name in _LOOP_AND_AFTER:
            workflow.sub_blocks.pop(name)
        workflow.sub_blocks["set_timesteps"] = HostRowTimestepsStep()  # same place in the sequence
    blocks.sub_blocks.pop("decode")
    return blocks


def _blocks_after_loop() -> SequentialPipelineBlocks:
    return SequentialPipelineBlocks.from_blocks_dict(
        {
            "after_denoise": MiniMaxH3AfterDenoiseStep(),
            "video": MiniMaxH3VideoDecodeStep(),
            "audio": MiniMaxH3AudioDecodeStep(),
        }
    )


# The layout sizes the blocks after the loop read (besides the latents rows)
DECODE_KEYS = (
    "num_condition_video_rows",
    "num_condition_audio_rows",
    "num_latent_frames",
    "latent_height",
    "latent_width",
    "num_audio_latents",
)
# What the engine reads of a prepared request (``RequestState``) besides DECODE_KEYS: the noised rows, the
# row-timestep plan and schedule, the prompt embeddings and the packed layout
PREPARED_KEYS = (
    "latents",
    "audio_latents",
    "row_timestep_plan",
    "timesteps",
    "prompt_embeds",
    "position_ids",
    "token_tags",
    "video_indices",
    "audio_indices",
    "text_indices",
    *DECODE_KEYS,
)


def decode_image(data: bytes, field: str) -> Image.Image:
    """An upload as RGB, or RequestError(field): over MAX_UPLOAD_PIXELS (checked on the header, before decoding)
    or undecodable."""
    problem = image_problem(data, verify=False)  # the decode below reads every pixel anyway
    if problem is not None:
        raise RequestError(field, f"{field} {problem}")
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Exception as e:  # as above: the upload's fault
        raise RequestError(field, f"{field} is not a decodable image: {e}") from None


def decode_reference(reference: Reference, index: int):
    """A diffusers reference object from uploaded bytes (video and audio decode through a file)."""
    field = f"references[{index}]"
    if reference.kind == "image":
        return MiniMaxH3ImageReference(image=decode_image(reference.data, field))
    cls = MiniMaxH3VideoReference if reference.kind == "video" else MiniMaxH3AudioReference
    with tempfile.NamedTemporaryFile(suffix=".mp4" if reference.kind == "video" else ".media", delete=False) as f:
        f.write(reference.data)
    try:
        return cls.from_file(f.name)
    except Exception as e:  # any decoder failure is the upload's fault
        raise RequestError(field, f"{field} is not a decodable {reference.kind}: {type(e).__name__}: {e}") from None
    finally:
        os.unlink(f.name)


class H3Stages:
    """The per-request stages of one checkpoint's components (rank 0 holds them)."""

    def __init__(self, components: dict[str, Any], pipeline_config: dict[str, Any]):
        self.before = _blocks_before_loop().init_pipeline()
        self.before.register_to_config(**pipeline_config)
        self.before.update_components(**{k: v for k, v in components.items() if k in self.before.component_names})
        self.after = _blocks_after_loop().init_pipeline()
        self.after.update_components(vae=components["vae"], audio_vae=components["audio_vae"])
        # The layout and after-denoise blocks read the patch off a transformer they do not declare (the loop
        # does), so they fall back to the released (1, 2, 2); a checkpoint with another patch is refused.
        self.partitions = tuple(p for p in ("transformer", "transformer_ref") if p in components)
        for name in self.partitions:
            patch = tuple(components[name].config.patch_size)
            if patch != self.before.patch_size or patch != self.after.patch_size:
                raise ValueError(f"{name} patch_size {patch} is not the layout's {self.before.patch_size}")
        self.vision_video = not isinstance(components["processor"], ImageOnlyQwen3VLProcessor)

    def rules(self) -> ModelRules:
        pipe = self.before
        return ModelRules(
            fps=pipe.fps,
            min_seconds=pipe.min_duration,
            max_seconds=pipe.max_duration,
            frames_per_chunk=pipe.vae_frames_per_chunk,
            latents_per_chunk=pipe.vae_latents_per_chunk,
            canvas_multiple=pipe.canvas_multiple,
            canvas_short_edge=pipe.config.canvas_short_edge,
            canvas_max_pixels=pipe.config.canvas_max_pixels,
            spatial_compression=pipe.vae_spatial_compression_ratio,
            patch_hw=tuple(pipe.patch_size[1:]),
            sample_rate=pipe.audio_sampling_rate,
            audio_channels=pipe.audio_channels,
            partitions=self.partitions,
            video_references=self.vision_video,
        )

    def prepare(self, request: GenerationRequest, rules: ModelRules) -> PipelineState:
        """Everything before the loop, by diffusers' blocks: packed rows, layout and schedules."""
        inputs: dict[str, Any] = dict(
            prompt=request.prompt,
            num_inference_steps=request.num_inference_steps,
            num_frames=request.num_frames or rules.min_frames,
            generator=torch.Generator("cpu").manual_seed(request.seed),
        )
        if request.width is not None:
            inputs.update(width=request.width, height=request.height)
        elif request.task == "ref2va":  # references never bind the canvas: the model's own 16:9
            inputs["width"], inputs["height"] = rules.default_canvas
        if request.first_frame is not None:
            inputs["image"] = decode_image(request.first_frame, "first_frame")
        if request.last_frame is not None:
            inputs["last_image"] = decode_image(request.last_frame, "last_frame")
        if request.references:
            inputs["references"] = [decode_reference(r, i) for i, r in enumerate(request.references)]
        try:
            return self.before(**inputs)
        except ValueError as e:  # the blocks' own input checks (reference limits, canvas of a keyframe...)
            raise RequestError(request.task, f"{request.task}: {e}") from None

    def decode(self, state: PipelineState, video_rows: torch.Tensor, audio_rows: torch.Tensor) -> PipelineState:
        """After the loop, by diffusers' blocks: latents, ``videos`` [1, F, 3, H, W] in [0, 1], ``audio`` [1, 2, S]."""
        return self.after(
            latents=video_rows, audio_latents=audio_rows, output_type="pt", **{k: state.get(k) for k in DECODE_KEYS}
        )

    def finish(
        self, state: PipelineState, video_rows: torch.Tensor, audio_rows: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """uint8 frames [F, H, W, 3], stereo audio [2, S] float32, and its sample rate."""
        out = self.decode(state, video_rows, audio_rows)
        video = out.get("videos")[0]  # [F, 3, H, W]
        frames = (video.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()  # as diffusers' numpy_to_pil
        return frames, out.get("audio")[0].float().cpu().numpy(), int(out.get("sampling_rate"))
