"""Step-level continuous batching: every step packs all active requests into one varlen forward.

Requests wait in a bounded queue (a full queue is refused at once), join the running pack at the
next step once diffusers' blocks prepared them, advance one denoising step per forward, and leave
when done, cancelled or past their deadline. Mixed sizes, tasks and step indices share each forward
(Ref2VA requests, which use their own transformer partition, share a second one).

Failures stay with the requests that cause them. A pack whose data fails (``PackFailed``: every rank
finished, the group is healthy) is retried in halves, down to single requests, so only a request that
fails on its own fails, and every other request of the pack still advances that step exactly once;
the other partition's pack and the waiting requests never see it. A broken worker group stops the
engine and fails everything with ``EngineStopped``. A watchdog (``check_health``) reports a stall when
work is active and nothing completed for many expected step times; ``drain`` hands back what never
started and lets the rest finish.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextvars
import dataclasses
import itertools
import logging
import math
import time
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from pipelines.h3 import GeneratedMedia, GenerationRequest, RequestError, RequestState, StepStats

from .worker_group import PackFailed, WorkerGroup, WorkerGroupBroken

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is closed or its worker group broke; the replica must be replaced (HTTP 503)."""


class EngineDraining(EngineStopped):
    """The replica is draining (scale-down or shutdown); this request never started here: run it elsewhere."""


class EngineStalled(EngineStopped):
    """Watchdog: work is active and no step completed within the stall window (health fails)."""


class DeadlineExceeded(RuntimeError):
    """The request passed its deadline and left the pack (HTTP 504)."""


# the stages the engine times (the replica adds "encode" for MP4/PNG encoding)
STAGES = ("queue_wait", "prepare", "first_step", "step", "decode", "end_to_end")
# why a request failed: its own data, its prepare or decode, its deadline, the worker group, a drain, a shutdown
FAILURE_REASONS = ("error", "prepare", "decode", "deadline", "worker_group", "draining", "shutdown")


