"""diffusers' MiniMax-H3 modular blocks, split around the denoising loop that h3serve runs itself.

``before`` is ``MiniMaxH3Blocks`` without its loop and decoders: media preparation, Qwen3-VL
encoding, the packed layout, noise, and the two schedules, for T2VA, FL2VA and Ref2VA alike.
``after`` is after-denoise (rows back to latents) and the video and audio decoders. Between them
h3serve's engine steps many requests in shared packed forwards.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import tempfile
from typing import Any, Protocol

import numpy as np
import torch
from diffusers import AutoencoderKLMiniMaxH3
from diffusers.modular_pipelines import (
    MiniMaxH3Blocks,
    MiniMaxH3ModularPipeline,
    ModularPipelineBlocks,
    PipelineState,
    SequentialPipelineBlocks,
)
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
from diffusers.modular_pipelines.modular_pipeline_utils import ComponentSpec, InputParam
from PIL import Image

from . import chunked_decode, tiled_decode
from .checkpoint import ImageOnlyQwen3VLProcessor
from .request import GenerationRequest, ModelRules, Reference, RequestError
from .tiled_decode import TileRunner
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


def text_encoder_layers() -> int:
    """How many Qwen3-VL decoder layers H3 reads: through diffusers' ``text_encoder_layer`` (50 as released), plus
    one, since diffusers' encoder step refuses a stack of exactly that many (its last state is post-norm)."""
    return int(MiniMaxH3ModularPipeline().text_encoder_layer) + 1


class _WithVae:
    """A pipeline's components with another ``vae`` (the rest read through)."""

    def __init__(self, components: Any, vae: Any):
        self._components, self.vae = components, vae

    def __getattr__(self, name: str) -> Any:
        return getattr(self._components, name)


class _TiledVae:
    """A video VAE whose ``decode`` sends its tiles to ``run_tiles`` (``tiled_decode.decode``); the rest reads
    through to the VAE."""

    def __init__(self, vae: Any, run_tiles: TileRunner):
        self._vae, self._run_tiles = vae, run_tiles

    def decode(self, latents: torch.Tensor, return_dict: bool = True):
        assert not return_dict, "diffusers' decode step asks for a tuple"
        return (tiled_decode.decode(self._vae, latents, self._run_tiles),)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)


class MediaSink(Protocol):
    """Takes a clip as its decode makes it: the sound whole, first, then the frames in order, chunk by chunk."""

    def audio(self, audio: np.ndarray, sample_rate: int) -> None: ...  # float32 [2, S]

    def frames(self, frames: np.ndarray) -> None: ...  # uint8 [f, H, W, 3]


def uint8_frames(videos: torch.Tensor) -> np.ndarray:
    """diffusers' ``videos`` [F, 3, H, W] in [0, 1] as uint8 [F, H, W, 3], rounded as diffusers' ``numpy_to_pil``."""
    return (videos.permute(0, 2, 3, 1) * 255).round().to(torch.uint8).cpu().numpy()


class _ChunkedVae:
    """A video VAE whose ``decode`` hands each temporal chunk to ``on_chunk`` once it is final
    (``chunked_decode``); the clip it returns is the VAE's own, bit for bit."""

    def __init__(self, vae: Any, on_chunk):
        self._vae, self._on_chunk = vae, on_chunk

    def decode(self, latents: torch.Tensor, return_dict: bool = True):
        assert not return_dict, "diffusers' decode step asks for a tuple"
        pieces = []
        for piece in chunked_decode.chunks(self._vae, latents):  # [1, 3, f, H, W]
            self._on_chunk(piece)
            pieces.append(piece)
        return (torch.cat(pieces, dim=2),)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vae, name)


