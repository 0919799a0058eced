"""Train the tiny MiniMax-H3 on the demo world, on CPU, in one command: ``python -m h3serve.demo.train OUT``.

Three stages, each a library class trained in place and saved in the released layout at the end:

1. **The video VAE** (``AutoencoderKLMiniMaxH3``): its encoder keeps its seeded random weights and its
   decoder, wider than the tiny preset's (``Recipe.video_decoder_*``; the checkpoint carries its own
   config), learns to invert it on decode windows of every colour x shape x motion clip (the
   autoencoders learn pixels, not prompts: the held-out split does not apply to them), through the
   library's own ``decode`` (temporal chunking included), in the pipeline's ImageNet-normalised pixel
   space. A random convolutional encoder keeps the colours apart; training it jointly with the decoder
   for the steps a CPU affords collapsed them (docs/BENCHMARKS.md section 8). Then the encoder trains with
   the decoder on single frames (``video_frame_*``; cheap: a frame encodes alone), so the latents keep the
   shapes' outlines, and the decoder alone again on the new latents (``video_refine_*``).
2. **The audio VAE** (``AutoencoderKLMiniMaxH3Audio``) the same way: its encoder keeps its seeded
   weights and its decoder learns to invert them on crops of each sound's whole-clip latents (mono, as
   the pipeline decodes the stereo channels as two batch items). Then both VAEs'
   ``latents_mean`` / ``latents_std`` are set to their latents' statistics over the world, so the
   transformer's clean rows have unit scale like its noise.
3. **The transformer** by rectified flow on the training split only (``world.training_scenes``):
   every training prompt goes through the pipeline's own ``prepare`` (Qwen3-VL ``hidden_states[50]``,
   the packed layout), its clean rows are the VAEs' latents of the scene, and a step of ``batch``
   documents runs through h3serve's ``packed_forward`` with gradients. The loss is the one the
   scheduler implies: it steps ``x0 = x_t + (1 - t) v`` with ``x_t = (1 - t) noise + t x0``, so the
   target velocity is ``x0 - noise``; video and audio draw their timesteps from one uniform ``u``
   through their own shifts (12 and 3), as every inference step pairs them. A share of the documents is
   cut to a window of the clip (``crop_to_window``): a step costs a fraction of a whole clip's, and the
   prompt is a larger share of what each row attends to, which the model learns to read sooner.

Over 600 lines: one recipe, read top to bottom (its settings, the three stages, the record it writes); a stage
split into its own module would only be called from here.

``--vaes-from CHECKPOINT`` keeps the VAEs of a checkpoint this recipe wrote and trains the transformer alone
(stage 3), for iterating on it without the VAE stages' ~22 minutes.

The defaults are the recipe of the built-in tiny checkpoint (``h3serve/pipelines/h3/checkpoints/minimax-h3-tiny-demo``,
``make demo-checkpoint``): ~43 minutes on 2 quiet cores; ``h3serve eval`` of it in docs/BENCHMARKS.md section 8.

The text encoder keeps its seeded weights (``checkpoint.keep_tokens_apart`` keeps the prompt's tokens
apart at layer 50); the tokenizer, processor and schedulers are the tiny preset's. Everything is
seeded; the recipe, its seeds, the command and the losses are written to ``OUT/training.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import world

logger = logging.getLogger("h3serve.demo.train")


@dataclasses.dataclass(frozen=True)
class Recipe:
    seed: int = 0
    threads: int = 2
    # video VAE: the decoder alone on the seeded encoder's latents, windows of 17 + 5 frames (7 latent frames)
    video_decoder_steps: int = 3000
    video_decoder_batch: int = 4
    video_decoder_lr: float = 2e-3
    # its width: a latent token becomes a 4 x 16 x 16 pixel block through one linear layer of this many features
    # (the tiny preset's 2 heads x 16 cannot draw a shape's edge inside a block)
    video_decoder_heads: int = 4
    video_decoder_head_dim: int = 32
    video_decoder_ffn_mult: int = 4
    # then the encoder with the decoder on single frames (0: the encoder keeps its seeded weights): a frame
    # encodes alone through the causal convolutions at ~1/20 of a window's cost, and a seeded encoder loses the
    # outline; then the decoder alone again on the trained encoder's latents of whole windows
    video_frame_steps: int = 6000
    video_frame_batch: int = 8
    video_frame_encoder_lr: float = 1e-3
    video_frame_decoder_lr: float = 5e-4
    video_refine_steps: int = 2000
    video_refine_lr: float = 1e-3
    # audio VAE: the decoder alone on crops of one-second (40 latents) of each sound's whole-clip latents
    audio_decoder_steps: int = 1000
    audio_decoder_batch: int = 4
    audio_decoder_latents: int = 40
    audio_decoder_lr: float = 2e-3
    # transformer: rectified flow on the training split
    transformer_steps: int = 6000
    transformer_batch: int = 8
    transformer_lr: float = 3e-3
    # the share of documents cut to a window of the clip (``crop_to_window``): a window of a fraction drawn
    # uniformly from [min, max] of the clip's time, text rows kept; the rest are whole clips
    transformer_window_share: float = 0.8
    transformer_window_min: float = 0.1
    transformer_window_max: float = 0.4
    warmup_steps: int = 100

    def __post_init__(self):
        if not 0.0 <= self.transformer_window_share <= 1.0:
            raise ValueError(f"transformer_window_share must be in [0, 1], got {self.transformer_window_share}")
        if not 0.0 < self.transformer_window_min <= self.transformer_window_max <= 1.0:
            raise ValueError(
                "transformer_window_min and transformer_window_max must satisfy 0 < min <= max <= 1, got "
                f"{self.transformer_window_min} and {self.transformer_window_max}"
            )

    def scaled(self, factor: float) -> Recipe:
        """The same recipe with every stage's steps times ``factor`` (a quick run for tests); a stage that is off
        (0 steps) stays off."""
        return dataclasses.replace(
            self,
            **{
                f.name: max(2, round(getattr(self, f.name) * factor))
                for f in dataclasses.fields(self)
                if f.name.endswith("_steps") and getattr(self, f.name)
            },
        )


def _warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _descend(loss: torch.Tensor, optimizer: torch.optim.Optimizer, schedule) -> float:
    """One optimiser step on ``loss`` (gradients clipped to norm 1); returns the loss."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    optimizer.step()
    schedule.step()
    return loss.item()


