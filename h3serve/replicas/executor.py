"""The executor: runs one step's batch on the SP worker group and reports what happened, nothing more.

vLLM v1's Executor in h3serve's terms. ``step(batch)`` packs the batch (one pack per transformer partition: Ref2VA
requests use their own, and a failure in one never touches the other), runs each pack's forward on the engine's one
model thread and returns a ``StepOutcome``: the forwards that ran (each request's share applied, or its own error),
the requests that failed on their own, the attempts that failed, and the SP groups replaced. It never touches a
future, a stat or an observer: the engine core applies the outcome.

Failures stay with the requests that cause them. A pack whose data fails (``PackFailed``: every rank left the step at
its agreement, the group is healthy) is retried in halves, down to single requests, so only a request that fails on
its own fails and every other request of the pack still advances that step exactly once. A failed attempt keeps only
a description of its error, so its pack and activations are freed before the halves run. A step that breaks the SP
group (``WorkerGroupBroken``) gets a new group (``h3serve.replicas.supervisor``) and its requests run that step again on
it,
each alone: a request in the steps of two groups that broke in a row fails naming the cause. A group that cannot be
replaced ends the step with ``StepOutcome.broken``: the engine stops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from h3serve.pipelines.h3 import GenerationRequest, RequestState, StepStats
from h3serve.pipelines.h3.memory import MeasuredUse, check_measured
from h3serve.pipelines.h3.packing import Document, Pack, pack_documents
from h3serve.pipelines.h3.step_cache import CachedPack, DocumentCache, PackCache, skipped_block_rows

from .contract import EngineLimits
from .cuda_faults import fatal
from .progress import Ema
from .requests import Ticket
from .supervisor import GroupSupervisor
from .worker_group import PackFailed, WorkerGroup, WorkerGroupBroken, describe, formatted

logger = logging.getLogger(__name__)

T = TypeVar("T")
Holders = Callable[[], Sequence[Ticket]]  # the requests whose states may hold step caches (RequestTable.with_states)


@dataclasses.dataclass(frozen=True)
class Forward:
    """One packed forward that ran: its requests in pack order, and each one's error applying its share (None:
    it advanced one step)."""

    tickets: tuple[Ticket, ...]
    errors: tuple[Exception | None, ...]
    stats: StepStats
    seconds: float


@dataclasses.dataclass
class StepOutcome:
    """What one step did, in the order it happened."""

    forwards: list[Forward] = dataclasses.field(default_factory=list)
    failed: list[tuple[Ticket, Exception, str]] = dataclasses.field(default_factory=list)  # (request, error, reason)
    failed_steps: list[str] = dataclasses.field(default_factory=list)  # "pack" | "worker_group", per failed attempt
    replaced: int = 0  # SP groups replaced
    broken: WorkerGroupBroken | None = None  # a broken group that could not be replaced: the engine stops

    def fail(self, ticket: Ticket, error: Exception, reason: str) -> None:
        self.failed.append((ticket, error, reason))

    def has_failed(self, ticket: Ticket) -> bool:
        return any(t is ticket for t, _, _ in self.failed)


@dataclasses.dataclass(frozen=True)
class StepCacheWarmUp:
    """The step cache's forwards at the row budget (``Executor.warm_up_step_cache``): what they held at their peak."""

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
    peak: PeakWarmUp | None = None  # at the row budget (``Executor.warm_up_peak``)


