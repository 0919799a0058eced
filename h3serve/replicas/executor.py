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

from h3serve.pipelines.h3 import RequestState, StepStats
from h3serve.pipelines.h3.packing import Pack
from h3serve.pipelines.h3.step_cache import skipped_block_rows

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


class Executor:
    """Rank 0's side of the SP group: the model thread, the group (replaced when a step breaks it), the step time."""

    def __init__(self, group: WorkerGroup, limits: EngineLimits):
        self.supervisor = GroupSupervisor(group)
        self.pipeline = group.pipeline
        self.device = self.pipeline.denoiser.device
        self._timeout = (limits.step_timeout_min_s, limits.step_timeout_factor)
        self.step_s = Ema(0.2)  # the expected step time: warm-up, then an EMA of forwards (the watchdog's clock)
        self.progress_at = time.monotonic()  # when a forward last finished, or a group was replaced
        # one thread for all model work: steps must not interleave on the device
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-engine")

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
        """Every step of ``state`` alone on every rank, as a pack of one (``WarmUps.clip``); its forwards and its
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
