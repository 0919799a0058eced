"""Step-level continuous batching: every step packs all active requests into one varlen forward.

Requests wait in a bounded queue (a full queue is refused at once), join the running pack at the
next step once diffusers' blocks prepared them, advance one denoising step per forward, and leave
when done or cancelled. Mixed sizes, tasks and step indices share each forward (Ref2VA requests,
which use their own transformer partition, share a second one).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import time
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from pipelines.h3 import GeneratedMedia, GenerationRequest, RequestError, RequestState, StepStats

from .worker_group import WorkerGroup, WorkerGroupBroken

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is closed or its worker group broke; the replica must be replaced (HTTP 503)."""


class EngineLimits(BaseModel):
    """The bounds of one replica's engine (the ``engine:`` block of the deploy args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(default=64, ge=1, description="waiting requests per replica; one more gets HTTP 503")
    max_active: int = Field(default=16, ge=1, description="requests in the running pack")
    max_rows_per_step: int = Field(
        default=16384,
        ge=64,
        description="rows of one packed forward: text, conditioning, audio and video rows of every request in it",
    )


class EngineObserver(Protocol):
    """Where the engine reports what it does (deploy wires this to Prometheus)."""

    def on_step(self, stats: StepStats, seconds: float) -> None: ...

    def on_queue(self, waiting: int, active: int) -> None: ...


@dataclasses.dataclass
class EngineStats:
    forwards: int = 0
    rows: int = 0
    padding_rows: int = 0
    completed: int = 0
    failed_steps: int = 0


class Ticket:
    """A submitted request: its future, progress and cost."""

    def __init__(self, request_id: str, request: GenerationRequest, rows: int, loop: asyncio.AbstractEventLoop):
        self.id, self.request, self.rows = request_id, request, rows
        self.future: asyncio.Future[GeneratedMedia] = loop.create_future()
        self.state: RequestState | None = None
        self.forwards = 0  # how many packed forwards this request was part of
        self.changed = asyncio.Event()

    @property
    def progress(self) -> tuple[int, int]:
        if self.state is None:
            return 0, self.request.num_inference_steps - 1  # the schedule's model evaluations
        return self.state.progress

    @property
    def prepared(self) -> RequestState:
        """The state of a ticket in the pack (diffusers' blocks ran for it when it joined)."""
        assert self.state is not None, f"{self.id} has not joined the pack"
        return self.state

    @property
    def cancelled(self) -> bool:
        return self.future.done() and self.future.cancelled()


class Engine:
    def __init__(self, group: WorkerGroup, limits: EngineLimits | None = None, observer: EngineObserver | None = None):
        self.group, self.pipeline, self.observer = group, group.pipeline, observer
        self.limits = limits or EngineLimits()
        self.stats = EngineStats()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._active: list[Ticket] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._ids = itertools.count()
        # one thread for all model work: steps must not interleave on the device
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-engine")

    # -- API ------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, request_id: str | None = None) -> Ticket:
        """Queue a request, or raise at once: RequestError (bad request), QueueFull, EngineStopped."""
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        rows = self.validate(request)
        self._drop_finished_waiting()
        if len(self._waiting) >= self.limits.max_queue:
            raise QueueFull(f"queue is full ({self.limits.max_queue} waiting); retry later")
        loop = asyncio.get_running_loop()
        ticket = Ticket(request_id or f"req-{next(self._ids)}", request, rows, loop)
        self._waiting.append(ticket)
        self._report_queue()
        if self._task is None:
            self._task = loop.create_task(self._run())
        self._wake.set()
        return ticket

    def validate(self, request: GenerationRequest) -> int:
        """About the rows the request adds to a pack; RequestError if the model or the budget cannot take it."""
        rows = self.pipeline.validate(request)
        self._check_budget(rows)
        return rows

    def _check_budget(self, rows: int) -> None:
        if rows > self.limits.max_rows_per_step:
            raise RequestError(
                "size",
                f"request needs {rows} rows per step, above this replica's budget of "
                f"{self.limits.max_rows_per_step}; ask for fewer pixels, frames or prompt tokens",
            )

    async def generate(self, request: GenerationRequest, request_id: str | None = None) -> GeneratedMedia:
        ticket = self.submit(request, request_id)
        try:
            return await ticket.future
        except asyncio.CancelledError:  # the caller went away: leave the pack
            self.cancel(ticket)
            raise

    def cancel(self, ticket: Ticket) -> None:
        if not ticket.future.done():
            ticket.future.cancel()
        self._drop_finished_waiting()
        self._report_queue()
        self._wake.set()

    @property
    def queue_depth(self) -> tuple[int, int]:
        return len(self._waiting), len(self._active)

    def check_health(self) -> None:
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        self.group.check_health()

    async def close(self, reason: str = "engine closed") -> None:
        self._stop_reason = reason
        self._fail_all(EngineStopped(reason))
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the step loop --------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stop_reason:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._join_waiting()
                await self._step_once()
            except WorkerGroupBroken as e:
                self._stop_reason = f"SP worker group failed: {e}"
                self._fail_all(EngineStopped(self._stop_reason))
                return
            except Exception:  # one bad step fails its pack, never the loop or the requests still waiting
                logger.exception("engine step failed")
                self.stats.failed_steps += 1
                self._fail_all(RuntimeError("generation failed; see the replica log"), only_active=True)

    async def _join_waiting(self) -> None:
        """Prepare waiting requests (diffusers' blocks before the loop) into the pack, oldest first."""
        loop = asyncio.get_running_loop()
        while self._waiting and len(self._active) < self.limits.max_active:
            ticket = self._waiting.popleft()
            if ticket.future.done():
                continue
            try:
                ticket.state = await loop.run_in_executor(self._executor, self.pipeline.prepare, ticket.request)
                ticket.rows = ticket.state.rows
                self._check_budget(ticket.rows)  # the estimate at submit was short (keyframe vision tokens)
            except Exception as e:
                if not ticket.future.done():
                    ticket.future.set_exception(e)
                continue
            self._active.append(ticket)
        self._report_queue()

    def _select(self) -> list[Ticket]:
        """Oldest first, within the row budget."""
        self._active = [t for t in self._active if not t.future.done()]
        batch, rows = [], 0
        for ticket in self._active:
            if rows + ticket.rows <= self.limits.max_rows_per_step:
                batch.append(ticket)
                rows += ticket.rows
        return batch

    async def _forward(self, pack):
        """One packed forward on every rank; a dead worker fails it at once, not at the collective timeout."""
        loop = asyncio.get_running_loop()
        refs = self.group.launch(pack)
        local = loop.run_in_executor(self._executor, self.group.forward_rank0, pack)
        watchers = [asyncio.wrap_future(ref.future()) for ref in refs]
        done, _ = await asyncio.wait([local, *watchers], return_when=asyncio.FIRST_EXCEPTION)
        for future in done:
            if future is not local and future.exception() is not None:
                self.group.mark_broken(f"an SP worker failed mid-step: {future.exception()}")
                raise WorkerGroupBroken(self.group.broken_reason) from future.exception()
        out = await local
        await asyncio.gather(*watchers)
        return out

    async def _step_once(self) -> None:
        batch = self._select()
        if not batch:
            return
        loop = asyncio.get_running_loop()
        by_state = {id(t.prepared): t for t in batch}
        for states, pack in self.pipeline.packs([t.prepared for t in batch]):
            started = time.perf_counter()
            out = await self._forward(pack)
            stats = self.pipeline.apply(states, pack, out)
            self.stats.forwards += 1
            self.stats.rows += stats.rows
            self.stats.padding_rows += stats.padding_rows
            if self.observer:
                self.observer.on_step(stats, time.perf_counter() - started)
            for state in states:
                ticket = by_state[id(state)]
                ticket.forwards += 1
                ticket.changed.set()
        for ticket in [t for t in batch if t.prepared.done]:
            self._active.remove(ticket)
            if ticket.future.done():
                continue
            try:
                media = await loop.run_in_executor(self._executor, self.pipeline.decode, ticket.prepared)
            except Exception as e:
                ticket.future.set_exception(e)
                continue
            if not ticket.future.done():
                ticket.future.set_result(media)
                self.stats.completed += 1
        self._report_queue()

    def _drop_finished_waiting(self) -> None:
        """Cancelled waiting requests leave the queue at once, so they never count against its bound."""
        if any(t.future.done() for t in self._waiting):
            self._waiting = collections.deque(t for t in self._waiting if not t.future.done())

    def _fail_all(self, error: Exception, only_active: bool = False) -> None:
        tickets = self._active + ([] if only_active else list(self._waiting))
        for ticket in tickets:
            if not ticket.future.done():
                ticket.future.set_exception(error)
        self._active = []
        if not only_active:
            self._waiting.clear()
        self._report_queue()

    def _report_queue(self) -> None:
        if self.observer:
            self.observer.on_queue(len(self._waiting), len(self._active))


__all__ = ["Engine", "EngineLimits", "EngineObserver", "EngineStopped", "QueueFull", "Ticket"]