class Executor:
    """Rank 0's side of the SP group: the model thread, the group (replaced when a step breaks it), the step time."""

    def __init__(self, group: WorkerGroup, limits: EngineLimits):
        self.supervisor = GroupSupervisor(group)
        self.pipeline = group.pipeline
        self.device = self.pipeline.denoiser.device
        self._timeout = (limits.step_timeout_min_s, limits.step_timeout_factor)
        self.step_cache_tiers = dict(limits.step_cache.tiers)  # the warm-up at the row budget reaches their peak
        for name, policy in limits.step_cache.tiers.items():  # refused here too: the deploy args refuse them earlier
            try:
                self.pipeline.check_step_cache(policy)
            except ValueError as e:
                raise ValueError(f"engine.step_cache.tiers.{name}: {e}") from None
        self.step_s = Ema(0.2)  # the expected step time: warm-up, then an EMA of forwards (the watchdog's clock)
        self.progress_at = time.monotonic()  # when a forward last finished, or a group was replaced
        # one thread for all model work: steps must not interleave on the device
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-engine")
        self.warm_state: RequestState | None = None  # the warm-up's request, prepared (``warm_up``)

    @property
    def group(self) -> WorkerGroup:
        return self.supervisor.group

    @property
    def step_bound_s(self) -> float:
        """How long one step may take on every rank before it breaks the SP group (sp_degree > 1)."""
        minimum, factor = self._timeout
        return max(minimum, factor * (self.step_s.value or 0.0))

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Model work on the engine's one thread."""
        return asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    # -- warm-up ------------------------------------------------------------------------------
    def warmup_request(self) -> GenerationRequest:
        """The smallest request the model's rules allow: the shortest clip on the smallest canvas, one step."""
        rules, side = self.pipeline.rules, self.pipeline.rules.canvas_multiple
        return GenerationRequest(
            prompt="warm-up", width=side, height=side, num_frames=rules.min_frames, num_inference_steps=2
        )

    def warm_up(self, state: RequestState | None, peak_rows: int | None = None) -> WarmUp:
        """One packed forward of ``state`` (None: ``warmup_request()`` prepared here) on every rank, then one more per
        LoRA adapter with its documents on the adapter's slot (its GEMM shapes and the widened timestep path land
        here, not on its first request). ``peak_rows``: then the same at that many rows (``warm_up_peak``)."""
        started = time.perf_counter()
        state = self.pipeline.prepare(self.warmup_request()) if state is None else state
        self.warm_state = state  # kept: a run-time adapter's warm-up forward runs it again (``warm_up_adapter``)
        ((_, pack),) = self.pipeline.packs([state])
        prepared = time.perf_counter()
        self.group(pack)
        seconds = time.perf_counter() - prepared
        self.step_s.value = seconds
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
        peak = self.warm_up_peak(state, peak_rows) if peak_rows else None
        return WarmUp(seconds, pack.total_rows, pack.padding_rows, by_adapter, peak)

    def warm_up_adapter(self, slot: int) -> float | None:
        """One packed forward of the warm-up request on adapter ``slot`` on every rank (a run-time adapter, before it
        is served, as ``warm_up`` does each deploy-time one); its seconds, or None when no warm-up ran
        (``engine.warmup`` off). The caller holds the engine between steps (``Engine.model_lock``)."""
        state = self.warm_state
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

    def warm_up_peak(self, state: RequestState, max_rows: int) -> PeakWarmUp:
        """The first pack at the row budget is the warm-up's, not a user's: ``state``'s document padded to
        ``max_rows`` (one padding document: every block runs on that many rows, as a full pack does) through every
        rank, on the base model and then on each LoRA adapter's slot (the deltas' activations); then every rank's
        device measured (CUDA: ``torch.cuda.mem_get_info``, logged) and checked against the deployment's memory
        plan (``spec.memory_plan``): ``memory.PlanExceeded``, naming the rank, the plan and the measured bytes, when
        a rank is past its plan by more than the reserve (the replica refuses to serve). With step-cache tiers the
        plan counts the cache's tensors on every row, so the step cache's peak runs too (``warm_up_step_cache``)
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
        cached = self.warm_up_step_cache(document, state.partition, rows, slots) if self.step_cache_tiers else None
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

    def warm_up_step_cache(
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

    # -- one step -----------------------------------------------------------------------------
    async def step(
        self,
        batch: Sequence[Ticket],
        holders: Holders,
        before: Callable[[tuple[Ticket, ...]], None] | None = None,
    ) -> StepOutcome:
        """One step for ``batch`` (empty: only a group broken outside a step is replaced). ``holders``: the requests
        whose states a replaced group's lost step caches concern. ``before``: run on the model thread before the
        forwards (``StepGate.before_forward``); its error is the engine's, raised."""
        outcome = StepOutcome()
        try:
            if self.group.broken_reason:  # broken outside a step (a health check found a rank gone): nobody's doing
                await self._replace(WorkerGroupBroken(self.group.broken_reason, recoverable=True), outcome, holders)
            if before is not None:
                await self.run_blocking(before, tuple(batch))
            partitions: dict[str, list[Ticket]] = {}
            for ticket in batch:
                partitions.setdefault(ticket.prepared.partition, []).append(ticket)
            for tickets in partitions.values():
                await self._advance(tickets, outcome, holders)
        except WorkerGroupBroken as e:  # it could not be replaced: only a new replica helps
            outcome.broken = e
        return outcome

    async def _advance(self, tickets: list[Ticket], outcome: StepOutcome, holders: Holders) -> None:
        """One step for ``tickets``; a pack whose data fails is retried in halves down to single requests; a step that
        breaks the SP group is run again on its replacement, each request alone."""
        tickets = [t for t in tickets if not t.future.done() and not outcome.has_failed(t)]
        if not tickets:
            return
        try:
            error = await self._try(tickets, outcome)
        except WorkerGroupBroken as broken:  # every communicator aborted; raised on when it cannot be replaced
            await self._replace(broken, outcome, holders)
            await self._after_break(tickets, broken.reason, outcome, holders)
            return
        if error is None:
            return
        outcome.failed_steps.append("pack")
        await self.run_blocking(self._release_failed_attempt)  # before the retry: the failed forward's memory
        if len(tickets) == 1:
            (ticket,) = tickets
            logger.error("request %s failed on its own: %s", ticket.id, error)
            outcome.fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
            return
        logger.warning("a pack of requests %s failed (%s); retrying them in halves", [t.id for t in tickets], error)
        half = len(tickets) // 2
        await self._advance(tickets[:half], outcome, holders)
        await self._advance(tickets[half:], outcome, holders)

    async def _after_break(self, tickets: list[Ticket], reason: str, outcome: StepOutcome, holders: Holders) -> None:
        """The requests of a step that broke the SP group: each runs the step again alone, on the new group, so a
        request that breaks a second group in a row is the cause and fails naming it; the others go on."""
        for ticket in tickets:
            ticket.breaks += 1
            if ticket.breaks >= 2 and not ticket.future.done():
                error = RuntimeError(
                    f"request {ticket.id} failed: steps it was in broke {ticket.breaks} SP groups in a row "
                    f"(last: {reason})"
                )
                outcome.fail(ticket, error, "worker_group")
        for ticket in tickets:
            await self._advance([ticket], outcome, holders)

    async def _replace(self, broken: WorkerGroupBroken, outcome: StepOutcome, holders: Holders) -> None:
        """A new SP group in place of the broken one (built on the model thread); raises WorkerGroupBroken when it
        cannot (rank 0 stuck, or the replacement failed to build)."""
        outcome.failed_steps.append("worker_group")
        if not broken.recoverable:  # rank 0's thread is stuck in the step: the model thread will not take the work
            self.supervisor.fail(broken)
        await self.supervisor.recover(broken, self.run_blocking)  # its loads hold no thread: only its rendezvous
        # The lost communicator's ranks held every caching request's residuals too; the new ones start without:
        # each caching request computes its next step in full (no request is ever fed a residual one rank lacks).
        for ticket in holders():
            if ticket.state is not None:
                ticket.state.free_step_cache()
        outcome.replaced += 1
        self.progress_at = time.monotonic()

    def _release_failed_attempt(self) -> None:
        """On the model thread, after a failed attempt: its pack and activations go before any retry runs (cycles
        through its frames included); on CUDA the cached blocks go back too, so an attempt that ran out of memory
        does not leave its halves less room than it had."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    async def _try(self, tickets: list[Ticket], outcome: StepOutcome) -> str | None:
        """Pack, forward and advance ``tickets`` by one step; what failed (a description: the exception's traceback
        would hold the failed forward's frames, pack and activations), or None. Raises WorkerGroupBroken."""
        states = [t.prepared for t in tickets]
        try:
            ((states, pack),) = await self.run_blocking(self.pipeline.packs, states)
        except Exception as e:  # the documents do not even pack together: their data (unless the device is poisoned)
            self._raise_if_fatal(e)
            logger.warning("requests %s do not pack together\n%s", [t.id for t in tickets], formatted(e))
            return describe(e)
        started = time.perf_counter()
        try:
            out = await self.group.forward_async(pack, self.run_blocking, self.step_bound_s)
            errors = await self.run_blocking(self._apply, states, pack, out)
        except PackFailed as e:
            return str(e)
        except WorkerGroupBroken:
            raise
        except Exception as e:
            self._raise_if_fatal(e)
            logger.warning("requests %s: their step failed\n%s", [t.id for t in tickets], formatted(e))
            return describe(e)
        seconds = time.perf_counter() - started
        self.progress_at = time.monotonic()
        self.step_s.add(seconds)
        for ticket in tickets:
            ticket.breaks = 0
        stats = StepStats(len(states), pack.total_rows, pack.padding_rows, skipped_block_rows(pack))
        outcome.forwards.append(Forward(tuple(tickets), tuple(errors), stats, seconds))
        return None

    async def denoise(self, state: RequestState) -> tuple[int, int]:
        """Every step of ``state`` alone on every rank, as a pack of one (the warm-up clip); its forwards and its
        pack's rows. Raises what the step raised (PackFailed, WorkerGroupBroken, the state's own error)."""
        forwards = rows = 0
        while not state.done:
            ((states, pack),) = await self.run_blocking(self.pipeline.packs, [state])
            out = await self.group.forward_async(pack, self.run_blocking, self.step_bound_s)
            (error,) = await self.run_blocking(self._apply, states, pack, out)
            if error is not None:
                raise error
            forwards, rows = forwards + 1, pack.total_rows
        return forwards, rows

    def _raise_if_fatal(self, error: BaseException) -> None:
        """A CUDA-fatal error on rank 0 (packing, applying a step's output) is this process's, not the pack's data:
        WorkerGroupBroken, not recoverable here, so the engine stops and the replica is replaced."""
        why = fatal(error)
        if why is not None:
            reason = f"rank 0 hit a CUDA-fatal error: its process is lost: {why}"
            self.group.mark_broken(reason)
            raise WorkerGroupBroken(reason, recoverable=False) from None

    def _apply(
        self, states: list[RequestState], pack: Pack, out: tuple[torch.Tensor, torch.Tensor]
    ) -> list[Exception | None]:
        """On the model thread: advance each state by its share of the forward; each one's error, or None."""
        errors: list[Exception | None] = []
        for state, (video, audio) in zip(states, pack.split(*out), strict=True):
            try:
                # each applies its own velocities: one bad output never half-advances another
                state.advance(video, audio)
                errors.append(None)
            except Exception as e:
                errors.append(e.with_traceback(None))  # its frames (and the forward's tensors) go now
        if self.device.type == "cuda":
            # the step is finished on the device before anyone reads its latents (a decode on the stage
            # stream) or frees a state whose memory the stage stream could then reuse
            torch.cuda.current_stream(self.device).synchronize()
        return errors
