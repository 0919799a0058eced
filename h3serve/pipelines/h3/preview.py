"""Previews of a clip while it forms, without a VAE decode.

A preview is the current clean-latent prediction of a few latent frames, ``x0 = x_t + (1 - t) v`` (the
scheduler's own ``denoised``), mapped to RGB by one linear map from the video VAE's latent channels. The map is
fitted per checkpoint when a replica loads, from that checkpoint's own VAE: a few procedural frames (shapes on
dark and mid backgrounds) are encoded as diffusers encodes a keyframe, and least squares maps each latent pixel to
the mean colour of the pixels it covers. The fit's error is logged; a preview is then a ``[N, C] @ [C, 3]`` matmul
on a few latent frames, small next to one packed forward.

Capture happens in ``RequestState.advance`` on the model thread, before the scheduler overwrites ``x_t`` in place
(a gather of the chosen frames' rows and one fused multiply-add); rendering (the matmul and a PNG) runs elsewhere,
on the engine's stage worker.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time

import numpy as np
import torch

logger = logging.getLogger(__name__)

FIT_SCENES = 12  # procedural frames the map is fitted on
FIT_SIZE = (64, 128)  # (height, width) of each: a multiple of every H3 VAE's 16x spatial compression
FIT_SEED = 0


@dataclasses.dataclass(frozen=True)
class PreviewMap:
    """Normalized video latents -> RGB in [0, 255]: ``rgb = latents @ weight + bias``."""

    weight: torch.Tensor  # [C, 3] fp32, on the host
    bias: torch.Tensor  # [3] fp32
    rmse: float  # on the fit's own frames, in 0..255 pixel units
    samples: int  # latent pixels the fit used

    @property
    def channels(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    @torch.no_grad()
    def fit(
        cls,
        vae: torch.nn.Module,
        pixel_mean: tuple[float, ...],
        pixel_std: tuple[float, ...],
        scenes: int = FIT_SCENES,
        size: tuple[int, int] = FIT_SIZE,
        seed: int = FIT_SEED,
    ) -> PreviewMap:
        """Least squares from ``vae``'s normalized latents of procedural frames to their pooled pixels."""
        from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

        started = time.perf_counter()
        generator = torch.Generator().manual_seed(seed)
        device = next(vae.parameters()).device
        inputs, targets = [], []
        for k in range(scenes):
            image = procedural_frame(*size, generator, dark=k % 2 == 0)  # [3, H, W] uint8
            # one frame, as a keyframe is encoded: [1, C, 1, h, w] normalized fp32 on the host
            latents = encode_vae_condition(vae, image[None, :, None].to(device), pixel_mean, pixel_std)
            channels, (h, w) = latents.shape[1], latents.shape[-2:]
            pooled = torch.nn.functional.avg_pool2d(image.float()[None], (size[0] // h, size[1] // w))[0]  # [3, h, w]
            inputs.append(latents[0, :, 0].reshape(channels, -1).T)  # [h*w, C]
            targets.append(pooled.reshape(3, -1).T)  # [h*w, 3]
        x, y = torch.cat(inputs), torch.cat(targets)
        design = torch.cat([x, torch.ones(len(x), 1)], dim=1)  # [N, C + 1]: the bias as a column
        solution = torch.linalg.lstsq(design, y).solution  # [C + 1, 3]
        rmse = float(((design @ solution - y) ** 2).mean().sqrt())
        fitted = cls(solution[:-1].contiguous(), solution[-1].contiguous(), rmse, len(x))
        logger.info(
            "preview map fitted from the video VAE: %d latent channels -> RGB on %d latent pixels of %d procedural "
            "frames, RMSE %.1f of 255, in %.2f s",
            channels,
            len(x),
            scenes,
            rmse,
            time.perf_counter() - started,
        )
        return fitted

    def rgb(self, latents: torch.Tensor) -> np.ndarray:
        """uint8 ``[F, h, w, 3]`` of normalized latents ``[F, C, h, w]``."""
        frames, channels, h, w = latents.shape
        flat = latents.float().cpu().permute(0, 2, 3, 1).reshape(-1, channels)  # [F*h*w, C]
        rgb = flat @ self.weight + self.bias  # [F*h*w, 3]
        return rgb.clamp(0, 255).round().to(torch.uint8).reshape(frames, h, w, 3).numpy()


def procedural_frame(height: int, width: int, generator: torch.Generator, dark: bool) -> torch.Tensor:
    """uint8 ``[3, H, W]``: a flat background (dark, or any mid tone) with three discs and squares of random colours."""
    background = torch.rand(3, generator=generator) * (0.15 if dark else 0.6)
    image = background[:, None, None].expand(3, height, width).clone()
    yy, xx = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    for _ in range(3):
        colour = torch.rand(3, generator=generator)
        cy = int(torch.randint(0, height, (1,), generator=generator))
        cx = int(torch.randint(0, width, (1,), generator=generator))
        r = int(torch.randint(height // 8, height // 3, (1,), generator=generator))
        if float(torch.rand(1, generator=generator)) < 0.5:
            inside = (yy - cy) ** 2 + (xx - cx) ** 2 < r**2
        else:
            inside = ((yy - cy).abs() < r) & ((xx - cx).abs() < r)
        image[:, inside] = colour[:, None]
    return (image * 255).round().to(torch.uint8)


def preview_frames(num_latent_frames: int, count: int) -> tuple[int, ...]:
    """``count`` latent frames spread from the first to the last (all of them when there are fewer)."""
    if count >= num_latent_frames:
        return tuple(range(num_latent_frames))
    if count == 1:
        return (num_latent_frames // 2,)
    return tuple(round(i * (num_latent_frames - 1) / (count - 1)) for i in range(count))


@dataclasses.dataclass(frozen=True)
class PreviewLayout:
    """Where a request's latent frames sit among its generated video rows (frame-major, then row-major)."""

    latent_height: int
    latent_width: int
    channels: int
    patch: tuple[int, int]  # (patch_h, patch_w); H3 patches (1, 2, 2)

    @property
    def rows_per_frame(self) -> int:
        return (self.latent_height // self.patch[0]) * (self.latent_width // self.patch[1])

    def rows(self, frames: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """int64 indices into the generated rows of ``frames``' rows, frame by frame."""
        per = self.rows_per_frame
        starts = torch.tensor(frames, dtype=torch.int64, device=device)[:, None] * per  # [F', 1]
        return (starts + torch.arange(per, device=device)).reshape(-1)  # [F' * per]

    def latents(self, rows: torch.Tensor) -> torch.Tensor:
        """``[F', C, h, w]`` of ``rows`` ``[F' * per, C * ph * pw]`` (the layout block's un-patchify, per frame)."""
        ph, pw = self.patch
        h, w = self.latent_height // ph, self.latent_width // pw
        x = rows.reshape(-1, h, w, self.channels, ph, pw)  # [F', h, w, C, ph, pw]
        x = x.permute(0, 3, 1, 4, 2, 5)  # [F', C, h, ph, w, pw]
        return x.reshape(-1, self.channels, self.latent_height, self.latent_width)


def clean_rows(rows: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The clean-latent prediction of the rows at ``index``: ``x0 = x_t + (1 - t) v``, as ``MiniMaxH3Scheduler.step``
    computes its ``denoised`` (data-ward velocity, clean-time ``t``). ``rows``, ``velocity``: ``[n, C*p]``; a copy."""
    x = rows.index_select(0, index)  # [k, C*p]
    v = velocity.index_select(0, index).to(x.dtype)
    return torch.addcmul(x, v, (1 - timestep).to(x.dtype))


def strip_png(frames: np.ndarray) -> bytes:
    """One PNG of ``frames`` uint8 ``[F, h, w, 3]`` side by side, a one-pixel dark gap between them."""
    from PIL import Image

    count, h, w, _ = frames.shape
    strip = np.zeros((h, count * (w + 1) - 1, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        strip[:, i * (w + 1) : i * (w + 1) + w] = frame
    buffer = io.BytesIO()
    Image.fromarray(strip).save(buffer, format="PNG")
    return buffer.getvalue()
