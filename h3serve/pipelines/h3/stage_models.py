"""The conditioner and decoder models a stage deployment (or rank 0) holds, and a checkpoint's model rules read from
its configs alone (no weights)."""

from __future__ import annotations

import logging
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState

from h3serve.attention import (
    DeviceType,
    parse_dtype,
)

from . import checkpoint as ckpt
from . import tiled_decode
from .config import default_vae_dtype
from .denoiser import quiet_libraries
from .handoff import DecodeHandoff, EncodedMedia, GeneratedMedia, PreparedState
from .placement import STAGE_ROLES
from .preview import PreviewMap
from .request import GenerationRequest, ModelRules
from .stages import H3Stages, text_encoder_layers
from .tiled_decode import TileRunner

logger = logging.getLogger(__name__)


def prepare_shifted(
    stages: H3Stages,
    planner: MiniMaxH3Scheduler,
    lock: threading.Lock,
    request: GenerationRequest,
    rules: ModelRules,
    shift: float | None,
) -> PipelineState:
    """diffusers' blocks before the loop for ``request``, its rows' schedule planned with ``shift`` (None: the
    released one). The timesteps block plans with the pipeline's own scheduler (``planner``): an adapter's shift
    is set there for this prepare and put back; ``lock`` keeps any other prepare from seeing it."""
    with lock:
        if shift is None:
            return stages.prepare(request, rules)
        released = planner.shift
        planner.set_shift(shift)
        try:
            return stages.prepare(request, rules)
        finally:
            planner.set_shift(released)


def config_only_component(index: ckpt.CheckpointIndex, name: str) -> torch.nn.Module:
    """A diffusers component (a VAE) built from its folder's config on the ``meta`` device: its config and the
    properties derived from it, no weights, no memory."""
    import diffusers

    library, class_name = ckpt.LAYOUT[name]
    assert library == "diffusers", name
    cls = getattr(diffusers, class_name)
    config = cls.load_config(index.folder(name), local_files_only=True)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.filterwarnings("ignore", message=".*weight_norm.*", category=FutureWarning)  # the audio VAE's
        return cls.from_config(config)


def checkpoint_rules(checkpoint: str | Path | None) -> ModelRules:
    """A checkpoint's model rules from its configs alone (config-only VAEs on ``meta``, its tokenizer, processor and
    schedulers; no weights): what an ingress checks video jobs against before any replica has loaded the model."""
    quiet_libraries()
    index = ckpt.CheckpointIndex(ckpt.resolve_checkpoint(checkpoint))
    components: dict[str, Any] = dict(
        vae=config_only_component(index, "vae"),
        audio_vae=config_only_component(index, "audio_vae"),
        tokenizer=ckpt.load_tokenizer(index),
        processor=ckpt.load_processor(index),
        **{name: ckpt.load_scheduler(index, name) for name in ("scheduler", "audio_scheduler")},
    )
    return H3Stages(components, index.pipeline_config).rules().model_copy(update={"partitions": index.partitions()})


def load_stage_components(
    index: ckpt.CheckpointIndex,
    device: str,
    dtype: str | torch.dtype,
    vae_dtype: str | torch.dtype,
    *,
    text_encoder: bool,
) -> dict[str, Any]:
    """What diffusers' blocks before and after the loop hold: both VAEs in ``vae_dtype``, the tokenizer, processor
    and schedulers, and (``text_encoder``) Qwen3-VL in ``dtype`` through the layer H3 reads. Each model is read
    straight onto ``device`` (``ckpt.load_model``): no host copy is made and moved, and the Qwen3-VL layers after
    the one H3 reads are never read at all."""
    components: dict[str, Any] = dict(
        vae=ckpt.load_model(index, "vae", parse_dtype(vae_dtype), device),
        audio_vae=ckpt.load_model(index, "audio_vae", parse_dtype(vae_dtype), device),
        tokenizer=ckpt.load_tokenizer(index),
        processor=ckpt.load_processor(index),
        **{n: ckpt.load_scheduler(index, n) for n in ("scheduler", "audio_scheduler")},
    )
    if text_encoder:
        components["text_encoder"] = ckpt.load_model(
            index, "text_encoder", parse_dtype(dtype), device, text_layers=text_encoder_layers()
        )
    return components


def load_tile_decoder(
    checkpoint: str | Path | None, device: str, vae_dtype: str | torch.dtype | None = None
) -> torch.nn.Module:
    """The video VAE alone, read as ``load_stage_components`` reads it (``vae_dtype``; None: the device's default):
    what a worker rank holds to decode a share of its replica's clips' tiles (``tiled_decode.decode_tiles``)."""
    quiet_libraries()
    index = ckpt.CheckpointIndex(ckpt.resolve_checkpoint(checkpoint))
    return ckpt.load_model(index, "vae", parse_dtype(vae_dtype or default_vae_dtype(device)), device)


def held_modules(value: Any) -> dict[str, torch.nn.Module]:
    return {name: module for name, module in vars(value).items() if isinstance(module, torch.nn.Module)}


