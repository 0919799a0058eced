"""The engine core: step-level continuous batching, every step one varlen forward of the scheduled requests.

vLLM v1's split, in h3serve's parts:

- ``replicas/requests.py``: the request table. A request waits in a bounded queue (a full engine is refused at
  once), is prepared on the stage worker (diffusers' blocks), is resident (ready, running or paused) until its
  schedule is done, then is decoded on the stage worker (both VAEs). The table says where each request is.
- ``replicas/scheduler.py``: pure decisions from request views. Each step, ``schedule`` picks the batch within the
  request and row budget by ``limits.policy`` (under ``srpt`` and ``priority`` a running request left out is paused:
  its latents and schedulers stay in its ``RequestState`` and it resumes with the same output); ``admit`` picks the
  next request to prepare ahead of the pack, for at most ``limits.max_prepared`` more states than ``max_active``,
  and at that bound the prepared request that never stepped and gives its room to one that outranks it.
- ``replicas/executor.py``: runs a batch on the SP worker group and reports what advanced, what failed, and the
  groups it replaced (pack bisection, a broken group's replacement and the step run again on it).
- ``replicas/stage_worker.py``: prepare and decode, here (``LocalStages``) or in stages of their own
  (``RemoteStages`` over a ``StageClient``), on a thread of their own, so neither ever holds up a step.
- ``replicas/progress.py``: stats, the one measured rate behind both ``load()`` and the ETAs, queue positions,
  previews and a followed request's events.
- ``replicas/hooks.py``: a ``StepGate`` above the policy, for benchmarks (one LoRA adapter per batch).

This module holds the API (submit, cancel, load, warm-up, health, drain, close) and two loops: the step loop
(schedule, execute, apply, progress) and the stage worker's (prepare the request ``admit`` names, or decode the
oldest denoised one). A request fails alone (its own data, its prepare or decode, its deadline); only a group that
cannot be replaced stops the engine and fails everything with ``EngineStopped``. A watchdog (``check_health``)
reports a stall when work is active and nothing completed (no step, no prepare, no decode) for many expected step
times; ``drain`` hands back what never started and lets the rest finish. Step caching (``limits.step_cache``): a
request's tier resolves at submit; its state lives in its ``RequestState``, freed when its schedule finishes or at
the step boundary after it fails or is cancelled (never under a forward that may still read it).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import math
import time

from pipelines.h3 import EncodedMedia, GeneratedMedia, GenerationRequest, RequestError, RequestState
from pipelines.h3.step_cache_tiers import StepCachePolicy

from . import scheduler
from .contract import (
    DeadlineExceeded,
    EngineDraining,
    EngineLimits,
    EngineLoad,
    EngineStalled,
    EngineStopped,
    QueueFull,
    check_priority,
)
from .executor import Executor, StepOutcome
from .hooks import StepGate, acts_before_forward, gated
from .progress import EngineObserver, EngineStats, Progress
from .requests import RequestTable, Stage, Ticket, check_rows, place
from .scheduler import Budget
from .stage_worker import LocalStages, RemoteStages, StageClient, Stages, StageWorker
from .supervisor import GroupSupervisor
from .worker_group import WorkerGroup

logger = logging.getLogger(__name__)

# how _expire words where a request was when its deadline passed
EXPIRED_WHERE = {"waiting": "before it started", "running": "in the pack", "decoding": "while decoding"}


class Engine:
    def __init__(
        self,
        group: WorkerGroup,
        limits: EngineLimits | None = None,
        observer: EngineObserver | None = None,
        remote: StageClient | None = None,
        gate: StepGate | None = None,
    ):
        """``remote``: conditioner and decoder stages of their own; None: prepare and decode run here.
        ``gate``: which prepared requests may join each step's batch (``StepGate``); None: every one, by the policy.
        """
        self.limits = limits or EngineLimits()
        self.pipeline, self.observer, self.remote, self.gate = group.pipeline, observer, remote, gate
        self.executor = Executor(group, self.limits.step_timeout_min_s, self.limits.step_timeout_factor)
        self.requests = RequestTable()
        self.stage_worker = StageWorker(self.executor.device, self.limits.stage_nice)
        self.progress = Progress(self.requests, self.limits, self.pipeline, observer, self.stage_worker)
        self.stages: Stages = (
            LocalStages(self.pipeline, self.stage_worker)
            if remote is None
            else RemoteStages(self.pipeline, self.stage_worker, remote, self.stats.handoff_bytes)
        )
        self._wake = asyncio.Event()  # the step loop: a request became ready, or the engine stops
        self._stage_wake = asyncio.Event()  # the stage worker: a request waits for prepare or decode
        self._task: asyncio.Task | None = None
        self._stage_task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._draining = False
        self._ids, self._orders = itertools.count(), itertools.count()
        self.warmup_s: dict[str | None, float] = {}  # warm_up()'s forward seconds by adapter (None: the base model)
        self._progress_at = time.monotonic()  # the watchdog: work arrived, or a prepare or decode ended
        for name, policy in self.limits.step_cache.tiers.items():  # the deploy args refuse them earlier too
            try:
                self.pipeline.check_step_cache(policy)
            except ValueError as e:
                raise ValueError(f"engine.step_cache.tiers.{name}: {e}") from None
        self.progress.observe("on_adapters", tuple(self.pipeline.denoiser.loras.loras))

    # -- what callers read --------------------------------------------------------------------
    @property
    def group(self) -> WorkerGroup:
        """The current SP group (a new one after a replacement)."""
        return self.executor.group

    @property
    def supervisor(self) -> GroupSupervisor:
        return self.executor.supervisor

    @property
    def stats(self) -> EngineStats:
        return self.progress.stats

    @property
    def step_bound_s(self) -> float:
        return self.executor.step_bound_s

    @property
    def expected_step_s(self) -> float | None:
        """The expected step time (warm-up, then an EMA of forwards): the watchdog's and the step bound's unit."""
        return self.executor.step_s.value

    @expected_step_s.setter
    def expected_step_s(self, seconds: float | None) -> None:
        self.executor.step_s.value = seconds

    @property
    def row_step_rate(self) -> float | None:
        """The measured row-step rate (``progress.RateMeter``): what ETAs and ``load()`` divide by."""
        return self.progress.meter.rate

    @property
    def stall_window_s(self) -> float:
        return max(self.limits.stall_min_s, self.limits.stall_factor * (self.expected_step_s or 0.0))

    @property
    def queue_depth(self) -> tuple[int, int]:
        """(waiting, active): requests that never started (queued, being prepared, prepared but never
        stepped), and those that did (running, paused, being decoded)."""
        return self.requests.depth()

    def queue_position(self, ticket: Ticket) -> int | None:
        return self.progress.queue_position(ticket)

    def eta_s(self, ticket: Ticket) -> float | None:
        return self.progress.eta_s(ticket)

    def step_cache_policy(self, request: GenerationRequest) -> StepCachePolicy | None:
        """The policy of the request's ``cache`` tier (None: off), or RequestError("cache") naming what is allowed."""
        return self.limits.step_cache.policy(request.cache)

    # -- API ----------------------------------------------------------------------------------
    def submit(
        self,
        request: GenerationRequest,
        request_id: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
        output: str | None = None,
    ) -> Ticket:
        """Queue a request, or raise at once: RequestError (bad request), QueueFull, EngineDraining, EngineStopped.

        ``deadline_s``: seconds from now until the request fails with DeadlineExceeded wherever it is
        (waiting, being prepared, in the pack, being decoded); None: ``limits.default_deadline_s``.
        ``priority``: an int from MIN_PRIORITY to MAX_PRIORITY, higher first under the "priority" policy
        (the other policies ignore it). ``adapter``: the LoRA adapter of the deployment it runs on (None: the
        base model); without ``num_inference_steps`` it runs the adapter's steps, and shares packs with requests
        on the base model and on other adapters. ``output`` ("png", "mp4"): with a decoder stage (``remote``) the
        future holds ``EncodedMedia`` encoded there; without one, or None, ``GeneratedMedia``.
        """
        if output not in (None, "png", "mp4"):
            raise ValueError(f"output must be 'png', 'mp4' or None, got {output!r}")
        if self._draining:
            raise EngineDraining("this replica is draining; retry on another replica")
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        check_priority(priority)
        request = self.pipeline.with_adapter(request, adapter)
        rows = self.validate(request)
        step_cache = self.step_cache_policy(request)
        if deadline_s is None:
            deadline_s = self.limits.default_deadline_s
        if deadline_s is not None and not (math.isfinite(deadline_s) and deadline_s > 0):
            raise RequestError("timeout_s", f"timeout_s must be a positive number of seconds, got {deadline_s}")
        self.requests.drop_finished(Stage.WAITING)
        # the engine holds a full pack plus a queue behind it, whatever stage each request is in (a cancelled
        # one leaves at the next step boundary, and no longer counts)
        if len(self.requests.held()) >= self.limits.capacity:
            waiting, active = self.queue_depth
            raise QueueFull(
                f"queue is full ({waiting} waiting, {active} active, {self.limits.max_active} in a pack); retry later"
            )
        loop = asyncio.get_running_loop()
        if not self._busy:
            self._progress_at = time.monotonic()  # the watchdog's clock starts when work arrives
        ticket = Ticket(
            request_id or f"req-{next(self._ids)}", request, rows, loop, deadline_s, priority, next(self._orders)
        )
        ticket.step_cache, ticket.adapter, ticket.output = step_cache, adapter, output
        if deadline_s is not None:
            timer = loop.call_later(deadline_s, self._expire, ticket)
            ticket.future.add_done_callback(lambda _: timer.cancel())
        self.requests.add(ticket)
        self.progress.start_busy()
        logger.info(
            "request %s queued (%d rows, deadline %s s, priority %d, adapter %s)",
            ticket.id,
            rows,
            deadline_s,
            priority,
            adapter or "none",
        )
        self.progress.report_queue()
        if self._task is None:
            # in contexts of their own: the loops serve every request, so they must not carry the first one's
            # request context (Serve's log prefix would name that request on every later line)
            self._task = loop.create_task(self._run(), context=contextvars.Context())
            self._stage_task = loop.create_task(self._run_stages(), context=contextvars.Context())
        self._stage_wake.set()
        return ticket

    def validate(self, request: GenerationRequest, adapter: str | None = None) -> int:
        """About the rows the request adds to a pack; RequestError if the model, the adapter or the budget cannot
        take it."""
        request = self.pipeline.with_adapter(request, adapter)
        rows = self.pipeline.validate(request)
        # the prompt's tokens; keyframes add theirs at prepare
        text_rows = self.pipeline.text_tokens(request.prompt) if self.limits.max_text_rows_per_step else None
        check_rows(self.limits, rows, text_rows)
        self.step_cache_policy(request)
        return rows

    async def generate(
        self,
        request: GenerationRequest,
        request_id: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
    ) -> GeneratedMedia:
        ticket = self.submit(request, request_id, deadline_s, priority, adapter)
        try:
            media = await asyncio.shield(ticket.future)  # a caller that goes away cancels through cancel(), counted
            assert isinstance(media, GeneratedMedia)  # no output asked: never encoded by a decoder stage
            return media
        except asyncio.CancelledError:  # the caller went away: leave the pack
            self.cancel(ticket)
            raise

    def cancel(self, ticket: Ticket) -> None:
        """Cancel a request wherever it is (a no-op once finished): waiting, it leaves the queue now; running, it
        leaves its pack at the next step boundary, where its state is freed; decoding, its result is dropped."""
        if not ticket.future.done():
            stage = place(ticket)
            ticket.future.cancel()
            self.stats.cancelled[stage] += 1
            self.progress.observe("on_cancelled", stage)
            logger.info("request %s cancelled (%s, step %d of %d)", ticket.id, stage, *ticket.progress)
        self._changed()

    def load(self) -> EngineLoad:
        """The backlog (rows x steps left of every request held, an adapter's own step count included), the
        measured row-step rate, the oldest wait of a request not started and the tightest deadline slack."""
        now, held = time.monotonic(), self.requests.held()
        slacks = [t.submitted + t.deadline_s - now for t in held if t.deadline_s is not None]
        waiting, active = self.requests.depth()
        return EngineLoad(
            backlog_row_steps=sum(t.work for t in held),
            row_step_rate=self.row_step_rate or 0.0,
            oldest_wait_s=max((now - t.submitted for t in held if not t.started), default=0.0),
            deadline_slack_s=min(slacks, default=None),
            waiting=waiting,
            active=active,
        )

    # -- warm-up, health, drain, close --------------------------------------------------------
    def warmup_request(self) -> GenerationRequest:
        """The smallest request the model's rules allow: the shortest clip on the smallest canvas, one step."""
        rules, side = self.pipeline.rules, self.pipeline.rules.canvas_multiple
        return GenerationRequest(
            prompt="warm-up", width=side, height=side, num_frames=rules.min_frames, num_inference_steps=2
        )

    def warm_up(self, state: RequestState | None = None) -> float:
        """Prepare the smallest request and run one packed forward on every rank, discarding the result.

        Synchronous, before any submit (kernel setup and compilation land here, not on the first user). With LoRA
        adapters, one more forward per adapter (``warmup_s`` holds each forward's seconds).
        ``state``: ``warmup_request()`` already prepared elsewhere (a conditioner stage); None prepares it here.
        Returns the forward's seconds, which seed the watchdog's expected step time and the measured rate.
        """
        if self._task is not None:
            raise RuntimeError("warm_up() runs before the first submit")
        started = time.perf_counter()
        state = self.pipeline.prepare(self.warmup_request()) if state is None else state
        prepared = time.perf_counter()
        warm = self.executor.warm_up(state)
        self.warmup_s = warm.by_adapter
        self.progress.meter.seed(warm.rows - warm.padding_rows, warm.seconds)
        logger.info(
            "warm-up: prepare %.2f s, one packed forward of %d rows on %d ranks %.2f s",
            prepared - started,
            warm.rows,
            self.group.sp_degree,
            warm.seconds,
        )
        return warm.seconds

    @property
    def _busy(self) -> bool:
        """Whether any submitted request has not finished (whatever its stage)."""
        return bool(self.requests.held())

    def check_health(self) -> None:
        """Raise EngineStopped (closed, or the group broke), EngineStalled or WorkerGroupBroken."""
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        # A stage replica that Serve is replacing can take minutes to load (Qwen3-VL): with a call to it in flight
        # and nothing to step here, the stage's own health check covers it
        awaiting_stages = self.stages.calls > 0 and not self.requests.live(Stage.RESIDENT)
        if self._busy and not awaiting_stages:
            quiet = time.monotonic() - max(self._progress_at, self.executor.progress_at)
            if quiet > self.stall_window_s:
                message = (
                    f"no step completed for {quiet:.1f} s with work active "
                    f"(stall window {self.stall_window_s:.1f} s, expected step {self.expected_step_s or 0:.2f} s)"
                )
                logger.error("engine stalled: %s", message)
                raise EngineStalled(message)
        self.supervisor.check_health()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop taking work, hand back what never started, let the started requests finish, then close.

        Requests that never entered a step (waiting, being prepared, or prepared but never stepped) fail at
        once with EngineDraining: they never started here, so they run sooner elsewhere than behind this
        replica's last requests, and a prepare is cheap to repeat. Started ones (running, paused, being
        decoded) get ``timeout_s`` (default ``limits.drain_timeout_s``) to finish; the rest fail with
        EngineStopped. Paused requests resume, since nothing new joins.
        """
        timeout_s = self.limits.drain_timeout_s if timeout_s is None else timeout_s
        self._draining = True
        handed_back = self.requests.unstarted()
        for ticket in [*self.requests.at(Stage.WAITING), *self.requests.at(Stage.RESIDENT)]:
            if not ticket.started:
                self.requests.move(ticket, Stage.DONE)
        for ticket in handed_back:
            self._fail(ticket, EngineDraining("this replica is draining; the request never started here"), "draining")
        self.progress.report_queue()
        started = [t.future for t in self.requests.held()]
        logger.info("draining: %d handed back, %d started get %g s", len(handed_back), len(started), timeout_s)
        if started:
            await asyncio.wait(started, timeout=timeout_s)
        await self.close("the replica drained")

    async def close(self, reason: str = "engine closed") -> None:
        self._stop_reason = self._stop_reason or reason
        self._fail_all(EngineStopped(reason), "shutdown")
        for task in (self._task, self._stage_task):
            if task is not None:
                task.cancel()
        self.executor.shutdown()
        self.stage_worker.shutdown()

    # -- the step loop: schedule, execute, apply, progress ------------------------------------
    async def _run(self) -> None:
        while not self._stop_reason:
            self._drop_finished_resident()
            if not self.requests.at(Stage.RESIDENT):
                self._stage_wake.set()  # room to prepare
                self.progress.account_busy(self._busy)
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step()
            except Exception:  # a fault of the engine itself: fail the prepared requests, never the loop or the queue
                failed = self.requests.at(Stage.RESIDENT)
                logger.exception("engine step failed outside any pack (requests %s)", [t.id for t in failed])
                self.stats.failed_steps += 1
                self.progress.observe("on_failed_step", "pack")
                for ticket in failed:
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed; see the replica log"), "error")
                self.requests.clear([Stage.RESIDENT])

    async def _step(self) -> None:
        batch = self._schedule()
        gate = self.gate
        before = gate.before_forward if gate is not None and batch and acts_before_forward(gate) else None
        outcome = await self.executor.step(batch, self._holders, before)
        self._apply(outcome)
        if outcome.broken is not None:  # it could not be replaced (counted there): only a new replica helps
            self._stop_reason = f"SP worker group failed: {outcome.broken}"
            self._fail_all(EngineStopped(self._stop_reason), "worker_group")
            self._stage_wake.set()  # the stage worker sees the stop
            return
        if self.gate is not None and not batch:  # the gate held every request back: sleep until something changes
            self._wake.clear()
            await self._wake.wait()
            return
        for ticket in batch:
            if ticket.prepared.done and not ticket.future.done():  # its schedule is done: the stage worker decodes
                ticket.running = False
                self.requests.move(ticket, Stage.DENOISED)
        self._drop_finished_resident()
        self._stage_wake.set()  # a finished, failed or cancelled request may have freed room to prepare another
        self.progress.account_busy(self._busy)
        self.progress.observe("on_duty_cycle", self.stats.duty_cycle)
        self.progress.report_queue()

    def _schedule(self) -> list[Ticket]:
        """This step's batch by the policy (among the gate's candidates, with a gate); running requests left out
        are paused (preemptions)."""
        resident, limits = self.requests.at(Stage.RESIDENT), self.limits
        candidates = resident if self.gate is None else gated(self.gate, self.requests, limits.policy, limits.aging_s)
        by_order = {t.order: t for t in candidates}
        budget = Budget(limits.max_active, limits.max_rows_per_step, limits.max_text_rows_per_step)
        now = time.monotonic()
        plan = scheduler.schedule([t.view() for t in candidates], budget, limits.policy, now, limits.aging_s)
        batch = [by_order[view.order] for view in plan.batch]
        # running requests the gate held back pause too (without a gate every resident request is a candidate)
        paused = [v.id for v in plan.preempted] + [t.id for t in resident if t.running and t.order not in by_order]
        for ticket in resident:
            ticket.running = False
        for ticket in batch:
            ticket.running = True
        if paused:
            self.stats.preemptions += len(paused)
            self.progress.observe("on_preempted", len(paused))
            logger.info(
                "paused %s at step boundary for %s (%s)", paused, [t.id for t in batch if not t.forwards], limits.policy
            )
        return batch

    def _apply(self, outcome: StepOutcome) -> None:
        """What the executor reports: failed attempts, then each forward's requests, then the requests that failed."""
        for reason in outcome.failed_steps:
            self.stats.failed_steps += 1
            self.progress.observe("on_failed_step", reason)
        self.stats.group_replacements += outcome.replaced
        for forward in outcome.forwards:
            adapters = collections.Counter(t.adapter for t in forward.tickets)
            self.progress.forward(forward.stats, forward.seconds, adapters)
            for ticket, error in zip(forward.tickets, forward.errors, strict=True):
                if ticket.future.done():  # cancelled or past its deadline during the forward: it has left
                    continue
                if error is not None:  # its own velocities failed to apply: the others of the pack advanced
                    logger.error("request %s: applying its step failed: %r", ticket.id, error)
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
                else:
                    self.progress.stepped(ticket)
        for ticket, error, reason in outcome.failed:
            self._fail(ticket, error, reason)

    def _holders(self) -> list[Ticket]:
        """The requests whose states may hold step caches: a replaced group's ranks lost theirs."""
        return [*self.requests.at(Stage.RESIDENT), *self.requests.at(Stage.DENOISED)]

    def _drop_finished_resident(self) -> None:
        """At a step boundary (no forward in flight): failed or cancelled requests leave, their step caches freed."""
        for ticket in self.requests.drop_finished(Stage.RESIDENT):
            if ticket.state is not None:
                ticket.state.free_step_cache()
                ticket.state = None  # its rows and schedulers go with it

    # -- the stage worker's loop: prepare ahead of the pack, decode after it --------------------
    async def _run_stages(self) -> None:
        while not self._stop_reason:
            ticket: Ticket | None = None
            try:
                self.requests.drop_finished(Stage.DENOISED)
                ticket, denoised = self._next_to_prepare(), self.requests.first(Stage.DENOISED)
                if ticket is not None and (not self.requests.live(Stage.RESIDENT) or denoised is None):
                    await self._prepare(ticket)  # an idle model thread needs a request more than a finished one
                elif denoised is not None:
                    ticket = denoised
                    await self._decode(ticket)
                else:
                    self.progress.account_busy(self._busy)
                    self._stage_wake.clear()
                    await self._stage_wake.wait()
            except Exception:  # a fault of the engine itself: fail the request at hand, never the stage worker
                logger.exception("the stage worker failed outside a prepare or decode (request %s)", ticket)
                if ticket is None:
                    await asyncio.sleep(1.0)  # no request to fail; the watchdog reports it if it persists
                else:
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed; see the replica log"), "error")
                    self.requests.drop_finished(Stage.PREPARING)

    def _next_to_prepare(self) -> Ticket | None:
        """The waiting request ``scheduler.admit`` names; the prepared one it evicts waits again, its state freed."""
        if self._draining or self._stop_reason:
            return None
        self.requests.drop_finished(Stage.WAITING)
        waiting, resident, limits = self.requests.at(Stage.WAITING), self.requests.live(Stage.RESIDENT), self.limits
        by_order = {t.order: t for t in [*waiting, *resident]}
        room = limits.max_active + limits.max_prepared
        admission = scheduler.admit(
            [t.view() for t in waiting],
            [t.view() for t in resident],
            room,
            limits.policy,
            time.monotonic(),
            limits.aging_s,
        )
        if admission.prepare is None:
            return None
        best = by_order[admission.prepare.order]
        if admission.evict is not None:
            worst = by_order[admission.evict.order]
            self.requests.move(worst, Stage.WAITING)
            worst.state = None  # its prepared state is freed; it is prepared again when its turn comes
            logger.info("request %s gives its prepared room to %s (%s), waits again", worst.id, best.id, limits.policy)
        return best

    async def _prepare(self, ticket: Ticket) -> None:
        self.requests.move(ticket, Stage.PREPARING)
        if not ticket.prepares:  # a request that gave its prepared room back waits on, and is timed once
            self.progress.stage("queue_wait", time.monotonic() - ticket.submitted)
        ticket.prepares += 1
        started = time.perf_counter()
        ticket.marks["prepare"] = time.monotonic()
        try:
            state = await self.stages.prepare(ticket)
            check_rows(self.limits, state.rows, state.text_rows)  # the estimate at submit was short (keyframes)
        except Exception as e:
            logger.warning("request %s: prepare failed", ticket.id, exc_info=True)
            self._fail(ticket, e, "prepare")
            self.requests.move(ticket, Stage.DONE)
            return
        finally:
            self._progress_at = time.monotonic()
        self.progress.stage("prepare", time.perf_counter() - started)
        ticket.marks["prepared"] = time.monotonic()
        if ticket.future.done():  # cancelled, past its deadline or handed back while being prepared
            self.requests.move(ticket, Stage.DONE)
            return
        ticket.state, ticket.rows, ticket.text_rows = state, state.rows, state.text_rows
        self.progress.prepared(ticket)
        self.requests.move(ticket, Stage.RESIDENT)
        logger.info("request %s prepared (%d rows, %d steps)", ticket.id, state.rows, state.steps)
        self.progress.report_queue()
        self._wake.set()

    async def _decode(self, ticket: Ticket) -> None:
        if ticket.future.done():
            self.requests.move(ticket, Stage.DONE)
            return
        self.requests.move(ticket, Stage.DECODING)
        self.progress.event(ticket, "decoding", eta_s=self.progress.decode_s.value)
        started = time.perf_counter()
        ticket.marks["decode"] = time.monotonic()
        try:
            media: GeneratedMedia | EncodedMedia = await self.stages.decode(ticket)
        except Exception as e:
            logger.error("request %s: decode failed", ticket.id, exc_info=True)
            self._fail(ticket, e, "decode")
            return
        finally:
            self.requests.move(ticket, Stage.DONE)
            self._progress_at = time.monotonic()
            self.progress.account_busy(self._busy)
        seconds = time.perf_counter() - started
        ticket.marks["decoded"] = time.monotonic()
        self.progress.decode_s.add(seconds)
        self.progress.stage("decode", seconds)
        if ticket.future.done():
            return
        ticket.future.set_result(media)
        self.stats.completed += 1
        end_to_end = time.monotonic() - ticket.submitted
        self.progress.stage("end_to_end", end_to_end)
        self.progress.report_queue()
        logger.info("request %s done in %.2f s (%d forwards)", ticket.id, end_to_end, ticket.forwards)

    # -- failures -----------------------------------------------------------------------------
    def _expire(self, ticket: Ticket) -> None:
        """The deadline timer: the request fails now, wherever it is; it leaves at its stage's next boundary."""
        if ticket.future.done():
            return
        error = DeadlineExceeded(
            f"request {ticket.id} passed its deadline of {ticket.deadline_s:g} s {EXPIRED_WHERE[place(ticket)]} "
            f"(step {ticket.progress[0]} of {ticket.progress[1]})"
        )
        self._fail(ticket, error, "deadline")
        self._changed()

    def _changed(self) -> None:
        """A request left: waiting ones leave the queue at once (never counting against its bound), both loops look."""
        self.requests.drop_finished(Stage.WAITING)
        self.progress.report_queue()
        self._wake.set()
        self._stage_wake.set()

    def _fail(self, ticket: Ticket, error: Exception, reason: str) -> None:
        if ticket.future.done():
            return
        ticket.future.set_exception(error)
        self.stats.failed_requests[reason] += 1
        self.progress.observe("on_failed_request", reason)
        if reason != "error":  # isolation logged the request's own failure with its traceback
            logger.warning("request %s failed (%s): %s", ticket.id, reason, error)

    def _fail_all(self, error: Exception, reason: str) -> None:
        for ticket in self.requests.held():
            self._fail(ticket, error, reason)
        self.requests.clear([Stage.WAITING, Stage.RESIDENT, Stage.DENOISED])
        self.progress.report_queue()
