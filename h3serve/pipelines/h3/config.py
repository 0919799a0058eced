"""H3 presets: ``full`` is the released MiniMax-H3, ``tiny`` the same library classes at tiny dims.

A preset names an architecture: admission refuses a checkpoint whose transformer/config.json has other
dims (heads, head size, layers, hidden size) before any weights are read; ``auto`` names none, and the
checkpoint's own architecture is served. ``full`` is ``MiniMaxH3Transformer3DModel``'s own default
config, which is the released one. ``tiny`` also carries the configs of every other component, which is
what ``h3serve weights`` builds a checkpoint in the released layout from.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
from pathlib import Path
from typing import Any, Literal

# The tiny text encoder must be deeper than the layer H3 reads (`hidden_states[50]`); its width is tiny.
TINY_TEXT_LAYERS = 51
# Tokens the tiny tokenizer knows as pieces; anything else falls back to byte-level pieces.
TINY_VOCAB_SIZE = 512


@dataclasses.dataclass(frozen=True)
class H3Preset:
    """An H3 architecture: the transformer config, and for ``tiny`` every other component's too."""

    name: str  # the model id the API serves by default
    transformer: dict[str, Any]  # MiniMaxH3Transformer3DModel kwargs; {} is the released config
    components: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    pipeline_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # canvas configs of the blocks

    def transformer_config(self) -> dict[str, Any]:
        """The whole transformer config: the class's defaults (the released values), then this preset's."""
        return {**transformer_defaults(), **self.transformer}

    def geometry(self) -> TransformerGeometry:
        return _geometry(self.name)