class H3StageModels:
    """A stage deployment's share of a checkpoint, without any transformer partition.

    ``conditioner``: tokenizer, processor, Qwen3-VL through the layer H3 reads, both VAEs (their encoders read
    keyframes and references) and diffusers' blocks before the loop; ``prepare`` returns a ``PreparedState``.
    ``decoder``: both VAEs and the blocks after the loop; ``decode`` returns the media, or its PNG/MP4 bytes.
    The text encoder is not loaded by a decoder. Outputs equal ``H3Pipeline.prepare``/``decode`` on the same
    checkpoint, device and dtype (the same diffusers blocks on the same weights).
    """

    def __init__(
        self,
        role: str,
        stages: H3Stages,
        schedulers: dict[str, MiniMaxH3Scheduler],
        device: torch.device,
        partitions: tuple[str, ...],
    ):
        """``partitions``: the checkpoint's transformer partitions, which the denoisers hold (a stage loads none,
        yet prepares Ref2VA requests for ``transformer_ref``)."""
        self.role, self.stages, self.device = role, stages, device
        self._schedulers = schedulers
        self._preparing = threading.Lock()
        self.rules: ModelRules = stages.rules().model_copy(update={"partitions": partitions})

    @classmethod
    def load(
        cls,
        role: str,
        checkpoint: str | Path | None,
        *,
        device: DeviceType = "cpu",
        dtype: str | torch.dtype = "float32",
        vae_dtype: str | torch.dtype | None = None,
    ) -> H3StageModels:
        """``dtype``: the text encoder's; ``vae_dtype``: both VAEs' (None: ``default_vae_dtype(device)``, bf16 on
        GPUs as released, with diffusers' ``_keep_in_fp32_modules`` in fp32)."""
        if role not in STAGE_ROLES:
            raise ValueError(f"stage role must be one of {', '.join(STAGE_ROLES)}, got {role!r}")
        quiet_libraries()
        index = ckpt.CheckpointIndex(ckpt.resolve_checkpoint(checkpoint))
        vae_dtype = vae_dtype or default_vae_dtype(device)
        components = load_stage_components(index, device, dtype, vae_dtype, text_encoder=role == "conditioner")
        schedulers = {n: components.pop(n) for n in ("scheduler", "audio_scheduler")}
        stages = H3Stages({**components, **schedulers}, index.pipeline_config)
        if device == "cuda" and parse_dtype(vae_dtype) != torch.float32:
            # this process holds no transformer: the VAEs' fp32 modules (and the bf16 text encoder) may use TF32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        return cls(role, stages, schedulers, torch.device(device), index.partitions())

    def held_models(self) -> dict[str, torch.nn.Module]:
        """Every model this stage holds, by component name (the memory plan's stage roles count these)."""
        models: dict[str, torch.nn.Module] = {}
        for pipeline in (self.stages.before, self.stages.after):
            models.update(held_modules(pipeline))
        return models

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, shift: float | None = None) -> PreparedState:
        """The conditioner's work for one request (the denoiser checked it and chose ``shift``: its adapter's)."""
        if self.role != "conditioner":
            raise RuntimeError(f"a {self.role} stage does not prepare requests")
        self.rules.check(request)
        state = prepare_shifted(self.stages, self._schedulers["scheduler"], self._preparing, request, self.rules, shift)
        return PreparedState.of(state)

    def fit_preview(self) -> PreviewMap:
        """The latent -> RGB preview map of this checkpoint's video VAE, for the denoisers (which hold no VAE)."""
        return PreviewMap.fit(self.stages.after.vae, self.stages.before.pixel_mean, self.stages.before.pixel_std)

    @torch.no_grad()
    def decode(
        self, handoff: DecodeHandoff, output: str | None = None, decode_tiles: TileRunner | None = None
    ) -> GeneratedMedia | EncodedMedia:
        """Both VAE decoders for one finished request; ``output`` "png"/"mp4": encoded here, None: the media.

        ``decode_tiles``: who decodes the video VAE's tiles (``tiled_decode``; the same frames), while the audio
        decoder runs beside them; None: this stage's VAE, tile after tile."""
        layout = PipelineState()
        for key, value in handoff.layout.items():
            layout.set(key, value)
        video_rows, audio_rows = handoff.video_rows.to(self.device), handoff.audio_rows.to(self.device)
        frames, audio, sample_rate = self.stages.finish(layout, video_rows, audio_rows, decode_tiles)
        media = GeneratedMedia(frames, audio, self.rules.fps, sample_rate)
        if output is None:
            return media
        if output not in ("png", "mp4"):
            raise ValueError(f"output must be 'png', 'mp4' or None, got {output!r}")
        return EncodedMedia(output, media.png() if output == "png" else media.mp4())

    def decode_tiles(self, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        """A share of another decode's video VAE tiles (``tiled_decode.decode_tiles``), back on the host."""
        if self.role != "decoder":
            raise RuntimeError(f"a {self.role} stage does not decode")
        return [tile.cpu() for tile in tiled_decode.decode_tiles(self.stages.after.vae, tiles)]
