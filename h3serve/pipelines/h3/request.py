"""What a caller asks MiniMax-H3 for, and the model's own rules a request must satisfy.

The rules (frame rate, clip lengths, the 17n+5 frame grid, canvas multiple, aspect limits, canvas
size) are read off the loaded checkpoint through diffusers' ``MiniMaxH3ModularPipeline``; its geometry
functions come torch-free from ``geometry`` (held equal to diffusers' own by tests/test_geometry.py), so the
ingress validates requests without importing torch. A request outside them raises
``RequestError`` naming the field and what is allowed.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .geometry import (
    MINIMAX_H3_MAX_ASPECT_RATIO,
    MINIMAX_H3_MIN_ASPECT_RATIO,
    align_num_frames,
    audio_latent_num_frames,
    resolve_canvas_size,
    video_latent_num_frames,
)

Task = Literal["t2va", "fl2va", "ref2va"]


class RequestError(ValueError):
    """A request this model cannot produce; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keep the field across process boundaries (Ray pickles errors)
        return type(self), (self.field, str(self))


class VisionUnavailable(RuntimeError):
    """A request needs a vision component this replica could not build."""


class Reference(BaseModel):
    """One Ref2VA reference: an encoded media file (PNG/JPEG image, MP4 video, WAV/MP3... audio)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["image", "video", "audio"]
    data: bytes = Field(min_length=1)


class GenerationRequest(BaseModel):
    """One clip: video at the model's frame rate with a stereo soundtrack.

    The task follows from the inputs: ``references`` make it Ref2VA, a first and/or last frame FL2VA,
    otherwise T2VA. MiniMax-H3 is guidance-distilled: there is no guidance scale or negative prompt.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str = Field(min_length=1)
    width: int | None = Field(default=None, gt=0)  # None with height: the model's canvas (or the keyframe's aspect)
    height: int | None = Field(default=None, gt=0)
    num_frames: int | None = Field(default=None, gt=0)  # None: the shortest clip; else 17n+5 within the clip lengths
    num_inference_steps: int = Field(default=50, ge=2)  # sigma grid points, the terminal zero included
    seed: int = Field(default=0, ge=0, lt=2**63)
    first_frame: bytes | None = None  # an encoded image the clip starts from
    last_frame: bytes | None = None  # an encoded image the clip ends on
    references: tuple[Reference, ...] = ()
    # step caching: "off" or a tier name of the deployment's engine.step_cache (None: the deployment's default);
    # the engine checks the name and resolves it to a policy (h3serve/pipelines/h3/step_cache.py)
    cache: str | None = Field(default=None, min_length=1)
    # the tenant that asked (a name from the ingress's key file; None: no tenants): the engine's scheduler shares
    # steps between tenants of equal priority (h3serve/replicas/scheduler.py); it changes nothing that is generated
    tenant: str | None = Field(default=None, min_length=1, max_length=63)

    @property
    def task(self) -> Task:
        if self.references:
            return "ref2va"
        return "fl2va" if self.first_frame is not None or self.last_frame is not None else "t2va"


