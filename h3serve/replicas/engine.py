"""The engine core: step-level continuous batching, every step one varlen forward of the scheduled requests.

vLLM v1's split: ``requests`` (the request table: where each request is), ``scheduler`` (pure decisions: each
step's batch and pauses, what to prepare next and what gives its room), ``executor`` (runs a batch on the SP worker
group, reports what advanced and what failed), ``stage_worker`` (prepare ahead of the pack and decode after it, here
or in stages of their own, never holding up a step), ``progress`` (stats, the one measured rate behind ``load()`` and
the ETAs, previews, events), ``warm_up`` (what runs before the replica is ready) and ``hooks`` (a ``StepGate``
above the policy, for benchmarks).

Here: the API (submit, cancel, load, warm-up, health, drain, close) and the step loop (schedule, execute, apply,
progress). A request fails alone (its data, its prepare or decode, its deadline); only an SP group that cannot be
replaced stops the engine and fails everything with ``EngineStopped``. The watchdog (``check_health``) reports a stall
when work is active and nothing completed (no step, prepare or decode) for many expected step times.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import time

from h3serve.pipelines.h3 import GeneratedMedia, GenerationRequest, RequestError, RequestState
from h3serve.pipelines.h3.lora import LoraSpec
from h3serve.pipelines.h3.pipeline import H3Pipeline
from h3serve.pipelines.h3.step_cache_tiers import StepCachePolicy

from . import scheduler
from .adapters import RuntimeAdapters
from .contract import (
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
from .requests import RequestTable, Stage, Ticket, check_rows, deadline_error, place
from .scheduler import Budget
from .stage_worker import LocalStages, RemoteStages, StageClient, StageLoop, Stages, StageWorker
from .supervisor import GroupSupervisor
from .warm_up import ClipWarmUp, WarmUp, WarmUps
from .worker_group import WorkerGroup

logger = logging.getLogger(__name__)


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
        self.pipeline: H3Pipeline = group.pipeline
        self.observer, self.remote, self.gate = observer, remote, gate
        self.executor = Executor(group, self.limits)
        self.warm_ups = WarmUps(self.executor, self.limits)
        self.requests = RequestTable()
        self.stage_worker = StageWorker(self.executor.device, self.limits.stage_nice)
        self.progress = Progress(self.requests, self.limits, self.pipeline, observer, self.stage_worker.run)
        self.stages: Stages = (
            LocalStages(self.pipeline, self.stage_worker, lambda: self.executor.group.tile_runner())
            if remote is None
            else RemoteStages(self.pipeline, self.stage_worker, remote, self.stats.handoff_bytes)
        )
        self._wake = asyncio.Event()  # the step loop: a request became ready, or the engine stops
        self.stage_loop = StageLoop(self.requests, self.stages, self.progress, self.limits, self._wake, self._poisoned)
        self._task: asyncio.Task | None = None
        self._stage_task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._ids, self._orders = itertools.count(), itertools.count()
        self.warmup_s: dict[str | None, float] = {}  # warm_up()'s forward seconds by adapter (None: the base model)
        self.last_warm_up: WarmUp | None = None  # what warm_up() ran and measured
        self.last_clip_warm_up: ClipWarmUp | None = None  # what warm_up_clip() ran
        self._progress_at = time.monotonic()  # the watchdog: when work arrived (the loops keep their own clocks)
        self.progress.observe("on_adapters", tuple(self.pipeline.denoiser.loras.loras))
        # held by each step, and by a run-time adapter's load between two steps (its warm-up forward on every rank)
        self.model_lock = asyncio.Lock()
        self.runtime_adapters = RuntimeAdapters(self.executor, self.warm_ups, self.requests, self.model_lock)

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
        if self.stage_loop.draining:
            raise EngineDraining("this replica is draining; retry on another replica")
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        check_priority(priority)
        request, rows, step_cache = self._checked(request, adapter)
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
            self._stage_task = loop.create_task(self.stage_loop.run(), context=contextvars.Context())
        self.stage_loop.wake.set()
        return ticket

    def validate(self, request: GenerationRequest, adapter: str | None = None) -> int:
        """About the rows the request adds to a pack; RequestError if the model, the adapter or the budget cannot
        take it."""
        return self._checked(request, adapter)[1]

    def _checked(
        self, request: GenerationRequest, adapter: str | None
    ) -> tuple[GenerationRequest, int, StepCachePolicy | None]:
        """The request as it runs on ``adapter``, its rows and its step-cache policy; or RequestError."""
        request = self.pipeline.with_adapter(request, adapter)
        rows = self.pipeline.validate(request)
        limit = self.limits.max_text_rows_per_step  # the prompt's tokens; keyframes add theirs at prepare
        check_rows(self.limits, rows, self.pipeline.text_tokens(request.prompt) if limit is not None else None)
        return request, rows, self.limits.step_cache.policy(request.cache)

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

    async def load_adapter(self, name: str, spec: LoraSpec) -> int:
        """Serve LoRA adapter ``name`` from now (``adapters.RuntimeAdapters.load``); its bytes on this rank."""
        nbytes = await self.runtime_adapters.load(name, spec)
        self.progress.observe("on_adapters", tuple(self.pipeline.denoiser.loras.loras))
        return nbytes

    async def unload_adapter(self, name: str, timeout_s: float | None = None) -> None:
        """Refuse new requests on ``name``; free it once its running requests finished (``RuntimeAdapters.unload``)."""
        try:
            await self.runtime_adapters.unload(name, timeout_s=timeout_s)
        finally:
            self.progress.observe("on_adapters", tuple(self.pipeline.denoiser.loras.loras))

    def load(self) -> EngineLoad:
        """What the replica reports to Serve's autoscaler: the backlog in row-steps and the measured rate."""
        return self.progress.load()

    # -- warm-up, health, drain, close --------------------------------------------------------
    def warmup_request(self) -> GenerationRequest:
        """The smallest request the model's rules allow: the shortest clip on the smallest canvas, one step."""
        return self.warm_ups.request()

    def warm_up(self, state: RequestState | None = None, peak: bool | None = None) -> float:
        """Prepare the smallest request and run one packed forward on every rank, discarding the result.

        Synchronous, before any submit (kernel setup and compilation land here, not on the first user). With LoRA
        adapters, one more forward per adapter (``warmup_s`` holds each forward's seconds).
        ``state``: ``warmup_request()`` already prepared elsewhere (a conditioner stage); None prepares it here.
        ``peak``: then the same request padded to ``max_rows_per_step`` on every rank, each rank's device measured
        and checked against the memory plan (``WarmUps.peak``: raises ``PlanExceeded``); None: on CUDA
        only (a CPU has no device memory to measure, and the forward at the budget costs the suite seconds).
        Returns the forward's seconds, which seed the watchdog's expected step time and the measured rate.
        """
        if self._task is not None:
            raise RuntimeError("warm_up() runs before the first submit")
        if peak is None:
            peak = self.executor.device.type == "cuda"
        warm = self.warm_ups.forwards(state, self.limits.max_rows_per_step if peak else None)
        self.last_warm_up = warm
        self.warmup_s = warm.by_adapter
        self.progress.meter.seed(warm.rows - warm.padding_rows, warm.seconds)
        return warm.seconds

    @property
    def clip_warm_up_due(self) -> bool:
        """Whether ``warm_up_clip`` runs at start (``limits.warmup_clip.enabled``, with the warm-up)."""
        return self.limits.warmup and self.limits.warmup_clip.enabled

    async def warm_up_clip(self) -> ClipWarmUp:
        """One whole request at the served size through this engine's stages and ranks, discarded, before the first
        submit (``WarmUps.clip``); raises ClipWarmUpRefused (the size) or what the clip's run raised."""
        if self._task is not None:
            raise RuntimeError("warm_up_clip() runs before the first submit")
        request = self.limits.warmup_clip.request()
        self.last_clip_warm_up = await self.warm_ups.clip(request, self.stages)
        return self.last_clip_warm_up

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
        # a replacement SP group loading (minutes on a GPU) is no stall: the supervisor bounds it by its startup timeout
        replacing = self.supervisor.replacing_since is not None
        if self._busy and not awaiting_stages and not replacing:
            quiet = time.monotonic() - max(self._progress_at, self.executor.progress_at, self.stage_loop.progress_at)
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
        self.stage_loop.draining = True
        handed_back = self.requests.hand_back()
        for ticket in handed_back:
            error = EngineDraining("this replica is draining; the request never started here")
            self.progress.fail(ticket, error, "draining")
        self.progress.report_queue()
        started = [t.future for t in self.requests.held()]
        logger.info("draining: %d handed back, %d started get %g s", len(handed_back), len(started), timeout_s)
        if started:
            await asyncio.wait(started, timeout=timeout_s)
        await self.close("the replica drained")

    async def close(self, reason: str = "engine closed") -> None:
        self._stop_reason = self._stop_reason or reason
        self._fail_all(EngineStopped(reason), "shutdown")
        self.stage_loop.stop()
        for task in (self._task, self._stage_task):
            if task is not None:
                task.cancel()
        self.executor.shutdown()
        self.stage_worker.shutdown()

    # -- the step loop: schedule, execute, apply, progress ------------------------------------
    async def _run(self) -> None:
        while not self._stop_reason:
            self.requests.leave_pack()
            if not self.requests.at(Stage.RESIDENT):
                self.stage_loop.wake.set()  # room to prepare
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
                    error = RuntimeError(f"request {ticket.id} failed; see the replica log")
                    self.progress.fail(ticket, error, "error")
                self.requests.clear([Stage.RESIDENT])

    async def _step(self) -> None:
        batch = self._schedule()
        gate = self.gate
        before = gate.before_forward if gate is not None and batch and acts_before_forward(gate) else None
        async with self.model_lock:
            outcome = await self.executor.step(batch, self.requests.with_states, before)
        self._apply(outcome)
        if outcome.broken is not None:  # it could not be replaced (counted there): only a new replica helps
            self._stop_reason = f"SP worker group failed: {outcome.broken}"
            self._fail_all(EngineStopped(self._stop_reason), "worker_group")
            self.stage_loop.stop()
            return
        if self.gate is not None and not batch:  # the gate held every request back: sleep until something changes
            self._wake.clear()
            await self._wake.wait()
            return
        for ticket in batch:
            if ticket.prepared.done and not ticket.future.done():  # its schedule is done: the stage worker decodes
                ticket.running = False
                self.requests.move(ticket, Stage.DENOISED)
        self.requests.leave_pack()
        self.stage_loop.wake.set()  # a finished, failed or cancelled request may have freed room to prepare another
        self.progress.account_busy(self._busy)
        self.progress.observe("on_duty_cycle", self.stats.duty_cycle)
        self.progress.report_queue()

    def _schedule(self) -> list[Ticket]:
        """This step's batch by the policy (among the gate's candidates, with a gate); running requests left out
        are paused (preemptions)."""
        resident, limits = self.requests.at(Stage.RESIDENT), self.limits
        candidates = resident if self.gate is None else gated(self.gate, self.requests, limits.policy, limits.aging_s)
        budget = Budget(limits.max_active, limits.max_rows_per_step, limits.max_text_rows_per_step)
        served = self.requests.served(limits.fair_share)
        now = time.monotonic()
        decision = scheduler.decide(resident, candidates, budget, limits.policy, now, limits.aging_s, served)
        for ticket in decision.batch:
            if not ticket.started:  # it enters a pack for the first time: its tenant is charged its whole work
                ticket.start_tag = self.requests.fair.charge(ticket.request.tenant, ticket.work)
        for ticket in resident:
            ticket.running = ticket in decision.batch
        if decision.paused:
            self.stats.preemptions += len(decision.paused)
            self.progress.observe("on_preempted", len(decision.paused))
            new = [t.id for t in decision.batch if not t.forwards]
            logger.info("paused %s at step boundary for %s (%s)", [t.id for t in decision.paused], new, limits.policy)
        return decision.batch

    def _apply(self, outcome: StepOutcome) -> None:
        """What the executor reports: failed attempts, then each forward's requests, then the requests that failed."""
        for reason in outcome.failed_steps:
            self.stats.failed_steps += 1
            self.progress.observe("on_failed_step", reason)
        self.stats.group_replacements += outcome.replaced
        for forward in outcome.forwards:
            self.progress.forward(forward.tickets, forward.errors, forward.stats, forward.seconds)
        for ticket, error, reason in outcome.failed:
            self.progress.fail(ticket, error, reason)

    # -- failures -----------------------------------------------------------------------------
    def _expire(self, ticket: Ticket) -> None:
        """The deadline timer: the request fails now, wherever it is; it leaves at its stage's next boundary."""
        if not ticket.future.done():
            self.progress.fail(ticket, deadline_error(ticket), "deadline")
            self._changed()

    def _changed(self) -> None:
        """A request left: waiting ones leave the queue at once (never counting against its bound), both loops look."""
        self.requests.drop_finished(Stage.WAITING)
        self.progress.report_queue()
        self._wake.set()
        self.stage_loop.wake.set()

    def _poisoned(self, why: str) -> None:
        """A CUDA-fatal error on this process outside a step (a prepare or decode on rank 0): the process is lost. The
        engine stops, health fails (Serve replaces the replica) and every request fails with EngineStopped, which the
        API answers 503 (a video job runs again elsewhere): never a failure of the request's own data."""
        reason = f"rank 0 hit a CUDA-fatal error: its process is lost: {why}"
        logger.error("%s; this replica stops and is replaced", reason)
        self.group.mark_broken(reason)
        self.supervisor.failed = self.supervisor.failed or reason
        self.stats.failed_steps += 1
        self.progress.observe("on_failed_step", "worker_group")
        self._stop_reason = self._stop_reason or reason
        self._fail_all(EngineStopped(reason), "worker_group")
        self.stage_loop.stop()
        self._wake.set()

    def _fail_all(self, error: Exception, reason: str) -> None:
        for ticket in self.requests.held():
            self.progress.fail(ticket, error, reason)
        self.requests.clear([Stage.WAITING, Stage.RESIDENT, Stage.DENOISED])
        self.progress.report_queue()
