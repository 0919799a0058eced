"""The clip's other stages at the released size on the meta device: Qwen3-VL's prefill, the video and audio decodes.

Each model is built from its released config with its library's own class on ``torch.device("meta")`` (no weights,
no data) and run once under ``FlopCounterMode`` and ``MetaRun`` (which gives a data-dependent op, such as Qwen3-VL's
vision grid, its host value): the FLOPs are the library's own ops at the released shapes, not a formula.

- **conditioning**: ``Qwen3VLForConditionalGeneration`` from the released ``text_encoder`` config
  (``memory.RELEASED_TEXT_ENCODER``), its decoder trimmed to the 51 layers H3 reads (``hidden_states[50]``), bf16,
  one prefill of the prompt (``shapes.TEXT_TOKENS`` rows) and, for FL2VA, both keyframes through the vision tower
  at the canvas (Qwen3-VL's image processor: 16-pixel patches, 2x2 merge, each image twice in time);
- **video decode**: ``AutoencoderKLMiniMaxH3`` at diffusers' defaults (the released config) with its released
  spatial tiling, one clip's latents ``[1, 24, 5n+2, H/16, W/16]``, fp32 as h3serve runs it today; bf16 as released
  (``_keep_in_fp32_modules`` fp32: issue 56 item 1) runs the same ops, so its FLOPs are the same;
- **audio decode**: ``AutoencoderKLMiniMaxH3Audio`` at its defaults, both stereo channels as a batch of 2;
- **MP4**: not a model; its cost is the frame bytes the encoder reads (``projection`` turns them into seconds at a
  stated rate).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

from h3serve.pipelines.h3.memory import RELEASED_TEXT_ENCODER, TEXT_ENCODER_LAYER
from h3serve.pipelines.h3.shapes import TEXT_TOKENS, Clip

from .runtime import MetaRun

PATCH, MERGE, TEMPORAL_PATCH = 16, 2, 2  # Qwen3-VL's image processor (Qwen3VLImageProcessor defaults)
AUDIO_LATENTS_PER_S = 40
FPS = 24


@dataclasses.dataclass(frozen=True)
class StageCount:
    """One stage of one clip, counted on meta: its FLOPs, the weights it reads, its largest live bytes."""

    stage: str
    flops: int
    weight_bytes: int
    peak_bytes: int  # the storages live at once during the run (its activations; weights excluded)
    what: str


def _params_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _count(stage: str, model: torch.nn.Module, what: str, call) -> StageCount:
    run = MetaRun(unknown=lambda kind, t: torch.zeros(t.shape, dtype=t.dtype))
    run.exclude(model)
    with torch.no_grad(), run, FlopCounterMode(display=False) as counter:
        call()
    return StageCount(stage, counter.get_total_flops(), _params_bytes(model), run.peak, what)


def _quiet():
    warnings.simplefilter("ignore")  # the audio VAE's weight_norm deprecation, transformers' init notes


def conditioning(clip: Clip, text_tokens: int = TEXT_TOKENS) -> StageCount:
    """Qwen3-VL's prefill of one request: the prompt, and each keyframe through the vision tower at the canvas."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(**RELEASED_TEXT_ENCODER)
    config.text_config.num_hidden_layers = TEXT_ENCODER_LAYER + 1  # H3Pipeline.load keeps layers [0, 51)
    with warnings.catch_warnings(), torch.device("meta"):
        _quiet()
        model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16).eval()
    grid_h, grid_w = clip.height // PATCH, clip.width // PATCH  # [1, h, w] patches per keyframe
    images = len(clip.keyframes)
    vision_tokens = images * grid_h * grid_w // MERGE**2
    what = f"{text_tokens} prompt + {vision_tokens} vision rows, {TEXT_ENCODER_LAYER + 1} layers, bf16"

    def prefill():  # inputs made inside the run, so their host values are known (the vision grid's ops read them)
        per_image = grid_h * grid_w // MERGE**2
        # each keyframe's block: a text label, then its vision tokens (a run of its own, as the processor lays it)
        types = [0] * (text_tokens - images) + ([0] + [1] * per_image) * images
        ids = torch.tensor([[config.image_token_id if t else 0 for t in types]], device="meta")
        kwargs = {}
        if images:
            patch_dim = 3 * TEMPORAL_PATCH * PATCH * PATCH  # [patches, 1536] as the image processor flattens them
            kwargs["pixel_values"] = torch.empty(
                images * grid_h * grid_w, patch_dim, dtype=torch.bfloat16, device="meta"
            )
            kwargs["image_grid_thw"] = torch.tensor([[1, grid_h, grid_w]] * images, device="meta")
            kwargs["mm_token_type_ids"] = torch.tensor([types], device="meta")
        model.model(input_ids=ids, **kwargs)

    return _count("conditioning (Qwen3-VL prefill)", model, what, prefill)


