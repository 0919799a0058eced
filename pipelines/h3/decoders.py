"""Small stand-in latent decoders: latents -> RGB frames and -> waveform. Weights are in the checkpoint.

Video latents are [C, F, H, W] with F = 1 + (frames - 1) / vae_temporal: the first
latent frame decodes to one frame, every later one to ``vae_temporal`` frames.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import H3Config


class VideoDecoder(nn.Module):
    """Per latent pixel: an MLP to ``vae_temporal`` RGB values; then bilinear upsampling by ``vae_spatial``."""

    def __init__(self, config: H3Config):
        super().__init__()
        self.s, self.t = config.vae_spatial, config.vae_temporal
        self.net = nn.Sequential(nn.Linear(config.video_channels, config.decoder_hidden), nn.GELU(),
                                 nn.Linear(config.decoder_hidden, self.t * 3))

    @torch.no_grad()
    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        """[C, F, h, w] -> uint8 frames [1 + (F-1)*t, h*s, w*s, 3]."""
        C, Fl, h, w = latent.shape
        x = self.net(latent.permute(1, 2, 3, 0).float())  # [F, h, w, t*3]
        x = x.reshape(Fl, h, w, self.t, 3).permute(0, 3, 4, 1, 2)  # [F, t, 3, h, w]
        x = torch.cat([x[:1, 0], x[1:].flatten(0, 1)])  # the first latent frame decodes to one frame
        frames = F.interpolate(x, scale_factor=self.s, mode="bilinear", align_corners=False).permute(0, 2, 3, 1)
        return ((torch.tanh(frames) + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


class AudioDecoder(nn.Module):
    def __init__(self, config: H3Config):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(config.audio_channels, config.decoder_hidden), nn.GELU(),
                                 nn.Linear(config.decoder_hidden, config.audio_hop))

    @torch.no_grad()
    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        """[A, C] -> float32 mono waveform in [-1, 1] of A * hop samples."""
        return torch.tanh(self.net(latent.float())).flatten() * 0.5


def latent_frames(num_frames: int, config: H3Config) -> int:
    if num_frames < 1 or (num_frames - 1) % config.vae_temporal:
        raise ValueError(f"num_frames={num_frames} must be 1 + {config.vae_temporal}k")
    return 1 + (num_frames - 1) // config.vae_temporal


def resample_audio(waveform: torch.Tensor, samples: int) -> torch.Tensor:
    """Trim or zero-pad the waveform to exactly ``samples`` (the video's duration)."""
    return F.pad(waveform, (0, max(0, samples - waveform.shape[0])))[:samples]