class TiledVideoDecodeStep(MiniMaxH3VideoDecodeStep):
    """diffusers' video decode step; given ``decode_tiles`` (a ``tiled_decode.TileRunner``) the VAE's tiles are
    decoded by it and blended by diffusers' own code (``tiled_decode``), the frames the same bits; given ``sink``
    (a ``MediaSink``) each temporal chunk's frames go to it as soon as they are final (``chunked_decode``)."""

    @property
    def inputs(self) -> list[InputParam]:
        return [
            *super().inputs,
            InputParam(name="decode_tiles", default=None, description="decodes the VAE's tiles; None: the VAE"),
            InputParam(name="sink", default=None, description="takes each final chunk's frames; None: nobody"),
        ]

    @torch.no_grad()
    def __call__(self, components, state: PipelineState):
        block_state = self.get_block_state(state)
        run_tiles, sink = block_state.decode_tiles, block_state.sink
        if run_tiles is not None and sink is not None:
            raise ValueError("a decode streams its chunks or sends its tiles away, not both")
        if run_tiles is not None:
            super().__call__(_WithVae(components, _TiledVae(components.vae, run_tiles)), state)
        elif sink is not None:
            chunked = _ChunkedVae(components.vae, self._to_frames(components, sink))
            super().__call__(_WithVae(components, chunked), state)
        else:
            super().__call__(components, state)
        return components, state

    @staticmethod
    def _to_frames(components, sink: MediaSink):
        """A decoded chunk [1, 3, f, H, W] to ``sink`` as the step makes the clip's frames: the same elementwise
        pixel scale, clamp and post-processing (the frames equal the whole clip's: ``tests/test_stream_decode.py``)."""
        device = components._execution_device
        pixel_mean = torch.tensor(components.pixel_mean, device=device).view(1, -1, 1, 1, 1)
        pixel_std = torch.tensor(components.pixel_std, device=device).view(1, -1, 1, 1, 1)

        def on_chunk(chunk: torch.Tensor) -> None:
            video = (chunk.float() * pixel_std + pixel_mean).clamp(0, 1)
            sink.frames(uint8_frames(components.video_processor.postprocess_video(video, output_type="pt")[0]))

        return on_chunk


class _VideoVaeStep(ModularPipelineBlocks):
    """Runs nothing: it declares the video VAE, whose latent channels after-denoise reads, in a pipeline that decodes
    only the audio."""

    model_name = "minimax-h3"

    @property
    def expected_components(self) -> list[ComponentSpec]:
        return [ComponentSpec("vae", AutoencoderKLMiniMaxH3)]

    @property
    def inputs(self) -> list[InputParam]:
        return []

    def __call__(self, components, state: PipelineState):
        return components, state


def _blocks_after_loop(*parts: str) -> SequentialPipelineBlocks:
    """After-denoise and the decoders in ``parts`` ("video", "audio"; none: both)."""
    blocks = {"video": TiledVideoDecodeStep(), "audio": MiniMaxH3AudioDecodeStep()}
    chosen = {name: block for name, block in blocks.items() if not parts or name in parts}
    if "video" not in chosen:
        chosen = {"video_vae": _VideoVaeStep(), **chosen}
    return SequentialPipelineBlocks.from_blocks_dict({"after_denoise": MiniMaxH3AfterDenoiseStep(), **chosen})


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
        # a decode whose tiles go elsewhere runs the audio decoder beside them (``decode(decode_tiles=)``)
        self._after_video = _blocks_after_loop("video").init_pipeline()
        self._after_video.update_components(vae=components["vae"])
        self._after_audio = _blocks_after_loop("audio").init_pipeline()
        self._after_audio.update_components(vae=components["vae"], audio_vae=components["audio_vae"])
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

    def decode(
        self,
        state: PipelineState,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        decode_tiles: TileRunner | None = None,
        sink: MediaSink | None = None,
    ) -> PipelineState:
        """After the loop, by diffusers' blocks: latents, ``videos`` [1, F, 3, H, W] in [0, 1], ``audio`` [1, 2, S].

        ``decode_tiles``: the video VAE's tiles are decoded by it (``tiled_decode``: the same frames), while the
        audio decoder runs beside it on a thread of its own. ``sink``: the audio is decoded first and handed to it,
        then each temporal chunk's frames as soon as they are final (a player of the stream needs every track's
        data to start: the sound is what the stream's first fragment waits for, not the end)."""
        inputs = dict(latents=video_rows, audio_latents=audio_rows, **{k: state.get(k) for k in DECODE_KEYS})
        if sink is not None:
            audio = self._after_audio(**inputs)
            sink.audio(audio.get("audio")[0].float().cpu().numpy(), int(audio.get("sampling_rate")))
            out = self._after_video(output_type="pt", sink=sink, **inputs)
            for key in ("audio", "sampling_rate"):
                out.set(key, audio.get(key))
            return out
        if decode_tiles is None:
            return self.after(output_type="pt", **inputs)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="audio-decode") as pool:
            audio = pool.submit(self._after_audio, **inputs)
            out = self._after_video(output_type="pt", decode_tiles=decode_tiles, **inputs)
            for key in ("audio", "sampling_rate"):
                out.set(key, audio.result().get(key))
        return out

    def finish(
        self,
        state: PipelineState,
        video_rows: torch.Tensor,
        audio_rows: torch.Tensor,
        decode_tiles: TileRunner | None = None,
        sink: MediaSink | None = None,
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """uint8 frames [F, H, W, 3], stereo audio [2, S] float32, and its sample rate."""
        out = self.decode(state, video_rows, audio_rows, decode_tiles, sink)
        frames = uint8_frames(out.get("videos")[0])  # [F, 3, H, W]
        return frames, out.get("audio")[0].float().cpu().numpy(), int(out.get("sampling_rate"))
