"""Rank 0's warm-ups before the replica is ready, so that no user pays a first call.

``WarmUps`` runs them on the executor's group and model thread, before the engine's first submit: one packed forward
of the smallest request on every rank (``forwards``; then one per LoRA adapter, and one for an adapter loaded while
serving: ``adapter``); on CUDA the same padded to the row budget (``peak``), with the step cache's peak
(``step_cache``), every rank's device measured against the memory plan; then, when enabled, the warm-up clip (``clip``).

The warm-up clip is one whole request at the served size through the replica's own path. Kernels are picked per
shape on their first call (cuDNN's convolutions and cuBLAS's GEMMs on a GPU, oneDNN's primitives on a CPU), and the
encoder starts on its first clip. The smallest request's warm-up (``forwards``) shares no shape with a user's clip
past the transformer's, so without this the first user pays for the VAE's and the encoder's first calls at the
served size. This runs the request a user gets by default (the model's canvas and shortest clip, or
``limits.warmup_clip``'s size) the way ``Engine`` runs one: prepared by the stages, every step on every rank on the
model thread, decoded by the stages (streamed when they stream, tiles over the ranks with ``decode_on_ranks``, one
decoder replica with stages of their own) and encoded to MP4. Its ticket never enters the request table: no event,
no metric and no count sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from h3serve.pipelines.h3 import EncodedMedia, GeneratedMedia, GenerationRequest, RequestError, RequestState
from h3serve.pipelines.h3.memory import MeasuredUse, check_measured
from h3serve.pipelines.h3.packing import Document, pack_documents
from h3serve.pipelines.h3.pipeline import H3Pipeline
from h3serve.pipelines.h3.step_cache import CachedPack, DocumentCache, PackCache

from .contract import EngineLimits
from .executor import Executor
from .requests import Ticket
from .stage_worker import Stages
from .worker_group import WorkerGroup

logger = logging.getLogger(__name__)


class ClipWarmUpRefused(ValueError):
    """``limits.warmup_clip`` names a request the served model refuses: the replica does not start."""


@dataclasses.dataclass(frozen=True)
class StepCacheWarmUp:
    """The step cache's forwards at the row budget (``WarmUps.step_cache``): what they held at their peak."""

    documents: int  # caching copies of the warm-up document in the pack
    caching_rows: int  # their rows (the rest of the budget: padding)
    held_bytes: int  # rank 0's residuals held by them when the third forward ran (every rank holds as many)
    skipped_block_rows: int  # rows x blocks the third forward skipped: the other copies ran on a sub-pack
    seconds: float  # the three forwards


@dataclasses.dataclass(frozen=True)
class PeakWarmUp:
    """The forwards at the row budget: the pack's rows, each forward's seconds by adapter, every rank's device."""

    rows: int
    by_adapter: dict[str | None, float]
    measured: list[MeasuredUse | None]  # by rank (None: a CPU rank, nothing to measure)
    checked: list[str]  # one line per rank against the plan (empty: nothing measured, or no plan)
    step_cache: StepCacheWarmUp | None = None  # when the deployment offers step-cache tiers


@dataclasses.dataclass(frozen=True)
class WarmUp:
    seconds: float  # the base model's forward
    rows: int  # its pack's rows, padding included
    padding_rows: int
    by_adapter: dict[str | None, float]  # each forward's seconds by adapter (None: the base model)
    peak: PeakWarmUp | None = None  # at the row budget (``WarmUps.peak``)


@dataclasses.dataclass(frozen=True)
class ClipWarmUp:
    """What the warm-up clip ran and how long each part took (wall clock, seconds)."""

    frames: tuple[int, ...] | None  # the decoded clip's (F, H, W) (None: a decoder stage encoded it)
    rows: int  # its pack's rows (padding included)
    forwards: int
    streamed: bool  # decoded as a fragmented MP4 stream (the path a followed video takes)
    prepare_s: float
    steps_s: float
    decode_s: float
    encode_s: float
    mp4_bytes: int


