"""What a caller asks for, checked against the model's geometry, and its denoising state."""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field

from .config import H3Config
from .decoders import latent_frames
from .packing import Document, DocumentOutput
from .sampler import FlowMatchEuler, guided


def video_frames(seconds: float, fps: int, config: H3Config) -> tuple[int, int]:
    """(frames to generate, frames to keep) for a clip: latents need 1 + vae_temporal * k frames."""
    keep = round(seconds * fps)
    step = config.vae_temporal
    return 1 + step * math.ceil((keep - 1) / step), keep


class RequestError(ValueError):
    """A request this model cannot produce; ``field`` names the offending request field."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # keep the field across process boundaries (Ray pickles errors)
        return type(self), (self.field, str(self))


class GenerationRequest(BaseModel):
    """One image (num_frames=1, no audio) or one video with audio."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str
    negative_prompt: str = ""
    width: int = Field(default=256, gt=0)
    height: int = Field(default=256, gt=0)
    num_frames: int = Field(default=1, ge=1)
    fps: int = Field(default=8, ge=1)
    steps: int = Field(default=8, ge=1)
    guidance_scale: float = Field(default=4.0, ge=0)
    shift: float = Field(default=3.0, gt=0)
    seed: int = Field(default=0, ge=0, lt=2**63)
    audio: bool | None = None  # default: videos have audio, images do not
    # frames to keep after decoding (latents need 1 + 4k frames; a caller may want exactly N)
    output_frames: int | None = Field(default=None, ge=1)

    @property
    def is_image(self) -> bool:
        return self.num_frames == 1

    @property
    def with_audio(self) -> bool:
        return (not self.is_image) if self.audio is None else self.audio

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1.0

    @property
    def frames_out(self) -> int:
        return self.output_frames or self.num_frames

    @property
    def duration_s(self) -> float:
        return self.frames_out / self.fps

    def check(self, config: H3Config) -> None:
        """Raise ValueError naming the field when the model cannot produce this shape."""
        step = config.vae_spatial * config.patch_size[1]
        for field in ("width", "height"):
            value = getattr(self, field)
            if value % step:
                raise RequestError(field, f"{field}={value} must be a multiple of {step}")
        try:
            latent_frames(self.num_frames, config)
        except ValueError as e:
            raise RequestError("num_frames", str(e)) from None
        if self.frames_out > self.num_frames:
            raise RequestError("output_frames", f"output_frames={self.output_frames} exceeds num_frames={self.num_frames}")

    def latent_shapes(self, config: H3Config) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
        video = (config.video_channels, latent_frames(self.num_frames, config),
                 self.height // config.vae_spatial, self.width // config.vae_spatial)
        audio = (math.ceil(self.duration_s * config.audio_latent_rate), config.audio_channels) if self.with_audio else None
        return video, audio


class RequestState:
    """One request's latents and sampler position; advances one step per packed forward."""

    def __init__(self, request: GenerationRequest, config: H3Config, text_cond: torch.Tensor,
                 text_uncond: torch.Tensor | None):
        self.request = request
        self.sampler = FlowMatchEuler(request.steps, request.shift)
        self.step_index = 0
        self.text_cond, self.text_uncond = text_cond, text_uncond
        video_shape, audio_shape = request.latent_shapes(config)
        # noise from a CPU generator: the same seed gives the same output on any device
        gen = torch.Generator().manual_seed(request.seed)
        self.video = torch.randn(video_shape, generator=gen)
        self.audio = torch.randn(audio_shape, generator=gen) if audio_shape else None

    def texts(self) -> list[torch.Tensor]:
        return [self.text_cond] if self.text_uncond is None else [self.text_cond, self.text_uncond]

    @property
    def done(self) -> bool:
        return self.step_index >= self.sampler.steps

    @property
    def progress(self) -> tuple[int, int]:
        return self.step_index, self.sampler.steps

    def documents(self) -> list[Document]:
        """The conditional document, then the unconditional one when CFG is on."""
        t = self.sampler.timestep(self.step_index)
        return [Document(text=text, video=self.video, audio=self.audio, timestep=t) for text in self.texts()]

    def advance(self, outputs: list[DocumentOutput]) -> None:
        cond, uncond = outputs[0], (outputs[1] if len(outputs) > 1 else None)
        scale = self.request.guidance_scale
        v_video = guided(cond.video, uncond.video if uncond else None, scale)
        self.video = self.sampler.step(self.video, v_video, self.step_index)
        if self.audio is not None:
            v_audio = guided(cond.audio, uncond.audio if uncond else None, scale)
            self.audio = self.sampler.step(self.audio, v_audio, self.step_index)
        self.step_index += 1
