"""MiniMax-H3 from a checkpoint directory: the denoiser every SP rank holds, and rank 0's whole pipeline.

``H3Denoiser`` is the transformer partition(s) with h3serve's attention processor on exactly the
admitted backend. ``H3Pipeline`` adds what runs once per request on rank 0 — diffusers' blocks
before and after the loop — and advances any number of requests by one step per packed forward.

With its stages elsewhere (``H3Pipeline.load(stages="remote")``: conditioner and decoder deployments of their
own) rank 0 holds only the transformer partitions and the tokenizer (to size a request's rows): no text
encoder, no VAE. Its model rules are read off the VAEs' configs on the ``meta`` device, and ``prepare`` and
``decode`` raise ``StagesElsewhere``; requests come in prepared (``admit``) and leave as ``decode_handoff``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState

from h3serve.attention import (
    AdmissionError,
    AttentionRequirements,
    BackendUnavailable,
    DeviceType,
    get_backend,
    parse_dtype,
    probe_platform,
)

from . import checkpoint as ckpt
from .attention_processor import SequenceParallel, install
from .config import TransformerGeometry, transformer_defaults
from .forward import packed_forward
from .lora import BASE_SLOT, LoraAdapter, LoraSpecs, load_partitions
from .lora_spec import asked_steps
from .packing import Document, Pack, pack_documents
from .placement import STAGE_PLACEMENTS, STAGE_ROLES, StagePlacement
from .preview import PreviewLayout, PreviewMap, clean_rows, preview_frames, strip_png
from .request import GenerationRequest, ModelRules, RequestError
from .stages import DECODE_KEYS, PREPARED_KEYS, H3Stages
from .step_cache import CachedPack, DocumentCache, PackCache, StepCachePolicy, skipped_block_rows

logger = logging.getLogger(__name__)

# What H3 needs from attention: many documents packed into one [T, H, D] forward.
REQUIREMENTS = AttentionRequirements(packed_varlen=True)


class StagesElsewhere(RuntimeError):
    """A pipeline loaded without its conditioner and decoder models (``stages="remote"``) was asked to run them."""


def _quiet_libraries() -> None:
    """No per-call progress bars in a server's log."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def check_capable(backend: str, model: str) -> None:
    """Fail closed unless the admitted backend can do what H3 needs (a fact of its code).

    The driver admitted it already; a replica checks again rather than trust its spec.
    """
    attention = get_backend(backend)
    missing = attention.unsupported_requirements(REQUIREMENTS)
    if missing:
        raise AdmissionError(
            f"Attention backend {attention.name!r} does not implement "
            f"{', '.join(AttentionRequirements.describe(m) for m in missing)}, which MiniMax-H3 "
            "requires; this replica refuses to build with it",
            backend=attention.name,
            model=model,
            missing=missing,
        )


def check_runs_here(backend: str, device: DeviceType, dtype: torch.dtype, head_dim: int, model: str) -> None:
    """Fail closed unless this node can run the admitted backend; it is never swapped for another."""
    attention = get_backend(backend)
    here = probe_platform(device)
    available = attention.availability(here, dtype=dtype, head_dim=head_dim)
    if not available or here.device_type != device:
        reason = available.reason or f"the node has no {device} device"
        raise BackendUnavailable(
            f"Attention backend {attention.name!r} cannot run on this node: {reason}",
            backend=attention.name,
            model=model,
        )


