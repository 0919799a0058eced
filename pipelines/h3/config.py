"""H3 model configuration: two presets (``tiny`` for CPU, ``full`` = the public H3), validated."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MODALITY_TEXT, MODALITY_VIDEO, MODALITY_AUDIO = 0, 1, 2
NUM_MODALITIES = 3


class H3Config(BaseModel):
    """Architecture and codec geometry. Every violation names its field."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    ffn_size: int = Field(gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)
    freq_dim: int = Field(default=256, gt=0)  # sinusoidal timestep features

    # 3D RoPE over (t, h, w): rope_freqs_per_axis frequencies per axis, each rotating 2 dims
    rope_freqs_per_axis: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)

    video_channels: int = Field(default=24, gt=0)
    audio_channels: int = Field(default=32, gt=0)
    patch_size: tuple[int, int, int] = (1, 2, 2)

    # text: encoder features -> condition projection -> token refiner (pre-norm, no AdaLN/RoPE)
    text_encoder: Literal["byte"] = "byte"
    text_dim: int = Field(gt=0)
    text_max_tokens: int = Field(gt=1)
    text_encoder_layers: int = Field(default=2, ge=0)
    refiner_layers: int = Field(default=2, ge=0)

    # latent codec geometry (the stand-in decoders in decoders.py follow it)
    vae_spatial: int = Field(default=16, gt=0)
    vae_temporal: int = Field(default=4, gt=0)
    decoder_hidden: int = Field(default=64, gt=0)
    audio_sample_rate: int = Field(default=16000, gt=0)
    audio_latent_rate: int = Field(default=25, gt=0)  # audio latents per second

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def rope_dims(self) -> int:
        return 3 * 2 * self.rope_freqs_per_axis

    @property
    def video_patch_dim(self) -> int:
        return self.video_channels * math.prod(self.patch_size)

    @property
    def out_dim(self) -> int:
        """Width of the DiT's per-row output: video patch or audio latent, zero-padded."""
        return max(self.video_patch_dim, self.audio_channels)

    @property
    def audio_hop(self) -> int:
        return self.audio_sample_rate // self.audio_latent_rate

    @model_validator(mode="after")
    def _check(self) -> H3Config:
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_dims > self.head_dim:
            raise ValueError(
                f"rope_freqs_per_axis={self.rope_freqs_per_axis} rotates {self.rope_dims} dims, "
                f"more than head_dim={self.head_dim}"
            )
        if any(p <= 0 for p in self.patch_size):
            raise ValueError(f"patch_size entries must be positive, got {self.patch_size}")
        if self.patch_size[0] != 1:
            raise ValueError("patch_size[0] (temporal) must be 1: one latent frame per token row")
        if self.audio_sample_rate % self.audio_latent_rate:
            raise ValueError(
                f"audio_sample_rate={self.audio_sample_rate} must be a multiple of "
                f"audio_latent_rate={self.audio_latent_rate}"
            )
        return self

    def check_sp_degree(self, sp_degree: int) -> None:
        """Ulysses splits heads across ranks, so the degree must divide num_heads."""
        if sp_degree < 1:
            raise ValueError(f"sp_degree must be >= 1, got {sp_degree}")
        if self.num_heads % sp_degree:
            allowed = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(f"sp_degree={sp_degree} must divide num_heads={self.num_heads}; allowed: {allowed}")

    def parameter_count(self) -> int:
        from .dit import H3DiT  # local import: building a model is not needed to read a config

        import torch

        with torch.device("meta"):
            return sum(p.numel() for p in H3DiT(self).parameters())


PRESETS: dict[str, H3Config] = {
    # CPU default: a 256x256 image at 8 steps in about a second on 2 cores.
    "tiny": H3Config(
        name="h3-tiny",
        num_layers=4,
        hidden_size=96,
        num_heads=4,
        head_dim=32,  # inner 128 != hidden 96, like the full model's 7168 != 5376
        ffn_size=256,
        rope_freqs_per_axis=4,
        text_dim=64,
        text_max_tokens=256,
        freq_dim=64,
    ),
    # The public H3 dimensions (sglang configs/models/dits/minimax_h3.py).
    "full": H3Config(
        name="h3-full",
        num_layers=50,
        hidden_size=5376,
        num_heads=56,
        head_dim=128,
        ffn_size=14336,
        rope_freqs_per_axis=16,
        text_dim=5120,
        text_max_tokens=512,
        decoder_hidden=256,
    ),
}


def preset(name: str) -> H3Config:
    if name not in PRESETS:
        raise ValueError(f"model preset {name!r} is not one of {', '.join(PRESETS)}")
    return PRESETS[name]
