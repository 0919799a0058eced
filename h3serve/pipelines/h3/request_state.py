"""One request's state between its steps: its latents, both schedulers and its step-cache state, advanced by each
packed forward's velocities."""

from __future__ import annotations

import dataclasses
import logging

import torch
from diffusers import MiniMaxH3Scheduler
from diffusers.modular_pipelines import PipelineState

from . import checkpoint as ckpt
from .lora import BASE_SLOT
from .packing import Document
from .preview import clean_rows
from .request import GenerationRequest
from .step_cache import DocumentCache, StepCachePolicy

logger = logging.getLogger(__name__)


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
        adapters: tuple[tuple[int, float | None], ...] = (),
    ):
        """``video`` must already carry the request's shift (an adapter's; ``H3Pipeline.prepare`` sets it)."""
        self.request, self.state = request, state
        # its documents' adapters in every pack: (slot, weight; None the spec's scale) each; (): the base model
        self.adapters = adapters
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

    @property
    def adapter_slot(self) -> int:
        """The one adapter's slot (``BASE_SLOT``: none); ValueError for a composition of several."""
        if len(self.adapters) > 1:
            raise ValueError(f"the request composes {len(self.adapters)} adapters; it has no single slot")
        return self.adapters[0][0] if self.adapters else BASE_SLOT

    @adapter_slot.setter
    def adapter_slot(self, slot: int) -> None:
        """Run on adapter ``slot`` alone at its spec's scale (``BASE_SLOT``: the base model)."""
        self.adapters = () if slot == BASE_SLOT else ((slot, None),)

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