class H3Denoiser:
    """The transformer partition(s) of a checkpoint, attending only through the admitted backend.

    With LoRA adapters (``load_adapters``), every partition holds each adapter in its slot, placed on the
    partition's device and dtype; base weights are never modified.
    """

    def __init__(self, transformers: dict[str, torch.nn.Module], backend: str, device: torch.device, directory: Path):
        self.transformers, self.backend, self.device, self.directory = transformers, backend, device, directory
        for model in transformers.values():
            install(model, get_backend(backend).make_impl())
        self.loras = LoraSpecs()
        self.adapters: dict[str, dict[int, LoraAdapter]] = {partition: {} for partition in transformers}

    def load_adapters(self, loras: LoraSpecs) -> None:
        """Read every adapter onto every partition (``load_partitions``: a file's keys routed as diffusers routes
        them; refused by name and key unless it fits). A partition an adapter leaves alone holds it with no layers."""
        adapters: dict[str, dict[int, LoraAdapter]] = {partition: {} for partition in self.transformers}
        for name, spec in loras.loras.items():
            for partition, adapter in load_partitions(name, spec, self.transformers).items():
                adapters[partition][loras.slots[name]] = adapter.placed_for(self.transformers[partition])
        self.loras, self.adapters = loras, adapters
        if loras.loras:
            logger.info("LoRA adapters served in slots %s", loras.slots)

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None,
        backend: str,
        *,
        device: DeviceType = "cpu",
        dtype: str | torch.dtype = "float32",
        expected: TransformerGeometry | None = None,
        loras: LoraSpecs | None = None,
    ) -> H3Denoiser:
        """Build with exactly ``backend`` (the driver's choice); never re-resolve.

        ``checkpoint`` None is the built-in tiny checkpoint. Raises AdmissionError for an incapable
        backend (before reading anything), BackendUnavailable when this node cannot run it,
        CheckpointError when the checkpoint does not fit or is not what the deployment was admitted for,
        LoraError for an adapter of ``loras`` that does not fit a partition.
        """
        check_capable(backend, str(checkpoint or "the built-in checkpoint"))
        _quiet_libraries()
        directory = ckpt.resolve_checkpoint(checkpoint)
        index = ckpt.CheckpointIndex(directory)
        geometries = {
            partition: TransformerGeometry.of(
                {**transformer_defaults(), **ckpt.load_component_config(index, partition)}
            )
            for partition in index.partitions()
        }
        for partition, found in geometries.items():  # the driver read them too, but this node's copy may differ
            if expected is not None and found != expected:
                raise ckpt.CheckpointError(
                    f"{directory / partition} has {found.describe()}, but the deployment was admitted for "
                    f"{expected.describe()} ({'; '.join(expected.differences(found))})"
                )
        geometry = geometries["transformer"]
        torch_dtype = parse_dtype(dtype)
        check_runs_here(backend, device, torch_dtype, geometry.head_dim, str(directory))
        models = {p: ckpt.load_model(index, p, torch_dtype, device) for p in index.partitions()}
        denoiser = cls(models, backend, torch.device(device), directory)
        if loras is not None:
            denoiser.load_adapters(loras)
        return denoiser

    def forward(self, pack: Pack, sp: SequenceParallel | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's share of one packed forward; rank 0 gets every row's velocity back.

        A ``CachedPack`` carries its documents' step caches into the forward (under Ulysses each rank its own).
        """
        cache = pack.step_cache if isinstance(pack, CachedPack) else None
        adapters = self.adapters[pack.partition] if pack.adapted else None
        return packed_forward(self.transformers[pack.partition], pack.to(self.device), sp, cache, adapters)


@dataclasses.dataclass
class GeneratedMedia:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray  # float32 [2, S] stereo
    fps: int
    sample_rate: int

    # media is imported on use: PyAV is needed to encode, not to build or run the model
    def png(self) -> bytes:
        """A still: the middle frame of the clip."""
        from .media import encode_png

        return encode_png(self.frames[len(self.frames) // 2])

    def mp4(self) -> bytes:
        from .media import encode_mp4

        return encode_mp4(self.frames, self.fps, self.audio, self.sample_rate)


@dataclasses.dataclass
class EncodedMedia:
    """A decoder stage's answer when asked for an encoding: the PNG or MP4 bytes, never the raw frames."""

    kind: str  # "png" | "mp4"
    data: bytes


def move_tensors(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor in it (through tuples and lists: the row-timestep plan) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(move_tensors(v, device) for v in value)
    return value


def payload_bytes(value: Any) -> int:
    """The bytes of the tensors, arrays and byte strings in ``value``: what a stage hand-off moves."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(payload_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(payload_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


@dataclasses.dataclass
class PreparedState:
    """A conditioner stage's answer: the values of diffusers' pipeline state that ``RequestState`` reads
    (``PREPARED_KEYS``), every tensor on the host, so it crosses the Ray object store once."""

    values: dict[str, Any]

    @classmethod
    def of(cls, state: PipelineState) -> PreparedState:
        return cls({key: move_tensors(state.get(key), "cpu") for key in PREPARED_KEYS})

    def pipeline_state(self, device: torch.device) -> PipelineState:
        """A diffusers ``PipelineState`` holding these values on ``device`` (the denoiser's)."""
        state = PipelineState()
        for key, value in self.values.items():
            state.set(key, move_tensors(value, device))
        return state

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.values)


@dataclasses.dataclass
class DecodeHandoff:
    """What a decoder stage needs of a finished request: its rows after the last step and the layout sizes."""

    video_rows: torch.Tensor  # [n_video, C*p] fp32 on the host, conditioning rows first
    audio_rows: torch.Tensor  # [n_audio, C_audio] fp32 on the host
    layout: dict[str, Any]  # DECODE_KEYS

    @property
    def nbytes(self) -> int:
        return payload_bytes([self.video_rows, self.audio_rows])


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


def _config_only(index: ckpt.CheckpointIndex, name: str) -> torch.nn.Module:
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
    _quiet_libraries()
    index = ckpt.CheckpointIndex(ckpt.resolve_checkpoint(checkpoint))
    components: dict[str, Any] = dict(
        vae=_config_only(index, "vae"),
        audio_vae=_config_only(index, "audio_vae"),
        tokenizer=ckpt.load_tokenizer(index),
        processor=ckpt.load_processor(index),
        **{name: ckpt.load_scheduler(index, name) for name in ("scheduler", "audio_scheduler")},
    )
    return H3Stages(components, index.pipeline_config).rules().model_copy(update={"partitions": index.partitions()})


def _held_modules(value: Any) -> dict[str, torch.nn.Module]:
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
    ) -> H3StageModels:
        if role not in STAGE_ROLES:
            raise ValueError(f"stage role must be one of {', '.join(STAGE_ROLES)}, got {role!r}")
        _quiet_libraries()
        index = ckpt.CheckpointIndex(ckpt.resolve_checkpoint(checkpoint))
        components: dict[str, Any] = dict(
            vae=ckpt.load_model(index, "vae", torch.float32, device),  # the VAEs run in fp32
            audio_vae=ckpt.load_model(index, "audio_vae", torch.float32, device),
            tokenizer=ckpt.load_tokenizer(index),
            processor=ckpt.load_processor(index),
        )
        if role == "conditioner":
            components["text_encoder"] = ckpt.load_model(index, "text_encoder", parse_dtype(dtype), "cpu")
        schedulers = {n: ckpt.load_scheduler(index, n) for n in ("scheduler", "audio_scheduler")}
        stages = H3Stages({**components, **schedulers}, index.pipeline_config)
        if role == "conditioner":  # as H3Pipeline.load: trimmed to the layer H3 reads before it moves
            ckpt.keep_decoder_layers(components["text_encoder"], stages.before.text_encoder_layer + 1)
            components["text_encoder"].to(device)
        return cls(role, stages, schedulers, torch.device(device), index.partitions())

    def held_models(self) -> dict[str, torch.nn.Module]:
        """Every model this stage holds, by component name (the memory plan's stage roles count these)."""
        models: dict[str, torch.nn.Module] = {}
        for pipeline in (self.stages.before, self.stages.after):
            models.update(_held_modules(pipeline))
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
    def decode(self, handoff: DecodeHandoff, output: str | None = None) -> GeneratedMedia | EncodedMedia:
        """Both VAE decoders for one finished request; ``output`` "png"/"mp4": encoded here, None: the media."""
        layout = PipelineState()
        for key, value in handoff.layout.items():
            layout.set(key, value)
        video_rows, audio_rows = handoff.video_rows.to(self.device), handoff.audio_rows.to(self.device)
        frames, audio, sample_rate = self.stages.finish(layout, video_rows, audio_rows)
        media = GeneratedMedia(frames, audio, self.rules.fps, sample_rate)
        if output is None:
            return media
        if output not in ("png", "mp4"):
            raise ValueError(f"output must be 'png', 'mp4' or None, got {output!r}")
        return EncodedMedia(output, media.png() if output == "png" else media.mp4())


class RequestState:
    """One request between diffusers' stages: its packed rows, layout, and its own two schedulers."""

    def __init__(
        self,
        request: GenerationRequest,
        state: PipelineState,
        video: MiniMaxH3Scheduler,
        audio: MiniMaxH3Scheduler,
        device: torch.device,
        step_cache: StepCachePolicy | None = None,
        adapter_slot: int = BASE_SLOT,
    ):
        """``video`` must already carry the request's shift (an adapter's; ``H3Pipeline.prepare`` sets it)."""
        self.request, self.state = request, state
        self.adapter_slot = adapter_slot  # its documents' slot in every pack (0: the base model)
        # this request's First-Block-Cache state (None: it computes every block at every step)
        self.step_cache: DocumentCache | None = DocumentCache(step_cache) if step_cache is not None else None
        self.partition = ckpt.PARTITIONS[request.task]
        self.video_rows: torch.Tensor = state.get("latents")  # [n_video, C*p] fp32, conditioning rows first
        self.audio_rows: torch.Tensor = state.get("audio_latents")  # [n_audio, C_audio] fp32
        self.plan = state.get("row_timestep_plan")  # per step: (distinct timesteps, row -> index)
        self.video_scheduler, self.audio_scheduler = video, audio
        for scheduler in (video, audio):
            scheduler.set_timesteps(request.num_inference_steps, device=device)
        if not torch.equal(video.timesteps, state.get("timesteps")):
            raise RuntimeError("the request's own video schedule differs from the one its layout was planned with")
        self.num_condition_video = state.get("num_condition_video_rows") or 0
        self.num_condition_audio = state.get("num_condition_audio_rows") or 0
        self.step_index = 0
        # previews (``preview.py``): the generated rows whose clean prediction the next ``advance`` captures, and the
        # last capture ``[k, C*p]``, which the engine takes for rendering off the model thread
        self.preview_index: torch.Tensor | None = None
        self.preview: torch.Tensor | None = None
        embeds = state.get("prompt_embeds")[0]  # [n_text, text_dim]
        self.layout = dict(
            prompt_embeds=embeds,
            position_ids=state.get("position_ids"),
            token_tags=state.get("token_tags"),
            video_indices=state.get("video_indices"),
            audio_indices=state.get("audio_indices"),
            text_indices=state.get("text_indices"),
        )

    @property
    def steps(self) -> int:
        return len(self.plan)

    @property
    def rows(self) -> int:
        return int(self.layout["position_ids"].shape[0])

    @property
    def text_rows(self) -> int:
        """Its prompt rows: the prompt's tokens and the keyframes' vision tokens."""
        return int(self.layout["text_indices"].shape[0])

    @property
    def done(self) -> bool:
        return self.step_index >= self.steps

    @property
    def progress(self) -> tuple[int, int]:
        return self.step_index, self.steps

    def document(self) -> Document:
        timestep, timestep_indices = self.plan[self.step_index]
        return Document(
            video_rows=self.video_rows,
            audio_rows=self.audio_rows,
            timestep=timestep,
            timestep_indices=timestep_indices,
            **self.layout,
        )

    def advance(self, video_velocity: torch.Tensor, audio_velocity: torch.Tensor) -> None:
        """One step of each schedule on the generated rows; conditioning rows are never written."""
        i, nv, na = self.step_index, self.num_condition_video, self.num_condition_audio
        t_video, t_audio = self.video_scheduler.timesteps[i], self.audio_scheduler.timesteps[i]
        video_velocity, audio_velocity = (
            video_velocity.to(self.video_rows.device),
            audio_velocity.to(self.audio_rows.device),
        )
        if self.preview_index is not None:  # before the step overwrites x_t in place
            self.preview = clean_rows(self.video_rows[nv:], video_velocity[nv:], t_video, self.preview_index)
            self.preview_index = None
        self.video_rows[nv:] = self.video_scheduler.step(
            video_velocity[nv:].float(), t_video, self.video_rows[nv:], return_dict=False
        )[0]
        self.audio_rows[na:] = self.audio_scheduler.step(
            audio_velocity[na:].float(), t_audio, self.audio_rows[na:], return_dict=False
        )[0]
        self.step_index += 1
        if self.done:
            self.free_step_cache()  # decoding needs none of it

    def free_step_cache(self) -> None:
        """Drop the cached residuals (two [S, hidden] tensors); its counters stay for reporting."""
        if self.step_cache is not None:
            self.step_cache.free()


@dataclasses.dataclass
class StepStats:
    requests: int
    rows: int
    padding_rows: int
    skipped_block_rows: int = 0  # rows x transformer blocks step caching skipped in this forward


class H3Pipeline:
    """Rank 0: diffusers' per-request stages around h3serve's packed multi-request denoising.

    ``stages`` None: conditioning and decoding run in stage deployments of their own (``load(stages="remote")``);
    this pipeline then holds no text encoder and no VAE, ``rules`` must be given, and ``prepare``, ``decode`` and
    the ``stages`` attribute raise ``StagesElsewhere`` (``has_stages`` says which it is).
    """

    requirements = REQUIREMENTS

    def __init__(
        self,
        denoiser: H3Denoiser,
        stages: H3Stages | None,
        schedulers: dict[str, MiniMaxH3Scheduler],
        tokenizer,
        name: str,
        rules: ModelRules | None = None,
    ):
        self.denoiser, self._stages, self.tokenizer, self.name = denoiser, stages, tokenizer, name
        self._schedulers = schedulers
        self._preparing = threading.Lock()  # one prepare at a time: an adapter's shift is set on a shared scheduler
        if rules is None:
            if stages is None:
                raise ValueError("a pipeline without its stages needs its model rules")
            rules = stages.rules()
        self.rules: ModelRules = rules
        self.row_multiple = 1  # a worker group sets its SP degree here: packs split evenly over its ranks
        # latent channels -> RGB for previews (``fit_preview``, or a conditioner stage's); None: no previews
        self.preview_map: PreviewMap | None = None
        self.forward: Callable[[Pack], tuple[torch.Tensor, torch.Tensor]] = self._forward_alone

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None,
        backend: str,
        *,
        device: DeviceType = "cpu",
        dtype: str | torch.dtype = "float32",
        expected: TransformerGeometry | None = None,
        name: str | None = None,
        loras: LoraSpecs | None = None,
        stages: StagePlacement = "local",
    ) -> H3Pipeline:
        """Every component of the checkpoint directory, the transformer(s) with exactly ``backend``, and ``loras``.

        ``stages="remote"``: conditioning and decoding run in stage deployments of their own, so only the
        transformer partition(s), the tokenizer and the schedulers are loaded (``load_denoiser_only``).
        """
        if stages not in STAGE_PLACEMENTS:
            raise ValueError(f"stages must be one of {', '.join(STAGE_PLACEMENTS)}, got {stages!r}")
        denoiser = H3Denoiser.load(checkpoint, backend, device=device, dtype=dtype, expected=expected, loras=loras)
        if stages == "remote":
            return cls.load_denoiser_only(denoiser, name)
        index = ckpt.CheckpointIndex(denoiser.directory)
        torch_dtype = parse_dtype(dtype)
        components = dict(denoiser.transformers)
        components.update(
            vae=ckpt.load_model(index, "vae", torch.float32, device),  # the VAEs run in fp32
            audio_vae=ckpt.load_model(index, "audio_vae", torch.float32, device),
            text_encoder=ckpt.load_model(index, "text_encoder", torch_dtype, "cpu"),  # trimmed before it moves
            tokenizer=ckpt.load_tokenizer(index),
            processor=ckpt.load_processor(index),
        )
        schedulers = {n: ckpt.load_scheduler(index, n) for n in ("scheduler", "audio_scheduler")}
        blocks = H3Stages({**components, **schedulers}, index.pipeline_config)
        # diffusers' encoder step refuses a stack of exactly `text_encoder_layer` layers (the last one is post-norm)
        ckpt.keep_decoder_layers(components["text_encoder"], blocks.before.text_encoder_layer + 1)
        components["text_encoder"].to(device)
        return cls(denoiser, blocks, schedulers, components["tokenizer"], name or denoiser.directory.name)

    @classmethod
    def load_denoiser_only(cls, denoiser: H3Denoiser, name: str | None = None) -> H3Pipeline:
        """Rank 0 of a replica whose conditioner and decoder are stage deployments of their own: ``denoiser``,
        the tokenizer (a request's rows are sized at submit) and the schedulers; no text encoder, no VAE.

        The model rules (frame and sample rates, canvas multiple...) are what diffusers' blocks derive from the
        VAEs' configs: they are read off config-only VAEs on the ``meta`` device, which are dropped after.
        """
        index = ckpt.CheckpointIndex(denoiser.directory)
        schedulers = {n: ckpt.load_scheduler(index, n) for n in ("scheduler", "audio_scheduler")}
        tokenizer = ckpt.load_tokenizer(index)
        config_only = dict(
            denoiser.transformers,
            vae=_config_only(index, "vae"),
            audio_vae=_config_only(index, "audio_vae"),
            tokenizer=tokenizer,
            processor=ckpt.load_processor(index),  # whether video references are served: torchvision here
            **schedulers,
        )
        rules = H3Stages(config_only, index.pipeline_config).rules()
        return cls(denoiser, None, schedulers, tokenizer, name or denoiser.directory.name, rules)

    @property
    def has_stages(self) -> bool:
        """Whether diffusers' blocks before and after the loop (text encoder, VAEs) run here."""
        return self._stages is not None

    @property
    def stages(self) -> H3Stages:
        """The per-request stages (their text encoder and VAEs); StagesElsewhere when loaded without them."""
        return self._local_stages("run diffusers' blocks before or after the loop")

    def held_models(self) -> dict[str, torch.nn.Module]:
        """Every model this pipeline holds, by component name: the transformer partition(s), and with its stages
        here the text encoder and both VAEs."""
        models = dict(self.denoiser.transformers)
        if self._stages is not None:
            for pipeline in (self._stages.before, self._stages.after):
                models.update(_held_modules(pipeline))
        return models

    def _local_stages(self, what: str) -> H3Stages:
        if self._stages is None:
            raise StagesElsewhere(
                f"this pipeline holds only the transformer partitions (loaded with stages='remote'): it cannot "
                f"{what}; the conditioner stage prepares requests (H3StageModels.prepare, then H3Pipeline.admit) "
                "and the decoder stage decodes them (H3Pipeline.decode_handoff, then H3StageModels.decode)"
            )
        return self._stages

    # -- one request's way in and out ----------------------------------------------------------
    def text_tokens(self, prompt: str) -> int:
        return len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def validate(self, request: GenerationRequest) -> int:
        """Check a request without running anything; returns about the rows it adds to a pack."""
        self.rules.check(request)
        return self.rules.rows(request, self.text_tokens(request.prompt))

    def check_step_cache(self, policy: StepCachePolicy) -> None:
        """ValueError unless ``policy`` leaves a block to skip in every transformer partition."""
        for model in self.denoiser.transformers.values():
            blocks = model.transformer_blocks
            assert isinstance(blocks, torch.nn.ModuleList)
            policy.check_blocks(len(blocks))

    def with_adapter(self, request: GenerationRequest, adapter: str | None) -> GenerationRequest:
        """``request`` as it runs on ``adapter`` (None: the base model): a request that sets no
        ``num_inference_steps`` gets the adapter's; RequestError("model") for an adapter not served here,
        RequestError("num_inference_steps") for steps the adapter was not distilled for."""
        spec = self.denoiser.loras.loras.get(adapter) if adapter is not None else None
        given = "num_inference_steps" in request.model_fields_set
        asked = asked_steps(spec, request.num_inference_steps, given)
        _, _, steps = self.denoiser.loras.resolve(adapter, asked)
        if steps is None or steps == request.num_inference_steps:
            return request
        return request.model_copy(update={"num_inference_steps": steps})

    @torch.no_grad()
    def prepare(
        self, request: GenerationRequest, step_cache: StepCachePolicy | None = None, adapter: str | None = None
    ) -> RequestState:
        """``step_cache``: the request's First-Block-Cache policy (None: every block at every step).

        ``adapter``: the LoRA adapter it runs on (None: the base model); ``request`` must already carry its
        steps (``with_adapter``). Its video schedule uses the adapter's ``shift`` when it declares one.
        """
        stages = self._local_stages("prepare a request")
        self.rules.check(request)
        if step_cache is not None:
            self.check_step_cache(step_cache)
        slot, shift = self.check_prepare(request, step_cache, adapter)
        state = prepare_shifted(stages, self._schedulers["scheduler"], self._preparing, request, self.rules, shift)
        return self._request_state(request, state, step_cache, slot, shift)

    def check_prepare(
        self, request: GenerationRequest, step_cache: StepCachePolicy | None, adapter: str | None
    ) -> tuple[int, float | None]:
        """The request's adapter slot and its video schedule's shift (None: the released one), or the error that
        refuses it (RequestError for the model's rules and the adapter, ValueError for the step cache)."""
        self.rules.check(request)
        if step_cache is not None:
            self.check_step_cache(step_cache)
        slot, spec, _ = self.denoiser.loras.resolve(adapter, request.num_inference_steps)  # checked again
        partition = ckpt.PARTITIONS[request.task]
        served = self.denoiser.adapters.get(partition, {})
        if adapter is not None and slot in served and not served[slot].layers:
            adapted = [p for p, by_slot in self.denoiser.adapters.items() if by_slot[slot].layers]
            raise RequestError(
                "model",
                f"adapter {adapter!r} adapts only the {', '.join(map(repr, adapted))} partition; a {request.task} "
                f"request runs on {partition!r}, which it leaves as the base model (use the base model id)",
            )
        return slot, spec.shift if spec is not None and spec.shift is not None else None

    @torch.no_grad()
    def admit(
        self,
        request: GenerationRequest,
        prepared: PreparedState,
        step_cache: StepCachePolicy | None = None,
        adapter: str | None = None,
    ) -> RequestState:
        """A request prepared by a conditioner stage (``H3StageModels.prepare`` with ``check_prepare``'s shift)
        as this pipeline's ``RequestState``: its host tensors move to the denoiser's device once."""
        slot, shift = self.check_prepare(request, step_cache, adapter)
        return self._request_state(request, prepared.pipeline_state(self.denoiser.device), step_cache, slot, shift)

    def _request_state(
        self,
        request: GenerationRequest,
        state: PipelineState,
        step_cache: StepCachePolicy | None,
        slot: int,
        shift: float | None,
    ) -> RequestState:
        video = MiniMaxH3Scheduler.from_config(self._schedulers["scheduler"].config)  # each request steps its own
        if shift is not None:
            video.set_shift(shift)
        return RequestState(
            request,
            state,
            video,
            MiniMaxH3Scheduler.from_config(self._schedulers["audio_scheduler"].config),
            self.denoiser.device,
            step_cache,
            slot,
        )

    def _forward_alone(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.denoiser.forward(pack)  # one rank: it has every row
        assert out is not None
        return out

    @torch.no_grad()
    def decode(self, state: RequestState) -> GeneratedMedia:
        stages = self._local_stages("decode a request")
        frames, audio, sample_rate = stages.finish(state.state, state.video_rows, state.audio_rows)
        return GeneratedMedia(frames, audio, self.rules.fps, sample_rate)

    def decode_handoff(self, state: RequestState) -> DecodeHandoff:
        """What a decoder stage needs of a finished request: its latents rows and layout sizes, on the host."""
        return DecodeHandoff(
            video_rows=state.video_rows.cpu(),
            audio_rows=state.audio_rows.cpu(),
            layout={key: state.state.get(key) for key in DECODE_KEYS},
        )

    # -- previews ------------------------------------------------------------------------------------
    def fit_preview(self) -> PreviewMap:
        """Fit (and keep) the latent -> RGB map of this checkpoint's video VAE (``preview.PreviewMap.fit``)."""
        stages = self._local_stages("fit the preview map from the video VAE")
        self.preview_map = PreviewMap.fit(stages.after.vae, stages.before.pixel_mean, stages.before.pixel_std)
        return self.preview_map

    def preview_layout(self, state: RequestState) -> PreviewLayout:
        ph, pw = self.rules.patch_hw
        height, width = state.state.get("latent_height"), state.state.get("latent_width")
        return PreviewLayout(height, width, state.video_rows.shape[1] // (ph * pw), (ph, pw))

    def request_preview(self, state: RequestState, frames: int) -> None:
        """The next step of ``state`` captures the clean prediction of ``frames`` latent frames (``state.preview``)."""
        chosen = preview_frames(int(state.state.get("num_latent_frames")), frames)
        state.preview_index = self.preview_layout(state).rows(chosen, state.video_rows.device)

    def render_preview(self, rows: torch.Tensor, layout: PreviewLayout) -> bytes:
        """A PNG strip of captured clean rows ``[k, C*p]``: the map's matmul per latent pixel, never a VAE decode."""
        if self.preview_map is None:
            raise RuntimeError("no preview map: fit_preview() (or a conditioner stage's) first")
        return strip_png(self.preview_map.rgb(layout.latents(rows.cpu())))

    # -- many requests, one step each ------------------------------------------------------------
    def packs(self, states: Sequence[RequestState]) -> list[tuple[list[RequestState], Pack]]:
        """One pack per transformer partition in use (T2VA and FL2VA share one; Ref2VA has its own)."""
        groups: dict[str, list[RequestState]] = {}
        for state in states:
            groups.setdefault(state.partition, []).append(state)
        packs: list[tuple[list[RequestState], Pack]] = []
        for partition, group in groups.items():
            slots = [s.adapter_slot for s in group]
            pack = pack_documents([s.document() for s in group], partition, self.row_multiple, slots)
            if any(s.step_cache is not None for s in group):  # else exactly the pack of a deployment without caching
                pack = CachedPack.of(pack, PackCache([s.step_cache for s in group]))
            packs.append((group, pack))
        return packs

    def apply(self, states: Sequence[RequestState], pack: Pack, out: tuple[torch.Tensor, torch.Tensor]) -> StepStats:
        """Advance every state of ``pack`` by one step from its packed forward's velocities."""
        for state, (video, audio) in zip(states, pack.split(*out), strict=True):
            state.advance(video, audio)
        return StepStats(len(states), pack.total_rows, pack.padding_rows, skipped_block_rows(pack))

    @torch.no_grad()
    def step(self, states: Sequence[RequestState]) -> list[StepStats]:
        """Advance every state by one step: one packed forward per partition in use."""
        return [self.apply(group, pack, self.forward(pack)) for group, pack in self.packs(states)]

    def generate(
        self,
        request: GenerationRequest,
        progress: Callable[[int, int], None] | None = None,
        step_cache: StepCachePolicy | None = None,
        adapter: str | None = None,
        stats: list[StepStats] | None = None,
    ) -> GeneratedMedia:
        """One request alone, start to finish; ``stats`` (when given) gets every forward's StepStats appended."""
        state = self.prepare(self.with_adapter(request, adapter), step_cache, adapter)
        while not state.done:
            forwards = self.step([state])
            if stats is not None:
                stats.extend(forwards)
            if progress:
                progress(*state.progress)
        return self.decode(state)