class ModelRules(BaseModel):
    """The generation rules of one loaded checkpoint, in numbers a client can act on."""

    model_config = ConfigDict(frozen=True)

    fps: int
    min_seconds: float
    max_seconds: float
    frames_per_chunk: int  # 17: the video VAE's clip length
    latents_per_chunk: int  # 5
    canvas_multiple: int  # 32: VAE compression x patch
    canvas_short_edge: int
    canvas_max_pixels: int
    spatial_compression: int  # 16
    patch_hw: tuple[int, int]
    sample_rate: int  # the audio VAE's
    audio_channels: int
    partitions: tuple[str, ...]  # "transformer", and "transformer_ref" where the checkpoint has Ref2VA
    video_references: bool  # whether this replica can read video references (needs torchvision)

    # -- clip length ------------------------------------------------------------------------
    def aligned_frames(self, num_frames: int) -> int:
        return align_num_frames(num_frames, self.frames_per_chunk, self.latents_per_chunk)

    @property
    def min_frames(self) -> int:
        return self.aligned_frames(math.ceil(self.min_seconds * self.fps))

    @property
    def max_frames(self) -> int:
        """The longest 17n+5 clip within the maximum duration."""
        longest = self.aligned_frames(1)
        while longest + self.frames_per_chunk <= self.max_seconds * self.fps:
            longest += self.frames_per_chunk
        return longest

    def frames_for_seconds(self, seconds: float) -> int:
        """The 17n+5 frame count of a clip ``seconds`` long, or RequestError("seconds")."""
        if not math.isfinite(seconds) or seconds <= 0:
            raise RequestError("seconds", f"seconds must be a positive number, got {seconds}")
        frames = self.aligned_frames(max(1, round(seconds * self.fps)))
        if not self.min_frames <= frames <= self.max_frames:
            raise RequestError(
                "seconds",
                f"seconds={seconds:g} is outside what the model generates: "
                f"{self.min_frames / self.fps:g} to {self.max_frames / self.fps:g} s "
                f"({self.min_frames} to {self.max_frames} frames at {self.fps} fps)",
            )
        return frames

    def check_frames(self, num_frames: int) -> None:
        if self.aligned_frames(num_frames) != num_frames:
            raise RequestError(
                "num_frames",
                f"num_frames must be {self.frames_per_chunk}n+{self.latents_per_chunk} "
                f"(the video VAE's grid), got {num_frames}; the nearest above is "
                f"{self.aligned_frames(num_frames)}",
            )
        if not self.min_frames <= num_frames <= self.max_frames:
            raise RequestError(
                "num_frames",
                f"num_frames must be between {self.min_frames} and {self.max_frames} "
                f"({self.min_seconds:g}-{self.max_seconds:g} s at {self.fps} fps), "
                f"got {num_frames}",
            )

    # -- canvas -----------------------------------------------------------------------------
    def max_canvas(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) of the largest canvas the model generates at this aspect ratio."""
        h, w = resolve_canvas_size(width, height, self.canvas_multiple, self.canvas_short_edge, self.canvas_max_pixels)
        return w, h

    @property
    def default_canvas(self) -> tuple[int, int]:
        """(width, height) of a request without a size or keyframe: the model's own 16:9 canvas."""
        return self.max_canvas(16, 9)

    def check_canvas(self, width: int, height: int) -> None:
        m = self.canvas_multiple
        if width % m or height % m:
            raise RequestError("size", f"width and height must be multiples of {m}, got {width}x{height}")
        ratio = width / height
        if not MINIMAX_H3_MIN_ASPECT_RATIO <= ratio <= MINIMAX_H3_MAX_ASPECT_RATIO:
            raise RequestError(
                "size",
                f"aspect ratio {width}:{height} is outside 1:{1 / MINIMAX_H3_MIN_ASPECT_RATIO:g}"
                f" to {MINIMAX_H3_MAX_ASPECT_RATIO:g}:1",
            )
        max_w, max_h = self.max_canvas(width, height)
        if width > max_w or height > max_h:
            raise RequestError(
                "size", f"{width}x{height} is larger than the model's canvas at that aspect ratio, {max_w}x{max_h}"
            )

    # -- a whole request -------------------------------------------------------------------
    def check(self, request: GenerationRequest) -> None:
        """Raise RequestError for anything the model cannot generate as asked."""
        if (request.width is None) != (request.height is None):
            raise RequestError("size", "width and height go together: give both or neither")
        if request.width is not None and request.height is not None:
            self.check_canvas(request.width, request.height)
        if request.num_frames is not None:
            self.check_frames(request.num_frames)
        if request.task == "ref2va":
            if "transformer_ref" not in self.partitions:
                raise RequestError(
                    "references",
                    "this checkpoint has no transformer_ref/ partition, so it cannot "
                    "condition on references (Ref2VA); it serves text and keyframes",
                )
            if not self.video_references and any(r.kind == "video" for r in request.references):
                raise RequestError(
                    "references",
                    "video references need torchvision on the replica, which is not "
                    "installed; image and audio references work",
                )

    def rows(self, request: GenerationRequest, text_tokens: int) -> int:
        """Rows the request's generated media and ``text_tokens`` of conditioning add to a pack."""
        width, height = self.default_canvas
        if request.width is not None and request.height is not None:
            width, height = request.width, request.height
        num_frames = request.num_frames or self.min_frames
        ph, pw = self.patch_hw
        per_frame = (height // self.spatial_compression // ph) * (width // self.spatial_compression // pw)
        video = video_latent_num_frames(num_frames, self.frames_per_chunk, self.latents_per_chunk) * per_frame
        audio = audio_latent_num_frames(num_frames, self.fps) * self.audio_channels
        keyframes = (request.first_frame is not None) + (request.last_frame is not None)
        return text_tokens + keyframes * per_frame + video + audio