class WarmUps:
    """The warm-ups of one engine, on its executor's group (a replaced one's too) and model thread."""

    def __init__(self, executor: Executor, limits: EngineLimits):
        self.executor = executor
        self.step_cache_tiers = dict(limits.step_cache.tiers)  # the warm-up at the row budget reaches their peak
        for name, policy in limits.step_cache.tiers.items():  # refused here too: the deploy args refuse them earlier
            try:
                self.pipeline.check_step_cache(policy)
            except ValueError as e:
                raise ValueError(f"engine.step_cache.tiers.{name}: {e}") from None
        self.state: RequestState | None = None  # the warm-up's request, prepared (``forwards``)

    @property
    def pipeline(self) -> H3Pipeline:
        return self.executor.pipeline

    @property
    def group(self) -> WorkerGroup:
        return self.executor.group

    def request(self) -> GenerationRequest:
        """The smallest request the model's rules allow: the shortest clip on the smallest canvas, one step."""
        rules, side = self.pipeline.rules, self.pipeline.rules.canvas_multiple
        return GenerationRequest(
            prompt="warm-up", width=side, height=side, num_frames=rules.min_frames, num_inference_steps=2
        )

    def forwards(self, state: RequestState | None, peak_rows: int | None = None) -> WarmUp:
        """One packed forward of ``state`` (None: ``request()`` prepared here) on every rank, then one more per
        LoRA adapter with its documents on the adapter's slot (its GEMM shapes and the widened timestep path land
        here, not on its first request). ``peak_rows``: then the same at that many rows (``peak``)."""
        started = time.perf_counter()
        state = self.pipeline.prepare(self.request()) if state is None else state
        self.state = state  # kept: a run-time adapter's warm-up forward runs it again (``adapter``)
        ((_, pack),) = self.pipeline.packs([state])
        prepared = time.perf_counter()
        self.group(pack)
        seconds = time.perf_counter() - prepared
        self.executor.step_s.value = seconds
        logger.info(
            "warm-up: prepare %.2f s, one packed forward of %d rows on %d ranks %.2f s",
            prepared - started,
            pack.total_rows,
            self.group.sp_degree,
            seconds,
        )
        by_adapter: dict[str | None, float] = {None: seconds}
        slots = self.pipeline.denoiser.loras.slots
        own_slot = state.adapter_slot
        try:
            for name, slot in slots.items():
                state.adapter_slot = slot
                ((_, adapter_pack),) = self.pipeline.packs([state])
                started = time.perf_counter()
                self.group(adapter_pack)
                by_adapter[name] = time.perf_counter() - started
        finally:
            state.adapter_slot = own_slot
        if slots:
            logger.info(
                "warm-up through each LoRA adapter: %s",
                ", ".join(f"{name} {by_adapter[name]:.2f} s" for name in slots),
            )
        peak = self.peak(state, peak_rows) if peak_rows else None
        return WarmUp(seconds, pack.total_rows, pack.padding_rows, by_adapter, peak)

    def adapter(self, slot: int) -> float | None:
        """One packed forward of the warm-up request on adapter ``slot`` on every rank (a run-time adapter, before it
        is served, as ``forwards`` does each deploy-time one); its seconds, or None when no warm-up ran
        (``engine.warmup`` off). The caller holds the engine between steps (``Engine.model_lock``)."""
        state = self.state
        if state is None:
            return None
        own_slot = state.adapter_slot
        try:
            state.adapter_slot = slot
            ((_, pack),) = self.pipeline.packs([state])
            started = time.perf_counter()
            self.group(pack)
            return time.perf_counter() - started
        finally:
            state.adapter_slot = own_slot

    def peak(self, state: RequestState, max_rows: int) -> PeakWarmUp:
        """The first pack at the row budget is the warm-up's, not a user's: ``state``'s document padded to
        ``max_rows`` (one padding document: every block runs on that many rows, as a full pack does) through every
        rank, on the base model and then on each LoRA adapter's slot (the deltas' activations); then every rank's
        device measured (CUDA: ``torch.cuda.mem_get_info``, logged) and checked against the deployment's memory
        plan (``spec.memory_plan``): ``memory.PlanExceeded``, naming the rank, the plan and the measured bytes, when
        a rank is past its plan by more than the reserve (the replica refuses to serve). With step-cache tiers the
        plan counts the cache's tensors on every row, so the step cache's peak runs too (``step_cache``)
        before anything is measured."""
        document = state.document()
        # [rows]: the document, then padding up to the budget (a document past the budget: alone, padded for the SP)
        rows = max_rows - max_rows % self.group.sp_degree
        if document.length > rows:
            rows = self.group.sp_degree
        self.group.device_memory(reset=True)  # each rank's peak count from here
        by_adapter: dict[str | None, float] = {}
        total = 0
        runs: dict[str | None, int] = {None: state.adapter_slot}
        runs.update(self.pipeline.denoiser.loras.slots)
        for name, slot in runs.items():
            pack = pack_documents([document], state.partition, rows, [slot])
            started = time.perf_counter()
            self.group(pack)
            by_adapter[name] = time.perf_counter() - started
            total = pack.total_rows
            del pack
        slots = list(runs.values())  # the step cache's copies take the base model and each adapter in turn
        cached = self.step_cache(document, state.partition, rows, slots) if self.step_cache_tiers else None
        measured = self.group.device_memory()
        logger.info(
            "warm-up at the row budget: %d rows on %d rank(s), %s%s",
            total,
            self.group.sp_degree,
            ", ".join(f"{'base' if n is None else n} {s:.2f} s" for n, s in by_adapter.items()),
            ""
            if cached is None
            else f"; step cache {cached.documents} caching document(s), {cached.caching_rows} rows, "
            f"{cached.held_bytes} residual bytes held, {cached.seconds:.2f} s",
        )
        checked: list[str] = []
        uses = [use for use in measured if use is not None]
        if uses:
            planned = self.group.spec.memory_plan
            if planned is None:  # measured, with nothing to check it against: the operator still sees it
                for use in uses:
                    logger.info(
                        "rank %d: %d of %d bytes in use after the warm-up at the row budget (tensors' peak %d); "
                        "no memory plan to check it against",
                        use.rank,
                        use.used_bytes,
                        use.total_bytes,
                        use.peak_tensor_bytes,
                    )
            else:
                checked = check_measured(planned, uses)  # raises PlanExceeded
                for line in checked:
                    logger.info("memory plan measured: %s", line)
        return PeakWarmUp(total, by_adapter, measured, checked, cached)

    def step_cache(
        self, document: Document, partition: str, rows: int, slots: list[int] | None = None
    ) -> StepCacheWarmUp:
        """The step cache's peak at the row budget, on every rank (what ``memory.activation_row_cost(step_cache=True)``
        plans per row): copies of ``document`` fill the ``rows`` of the budget, each with its own cache state, the
        tiers' ``fn_blocks``/``bn_blocks`` in turn (documents that decide at different blocks: under Ulysses h_0 stays
        gathered beside a sub-pack), and run three forwards: every copy fills its residuals; every copy computes
        again beside the residuals it holds (held + pending, h_0 kept, the gathered rows under Ulysses); then half
        the copies skip, so the others' middle blocks run on a sub-pack beside the whole pack. ``slots``: the copies
        take these adapter slots in turn (LoRA's deltas follow their rows into the sub-pack). The states are freed
        after (the workers drop theirs with the next pack, as for any finished request)."""
        started = time.perf_counter()
        copies = max(1, rows // document.length)
        tiers = list(self.step_cache_tiers.values())
        caches = []
        for i in range(copies):
            tier = tiers[i % len(tiers)]
            # even copies skip from the third step on (nothing under 1e9 changes that much), odd ones always compute
            threshold = 1e9 if i % 2 == 0 and copies > 1 else 0.0
            policy = tier.model_copy(update=dict(threshold=threshold, warmup_steps=2, max_consecutive_skips=10**6))
            caches.append(DocumentCache(policy))
        slots = slots or [0]
        pack = pack_documents([document] * copies, partition, rows, [slots[i % len(slots)] for i in range(copies)])
        held = skipped = 0
        try:
            for _ in range(3):
                cached = CachedPack.of(pack, PackCache(list(caches)))
                self.group(cached)
                held = max(held, sum(cache.residual_bytes for cache in caches))
                assert cached.step_cache is not None
                skipped = cached.step_cache.skipped_block_rows
        finally:
            for cache in caches:
                cache.free()
        return StepCacheWarmUp(copies, copies * document.length, held, skipped, time.perf_counter() - started)

    async def clip(self, request: GenerationRequest, stages: Stages) -> ClipWarmUp:
        """Run ``request`` through prepare, its steps, the decode and the MP4, discarding the clip. Raises
        ClipWarmUpRefused when the model refuses the request; any other failure is the replica's (it does not start)."""
        try:
            rows = self.pipeline.validate(request)
        except RequestError as e:
            raise ClipWarmUpRefused(f"engine.warmup_clip: the served model refuses it: {e}") from None
        loop = asyncio.get_running_loop()
        ticket = Ticket("warm-up-clip", request, rows, loop, None)  # never in the request table
        ticket.output = "mp4"  # a decoder stage encodes it, as it does a user's video
        started = time.perf_counter()
        ticket.state = await stages.prepare(ticket)
        prepared = time.perf_counter()
        forwards, pack_rows = await self.executor.denoise(ticket.prepared)
        stepped = time.perf_counter()
        streamed = stages.streams()
        chunks: list[int] = []
        media = await stages.decode(ticket, (lambda data, _frames: chunks.append(len(data))) if streamed else None)
        decoded = time.perf_counter()
        mp4 = media.data if isinstance(media, EncodedMedia) else await asyncio.to_thread(media.mp4)
        encoded = time.perf_counter()
        warm = ClipWarmUp(
            frames=tuple(int(n) for n in media.frames.shape[:3]) if isinstance(media, GeneratedMedia) else None,
            rows=pack_rows,
            forwards=forwards,
            streamed=bool(chunks),
            prepare_s=prepared - started,
            steps_s=stepped - prepared,
            decode_s=decoded - stepped,
            encode_s=encoded - decoded,
            mp4_bytes=len(mp4),
        )
        logger.info(
            "warm-up clip %s: prepare %.2f s, %d forwards of %d rows %.2f s, decode %.2f s%s, MP4 %.2f s",
            "x".join(map(str, warm.frames)) if warm.frames else "(decoded by the decoder stage)",
            warm.prepare_s,
            forwards,
            pack_rows,
            warm.steps_s,
            warm.decode_s,
            " (streamed)" if warm.streamed else "",
            warm.encode_s,
        )
        return warm