class EngineLimits(BaseModel):
    """The bounds of one replica's engine (the ``engine:`` block of the deploy args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(
        default=64,
        ge=1,
        description="requests waiting behind a full pack, per replica; the engine holds at most max_queue + "
        "max_active requests and refuses one more with HTTP 503",
    )
    max_active: int = Field(default=16, ge=1, description="requests in the running pack")
    max_rows_per_step: int = Field(
        default=16384,
        ge=64,
        description="rows of one packed forward: text, conditioning, audio and video rows of every request in it",
    )
    drain_timeout_s: float = Field(
        default=600.0, gt=0, description="on scale-down or shutdown, active requests get this long to finish"
    )
    default_deadline_s: float | None = Field(
        default=None, gt=0, description="a request's deadline in seconds when it gives none; None: no deadline"
    )
    stall_factor: float = Field(
        default=20.0,
        gt=0,
        description="health fails when work is active and no step completed within "
        "max(stall_min_s, stall_factor * expected step time)",
    )
    stall_min_s: float = Field(default=120.0, gt=0, description="the shortest stall window, in seconds")
    warmup: bool = Field(default=True, description="one warm-up forward before the replica reports ready")

    @property
    def capacity(self) -> int:
        """Requests one engine holds at once: a full pack plus the queue behind it; one more gets QueueFull."""
        return self.max_active + self.max_queue


class EngineObserver(Protocol):
    """Where the engine reports what it does (deploy wires this to Prometheus)."""

    def on_step(self, stats: StepStats, seconds: float) -> None: ...

    def on_queue(self, waiting: int, active: int) -> None: ...

    def on_stage(self, stage: str, seconds: float) -> None: ...  # stage in STAGES

    def on_failed_step(self, reason: str) -> None: ...  # "pack" | "worker_group"

    def on_failed_request(self, reason: str) -> None: ...  # reason in FAILURE_REASONS


@dataclasses.dataclass
class EngineStats:
    forwards: int = 0  # successful packed forwards
    rows: int = 0
    padding_rows: int = 0
    completed: int = 0
    failed_steps: int = 0  # forwards (or packs that could not be built) that failed, isolation retries included
    failed_requests: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason


class Ticket:
    """A submitted request: its future, progress, cost and deadline."""

    def __init__(
        self,
        request_id: str,
        request: GenerationRequest,
        rows: int,
        loop: asyncio.AbstractEventLoop,
        deadline_s: float | None,
    ):
        self.id, self.request, self.rows, self.deadline_s = request_id, request, rows, deadline_s
        self.future: asyncio.Future[GeneratedMedia] = loop.create_future()
        self.state: RequestState | None = None
        self.forwards = 0  # how many packed forwards this request was part of
        self.changed = asyncio.Event()
        self.submitted = time.monotonic()
        self.first_step_done = False

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
        self._preparing: Ticket | None = None  # popped from the queue, diffusers' blocks running for it
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._draining = False
        self._ids = itertools.count()
        # the watchdog: the expected step time (warm-up, then an EMA of steps) and the last completed work
        self.expected_step_s: float | None = None
        self._progress_at = time.monotonic()
        # one thread for all model work: steps must not interleave on the device
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-engine")

    # -- API ------------------------------------------------------------------------------
    def submit(
        self, request: GenerationRequest, request_id: str | None = None, deadline_s: float | None = None
    ) -> Ticket:
        """Queue a request, or raise at once: RequestError (bad request), QueueFull, EngineDraining, EngineStopped.

        ``deadline_s``: seconds from now until the request fails with DeadlineExceeded wherever it is
        (waiting, being prepared, in the pack); None: ``limits.default_deadline_s``.
        """
        if self._draining:
            raise EngineDraining("this replica is draining; retry on another replica")
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        rows = self.validate(request)
        if deadline_s is None:
            deadline_s = self.limits.default_deadline_s
        if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
            raise RequestError("timeout_s", f"timeout_s must be a positive number of seconds, got {deadline_s}")
        self._drop_finished_waiting()
        # the engine holds a full pack plus a queue behind it; a request the pack can still take does not count
        # against the queue even before the loop has moved it there (a burst fills the pack, then the queue)
        active = sum(not t.future.done() for t in self._active)  # a cancelled one leaves at the next step
        held = len(self._waiting) + active + (self._preparing is not None)
        if held >= self.limits.capacity:
            raise QueueFull(
                f"queue is full ({len(self._waiting)} waiting, {self.limits.max_active} in the pack); retry later"
            )
        loop = asyncio.get_running_loop()
        if not self._busy:
            self._progress_at = time.monotonic()  # the watchdog's clock starts when work arrives
        ticket = Ticket(request_id or f"req-{next(self._ids)}", request, rows, loop, deadline_s)
        if deadline_s is not None:
            timer = loop.call_later(deadline_s, self._expire, ticket)
            ticket.future.add_done_callback(lambda _: timer.cancel())
        self._waiting.append(ticket)
        logger.info("request %s queued (%d rows, deadline %s s)", ticket.id, rows, deadline_s)
        self._report_queue()
        if self._task is None:
            # in a context of its own: the loop serves every request, so it must not carry the first one's
            # request context (Serve's log prefix would name that request on every later line)
            self._task = loop.create_task(self._run(), context=contextvars.Context())
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

    async def generate(
        self, request: GenerationRequest, request_id: str | None = None, deadline_s: float | None = None
    ) -> GeneratedMedia:
        ticket = self.submit(request, request_id, deadline_s)
        try:
            return await ticket.future
        except asyncio.CancelledError:  # the caller went away: leave the pack
            self.cancel(ticket)
            raise

    def cancel(self, ticket: Ticket) -> None:
        if not ticket.future.done():
            ticket.future.cancel()
            logger.info("request %s cancelled", ticket.id)
        self._drop_finished_waiting()
        self._report_queue()
        self._wake.set()

    @property
    def queue_depth(self) -> tuple[int, int]:
        return len(self._waiting), len(self._active)

    # -- warm-up, health, drain, close ----------------------------------------------------
    def warmup_request(self) -> GenerationRequest:
        """The smallest request the model's rules allow: the shortest clip on the smallest canvas, one step."""
        rules, side = self.pipeline.rules, self.pipeline.rules.canvas_multiple
        return GenerationRequest(
            prompt="warm-up", width=side, height=side, num_frames=rules.min_frames, num_inference_steps=2
        )

    def warm_up(self) -> float:
        """Prepare the smallest request and run one packed forward on every rank, discarding the result.

        Synchronous, before any submit (kernel setup and compilation land here, not on the first user).
        Returns the forward's seconds, which seed the watchdog's expected step time.
        """
        if self._task is not None:
            raise RuntimeError("warm_up() runs before the first submit")
        request = self.warmup_request()
        started = time.perf_counter()
        state = self.pipeline.prepare(request)
        ((_, pack),) = self.pipeline.packs([state])
        prepared = time.perf_counter()
        self.group(pack)
        seconds = time.perf_counter() - prepared
        self.expected_step_s = seconds
        logger.info(
            "warm-up: prepare %.2f s, one packed forward of %d rows on %d ranks %.2f s",
            prepared - started,
            pack.total_rows,
            self.group.sp_degree,
            seconds,
        )
        return seconds

    @property
    def stall_window_s(self) -> float:
        expected = self.expected_step_s or 0.0
        return max(self.limits.stall_min_s, self.limits.stall_factor * expected)

    @property
    def _busy(self) -> bool:
        return bool(self._waiting or self._active or self._preparing)

    def check_health(self) -> None:
        """Raise EngineStopped (closed, or the group broke), EngineStalled or WorkerGroupBroken."""
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        if self._busy:
            quiet = time.monotonic() - self._progress_at
            if quiet > self.stall_window_s:
                message = (
                    f"no step completed for {quiet:.1f} s with work active "
                    f"(stall window {self.stall_window_s:.1f} s, expected step {self.expected_step_s or 0:.2f} s)"
                )
                logger.error("engine stalled: %s", message)
                raise EngineStalled(message)
        self.group.check_health()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop taking work, hand back what never started, let the active requests finish, then close.

        Waiting requests fail at once with EngineDraining (they never started here: run them elsewhere);
        active ones get ``timeout_s`` (default ``limits.drain_timeout_s``) to finish; the rest fail with
        EngineStopped.
        """
        timeout_s = self.limits.drain_timeout_s if timeout_s is None else timeout_s
        self._draining = True
        handed_back = [t for t in self._waiting if not t.future.done()]
        self._waiting.clear()
        for ticket in handed_back:
            self._fail(ticket, EngineDraining("this replica is draining; the request never started here"), "draining")
        self._report_queue()
        started = [t.future for t in [*self._active, *([self._preparing] if self._preparing else [])]]
        logger.info("draining: %d handed back, %d active get %g s", len(handed_back), len(started), timeout_s)
        if started:
            await asyncio.wait(started, timeout=timeout_s)
        await self.close("the replica drained")

    async def close(self, reason: str = "engine closed") -> None:
        self._stop_reason = self._stop_reason or reason
        self._fail_all(EngineStopped(reason), "shutdown")
        if self._task is not None:
            self._task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- the step loop --------------------------------------------------------------------
    def _run_blocking(self, fn, *args) -> asyncio.Future[Any]:
        """Model work on the engine's one thread."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

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
                self.stats.failed_steps += 1
                self._observe("on_failed_step", "worker_group")
                self._fail_all(EngineStopped(self._stop_reason), "worker_group")
                return
            except Exception:  # a fault of the engine itself: fail the pack, never the loop or the waiting requests
                logger.exception("engine step failed outside any pack (requests %s)", [t.id for t in self._active])
                self.stats.failed_steps += 1
                self._observe("on_failed_step", "pack")
                for ticket in self._active:
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed; see the replica log"), "error")
                self._active = []

    async def _join_waiting(self) -> None:
        """Prepare waiting requests (diffusers' blocks before the loop) into the pack, oldest first."""
        while self._waiting and len(self._active) < self.limits.max_active:
            ticket = self._waiting.popleft()
            if ticket.future.done():
                continue
            self._stage("queue_wait", time.monotonic() - ticket.submitted)
            self._preparing = ticket
            started = time.perf_counter()
            try:
                state = await self._run_blocking(self.pipeline.prepare, ticket.request)
                self._check_budget(state.rows)  # the estimate at submit was short (keyframe vision tokens)
            except Exception as e:
                logger.warning("request %s: prepare failed", ticket.id, exc_info=True)
                self._fail(ticket, e, "prepare")
                continue
            finally:
                self._preparing = None
                self._progress_at = time.monotonic()
            self._stage("prepare", time.perf_counter() - started)
            if ticket.future.done():  # cancelled or past its deadline while being prepared
                continue
            ticket.state, ticket.rows = state, state.rows
            self._active.append(ticket)
            logger.info("request %s joined the pack (%d rows, %d steps)", ticket.id, state.rows, state.steps)
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

    async def _step_once(self) -> None:
        batch = self._select()
        if not batch:
            return
        partitions: dict[str, list[Ticket]] = {}
        for ticket in batch:  # one pack per transformer partition; a failure in one never touches the other
            partitions.setdefault(ticket.prepared.partition, []).append(ticket)
        for tickets in partitions.values():
            await self._advance(tickets)
        for ticket in [t for t in batch if t.prepared.done]:
            self._active.remove(ticket)
            if not ticket.future.done():
                await self._decode(ticket)
        self._report_queue()

    async def _advance(self, tickets: list[Ticket]) -> None:
        """One step for ``tickets``; a pack whose data fails is retried in halves down to single requests."""
        tickets = [t for t in tickets if not t.future.done()]
        if not tickets:
            return
        error = await self._try_step(tickets)
        if error is None:
            return
        self.stats.failed_steps += 1
        self._observe("on_failed_step", "pack")
        ids = [t.id for t in tickets]
        if len(tickets) == 1:
            (ticket,) = tickets
            logger.error("request %s failed on its own: %s", ticket.id, error, exc_info=error)
            self._fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
            return
        logger.warning("a pack of requests %s failed (%s); retrying them in halves", ids, error, exc_info=error)
        half = len(tickets) // 2
        await self._advance(tickets[:half])
        await self._advance(tickets[half:])

    async def _try_step(self, tickets: list[Ticket]) -> Exception | None:
        """Pack, forward and advance ``tickets`` by one step; the data failure, or None. Raises WorkerGroupBroken."""
        try:
            ((states, pack),) = self.pipeline.packs([t.prepared for t in tickets])
        except Exception as e:  # the documents do not even pack together: their data
            return e
        started = time.perf_counter()
        try:
            out = await self.group.forward_async(pack, self._run_blocking)
            outputs = pack.split(*out)
        except PackFailed as e:
            return e
        except WorkerGroupBroken:
            raise
        except Exception as e:
            return e
        seconds = time.perf_counter() - started
        self._progress_at = time.monotonic()
        self.expected_step_s = seconds if self.expected_step_s is None else 0.8 * self.expected_step_s + 0.2 * seconds
        stats = StepStats(len(states), pack.total_rows, pack.padding_rows)
        self.stats.forwards += 1
        self.stats.rows += stats.rows
        self.stats.padding_rows += stats.padding_rows
        self._observe("on_step", stats, seconds)
        self._stage("step", seconds)
        for ticket, state, (video, audio) in zip(tickets, states, outputs, strict=True):
            if ticket.future.done():  # cancelled or past its deadline during the forward: it has left
                continue
            try:  # each request applies its own velocities: one bad output never half-advances another
                state.advance(video, audio)
            except Exception as e:
                logger.error("request %s: applying its step failed", ticket.id, exc_info=True)
                self._fail(ticket, RuntimeError(f"request {ticket.id} failed: {e}"), "error")
                continue
            ticket.forwards += 1
            if not ticket.first_step_done:
                ticket.first_step_done = True
                self._stage("first_step", time.monotonic() - ticket.submitted)
            ticket.changed.set()
        return None

    async def _decode(self, ticket: Ticket) -> None:
        started = time.perf_counter()
        try:
            media = await self._run_blocking(self.pipeline.decode, ticket.prepared)
        except Exception as e:
            logger.error("request %s: decode failed", ticket.id, exc_info=True)
            self._fail(ticket, e, "decode")
            return
        finally:
            self._progress_at = time.monotonic()
        self._stage("decode", time.perf_counter() - started)
        if ticket.future.done():
            return
        ticket.future.set_result(media)
        self.stats.completed += 1
        end_to_end = time.monotonic() - ticket.submitted
        self._stage("end_to_end", end_to_end)
        logger.info("request %s done in %.2f s (%d forwards)", ticket.id, end_to_end, ticket.forwards)

    # -- failures -------------------------------------------------------------------------
    def _expire(self, ticket: Ticket) -> None:
        """The deadline timer: the request fails now and leaves the pack at the next step boundary."""
        if ticket.future.done():
            return
        where = "in the pack" if ticket.state is not None else "before it started"
        error = DeadlineExceeded(
            f"request {ticket.id} passed its deadline of {ticket.deadline_s:g} s {where} "
            f"(step {ticket.progress[0]} of {ticket.progress[1]})"
        )
        self._fail(ticket, error, "deadline")
        self._drop_finished_waiting()
        self._report_queue()
        self._wake.set()

    def _fail(self, ticket: Ticket, error: Exception, reason: str) -> None:
        if ticket.future.done():
            return
        ticket.future.set_exception(error)
        self.stats.failed_requests[reason] += 1
        self._observe("on_failed_request", reason)
        if reason != "error":  # isolation logged the request's own failure with its traceback
            logger.warning("request %s failed (%s): %s", ticket.id, reason, error)

    def _fail_all(self, error: Exception, reason: str) -> None:
        tickets = [*self._active, *self._waiting, *([self._preparing] if self._preparing else [])]
        for ticket in tickets:
            self._fail(ticket, error, reason)
        self._active = []
        self._waiting.clear()
        self._report_queue()

    def _drop_finished_waiting(self) -> None:
        """Cancelled waiting requests leave the queue at once, so they never count against its bound."""
        if any(t.future.done() for t in self._waiting):
            self._waiting = collections.deque(t for t in self._waiting if not t.future.done())

    # -- observing --------------------------------------------------------------------------
    def _stage(self, stage: str, seconds: float) -> None:
        self._observe("on_stage", stage, seconds)

    def _report_queue(self) -> None:
        self._observe("on_queue", len(self._waiting), len(self._active))

    def _observe(self, method: str, *args: Any) -> None:
        """Report to the observer; a failing observer is logged and never fails a request."""
        if self.observer is None:
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("engine observer %s failed", method)