def latent_frames(clip: Clip) -> int:
    return (clip.num_frames - 5) // 17 * 5 + 2  # 17n+5 frames -> 5n+2 latent frames


def _video_vae():
    from diffusers import AutoencoderKLMiniMaxH3

    with warnings.catch_warnings(), torch.device("meta"):
        _quiet()
        return AutoencoderKLMiniMaxH3()


def video_decode(clip: Clip) -> StageCount:
    """The video VAE's decode of one clip at the released tiling, fp32 as h3serve runs it today (the FLOPs are the
    same in bf16: ``bf16_video_decode``)."""
    vae = _video_vae()
    z = torch.empty(1, vae.config.latent_channels, latent_frames(clip), clip.height // 16, clip.width // 16)
    what = f"latents {list(z.shape)}, released tiling"
    return _count("video decode (VAE)", vae, what, lambda: vae.decode(z.to("meta"), return_dict=False))


def bf16_video_decode(fp32: StageCount) -> StageCount:
    """The same decode as released: bf16, diffusers' ``_keep_in_fp32_modules`` in fp32 (issue 56 item 1): the same
    ops, so the same FLOPs; the weights it reads at their dtypes, activations at half the bytes (projected)."""
    vae = _video_vae()
    keep = set(vae._keep_in_fp32_modules or ())
    weights = sum(
        p.numel() * (4 if keep & set(name.split(".")) else 2) for name, p in vae.named_parameters()
    )  # as from_pretrained(torch_dtype=torch.bfloat16) places them
    return dataclasses.replace(fp32, weight_bytes=weights, peak_bytes=fp32.peak_bytes // 2, what=fp32.what + ", bf16")


def audio_decode(clip: Clip) -> StageCount:
    """The audio VAE's decode of one clip's stereo latents (fp32, as diffusers runs it)."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    with warnings.catch_warnings(), torch.device("meta"):
        _quiet()
        vae = AutoencoderKLMiniMaxH3Audio()
    frames = round(clip.num_frames / FPS * AUDIO_LATENTS_PER_S)
    z = torch.empty(2, vae.config.latent_channels, frames, device="meta")  # the stereo channels as a batch
    what = f"latents {list(z.shape)}, fp32"
    return _count("audio decode (VAE)", vae, what, lambda: vae.decode(z, return_dict=False))


@functools.cache
def _decodes(width: int, height: int, num_frames: int) -> tuple[StageCount, StageCount]:
    clip = Clip(width, height, num_frames)  # keyframes change the conditioning only
    return video_decode(clip), audio_decode(clip)


@functools.cache
def stage_counts(clip: Clip) -> tuple[StageCount, StageCount, StageCount]:
    """Conditioning, video decode and audio decode of one request of ``clip`` (the video decode takes minutes on meta:
    ~2.5 min for a released clip on 2 cores, its ~200 tile-chunks each a whole decoder)."""
    return (conditioning(clip), *_decodes(clip.width, clip.height, clip.num_frames))