class _Progress:
    """A log line every ``every`` seconds with the stage's step and running loss."""

    def __init__(self, stage: str, total: int, every: float = 20.0):
        self.stage, self.total, self.every = stage, total, every
        self.start = self.last = time.monotonic()
        self.losses: list[float] = []
        self.parts: dict[str, list[float]] = {}

    def __call__(self, step: int, loss: float, **parts: float) -> None:
        """``parts``: the loss's terms by name (e.g. video, audio), logged and summarised beside it."""
        self.losses.append(loss)
        for name, value in parts.items():
            self.parts.setdefault(name, []).append(value)
        now = time.monotonic()
        if now - self.last >= self.every or step + 1 == self.total:
            self.last = now
            terms = "".join(f" {name} {np.mean(values[-50:]):.4f}" for name, values in self.parts.items())
            recent = float(np.mean(self.losses[-50:]))
            logger.info(
                "%s step %d/%d loss %.4f%s (%.0f s)", self.stage, step + 1, self.total, recent, terms, now - self.start
            )

    def summary(self) -> dict[str, Any]:
        def tail_mean(values: list[float]) -> float:
            return float(np.mean(values[-max(1, len(values) // 10) :]))

        return {
            "steps": len(self.losses),
            "seconds": round(time.monotonic() - self.start, 1),
            "final_loss": tail_mean(self.losses),
            **{f"final_{name}_loss": tail_mean(values) for name, values in self.parts.items()},
        }


# ----------------------------------------------------------------------------- the world's clips


class WorldClips:
    """Every colour x shape x motion clip (or those of ``combinations``) in the checkpoint's format, rendered once
    (uint8, ~3 MB each)."""

    def __init__(self, fmt: world.ClipFormat, combinations: Sequence[tuple[str, str, str]] = world.COMBINATIONS):
        self.fmt, self.combinations = fmt, tuple(combinations)
        self.frames = {c: world.render_video(world.Scene(*c, sound="silence"), fmt) for c in self.combinations}

    def pixels(self, combination: tuple[str, str, str], start: int = 0, count: int | None = None) -> torch.Tensor:
        """float32 [3, F, H, W] in [0, 1]: frames ``start .. start + count`` of one clip."""
        frames = self.frames[combination][start : None if count is None else start + count]
        return torch.from_numpy(frames).permute(3, 0, 1, 2).float().div(255.0)


def _normalise_pixels(pixels: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] in [0, 1] -> the video VAE's ImageNet-normalised input."""
    return (pixels - mean.view(1, 3, 1, 1, 1)) / std.view(1, 3, 1, 1, 1)


@dataclasses.dataclass(frozen=True)
class DecodeWindows:
    """The decode windows of a clip.

    The video VAE encodes 17-frame chunks independently (causal in time within a chunk) into 5 latent
    frames, and decodes windows of 5 + 2 latent frames into 17 + 5 pixel frames: latents ``5k .. 5k + 7``
    of a whole clip are exactly the encoding of frames ``17k .. 17k + 22``, and the VAEs train on those.
    """

    frames_per_chunk: int  # 17
    latents_per_chunk: int  # 5
    count: int  # windows in a clip

    @classmethod
    def of(cls, rules, num_frames: int) -> DecodeWindows:
        count = (num_frames - rules.latents_per_chunk) // rules.frames_per_chunk
        return cls(rules.frames_per_chunk, rules.latents_per_chunk, count)

    def __call__(self, k: int) -> tuple[slice, slice]:
        """(pixel frames, latent frames) of window k."""
        f, n = self.frames_per_chunk, self.latents_per_chunk
        return slice(k * f, (k + 1) * f + n), slice(k * n, (k + 1) * n + 2)


def _reconstruction_loss(recon: torch.Tensor, x: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """MSE in normalised pixels with the object weighted up: it covers ~5% of a frame, the background wins otherwise."""
    foreground = (pixels - pixels.median()).abs().amax(dim=1, keepdim=True) > 0.1  # [B, 1, F, H, W]
    return ((1.0 + 10.0 * foreground.float()) * (recon - x).pow(2)).mean()


def demo_video_vae(recipe: Recipe):
    """The tiny preset's video VAE with the recipe's wider decoder, seeded (its encoder is never trained)."""
    from diffusers import AutoencoderKLMiniMaxH3

    from h3serve.pipelines.h3 import preset

    torch.manual_seed(recipe.seed + 1)
    return AutoencoderKLMiniMaxH3(
        **{
            **preset("tiny").components["vae"],
            "decoder_num_attention_heads": recipe.video_decoder_heads,
            "decoder_attention_head_dim": recipe.video_decoder_head_dim,
            "decoder_ffn_mult": recipe.video_decoder_ffn_mult,
        }
    )


def _video_decoder_parameters(vae) -> list[torch.nn.Parameter]:
    """What the decoder stages train: the decoder and the projection into it."""
    return [*vae.decoder.parameters(), *vae.post_quant_conv.parameters()]


def train_video_decoder(
    vae,
    clips: WorldClips,
    latents: dict,
    recipe: Recipe,
    pixel_mean,
    pixel_std,
    windows: DecodeWindows,
    stage: str = "video decoder",
):
    """The decoder alone on the (fixed) encoder's latents of every combination: ~0.1 s a step on 2 cores, where a
    step through the encoder's backward costs seconds."""
    rng = random.Random(recipe.seed + 6)
    mean, std = torch.tensor(pixel_mean), torch.tensor(pixel_std)
    optimizer = torch.optim.AdamW(_video_decoder_parameters(vae), lr=recipe.video_decoder_lr, weight_decay=0.0)
    schedule = _warmup_cosine(optimizer, recipe.warmup_steps // 2, recipe.video_decoder_steps)
    progress = _Progress(stage, recipe.video_decoder_steps)
    vae.decoder.train()
    for step in range(recipe.video_decoder_steps):
        pixels, zs = [], []
        for _ in range(recipe.video_decoder_batch):
            combination = rng.choice(clips.combinations)
            frames, latent_frames = windows(rng.randrange(windows.count))
            pixels.append(clips.pixels(combination)[:, frames])
            zs.append(latents[combination][:, latent_frames])
        batch = torch.stack(pixels)  # [B, 3, 22, H, W]
        recon = vae.decode(torch.stack(zs)).sample
        loss = _reconstruction_loss(recon, _normalise_pixels(batch, mean, std), batch)
        progress(step, _descend(loss, optimizer, schedule))
    vae.decoder.eval()
    return progress.summary()


def train_video_on_frames(vae, clips: WorldClips, recipe: Recipe, pixel_mean, pixel_std) -> dict[str, Any]:
    """The encoder jointly with the (already trained) decoder on single frames of every combination.

    A frame encodes alone (the causal convolutions see zeros before it) into one latent frame, which the
    decoder expands to ``temporal_compression_ratio`` frames: the last is the frame (the decode drops the rest
    at a clip's start). A step costs ~1/20 of a decode window's through the encoder's backward, so the encoder
    can learn the shapes' outlines that its seeded weights blur; the decoder must already invert the seeded
    encoder (``train_video_decoder`` first), or the joint steps collapse the colours (docs/BENCHMARKS.md).
    """
    ratio = vae.temporal_compression_ratio
    if vae.frame_pre_padding != ratio - 1:  # the library's geometry: a clip's first frame is latent 0's last
        raise ValueError(f"a first frame decodes at {vae.frame_pre_padding} of {ratio}: not the last, as assumed")
    rng = random.Random(recipe.seed + 7)
    mean, std = torch.tensor(pixel_mean), torch.tensor(pixel_std)
    channels = vae.config.latent_channels
    optimizer = torch.optim.AdamW(
        [
            {"params": [*vae.encoder.parameters(), *vae.quant_conv.parameters()], "lr": recipe.video_frame_encoder_lr},
            {"params": _video_decoder_parameters(vae), "lr": recipe.video_frame_decoder_lr},
        ],
        weight_decay=0.0,
    )
    schedule = _warmup_cosine(optimizer, recipe.warmup_steps // 2, recipe.video_frame_steps)
    progress = _Progress("video frames", recipe.video_frame_steps)
    vae.train()
    for step in range(recipe.video_frame_steps):
        frames = [
            clips.pixels(rng.choice(clips.combinations), rng.randrange(clips.fmt.num_frames), 1)
            for _ in range(recipe.video_frame_batch)
        ]
        batch = torch.stack(frames)  # [B, 3, 1, H, W]
        x = _normalise_pixels(batch, mean, std)
        z = vae.quant_conv(vae.encoder(x))[:, :channels]  # [B, C, 1, h, w]: the posterior's mode
        recon = vae.decoder(vae.post_quant_conv(z))[:, :, -1:]  # [B, 3, 1, H, W] of [B, 3, ratio, H, W]
        loss = _reconstruction_loss(recon, x, batch)
        progress(step, _descend(loss, optimizer, schedule))
    vae.eval()
    return progress.summary()


def train_audio_decoder(audio_vae, fmt: world.ClipFormat, recipe: Recipe) -> dict[str, Any]:
    """The audio decoder alone on the (fixed) seeded encoder's latents of each sound's whole clip.

    It trains on crops of the latents the transformer learns to generate (one sound's whole clip, encoded
    once), against the samples those latents cover: a decoder trained on short separately-encoded windows
    learned their edges, and heard silence as a hum in the middle of a clip. Every joint encoder-decoder
    variant tried collapsed to silence (docs/BENCHMARKS.md section 8).
    """
    rng = random.Random(recipe.seed + 2)
    hop = math.prod(audio_vae.config.encoder_rates)  # waveform samples per latent
    waveforms, latents = {}, {}
    with torch.no_grad():
        for sound in world.SOUNDS:
            mono = torch.from_numpy(world.render_audio(world.Scene("red", "circle", "still", sound), fmt)[:1])
            waveforms[sound] = mono  # [1, S]
            latents[sound] = audio_vae.encode(mono[:, None]).latent_dist.mode()[0]  # [C, S / hop]
    # the sounds' codes differ by ~0.05 on a shared offset of ~1.5: start the decoder's input projection on
    # the world's standardised latents, or it spends its steps learning that scale
    stacked = torch.cat(list(latents.values()), dim=-1)  # [C, 3 * S / hop]
    mean, std = stacked.mean(dim=-1), stacked.std(dim=-1).clamp_min(1e-4)  # [C]
    with torch.no_grad():
        weight = audio_vae.dec_in_proj.weight  # [latent_dim, C, 1]
        audio_vae.dec_in_proj.bias -= (weight[..., 0] * (mean / std)).sum(dim=-1)
        weight /= std.view(1, -1, 1)
    count = next(iter(latents.values())).shape[-1]  # latents in a clip; the last may cover fewer samples
    crop = min(recipe.audio_decoder_latents, count)
    parameters = [*audio_vae.dec_in_proj.parameters(), *audio_vae.decoder.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=recipe.audio_decoder_lr, weight_decay=0.0)
    schedule = _warmup_cosine(optimizer, recipe.warmup_steps // 2, recipe.audio_decoder_steps)
    progress = _Progress("audio decoder", recipe.audio_decoder_steps)
    audio_vae.decoder.train()
    for step in range(recipe.audio_decoder_steps):
        sounds = [rng.choice(world.SOUNDS) for _ in range(recipe.audio_decoder_batch)]
        # a clip's first and last latents (the encoder's edges) start and end half the crops: uniform
        # crops would reach them once in ~170, and a whole clip's decode starts and ends there
        starts = [(0, count - crop, rng.randrange(count - crop + 1))[min(2, rng.randrange(4))] for _ in sounds]
        crops = list(zip(sounds, starts, strict=True))
        recon = audio_vae.decode(torch.stack([latents[s][:, i : i + crop] for s, i in crops])).sample  # [B, 1, n]
        targets = [waveforms[s][:, i * hop : (i + crop) * hop] for s, i in crops]  # a clip's last crop may be shorter
        loss = torch.stack([(r[:, : t.shape[-1]] - t).abs().mean() for r, t in zip(recon, targets, strict=True)]).mean()
        progress(step, _descend(loss, optimizer, schedule))
    audio_vae.decoder.eval()
    return progress.summary()


# ----------------------------------------------------------------------------- latents of the world


@torch.no_grad()
def encode_video(vae, clips: WorldClips, pixel_mean, pixel_std) -> dict[tuple[str, str, str], torch.Tensor]:
    """Raw (unnormalised) video latents [C, f, h, w] of every clip of ``clips``."""
    mean, std = torch.tensor(pixel_mean), torch.tensor(pixel_std)
    video: dict[tuple[str, str, str], torch.Tensor] = {}
    for i in range(0, len(clips.combinations), 2):  # in pairs: torch's CPU conv3d is oneDNN's for a batch of 2,
        pair = clips.combinations[i : i + 2]  # a slow reference kernel for some single clips
        pixels = torch.stack([clips.pixels(c) for c in pair])
        video.update(zip(pair, vae.encode(_normalise_pixels(pixels, mean, std)).latent_dist.mode(), strict=True))
    return video


@torch.no_grad()
def encode_audio(audio_vae, fmt: world.ClipFormat) -> dict[str, torch.Tensor]:
    """Raw (unnormalised) audio latents [2, C, n] of each sound's whole clip."""
    audio = {}
    for sound in world.SOUNDS:
        stereo = torch.from_numpy(world.render_audio(world.Scene("red", "circle", "still", sound), fmt))
        audio[sound] = audio_vae.encode(stereo[:, None]).latent_dist.mode()  # [2, C, n]
    return audio


def latent_statistics(latents: list[torch.Tensor], channel_dim: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std over every latent (what ``latents_mean`` / ``latents_std`` normalise by)."""
    flat = torch.cat([x.movedim(channel_dim, 0).reshape(x.shape[channel_dim], -1) for x in latents], dim=1)
    return flat.mean(dim=1).tolist(), flat.std(dim=1).clamp_min(1e-3).tolist()


# ----------------------------------------------------------------------------- the transformer


def _shifted_sigma(u: float, shift: float) -> float:
    """The schedulers' exponential shift of a uniform grid point (``MiniMaxH3Scheduler.set_timesteps``)."""
    return shift * u / (1 + (shift - 1) * u)


class TrainingDocuments:
    """Documents of the training split: the pipeline's layout and prompt of each scene, noised clean rows."""

    def __init__(self, pipeline, video_rows: dict, audio_rows: dict, fmt: world.ClipFormat, seed: int):
        from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

        self.pipeline, self.video_rows, self.audio_rows, self.fmt = pipeline, video_rows, audio_rows, fmt
        self.build_row_timesteps = MiniMaxH3SetTimestepsStep.build_row_timesteps
        self.layouts: dict[str, dict[str, torch.Tensor]] = {}
        self.generator = torch.Generator("cpu").manual_seed(seed)
        self.rng = random.Random(seed)
        self.shifts = (
            pipeline._schedulers["scheduler"].config.shift,
            pipeline._schedulers["audio_scheduler"].config.shift,
        )

    def layout(self, prompt: str) -> dict[str, torch.Tensor]:
        """The prompt's conditioning and the clip's packed layout, by diffusers' blocks (cached per prompt)."""
        from h3serve.pipelines.h3 import GenerationRequest

        if prompt not in self.layouts:
            request = GenerationRequest(
                prompt=prompt,
                width=self.fmt.width,
                height=self.fmt.height,
                num_frames=self.fmt.num_frames,
                num_inference_steps=2,
            )
            self.layouts[prompt] = self.pipeline.prepare(request).layout
        return self.layouts[prompt]

    def document(self, scene: world.Scene):
        """(Document, target video velocity [n_video, Cp], target audio velocity [n_audio, C])."""
        from h3serve.pipelines.h3.packing import Document

        layout = self.layout(scene.prompt)
        x0_video, x0_audio = self.video_rows[scene.combination], self.audio_rows[scene.sound]
        noise_video = torch.randn(x0_video.shape, generator=self.generator)
        noise_audio = torch.randn(x0_audio.shape, generator=self.generator)
        u = self.rng.random()
        sigma_video, sigma_audio = (_shifted_sigma(u, s) for s in self.shifts)
        timestep, timestep_indices = self.build_row_timesteps(
            layout["video_indices"],
            layout["audio_indices"],
            0,
            0,
            layout["text_indices"].numel(),
            1 - sigma_video,
            1 - sigma_audio,
            0.0,
            0.0,
        )
        document = Document(
            video_rows=sigma_video * noise_video + (1 - sigma_video) * x0_video,
            audio_rows=sigma_audio * noise_audio + (1 - sigma_audio) * x0_audio,
            timestep=timestep,
            timestep_indices=timestep_indices,
            **layout,
        )
        return document, x0_video - noise_video, x0_audio - noise_audio


def crop_to_window(document, video_target: torch.Tensor, audio_target: torch.Tensor, start: float, stop: float):
    """(document, video target, audio target) of only the media rows whose time position is in [start, stop].

    The prompt's rows are kept, and every kept row keeps the whole clip's position ids, so a window trains
    the rows it keeps exactly as they sit in the clip (the video and audio of the same seconds: H3 puts both
    on one time axis); only the rows outside it are missing. A step over windows costs a fraction of one over
    whole clips, and the prompt is a larger share of each document's attention.
    """
    from h3serve.pipelines.h3.packing import Document

    time = document.position_ids[:, 0]  # [S] the time coordinate of every row
    in_window = (time >= start) & (time <= stop)
    keep_video, keep_audio = in_window[document.video_indices], in_window[document.audio_indices]
    keep = in_window.clone()
    keep[document.text_indices] = True  # text rows have time positions too (0, 1, ...): never cut the prompt
    position = torch.cumsum(keep.long(), 0) - 1  # [S] each kept row's index in the window
    window = Document(
        prompt_embeds=document.prompt_embeds,
        video_rows=document.video_rows[keep_video],
        audio_rows=document.audio_rows[keep_audio],
        position_ids=document.position_ids[keep],
        token_tags=document.token_tags[keep],
        video_indices=position[document.video_indices[keep_video]],
        audio_indices=position[document.audio_indices[keep_audio]],
        text_indices=position[document.text_indices],
        timestep=document.timestep,
        timestep_indices=document.timestep_indices[keep],
    )
    return window, video_target[keep_video], audio_target[keep_audio]


def train_transformer(pipeline, documents: TrainingDocuments, recipe: Recipe) -> dict[str, Any]:
    from h3serve.pipelines.h3.forward import packed_forward
    from h3serve.pipelines.h3.packing import pack_documents

    forward = inspect.unwrap(packed_forward)  # the same computation, with gradients
    model = pipeline.denoiser.transformers["transformer"]
    scenes = world.training_scenes(recipe.seed + 3, documents.video_rows)  # the combinations encoded
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.transformer_lr, weight_decay=0.01)
    schedule = _warmup_cosine(optimizer, recipe.warmup_steps, recipe.transformer_steps)
    progress = _Progress("transformer", recipe.transformer_steps)
    windows = random.Random(recipe.seed + 7)

    def training_document(scene: world.Scene):
        document, video_target, audio_target = documents.document(scene)
        if windows.random() >= recipe.transformer_window_share:
            return document, video_target, audio_target
        media = torch.cat([document.video_indices, document.audio_indices])
        first, last = (float(f(document.position_ids[media, 0])) for f in (torch.min, torch.max))
        length = (last - first) * windows.uniform(recipe.transformer_window_min, recipe.transformer_window_max)
        # windows may run off either end of the clip, so its first and last frames are in as many windows as
        # any other (a window kept inside the clip would reach them only when it starts exactly there)
        start = first - length + windows.random() * (last - first + length)
        return crop_to_window(document, video_target, audio_target, start, start + length)

    model.train()
    for step in range(recipe.transformer_steps):
        batch = [training_document(next(scenes)) for _ in range(recipe.transformer_batch)]
        pack = pack_documents([d for d, _, _ in batch])
        video_out, audio_out = forward(model, pack)  # [N_video, Cp], [N_audio, C]
        video_target = torch.cat([v for _, v, _ in batch])
        audio_target = torch.cat([a for _, _, a in batch])
        video_loss = F.mse_loss(video_out.float(), video_target)
        audio_loss = F.mse_loss(audio_out.float(), audio_target)
        loss = _descend(video_loss + audio_loss, optimizer, schedule)
        progress(step, loss, video=video_loss.item(), audio=audio_loss.item())
    model.eval()
    return progress.summary()


# ----------------------------------------------------------------------------- the whole recipe


def _rows(pipeline, video: dict, audio: dict) -> tuple[dict, dict]:
    """Normalised latents as the transformer's rows: video patchified, audio channel-major."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    vae, audio_vae = pipeline.stages.after.vae, pipeline.stages.after.audio_vae
    v_mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    v_std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    a_mean = torch.tensor(audio_vae.config.latents_mean).view(1, -1, 1)
    a_std = torch.tensor(audio_vae.config.latents_std).view(1, -1, 1)
    patch = tuple(pipeline.stages.before.patch_size)
    video_rows = {c: patchify_video_latents(((z - v_mean) / v_std)[None], patch) for c, z in video.items()}
    audio_rows = {s: ((z - a_mean) / a_std).transpose(1, 2).reshape(-1, z.shape[1]) for s, z in audio.items()}
    return video_rows, audio_rows


def _trained_vaes(checkpoint: Path, components: dict[str, Any], report: dict[str, Any]) -> None:
    """Put a trained checkpoint's VAEs (with their latents' statistics) in ``components`` and its VAE stages'
    record in ``report``: a transformer-only run over the latents of a checkpoint the recipe wrote."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    record = json.loads((checkpoint / "training.json").read_text())  # written by this recipe, or refused here
    components["vae"] = AutoencoderKLMiniMaxH3.from_pretrained(checkpoint / "vae")
    components["audio_vae"] = AutoencoderKLMiniMaxH3Audio.from_pretrained(checkpoint / "audio_vae")
    report["vaes_from"] = {
        "checkpoint": str(checkpoint),
        "recipe": record["recipe"],
        **{s: record[s] for s in ("audio_decoder", "video_decoder", "video_frames", "video_refine") if s in record},
    }


def train(
    out: str | Path,
    recipe: Recipe,
    backend: str = "auto",
    vaes_from: str | Path | None = None,
    combinations: Sequence[tuple[str, str, str]] = world.COMBINATIONS,
) -> dict[str, Any]:
    """The whole recipe into ``out``; with ``vaes_from`` (a checkpoint this recipe wrote) its VAEs are kept as
    they are and only the transformer trains (the recipe's VAE stages are skipped). ``combinations``: the part
    of the world it renders, encodes and trains on (the whole world unless a test asks for a few: every clip is
    encoded once or twice, most of a short run's time)."""
    from h3serve.pipelines.h3 import H3Pipeline, preset
    from h3serve.pipelines.h3.checkpoint import save_checkpoint, tiny_components

    torch.set_num_threads(recipe.threads)
    started = time.monotonic()
    out = Path(out)
    components = tiny_components(recipe.seed)
    pipeline_config = preset("tiny").pipeline_config
    report: dict[str, Any] = {"recipe": dataclasses.asdict(recipe), "torch": torch.__version__}
    if tuple(combinations) != world.COMBINATIONS:
        report["combinations"] = [list(c) for c in combinations]
    if vaes_from is not None:
        _trained_vaes(Path(vaes_from), components, report)

    with tempfile.TemporaryDirectory(prefix="h3-train-") as scratch:
        # the format and pixel convention come from the pipeline's own blocks: load the untrained checkpoint once
        save_checkpoint(components, Path(scratch) / "untrained", pipeline_config)
        probe = H3Pipeline.load(Path(scratch) / "untrained", _resolve_backend(backend, Path(scratch) / "untrained"))
        probe_rules = probe.rules
        fmt = world.ClipFormat.of(probe_rules)
        pixel_mean, pixel_std = probe.stages.after.pixel_mean, probe.stages.after.pixel_std
        del probe
        torch.manual_seed(recipe.seed)
        clips, windows = WorldClips(fmt, combinations), DecodeWindows.of(probe_rules, fmt.num_frames)
        if vaes_from is None:
            components["vae"] = demo_video_vae(recipe)
        vae, audio_vae = components["vae"], components["audio_vae"]
        if vaes_from is None:
            report["audio_decoder"] = train_audio_decoder(audio_vae, fmt, recipe)
        video, audio = encode_video(vae, clips, pixel_mean, pixel_std), encode_audio(audio_vae, fmt)
        if vaes_from is None:
            report["video_decoder"] = train_video_decoder(vae, clips, video, recipe, pixel_mean, pixel_std, windows)
            if recipe.video_frame_steps:
                report["video_frames"] = train_video_on_frames(vae, clips, recipe, pixel_mean, pixel_std)
                video = encode_video(vae, clips, pixel_mean, pixel_std)  # the trained encoder's latents
                refine = dataclasses.replace(
                    recipe, video_decoder_steps=recipe.video_refine_steps, video_decoder_lr=recipe.video_refine_lr
                )
                report["video_refine"] = train_video_decoder(
                    vae, clips, video, refine, pixel_mean, pixel_std, windows, stage="video refine"
                )
            v_mean, v_std = latent_statistics(list(video.values()), 0)
            a_mean, a_std = latent_statistics(list(audio.values()), 1)
            vae.register_to_config(latents_mean=tuple(v_mean), latents_std=tuple(v_std))
            audio_vae.register_to_config(latents_mean=a_mean, latents_std=a_std)

        save_checkpoint(components, Path(scratch) / "vaes", pipeline_config)
        pipeline = H3Pipeline.load(Path(scratch) / "vaes", _resolve_backend(backend, Path(scratch) / "vaes"))
        video_rows, audio_rows = _rows(pipeline, video, audio)
        documents = TrainingDocuments(pipeline, video_rows, audio_rows, fmt, recipe.seed + 4)
        torch.manual_seed(recipe.seed + 5)
        report["transformer"] = train_transformer(pipeline, documents, recipe)
        components["transformer"].load_state_dict(pipeline.denoiser.transformers["transformer"].state_dict())

    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(components, staging, pipeline_config)
    report["seconds"] = round(time.monotonic() - started, 1)
    report["command"] = (
        "python -m h3serve.demo.train " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("train.py") else None
    )
    (staging / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return report


def _resolve_backend(backend: str, checkpoint: Path) -> str:
    """The attention backend admission picks for this CPU (training runs h3serve's own packed forward)."""
    from h3serve.attention import probe_platform, resolve
    from h3serve.pipelines.h3 import REQUIREMENTS, TransformerGeometry

    geometry = TransformerGeometry.from_checkpoint(checkpoint)
    resolution = resolve(
        REQUIREMENTS, backend, probe_platform("cpu"), model=str(checkpoint), dtype="float32", head_dim=geometry.head_dim
    )
    return resolution.backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m h3serve.demo.train", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write the trained checkpoint to (replaced)")
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every stage's steps (a quick run: 0.01)")
    parser.add_argument(
        "--vaes-from",
        metavar="CHECKPOINT",
        help="keep the VAEs of a checkpoint this recipe wrote and train the transformer only",
    )
    for field in dataclasses.fields(Recipe):
        if field.name != "seed":
            parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=None)
    ns = parser.parse_args(argv)
    overrides = {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(Recipe) if getattr(ns, f.name, None) is not None
    }
    recipe = Recipe(**overrides)
    if ns.scale != 1.0:
        recipe = recipe.scaled(ns.scale)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    report = train(ns.out, recipe, vaes_from=ns.vaes_from)
    print(json.dumps({k: v for k, v in report.items() if k not in ("recipe", "command")}, indent=1))


if __name__ == "__main__":
    main()