@dataclasses.dataclass(frozen=True)
class TransformerGeometry:
    """What admission, Ulysses and the memory plan need to know about a transformer, from a preset or a checkpoint."""

    num_heads: int
    head_dim: int
    num_layers: int
    hidden_size: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> TransformerGeometry:
        return cls(
            num_heads=int(config["num_attention_heads"]),
            head_dim=int(config["attention_head_dim"]),
            num_layers=int(config["num_layers"]),
            hidden_size=int(config["hidden_size"]),
        )

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> TransformerGeometry:
        path = Path(directory) / "transformer" / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: not a MiniMax-H3 checkpoint directory")
        return cls.of(json.loads(path.read_text()))

    def describe(self) -> str:
        return f"{self.num_heads} heads x {self.head_dim}, {self.num_layers} layers, hidden {self.hidden_size}"

    def differences(self, other: TransformerGeometry) -> list[str]:
        """The fields in which ``other`` differs, as ``name <self's> vs <other's>``."""
        return [
            f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def check_sp_degree(self, sp_degree: int) -> None:
        """Ulysses splits heads across ranks, so the degree must divide the head count."""
        if sp_degree < 1:
            raise ValueError(f"sp_degree must be >= 1, got {sp_degree}")
        if self.num_heads % sp_degree:
            allowed = [d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]
            raise ValueError(
                f"sp_degree={sp_degree} must divide the transformer's {self.num_heads} attention heads; "
                f"allowed: {allowed}"
            )


PRESETS: dict[str, H3Preset] = {
    # The released MiniMax-H3: 50 blocks, hidden 5376, 56 heads x 128 (diffusers' defaults).
    "full": H3Preset(name="minimax-h3", transformer={}),
    "tiny": H3Preset(
        name="minimax-h3-tiny",
        transformer=dict(
            num_attention_heads=4,
            attention_head_dim=32,  # inner 128 != hidden 96, as the released 7168 != 5376
            hidden_size=96,
            num_layers=4,
            num_refiner_layers=2,
            ffn_dim=256,
            in_channels=8,
            audio_in_channels=8,
            text_dim=32,
            freq_dim=64,
            time_embed_hidden_dim=96,
            time_embed_dim=48,
            rope_freq_dim=4,  # 2 * 3 * 4 = 24 of 32 channels rotated, the released 96 of 128
        ),
        components=dict(
            vae=dict(
                latent_channels=8,
                block_out_channels=(16, 32, 32, 32),
                layers_per_block=1,
                spatial_downsample_factors=(2, 2, 2, 2),  # 16x, as released
                temporal_downsample_factors=(1, 2, 2, 1),  # 17 frames -> 5 latents, as released
                norm_num_groups=8,
                decoder_num_layers=2,
                decoder_num_attention_heads=2,
                decoder_attention_head_dim=16,
                decoder_num_register_tokens=1,
                decoder_ffn_mult=2,
                latents_mean=(0.0,) * 8,
                latents_std=(1.0,) * 8,
            ),
            audio_vae=dict(
                encoder_dim=8,
                encoder_rates=(2, 4, 5, 5),  # 200 samples a latent: 40 latents/s at 8 kHz, as released at 32 kHz
                latent_dim=32,
                latent_channels=8,
                num_attention_heads=2,
                decoder_dim=32,
                decoder_rates=(5, 5, 4, 2),
                decoder_kernel_sizes=(10, 10, 8, 4),
                resblock_kernel_sizes=(3,),
                resblock_dilation_sizes=((1, 3),),
                sampling_rate=8000,
                latents_mean=[0.0] * 8,
                latents_std=[1.0] * 8,
            ),
            text_encoder=dict(
                text_config=dict(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=TINY_TEXT_LAYERS,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    head_dim=16,
                    max_position_embeddings=4096,
                    rope_parameters={
                        "rope_type": "default",
                        "rope_theta": 10000.0,
                        "mrope_section": [4, 2, 2],
                        "mrope_interleaved": True,
                    },
                ),
                vision_config=dict(
                    depth=1,
                    hidden_size=32,
                    intermediate_size=64,
                    num_heads=2,
                    patch_size=16,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    out_hidden_size=32,
                    num_position_embeddings=256,
                    deepstack_visual_indexes=[0],
                ),
                tie_word_embeddings=True,
            ),
            processor=dict(
                patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32, max_pixels=256 * 256
            ),
            scheduler=dict(shift=12.0),
            audio_scheduler=dict(shift=3.0),
        ),
        # A 128x64 default canvas (16:9 rounded to the 32-pixel grid), 5-15 s at 24 fps as released.
        pipeline_config=dict(canvas_short_edge=64, canvas_max_pixels=128 * 64, reference_image_short_edge=64),
    ),
}


@functools.cache
def _transformer_defaults() -> dict[str, Any]:
    from diffusers import MiniMaxH3Transformer3DModel

    return {
        name: p.default
        for name, p in inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def transformer_defaults() -> dict[str, Any]:
    """``MiniMaxH3Transformer3DModel``'s constructor defaults: the released config (a copy, to update freely)."""
    return dict(_transformer_defaults())


@functools.cache
def _geometry(model_name: str) -> TransformerGeometry:
    """A preset's heads, read once (inspecting diffusers' signature is the slow part of admission)."""
    (spec,) = [p for p in PRESETS.values() if p.name == model_name]
    return TransformerGeometry.of(spec.transformer_config())


def default_dtype(device: str) -> Literal["bfloat16", "float32"]:
    """The transformer's and text encoder's dtype when none is given: bf16 on GPUs, as released; fp32 on CPUs."""
    return "bfloat16" if device == "cuda" else "float32"


def default_vae_dtype(device: str) -> Literal["bfloat16", "float32"]:
    """The VAEs' dtype when none is given: bf16 on GPUs as released (diffusers keeps each VAE's
    ``_keep_in_fp32_modules`` in fp32); fp32 on CPUs, the exact reference the CPU tests compare against (bf16 decodes
    there too, and faster at larger canvases: docs/CONFIG.md has the numbers)."""
    return "bfloat16" if device == "cuda" else "float32"


# ``model: auto``: no preset; the architecture is the checkpoint's own (its transformer/config.json).
AUTO = "auto"


def preset(name: str) -> H3Preset:
    if name not in PRESETS:
        hint = f" ({AUTO!r} names no preset: the checkpoint's own architecture)" if name == AUTO else ""
        raise ValueError(f"model preset {name!r} is not one of {', '.join(PRESETS)}{hint}")
    return PRESETS[name]
