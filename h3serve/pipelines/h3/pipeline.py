"""MiniMax-H3 from a checkpoint directory: rank 0's whole pipeline.

``H3Pipeline`` holds the denoiser every SP rank holds (``denoiser.H3Denoiser``: the transformer partition(s) with
h3serve's attention processor on exactly the admitted backend), adds what runs once per request on rank 0 —
diffusers' blocks before and after the loop (``stage_models``) — and advances any number of requests
(``request_state.RequestState``) by one step per packed forward. What crosses to stages of their own is in
``handoff``.

With its stages elsewhere (``H3Pipeline.load(stages="remote")``: conditioner and decoder deployments of their
own) rank 0 holds only the transformer partitions and the tokenizer (to size a request's rows): no text
encoder, no VAE. Its model rules are read off the VAEs' configs on the ``meta`` device, and ``prepare`` and
``decode`` raise ``StagesElsewhere``; requests come in prepared (``admit``) and leave as ``decode_handoff``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState

from h3serve.attention import (
    DeviceType,
)

from . import checkpoint as ckpt
from .config import TransformerGeometry, default_vae_dtype
from .denoiser import REQUIREMENTS, H3Denoiser
from .handoff import DecodeHandoff, GeneratedMedia, PreparedState
from .lora import LoraSpecs
from .packing import Pack, pack_documents
from .placement import STAGE_PLACEMENTS, StagePlacement
from .preview import PreviewLayout, PreviewMap, preview_frames, strip_png
from .request import GenerationRequest, ModelRules, RequestError
from .request_state import RequestState, StepStats
from .stage_models import config_only_component, held_modules, load_stage_components, prepare_shifted
from .stages import DECODE_KEYS, H3Stages, MediaSink
from .step_cache import CachedPack, PackCache, StepCachePolicy, skipped_block_rows
from .tiled_decode import TileRunner

logger = logging.getLogger(__name__)


class StagesElsewhere(RuntimeError):
    """A pipeline loaded without its conditioner and decoder models (``stages="remote"``) was asked to run them."""


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
        vae_dtype: str | torch.dtype | None = None,
    ) -> H3Pipeline:
        """Every component of the checkpoint directory, the transformer(s) with exactly ``backend``, and ``loras``.

        ``dtype``: the transformer's and text encoder's; ``vae_dtype``: both VAEs' (None: ``default_vae_dtype``,
        bf16 on GPUs as released, with diffusers' ``_keep_in_fp32_modules`` in fp32; fp32 on CPUs).

        ``stages="remote"``: conditioning and decoding run in stage deployments of their own, so only the
        transformer partition(s), the tokenizer and the schedulers are loaded (``load_denoiser_only``).
        """
        if stages not in STAGE_PLACEMENTS:
            raise ValueError(f"stages must be one of {', '.join(STAGE_PLACEMENTS)}, got {stages!r}")
        denoiser = H3Denoiser.load(checkpoint, backend, device=device, dtype=dtype, expected=expected, loras=loras)
        if stages == "remote":
            return cls.load_denoiser_only(denoiser, name)
        index = ckpt.CheckpointIndex(denoiser.directory)
        vae_dtype = vae_dtype or default_vae_dtype(device)
        components = dict(denoiser.transformers)
        components.update(load_stage_components(index, device, dtype, vae_dtype, text_encoder=True))
        schedulers = {n: components.pop(n) for n in ("scheduler", "audio_scheduler")}
        blocks = H3Stages({**components, **schedulers}, index.pipeline_config)
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
            vae=config_only_component(index, "vae"),
            audio_vae=config_only_component(index, "audio_vae"),
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
                models.update(held_modules(pipeline))
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
        """``request`` as it runs on ``adapter`` (``lora_spec.composition_key``: one adapter or several with weights;
        None: the base model): a request that sets no ``num_inference_steps`` gets a few-step adapter's; RequestError
        ("model"/"lora") for an adapter not served here, a list over the limits (``LoraSpecs.compose``, and the
        ranks over ``max_rank_per_pack``), RequestError("num_inference_steps") for steps an adapter was not distilled
        for."""
        given = "num_inference_steps" in request.model_fields_set
        composition = self.denoiser.loras.compose(adapter, request.num_inference_steps, given)
        self.check_rank(composition.uses)
        steps = composition.steps
        if steps is None or steps == request.num_inference_steps:
            return request
        return request.model_copy(update={"num_inference_steps": steps})

    def check_rank(self, uses: Sequence[tuple[int, float | None]]) -> None:
        """RequestError("lora") when one request's adapters alone are over the pack's rank budget."""
        budget = self.denoiser.loras.limits.max_rank_per_pack
        rank = self.denoiser.rank_of(slot for slot, _ in uses)
        if budget is not None and rank > budget:
            raise RequestError(
                "lora", f"the adapters' ranks sum to {rank}, over this deployment's max_rank_per_pack {budget}"
            )

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
        uses, shift = self.check_prepare(request, step_cache, adapter)
        state = prepare_shifted(stages, self._schedulers["scheduler"], self._preparing, request, self.rules, shift)
        return self._request_state(request, state, step_cache, uses, shift)

    def check_prepare(
        self, request: GenerationRequest, step_cache: StepCachePolicy | None, adapter: str | None
    ) -> tuple[tuple[tuple[int, float], ...], float | None]:
        """The request's adapters ((slot, weight) each) and its video schedule's shift (None: the released one), or
        the error that refuses it (RequestError for the model's rules and the adapters, ValueError for the step
        cache)."""
        self.rules.check(request)
        if step_cache is not None:
            self.check_step_cache(step_cache)
        composition = self.denoiser.loras.compose(adapter, request.num_inference_steps)  # checked again
        self.check_rank(composition.uses)
        partition = ckpt.PARTITIONS[request.task]
        served = self.denoiser.adapters.get(partition, {})
        for name, (slot, _) in zip(composition.names, composition.uses, strict=True):
            if slot in served and not served[slot].layers:
                adapted = [p for p, by_slot in self.denoiser.adapters.items() if by_slot[slot].layers]
                raise RequestError(
                    "model" if len(composition.names) == 1 else "lora",
                    f"adapter {name!r} adapts only the {', '.join(map(repr, adapted))} partition; a {request.task} "
                    f"request runs on {partition!r}, which it leaves as the base model (use the base model id)",
                )
        return composition.uses, composition.shift

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
        uses, shift = self.check_prepare(request, step_cache, adapter)
        return self._request_state(request, prepared.pipeline_state(self.denoiser.device), step_cache, uses, shift)

    def _request_state(
        self,
        request: GenerationRequest,
        state: PipelineState,
        step_cache: StepCachePolicy | None,
        uses: tuple[tuple[int, float], ...],
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
            uses,
        )

    def _forward_alone(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.denoiser.forward(pack)  # one rank: it has every row
        assert out is not None
        return out

    @torch.no_grad()
    def decode(
        self, state: RequestState, decode_tiles: TileRunner | None = None, sink: MediaSink | None = None
    ) -> GeneratedMedia:
        """The clip's media. ``decode_tiles``: who decodes the video VAE's tiles (``tiled_decode``: the same frames;
        the audio decoder runs beside them); None: this pipeline's VAE, tile after tile. ``sink``: its sound, then its
        frames chunk by chunk as the decode makes them (not with ``decode_tiles``)."""
        stages = self._local_stages("decode a request")
        frames, audio, sample_rate = stages.finish(
            state.state, state.video_rows, state.audio_rows, decode_tiles, sink=sink
        )
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
        for partition, partition_states in groups.items():
            for group in self._rank_groups(partition_states):
                # each distinct list of adapters is one composition id of the pack (0: the base model)
                ids: dict[tuple[tuple[int, float | None], ...], int] = {}
                slots = [ids.setdefault(s.adapters, len(ids) + 1) if s.adapters else 0 for s in group]
                pack = pack_documents([s.document() for s in group], partition, self.row_multiple, slots)
                pack.compositions = {i: uses for uses, i in ids.items()}
                if any(s.step_cache is not None for s in group):  # else exactly a deployment's pack without caching
                    pack = CachedPack.of(pack, PackCache([s.step_cache for s in group]))
                packs.append((group, pack))
        return packs

    def _rank_groups(self, states: list[RequestState]) -> list[list[RequestState]]:
        """``states`` in packs whose distinct adapters' ranks sum to at most ``max_rank_per_pack`` (one pack when
        there is no bound or they fit): a request is never over it alone (``check_rank``), so each pack runs."""
        budget = self.denoiser.loras.limits.max_rank_per_pack
        if budget is None:
            return [states]
        groups: list[tuple[list[RequestState], set[int]]] = []
        for state in states:
            mine = {slot for slot, _ in state.adapters}
            for members, slots in groups:  # the first pack it fits in
                if self.denoiser.rank_of(slots | mine) <= budget:
                    members.append(state)
                    slots |= mine
                    break
            else:
                groups.append(([state], mine))
        return [members for members, _ in groups]

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
