"""Step-level continuous batching: every step packs the scheduled requests into one varlen forward.

A request passes through stages. It waits in a bounded queue (a full engine is refused at once); the
stage worker prepares it (diffusers' blocks: text encoding, layout, keyframes and references); it joins
the candidates of the next step boundary already prepared; each step, the scheduler
(``replicas/scheduler.py``, by ``limits.policy``) picks the batch within the request and row budget
and every request in it advances one denoising step in one packed forward (Ref2VA requests, which use
their own transformer partition, share a second one); when its schedule is done the stage worker
decodes it (both VAEs). Prepare and decode run on the stage worker's thread (on CUDA, on its own
stream), the forwards on the engine's one model thread, so neither a prepare nor a decode ever holds up
a step. The stage worker prepares ahead of the pack for at most ``limits.max_prepared`` requests:
prepared states held at once (ready, running or paused) are at most ``max_active + max_prepared``; at that
bound a waiting request that outranks a ready one that never stepped takes its room (that one waits again).

With stages of their own (``remote``: a ``StageClient``, deploy's Serve handles of a shared conditioner and
decoder) the stage worker keeps its place and order, but hands the work over: the conditioner returns the
prepared state as host tensors (``PreparedState``), which ``H3Pipeline.admit`` places on the model's device;
a finished request's rows go to the decoder on the host (``DecodeHandoff``), which returns the media, or its
PNG/MP4 bytes when ``submit`` named an ``output``. A stage's error fails that request alone (reason ``prepare``
or ``decode``); ``stats.handoff_bytes`` counts what crossed.

Under ``srpt`` and ``priority`` a running request the scheduler leaves out at a step boundary is paused
(a preemption): its latents and schedulers stay in its ``RequestState`` on the model's device, and it
resumes where it stopped, with the same output as if never paused. A ``StepGate`` (``Engine(gate=...)``, none by
default) is a rule above the policy: at each boundary it names which prepared requests may join the batch (the
LoRA benchmark's one-adapter-per-batch and merge-swap modes are gates); the ones it holds back wait, prepared.

Step caching (``limits.step_cache``): a request's ``cache`` tier resolves at submit to its First-Block-Cache
policy (``pipelines/h3/step_cache.py``), or to a RequestError("cache") naming the tiers. Its state lives in its
``RequestState``: kept while paused (it resumes deciding as if never paused), freed when its schedule finishes,
and when it fails or is cancelled at the next step boundary (never under a forward that may still read it).
Under Ulysses every worker rank holds the same states (``worker_group``), freed before the next pack.

Failures stay with the requests that cause them. A pack whose data fails (``PackFailed``: every rank left the step
at its agreement, the group is healthy) is retried in halves, down to single requests, so only a request that fails
on its own fails, and every other request of the pack still advances that step exactly once; the other partition's
pack and the waiting requests never see it. A failed attempt keeps only a description of its error, so its pack and
activations are freed before the halves run. A step that breaks the SP group (a rank failed past the agreement,
died, or the step outlived its bound ``step_bound_s``: ``WorkerGroupBroken``, every communicator aborted) gets a
new group (``replicas.supervisor``), and its requests run that step again on it, each alone: a request in the steps
of two groups that broke in a row fails naming the cause, the others go on. Only a group that cannot be replaced
(rank 0 stuck, or the replacement failed) stops the engine and fails everything with ``EngineStopped``. A failed
prepare or decode fails its request alone. A watchdog (``check_health``) reports a stall when work is active and
nothing completed (no step, no prepare, no decode) for many expected step times; ``drain`` hands back what never
started (waiting, being prepared, or prepared but never stepped) and lets the rest (running, paused, decoding)
finish.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import gc
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import torch

from pipelines.h3 import (
    DecodeHandoff,
    EncodedMedia,
    GeneratedMedia,
    GenerationRequest,
    PreparedState,
    RequestError,
    RequestState,
    StepStats,
)
from pipelines.h3.packing import Pack
from pipelines.h3.pipeline import payload_bytes
from pipelines.h3.step_cache import skipped_block_rows
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
from .scheduler import POLICIES as POLICIES  # the policies, re-exported where EngineLimits names them
from .scheduler import Budget, Policy, RequestView
from .supervisor import GroupSupervisor
from .worker_group import PackFailed, WorkerGroup, WorkerGroupBroken, describe, formatted

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StageClient(Protocol):
    """Conditioner and decoder stages of their own (deploy wires this to Serve deployment handles): the engine
    hands a request over to them instead of preparing or decoding it on its stage worker. Their errors are the
    request's (RequestError stays a RequestError), never the engine's."""

    async def prepare(self, request: GenerationRequest, shift: float | None) -> PreparedState: ...

    async def decode(self, handoff: DecodeHandoff, output: str | None) -> GeneratedMedia | EncodedMedia: ...


class EngineObserver(Protocol):
    """Where the engine reports what it does (deploy wires this to Prometheus)."""

    def on_step(self, stats: StepStats, seconds: float) -> None: ...

    def on_queue(self, waiting: int, active: int) -> None: ...

    def on_stage(self, stage: str, seconds: float) -> None: ...  # stage in STAGES

    def on_failed_step(self, reason: str) -> None: ...  # "pack" | "worker_group"

    def on_failed_request(self, reason: str) -> None: ...  # reason in FAILURE_REASONS

    def on_preempted(self, count: int) -> None: ...  # ``count`` requests paused at this step boundary

    def on_duty_cycle(self, fraction: float) -> None: ...  # after each step: forward time / busy time so far

    # optional (an observer without them is not told): LoRA adapters, names from the deployment's bounded set
    def on_adapters(self, served: Sequence[str]) -> None: ...  # once, when the engine starts: the adapters it serves

    # after each packed forward: its documents by adapter (None: the base model)
    def on_adapter_documents(self, documents: Mapping[str | None, int]) -> None: ...

    # one request's progress (REQUEST_EVENTS), for whoever follows it; on the engine's event loop
    def on_request_event(self, ticket: Ticket, kind: str, fields: dict[str, Any]) -> None: ...

    def on_cancelled(self, stage: str) -> None: ...  # stage in CANCEL_STAGES: where the request was when cancelled


# observer methods added after the first observers were written: the engine skips them on an observer without them
OPTIONAL_OBSERVER_METHODS = ("on_adapters", "on_adapter_documents", "on_request_event", "on_cancelled")


@dataclasses.dataclass
class EngineStats:
    forwards: int = 0  # successful packed forwards
    rows: int = 0
    padding_rows: int = 0
    completed: int = 0
    failed_steps: int = 0  # forwards (or packs that could not be built) that failed, isolation retries included
    failed_requests: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by reason
    preemptions: int = 0  # times an active request was paused at a step boundary for another
    forward_s: float = 0.0  # seconds spent in packed forwards
    skipped_block_rows: int = 0  # rows x transformer blocks step caching skipped
    busy_s: float = 0.0  # seconds with any work submitted and not finished
    group_replacements: int = 0  # SP groups replaced after a step broke them (replicas.supervisor)
    # with stages of their own (``StageClient``): bytes handed over, by direction: "prepared" (conditioner ->
    # denoiser), "latents" (denoiser -> decoder), "media" (decoder -> replica, encoded or raw)
    handoff_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    cancelled: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by CANCEL_STAGES
    # preview captures taken in a step, and previews rendered and shown: fewer when a newer capture replaced one
    # waiting for the stage worker, or a rendering ended after its request did
    preview_captures: int = 0
    previews: int = 0
    row_steps: int = 0  # rows (padding not counted) x denoising steps advanced by successful forwards

    @property
    def duty_cycle(self) -> float:
        """The share of busy time the model spent in forwards (0.0 before any work)."""
        return self.forward_s / self.busy_s if self.busy_s > 0 else 0.0


# the row-step rate is sampled over at least this many busy seconds (a GPU step of a released clip takes seconds),
# each sample weighing this much against the rate before it
RATE_WINDOW_S, RATE_SMOOTHING = 5.0, 0.5


class Ticket:
    """A submitted request: its future, progress, cost, deadline and priority."""

    def __init__(
        self,
        request_id: str,
        request: GenerationRequest,
        rows: int,
        loop: asyncio.AbstractEventLoop,
        deadline_s: float | None,
        priority: int = 0,
        order: int = 0,
    ):
        self.id, self.request, self.rows, self.deadline_s = request_id, request, rows, deadline_s
        self.text_rows = 0  # its prompt rows, known once prepared (the scheduler sees prepared requests only)
        self.priority, self.order = priority, order  # order: the engine's submission sequence number
        self.step_cache: StepCachePolicy | None = None  # its step-cache tier's policy (None: off)
        self.adapter: str | None = None  # the LoRA adapter it runs on (None: the base model)
        self.output: str | None = None  # "png"/"mp4": a decoder stage encodes it (the future holds EncodedMedia)
        self.future: asyncio.Future[GeneratedMedia | EncodedMedia] = loop.create_future()
        self.state: RequestState | None = None
        self.forwards = 0  # how many packed forwards this request was part of
        self.running = False  # in the batch of the current (or last) step
        self.changed = asyncio.Event()
        self.submitted = time.monotonic()
        # time.monotonic() of each stage's edge (TICKET_MARKS): where its latency went, for benchmarks.served_trace
        self.marks: dict[str, float] = {"submitted": self.submitted}
        self.first_step_done = False
        self.step_event_at = -math.inf  # time.monotonic() of its last step event (limits.step_events_every_s)
        self.prepares = 0  # more than one when it gave its prepared room to a request that outranks it
        # followed by a client (video jobs): previews under ``limits.preview``, and where it was last reported
        self.preview = False
        self.previewing = False  # a preview of it is being rendered (one at a time)
        self.pending_preview: tuple[torch.Tensor, int, int] | None = None  # the newest capture waiting for that one
        self.last_preview: tuple[int, float] = (0, 0.0)  # (step, time.monotonic()) of its last capture
        self.reported: tuple[int, float, float] | None = None  # queued: (position, eta_s, when) last reported
        self.breaks = 0  # SP groups broken in a row by steps it was in (reset by a step that succeeds)

    @property
    def progress(self) -> tuple[int, int]:
        if self.state is None:
            return 0, self.request.num_inference_steps - 1  # the schedule's model evaluations
        return self.state.progress

    @property
    def started(self) -> bool:
        """Whether it ever entered a step (a request prepared but never stepped has not started)."""
        return self.running or self.forwards > 0

    @property
    def prepared(self) -> RequestState:
        """The state of a prepared ticket (diffusers' blocks ran for it)."""
        assert self.state is not None, f"{self.id} has not been prepared"
        return self.state

    @property
    def cancelled(self) -> bool:
        return self.future.done() and self.future.cancelled()

    def view(self) -> RequestView:
        """What the scheduler sees (before prepare: the rows estimated at submit, every step left)."""
        done, total = self.progress
        return RequestView(
            id=self.id,
            order=self.order,
            submitted=self.submitted,
            rows=self.rows,
            text_rows=self.text_rows,
            steps_left=total - done,
            priority=self.priority,
            running=self.running,
        )


def lower_thread_priority(nice: int) -> None:
    """This thread's Linux niceness raised by ``nice`` (capped at 19), per thread (PRIO_PROCESS with its native id).
    Relative, since Ray starts its workers niced already (15) and lowering a niceness needs privilege. A no-op for 0
    and where the platform has no per-thread niceness."""
    if nice > 0 and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            logger.warning("cannot raise this thread's niceness by %d", nice, exc_info=True)


class StageWorker:
    """One thread for prepare and decode; on CUDA its work runs on a stream of its own.

    The stream keeps its VAE and text-encoder kernels from queueing behind the forwards on the model
    thread's stream. It is synchronized before a result is handed back, so the model thread only ever
    reads finished tensors; the model thread synchronizes its own stream at the end of every step
    (``Engine._apply``), so a decode only ever reads finished latents.
    """

    def __init__(self, device: torch.device, nice: int = 0):
        """``nice``: the thread's niceness above the step loop's (``EngineLimits.stage_nice``)."""
        self.executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="h3-stages", initializer=lower_thread_priority, initargs=(nice,)
        )
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = torch.cuda.Stream(device=torch.device("cuda", index))

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self.executor, self._on_stream, fn, *args)

    def _on_stream(self, fn: Callable[..., T], *args: Any) -> T:
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            result = fn(*args)
        self.stream.synchronize()  # every tensor of the result is complete before another thread reads it
        return result

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class StepBoundary:
    """What a ``StepGate`` sees at a step boundary (no forward in flight)."""

    prepared: tuple[Ticket, ...]  # prepared, not finished: ready (never stepped), running or paused; in held order
    waiting: tuple[Ticket, ...]  # submitted, not finished, not prepared yet (queued, or being prepared now)
    now: float  # time.monotonic() at this boundary
    policy: Policy  # the engine's ``limits.policy``
    aging_s: float  # the engine's ``limits.aging_s``

    def rank(self, ticket: Ticket) -> tuple[float, int]:
        """``ticket``'s place under the engine's policy at this boundary; lower runs first (``scheduler.rank_key``)."""
        return scheduler.rank_key(ticket.view(), self.policy, self.now, self.aging_s)


class StepGate:
    """A rule above the engine's policy: which prepared requests may join a step's batch (``Engine(gate=...)``).

    At every step boundary the engine asks ``candidates`` which of ``boundary.prepared`` may run this step; the
    policy, the request and row budget and preemption then choose the batch among those exactly as they do
    without a gate. A request the gate holds back waits, prepared, and is asked about again at the next boundary:
    nothing is dropped. A running request it leaves out is paused (counted as a preemption) and resumes, where it
    stopped, when a later boundary lets it in. When it lets none in, the step loop sleeps until a request is
    prepared, cancelled or passes its deadline, then asks again (a gate that never lets work in is a stall, which
    the watchdog reports).

    ``before_forward(batch)`` runs on the model thread once the batch is chosen, before its forward: the place for
    model state the batch needs (``benchmarks/lora.py`` fuses the batch's adapter there for sglang's merge-swap).
    An exception from either method is an engine fault: the prepared requests fail, the engine goes on.

    This base class lets every prepared request in and does nothing before a forward, so an engine with it
    schedules as one without a gate. Subclasses override either method (for example one LoRA adapter per batch).
    """

    def candidates(self, boundary: StepBoundary) -> Iterable[Ticket]:
        """The prepared requests (a subset of ``boundary.prepared``) that may run this step."""
        return boundary.prepared

    def before_forward(self, batch: Sequence[Ticket]) -> None:
        """On the model thread: ``batch`` (non-empty) is about to run one step."""
        return None


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
        self.supervisor = GroupSupervisor(group)  # replaces the SP group when a step breaks it
        self.pipeline, self.observer, self.remote = group.pipeline, observer, remote
        self.gate = gate
        self.limits = limits or EngineLimits()
        self.stats = EngineStats()
        self._waiting: list[Ticket] = []  # submitted, not yet prepared
        self._preparing: Ticket | None = None  # on the stage worker: diffusers' blocks running for it
        self._resident: list[Ticket] = []  # prepared, schedule not done: ready (never stepped), running, paused
        self._decoding: collections.deque[Ticket] = collections.deque()  # schedule done, decode not yet started
        self._decoding_now: Ticket | None = None  # on the stage worker: its VAE decodes running
        self._wake = asyncio.Event()  # the step loop: a request became ready, or the engine stops
        self._stage_wake = asyncio.Event()  # the stage worker: a request waits for prepare or decode
        self._task: asyncio.Task | None = None
        self._stage_task: asyncio.Task | None = None
        self._stop_reason: str | None = None
        self._draining = False
        self._ids = itertools.count()
        self._orders = itertools.count()
        # the watchdog: the expected step time (warm-up, then an EMA of steps) and the last completed work
        self.expected_step_s: float | None = None
        self.warmup_s: dict[str | None, float] = {}  # warm_up()'s forward seconds by adapter (None: the base model)
        self._progress_at = time.monotonic()
        self._stage_calls = 0  # calls to stage deployments in flight (``_awaiting_stage``)
        self._busy_since: float | None = None  # when the current stretch of busy time began (stats.busy_s)
        # ETAs: rows per second of forward (warm-up, then an EMA of steps), the last pack's rows, an EMA of decodes
        self.row_step_rate: float | None = None
        self._pack_rows = 0
        self._decode_s: float | None = None
        # the backlog row-step rate (``load``: over busy time, prepares and decodes too), and the busy seconds and
        # row-steps it was sampled at
        self.backlog_rate = 0.0
        self._backlog_rate_mark = (0.0, 0)
        self._device = self.pipeline.denoiser.device
        # one thread for all model work: steps must not interleave on the device
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-engine")
        self._stages = StageWorker(self._device, self.limits.stage_nice)
        self._check_step_cache()
        self._observe("on_adapters", tuple(self.pipeline.denoiser.loras.loras))

    @property
    def group(self) -> WorkerGroup:
        """The current SP group (a new one after a replacement)."""
        return self.supervisor.group

    @property
    def step_bound_s(self) -> float:
        """How long one step may take on every rank before it breaks the SP group (sp_degree > 1)."""
        expected = self.expected_step_s or 0.0
        return max(self.limits.step_timeout_min_s, self.limits.step_timeout_factor * expected)

    def _check_step_cache(self) -> None:
        """Refuse tiers this replica cannot run (the deploy args refuse them earlier, from the preset)."""
        for name, policy in self.limits.step_cache.tiers.items():
            try:
                self.pipeline.check_step_cache(policy)
            except ValueError as e:
                raise ValueError(f"engine.step_cache.tiers.{name}: {e}") from None

    def step_cache_policy(self, request: GenerationRequest) -> StepCachePolicy | None:
        """The policy of the request's ``cache`` tier (None: off), or RequestError("cache") naming what is allowed."""
        return self.limits.step_cache.policy(request.cache)

    # -- API ------------------------------------------------------------------------------
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
        self._drop_finished_waiting()
        # the engine holds a full pack plus a queue behind it, whatever stage each request is in (a cancelled
        # one leaves at the next step boundary, and no longer counts)
        if self._held() >= self.limits.capacity:
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
        self._waiting.append(ticket)
        if self._busy_since is None:  # busy time runs from the first submitted request to the last finished one
            self._busy_since = time.monotonic()
        logger.info(
            "request %s queued (%d rows, deadline %s s, priority %d, adapter %s)",
            ticket.id,
            rows,
            deadline_s,
            priority,
            adapter or "none",
        )
        self._report_queue()
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
        self._check_budget(rows)
        if self.limits.max_text_rows_per_step is not None:  # the prompt's tokens; keyframes add theirs at prepare
            self._check_text_budget(self.pipeline.text_tokens(request.prompt))
        self.step_cache_policy(request)
        return rows

    def _check_budget(self, rows: int) -> None:
        if rows > self.limits.max_rows_per_step:
            raise RequestError(
                "size",
                f"request needs {rows} rows per step, above this replica's budget of "
                f"{self.limits.max_rows_per_step}; ask for fewer pixels, frames or prompt tokens",
            )

    def _check_text_budget(self, text_rows: int) -> None:
        """A request whose prompt rows alone exceed a pack's would never be scheduled: refused instead."""
        limit = self.limits.max_text_rows_per_step
        if limit is not None and text_rows > limit:
            raise RequestError(
                "prompt",
                f"request needs {text_rows} prompt rows per step (its prompt's tokens and its keyframes' vision "
                f"tokens), above this replica's budget of {limit}; shorten the prompt",
            )

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
            stage = "waiting" if not ticket.started else "decoding" if ticket.prepared.done else "running"
            ticket.future.cancel()
            self.stats.cancelled[stage] += 1
            self._observe("on_cancelled", stage)
            logger.info("request %s cancelled (%s, step %d of %d)", ticket.id, stage, *ticket.progress)
        self._drop_finished_waiting()
        self._report_queue()
        self._wake.set()
        self._stage_wake.set()

    @property
    def queue_depth(self) -> tuple[int, int]:
        """(waiting, active): requests that never started (queued, being prepared, prepared but never
        stepped), and those that did (running, paused, being decoded)."""
        held = self._held_tickets()
        started = sum(t.started for t in held)
        return len(held) - started, started

    def load(self) -> EngineLoad:
        """The backlog (rows x steps left of every request held, an adapter's own step count included), the
        measured row-step rate, the oldest wait of a request not started and the tightest deadline slack."""
        now = time.monotonic()
        held = self._held_tickets()
        backlog = sum(t.rows * (t.progress[1] - t.progress[0]) for t in held)
        waits = [now - t.submitted for t in held if not t.started]
        slacks = [t.submitted + t.deadline_s - now for t in held if t.deadline_s is not None]
        started = sum(t.started for t in held)
        return EngineLoad(
            backlog_row_steps=backlog,
            row_step_rate=self._measure_backlog_rate(),
            oldest_wait_s=max(waits, default=0.0),
            deadline_slack_s=min(slacks, default=None),
            waiting=len(held) - started,
            active=started,
        )

    def _measure_backlog_rate(self) -> float:
        """Row-steps done per busy second since the last sample, once the sample spans ``RATE_WINDOW_S`` busy seconds
        and some steps; smoothed. Busy time counts prepares and decodes too: what a replica gets through in practice."""
        busy = self.stats.busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)
        busy_at, rows_at = self._backlog_rate_mark
        if busy - busy_at >= RATE_WINDOW_S and self.stats.row_steps > rows_at:
            sample = (self.stats.row_steps - rows_at) / (busy - busy_at)
            rate = self.backlog_rate
            self.backlog_rate = sample if rate == 0 else (1 - RATE_SMOOTHING) * rate + RATE_SMOOTHING * sample
            self._backlog_rate_mark = (busy, self.stats.row_steps)
        return self.backlog_rate

    def _held_tickets(self) -> list[Ticket]:
        """Every request the engine holds, whatever its stage, that has not finished."""
        tickets = [*self._waiting, *self._resident, *self._decoding]
        tickets += [t for t in (self._preparing, self._decoding_now) if t is not None]
        return [t for t in tickets if not t.future.done()]

    def _held(self) -> int:
        return len(self._held_tickets())

    # -- warm-up, health, drain, close ----------------------------------------------------
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
        Returns the forward's seconds, which seed the watchdog's expected step time.
        """
        if self._task is not None:
            raise RuntimeError("warm_up() runs before the first submit")
        started = time.perf_counter()
        state = self.pipeline.prepare(self.warmup_request()) if state is None else state
        ((_, pack),) = self.pipeline.packs([state])
        prepared = time.perf_counter()
        self.group(pack)
        seconds = time.perf_counter() - prepared
        self.expected_step_s = seconds
        self.row_step_rate = pack.total_rows / seconds if seconds > 0 else None
        self.warmup_s = {None: seconds}
        if seconds > 0:  # the backlog rate's seed, until steps are measured
            self.backlog_rate = (pack.total_rows - pack.padding_rows) / seconds
        logger.info(
            "warm-up: prepare %.2f s, one packed forward of %d rows on %d ranks %.2f s",
            prepared - started,
            pack.total_rows,
            self.group.sp_degree,
            seconds,
        )
        self._warm_up_adapters(state)
        return seconds

    def _warm_up_adapters(self, state: RequestState) -> None:
        """One more forward of the warm-up state per LoRA adapter, its documents on the adapter's slot: the adapter
        path's first-use costs (its GEMM shapes, the widened timestep path) land here, not on its first request."""
        slots = self.pipeline.denoiser.loras.slots
        own_slot = state.adapter_slot
        try:
            for name, slot in slots.items():
                state.adapter_slot = slot
                ((_, pack),) = self.pipeline.packs([state])
                started = time.perf_counter()
                self.group(pack)
                self.warmup_s[name] = time.perf_counter() - started
        finally:
            state.adapter_slot = own_slot
        if slots:
            logger.info(
                "warm-up through each LoRA adapter: %s",
                ", ".join(f"{name} {self.warmup_s[name]:.2f} s" for name in slots),
            )

    @property
    def stall_window_s(self) -> float:
        expected = self.expected_step_s or 0.0
        return max(self.limits.stall_min_s, self.limits.stall_factor * expected)

    @property
    def _busy(self) -> bool:
        """Whether any submitted request has not finished (whatever its stage)."""
        return bool(self._held_tickets())

    def _only_awaiting_stages(self) -> bool:
        """Whether the only work is a stage deployment's: a call to it in flight and nothing to step here. A stage
        replica that Serve is replacing can take minutes to load (Qwen3-VL); the stage's own health check covers
        a stage that hangs, and a step that hangs here with a call in flight is still caught (there is work to step)."""
        return self._stage_calls > 0 and all(t.future.done() for t in self._resident)

    def check_health(self) -> None:
        """Raise EngineStopped (closed, or the group broke), EngineStalled or WorkerGroupBroken."""
        if self._stop_reason:
            raise EngineStopped(self._stop_reason)
        if self._busy and not self._only_awaiting_stages():
            quiet = time.monotonic() - self._progress_at
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
        handed_back = [t for t in self._held_tickets() if not t.started]
        self._waiting.clear()
        self._resident = [t for t in self._resident if t.started]
        for ticket in handed_back:
            self._fail(ticket, EngineDraining("this replica is draining; the request never started here"), "draining")
        self._report_queue()
        started = [t.future for t in self._held_tickets()]
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
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._stages.shutdown()

    # -- the step loop: schedule, pack, forward on the model thread ---------------------------
    def _run_blocking(self, fn, *args) -> asyncio.Future[Any]:
        """Model work on the engine's one thread."""
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _drop_finished_resident(self) -> None:
        """At a step boundary (no forward in flight): failed or cancelled requests leave, their step caches freed."""
        for ticket in self._resident:
            if ticket.future.done() and ticket.state is not None:
                ticket.state.free_step_cache()
                ticket.state = None  # its rows and schedulers go with it (a finished one left for decoding before)
        self._resident = [t for t in self._resident if not t.future.done()]

    async def _run(self) -> None:
        while not self._stop_reason:
            self._drop_finished_resident()
            if not self._resident:
                self._stage_wake.set()  # room to prepare
                self._account_busy()
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._step_once()
            except WorkerGroupBroken as e:  # it could not be replaced (counted there): only a new replica helps
                self._stop_reason = f"SP worker group failed: {e}"
                self._fail_all(EngineStopped(self._stop_reason), "worker_group")
                self._stage_wake.set()  # the stage worker sees the stop
                return
            except Exception:  # a fault of the engine itself: fail the prepared requests, never the loop or the queue
                failed = self._resident
                logger.exception("engine step failed outside any pack (requests %s)", [t.id for t in failed])
                self.stats.failed_steps += 1
                self._observe("on_failed_step", "pack")
                for ticket in failed:
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed; see the replica log"), "error")
                self._resident = []

    def _schedule(self) -> list[Ticket]:
        """This step's batch by the policy (among the gate's candidates, with a gate); running requests left out
        are paused (preemptions)."""
        candidates = self._resident if self.gate is None else self._gated()
        by_order = {t.order: t for t in candidates}
        plan = scheduler.schedule(
            [t.view() for t in candidates],
            Budget(self.limits.max_active, self.limits.max_rows_per_step, self.limits.max_text_rows_per_step),
            self.limits.policy,
            time.monotonic(),
            self.limits.aging_s,
        )
        batch = [by_order[view.order] for view in plan.batch]
        # running requests the gate held back pause too (without a gate every resident request is a candidate)
        paused = [v.id for v in plan.preempted] + [
            t.id for t in self._resident if t.running and t.order not in by_order
        ]
        for ticket in self._resident:
            ticket.running = False
        for ticket in batch:
            ticket.running = True
        if paused:
            self.stats.preemptions += len(paused)
            self._observe("on_preempted", len(paused))
            logger.info(
                "paused %s at step boundary for %s (%s)",
                paused,
                [t.id for t in batch if not t.forwards],
                self.limits.policy,
            )
        return batch

    def _gated(self) -> list[Ticket]:
        """The prepared requests the gate lets into this step, in held order; RuntimeError for one it invents."""
        assert self.gate is not None
        waiting = [*self._waiting, *([self._preparing] if self._preparing is not None else [])]
        boundary = StepBoundary(
            prepared=tuple(t for t in self._resident if not t.future.done()),
            waiting=tuple(t for t in waiting if not t.future.done()),
            now=time.monotonic(),
            policy=self.limits.policy,
            aging_s=self.limits.aging_s,
        )
        allowed = set(map(id, self.gate.candidates(boundary)))
        prepared = set(map(id, boundary.prepared))
        if not allowed <= prepared:
            raise RuntimeError(f"the step gate {type(self.gate).__name__} named requests that are not prepared")
        return [t for t in boundary.prepared if id(t) in allowed]

    async def _step_once(self) -> None:
        if self.group.broken_reason:  # broken outside a step (a health check found a rank gone): no request's doing
            await self._replace_group(WorkerGroupBroken(self.group.broken_reason, recoverable=True))
        batch = self._schedule()
        if self.gate is not None:
            if not batch:  # the gate held every prepared request back: sleep until the engine's state changes
                self._wake.clear()
                await self._wake.wait()
                return
            if type(self.gate).before_forward is not StepGate.before_forward:
                await self._run_blocking(self.gate.before_forward, tuple(batch))
        partitions: dict[str, list[Ticket]] = {}
        for ticket in batch:  # one pack per transformer partition; a failure in one never touches the other
            partitions.setdefault(ticket.prepared.partition, []).append(ticket)
        for tickets in partitions.values():
            await self._advance(tickets)
        for ticket in batch:
            if ticket.prepared.done and not ticket.future.done():  # its schedule is done: the stage worker decodes
                ticket.running = False
                self._resident.remove(ticket)
                self._decoding.append(ticket)
                self._stage_wake.set()
        self._drop_finished_resident()
        self._stage_wake.set()  # a finished, failed or cancelled request may have freed room to prepare another
        self._account_busy()
        self._observe("on_duty_cycle", self.stats.duty_cycle)
        self._report_queue()

    async def _advance(self, tickets: list[Ticket]) -> None:
        """One step for ``tickets``; a pack whose data fails is retried in halves down to single requests; a step that
        breaks the SP group is run again on its replacement, each request alone."""
        tickets = [t for t in tickets if not t.future.done()]
        if not tickets:
            return
        try:
            error = await self._try_step(tickets)
        except WorkerGroupBroken as broken:  # every communicator aborted; raised on when it cannot be replaced
            await self._replace_group(broken)
            await self._after_break(tickets, broken.reason)
            return
        if error is None:
            return
        self.stats.failed_steps += 1
        self._observe("on_failed_step", "pack")
        ids = [t.id for t in tickets]
        await self._run_blocking(self._release_failed_attempt)  # before the retry: the failed forward's memory
        if len(tickets) == 1:
            (ticket,) = tickets
            logger.error("request %s failed on its own: %s", ticket.id, error)
            self._fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
            return
        logger.warning("a pack of requests %s failed (%s); retrying them in halves", ids, error)
        half = len(tickets) // 2
        await self._advance(tickets[:half])
        await self._advance(tickets[half:])

    async def _after_break(self, tickets: list[Ticket], reason: str) -> None:
        """The requests of a step that broke the SP group: each runs the step again alone, on the new group, so a
        request that breaks a second group in a row is the cause and fails naming it; the others go on."""
        for ticket in tickets:
            ticket.breaks += 1
            if ticket.breaks >= 2:
                self._fail(
                    ticket,
                    RuntimeError(
                        f"request {ticket.id} failed: steps it was in broke {ticket.breaks} SP groups in a row "
                        f"(last: {reason})"
                    ),
                    "worker_group",
                )
        for ticket in tickets:
            await self._advance([ticket])

    async def _replace_group(self, broken: WorkerGroupBroken) -> None:
        """A new SP group in place of the broken one (the engine's model thread builds it); raises WorkerGroupBroken
        when it cannot (rank 0 stuck, or the replacement failed to build): the engine then stops."""
        self.stats.failed_steps += 1
        self._observe("on_failed_step", "worker_group")
        if not broken.recoverable:  # rank 0's thread is stuck in the step: the model thread will not take the work
            self.supervisor.fail(broken)
        await self._run_blocking(self.supervisor.replace, broken)
        # The lost communicator's ranks held every caching request's residuals too; the new ones start without:
        # each caching request computes its next step in full (no request is ever fed a residual one rank lacks).
        for ticket in [*self._resident, *self._decoding]:
            if ticket.state is not None:
                ticket.state.free_step_cache()
        self.stats.group_replacements += 1
        self._progress_at = time.monotonic()

    def _release_failed_attempt(self) -> None:
        """On the model thread, after a failed attempt: its pack and activations go before any retry runs (cycles
        through its frames included); on CUDA the cached blocks go back too, so an attempt that ran out of memory
        does not leave its halves less room than it had."""
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    async def _try_step(self, tickets: list[Ticket]) -> str | None:
        """Pack, forward and advance ``tickets`` by one step; what failed (a description: the exception's traceback
        would hold the failed forward's frames, pack and activations), or None. Raises WorkerGroupBroken."""
        states = [t.prepared for t in tickets]
        try:
            ((states, pack),) = await self._run_blocking(self.pipeline.packs, states)  # on the model thread
        except Exception as e:  # the documents do not even pack together: their data
            logger.warning("requests %s do not pack together\n%s", [t.id for t in tickets], formatted(e))
            return describe(e)
        started = time.perf_counter()
        try:
            out = await self.group.forward_async(pack, self._run_blocking, self.step_bound_s)
            errors = await self._run_blocking(self._apply, states, pack, out)
        except PackFailed as e:
            return str(e)
        except WorkerGroupBroken:
            raise
        except Exception as e:
            logger.warning("requests %s: their step failed\n%s", [t.id for t in tickets], formatted(e))
            return describe(e)
        seconds = time.perf_counter() - started
        self._progress_at = time.monotonic()
        self.expected_step_s = seconds if self.expected_step_s is None else 0.8 * self.expected_step_s + 0.2 * seconds
        self._measure_rate(pack.total_rows, seconds)
        stats = StepStats(len(states), pack.total_rows, pack.padding_rows, skipped_block_rows(pack))
        self.stats.skipped_block_rows += stats.skipped_block_rows
        self.stats.forwards += 1
        self.stats.rows += stats.rows
        self.stats.padding_rows += stats.padding_rows
        self.stats.row_steps += stats.rows - stats.padding_rows
        self.stats.forward_s += seconds
        self._observe("on_step", stats, seconds)
        self._observe("on_adapter_documents", collections.Counter(t.adapter for t in tickets))
        self._stage("step", seconds)
        for ticket, error in zip(tickets, errors, strict=True):
            ticket.breaks = 0
            if ticket.future.done():  # cancelled or past its deadline during the forward: it has left
                continue
            if error is not None:  # each request applies its own velocities: one bad output never half-advances another
                logger.error("request %s: applying its step failed: %s", ticket.id, describe(error))
                self._fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
                continue
            ticket.forwards += 1
            ticket.marks["last_step"] = time.monotonic()
            if not ticket.first_step_done:
                ticket.first_step_done = True
                ticket.marks["first_step"] = ticket.marks["last_step"]
                self._stage("first_step", time.monotonic() - ticket.submitted)
                self._event(ticket, "started")
            self._after_step(ticket)
            ticket.changed.set()
        return None

    def _apply(
        self, states: list[RequestState], pack: Pack, out: tuple[torch.Tensor, torch.Tensor]
    ) -> list[Exception | None]:
        """On the model thread: advance each state by its share of the forward; each one's error, or None."""
        errors: list[Exception | None] = []
        for state, (video, audio) in zip(states, pack.split(*out), strict=True):
            try:
                state.advance(video, audio)
                errors.append(None)
            except Exception as e:
                errors.append(e)
        if self._device.type == "cuda":
            # the step is finished on the device before anyone reads its latents (a decode on the stage
            # stream) or frees a state whose memory the stage stream could then reuse
            torch.cuda.current_stream(self._device).synchronize()
        return errors

    # -- the stage worker: prepare ahead of the pack, decode after it ---------------------------------
    async def _run_stages(self) -> None:
        while not self._stop_reason:
            ticket: Ticket | None = None
            try:
                self._decoding = collections.deque(t for t in self._decoding if not t.future.done())
                ticket = self._next_to_prepare()
                model_idle = not any(not t.future.done() for t in self._resident)
                if ticket is not None and (model_idle or not self._decoding):
                    await self._prepare(ticket)  # an idle model thread needs a request more than a finished one
                elif self._decoding:
                    ticket = self._decoding.popleft()
                    await self._decode(ticket)
                else:
                    ticket = None
                    self._account_busy()
                    self._stage_wake.clear()
                    await self._stage_wake.wait()
            except Exception:  # a fault of the engine itself: fail the request at hand, never the stage worker
                logger.exception("the stage worker failed outside a prepare or decode (request %s)", ticket)
                if ticket is None:
                    await asyncio.sleep(1.0)  # no request to fail; the watchdog reports it if it persists
                else:
                    self._fail(ticket, RuntimeError(f"request {ticket.id} failed; see the replica log"), "error")

    def _next_to_prepare(self) -> Ticket | None:
        """The waiting request the policy serves first, while the prepared states held stay within the bound."""
        if self._draining or self._stop_reason:
            return None
        self._drop_finished_waiting()
        if not self._waiting:
            return None
        now, policy, aging_s = time.monotonic(), self.limits.policy, self.limits.aging_s
        best = min(self._waiting, key=lambda t: scheduler.rank_key(t.view(), policy, now, aging_s))
        resident = [t for t in self._resident if not t.future.done()]
        if len(resident) < self.limits.max_active + self.limits.max_prepared:
            return best
        # at the bound: a prepared request that never stepped and ranks below ``best`` gives its room back (only
        # its prepare is lost); running and paused ones keep theirs. Under fcfs nothing waiting outranks them.
        never_stepped = [t for t in resident if not t.started]
        if not never_stepped:
            return None
        worst = max(never_stepped, key=lambda t: scheduler.rank_key(t.view(), policy, now, aging_s))
        if scheduler.rank_key(best.view(), policy, now, aging_s) >= scheduler.rank_key(
            worst.view(), policy, now, aging_s
        ):
            return None
        self._resident.remove(worst)
        worst.state = None  # its prepared state is freed; it is prepared again when its turn comes
        self._waiting.append(worst)
        logger.info("request %s gives its prepared room to %s (%s) and waits again", worst.id, best.id, policy)
        return best

    async def _prepare(self, ticket: Ticket) -> None:
        self._waiting.remove(ticket)
        if not ticket.prepares:  # a request that gave its prepared room back waits on, and is timed once
            self._stage("queue_wait", time.monotonic() - ticket.submitted)
        ticket.prepares += 1
        self._preparing = ticket
        started = time.perf_counter()
        ticket.marks["prepare"] = time.monotonic()
        try:
            if self.remote is None:
                state = await self._stages.run(self.pipeline.prepare, ticket.request, ticket.step_cache, ticket.adapter)
            else:
                state = await self._prepare_remote(ticket)
            self._check_budget(state.rows)  # the estimate at submit was short (keyframe vision tokens)
            self._check_text_budget(state.text_rows)
        except Exception as e:
            logger.warning("request %s: prepare failed", ticket.id, exc_info=True)
            self._fail(ticket, e, "prepare")
            return
        finally:
            self._preparing = None
            self._progress_at = time.monotonic()
        self._stage("prepare", time.perf_counter() - started)
        ticket.marks["prepared"] = time.monotonic()
        if ticket.future.done():  # cancelled, past its deadline or handed back while being prepared
            return
        ticket.state, ticket.rows, ticket.text_rows = state, state.rows, state.text_rows
        if self._previews(ticket):  # its first step shows the first clean prediction
            self.pipeline.request_preview(state, self.limits.preview.frames)
        self._resident.append(ticket)
        logger.info("request %s prepared (%d rows, %d steps)", ticket.id, state.rows, state.steps)
        self._report_queue()
        self._wake.set()

    @contextlib.contextmanager
    def _awaiting_stage(self):
        """Around a call to a stage deployment: the watchdog does not count it as this engine's stall."""
        self._stage_calls += 1
        try:
            yield
        finally:
            self._stage_calls -= 1

    async def _prepare_remote(self, ticket: Ticket) -> RequestState:
        """The conditioner stage prepares it; its host tensors become this pipeline's state on the stage worker."""
        _, shift = self.pipeline.check_prepare(ticket.request, ticket.step_cache, ticket.adapter)  # refuse before
        assert self.remote is not None
        with self._awaiting_stage():
            prepared = await self.remote.prepare(ticket.request, shift)
        self.stats.handoff_bytes["prepared"] += prepared.nbytes
        logger.info("request %s: %d prepared bytes from the conditioner stage", ticket.id, prepared.nbytes)
        return await self._stages.run(self.pipeline.admit, ticket.request, prepared, ticket.step_cache, ticket.adapter)

    async def _decode_remote(self, ticket: Ticket) -> GeneratedMedia | EncodedMedia:
        """The decoder stage decodes (and encodes, for ``ticket.output``) its latents, copied to the host once."""
        assert self.remote is not None
        handoff = await self._stages.run(self.pipeline.decode_handoff, ticket.prepared)
        self.stats.handoff_bytes["latents"] += handoff.nbytes
        with self._awaiting_stage():
            media = await self.remote.decode(handoff, ticket.output)
        media_bytes = len(media.data) if isinstance(media, EncodedMedia) else payload_bytes(media)
        self.stats.handoff_bytes["media"] += media_bytes
        logger.info(
            "request %s: %d latent bytes to the decoder stage, %d media bytes back",
            ticket.id,
            handoff.nbytes,
            media_bytes,
        )
        return media

    async def _decode(self, ticket: Ticket) -> None:
        if ticket.future.done():
            return
        self._decoding_now = ticket
        self._event(ticket, "decoding", eta_s=self._decode_s)
        started = time.perf_counter()
        ticket.marks["decode"] = time.monotonic()
        try:
            if self.remote is None:
                media: GeneratedMedia | EncodedMedia = await self._stages.run(self.pipeline.decode, ticket.prepared)
            else:
                media = await self._decode_remote(ticket)
        except Exception as e:
            logger.error("request %s: decode failed", ticket.id, exc_info=True)
            self._fail(ticket, e, "decode")
            return
        finally:
            self._decoding_now = None
            self._progress_at = time.monotonic()
            self._account_busy()
        seconds = time.perf_counter() - started
        ticket.marks["decoded"] = time.monotonic()
        self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
        self._stage("decode", seconds)
        if ticket.future.done():
            return
        ticket.future.set_result(media)
        self.stats.completed += 1
        end_to_end = time.monotonic() - ticket.submitted
        self._stage("end_to_end", end_to_end)
        self._report_queue()
        logger.info("request %s done in %.2f s (%d forwards)", ticket.id, end_to_end, ticket.forwards)

    # -- failures -------------------------------------------------------------------------
    def _expire(self, ticket: Ticket) -> None:
        """The deadline timer: the request fails now, wherever it is; it leaves at its stage's next boundary."""
        if ticket.future.done():
            return
        if not ticket.started:
            where = "before it started"
        elif ticket.state is not None and ticket.state.done:
            where = "while decoding"
        else:
            where = "in the pack"
        error = DeadlineExceeded(
            f"request {ticket.id} passed its deadline of {ticket.deadline_s:g} s {where} "
            f"(step {ticket.progress[0]} of {ticket.progress[1]})"
        )
        self._fail(ticket, error, "deadline")
        self._drop_finished_waiting()
        self._report_queue()
        self._wake.set()
        self._stage_wake.set()

    def _fail(self, ticket: Ticket, error: Exception, reason: str) -> None:
        if ticket.future.done():
            return
        ticket.future.set_exception(error)
        self.stats.failed_requests[reason] += 1
        self._observe("on_failed_request", reason)
        if reason != "error":  # isolation logged the request's own failure with its traceback
            logger.warning("request %s failed (%s): %s", ticket.id, reason, error)

    def _fail_all(self, error: Exception, reason: str) -> None:
        for ticket in self._held_tickets():
            self._fail(ticket, error, reason)
        self._resident = []
        self._waiting.clear()
        self._decoding.clear()
        self._report_queue()

    def _drop_finished_waiting(self) -> None:
        """Cancelled waiting requests leave the queue at once, so they never count against its bound."""
        if any(t.future.done() for t in self._waiting):
            self._waiting = [t for t in self._waiting if not t.future.done()]

    def _account_busy(self) -> None:
        """Add the busy time since the last call to ``stats.busy_s``; a stretch ends when no work is left."""
        now = time.monotonic()
        if self._busy_since is not None:
            self.stats.busy_s += now - self._busy_since
        self._busy_since = now if self._busy else None

    # -- a followed request's events: queue position, ETA, steps, previews -------------------------
    def _measure_rate(self, rows: int, seconds: float) -> None:
        """The replica's row-step rate (rows of packed forward per second), an EMA of steps: what ETAs divide by."""
        self._pack_rows = rows
        if seconds > 0:
            rate = rows / seconds
            self.row_step_rate = rate if self.row_step_rate is None else 0.8 * self.row_step_rate + 0.2 * rate

    @staticmethod
    def _work(ticket: Ticket) -> int:
        """Its remaining row-steps (0 once its schedule is done)."""
        done, total = ticket.progress
        return ticket.rows * max(total - done, 0)

    def _queued(self) -> list[Ticket]:
        """Requests that never started, in the order the policy would start them."""
        now, policy, aging_s = time.monotonic(), self.limits.policy, self.limits.aging_s
        return sorted(
            (t for t in self._held_tickets() if not t.started),
            key=lambda t: scheduler.rank_key(t.view(), policy, now, aging_s),
        )

    def queue_position(self, ticket: Ticket) -> int | None:
        """1 for the next request to start; None once it started (or finished)."""
        queued = self._queued()
        return queued.index(ticket) + 1 if ticket in queued else None

    def eta_s(self, ticket: Ticket) -> float | None:
        """Seconds until its media is decoded, from the measured row-step rate; None before any forward ran.

        Queued: the row-steps of every started request and of those queued ahead of it, then its own. Running: its
        steps left at the last pack's rows. An EMA of decodes is added."""
        rate, decode = self.row_step_rate, self._decode_s or 0.0
        if ticket.future.done() or rate is None:
            return None
        if ticket.state is not None and ticket.state.done:
            return decode
        if ticket.started:
            done, total = ticket.progress
            return (total - done) * max(self._pack_rows, ticket.rows) / rate + decode
        ahead = sum(self._work(t) for t in self._held_tickets() if t.started)
        for other in self._queued():
            ahead += self._work(other)
            if other is ticket:
                break
        return ahead / rate + decode

    def _report_positions(self) -> None:
        """A queued event for each request whose position changed, or whose ETA moved a second (at most 1/s)."""
        if self.observer is None or not hasattr(self.observer, "on_request_event"):
            return
        rate, decode = self.row_step_rate, self._decode_s or 0.0
        ahead = sum(self._work(t) for t in self._held_tickets() if t.started)
        now = time.monotonic()
        for position, ticket in enumerate(self._queued(), 1):
            ahead += self._work(ticket)
            eta = None if rate is None else ahead / rate + decode
            last = ticket.reported
            moved = last is not None and eta is not None and abs(eta - last[1]) >= 1.0 and now - last[2] >= 1.0
            if last is None or last[0] != position or moved:
                ticket.reported = (position, -1.0 if eta is None else eta, now)
                self._event(ticket, "queued", position=position, eta_s=eta)

    def _previews(self, ticket: Ticket) -> bool:
        return ticket.preview and self.limits.preview.enabled and self.pipeline.preview_map is not None

    def _after_step(self, ticket: Ticket) -> None:
        """After a step of ``ticket``: its step event, the render of a preview captured in it, and whether its next
        step captures one (``limits.preview``: every N steps or S seconds, whichever first; one rendering at a time)."""
        state = ticket.prepared
        done, total = state.progress
        every_s, now = self.limits.step_events_every_s, time.monotonic()
        if state.done or not every_s or now - ticket.step_event_at >= every_s:
            ticket.step_event_at = now
            self._event(ticket, "step", step=done, steps=total, eta_s=self.eta_s(ticket))
        if state.preview is not None:
            self.stats.preview_captures += 1
            rows, state.preview = state.preview, None
            ticket.last_preview = (done, time.monotonic())
            if ticket.previewing:  # the stage worker is busy (a decode, a prepare): the newest capture waits
                ticket.pending_preview = (rows, done, total)
            else:
                self._render_preview(ticket, rows, done, total)
        if not self._previews(ticket) or state.done or state.preview_index is not None:
            return
        policy, (last_step, last_at) = self.limits.preview, ticket.last_preview
        due_steps = policy.every_steps is not None and done + 1 - last_step >= policy.every_steps
        due_time = policy.every_s is not None and time.monotonic() - last_at >= policy.every_s
        if due_steps or due_time:
            self.pipeline.request_preview(state, policy.frames)

    def _render_preview(self, ticket: Ticket, rows: torch.Tensor, step: int, steps: int) -> None:
        """The map's matmul and a PNG on the stage worker; reported when done, unless the request finished."""
        ticket.previewing = True
        layout = self.pipeline.preview_layout(ticket.prepared)
        rendering = self._stages.run(self.pipeline.render_preview, rows, layout)

        def rendered(future: asyncio.Future[bytes]) -> None:
            ticket.previewing = False
            if future.cancelled() or ticket.future.done():
                ticket.pending_preview = None
                return
            if future.exception() is not None:  # a preview never fails its request
                logger.warning("request %s: preview failed: %r", ticket.id, future.exception())
            else:
                self.stats.previews += 1
                self._event(ticket, "preview", step=step, steps=steps, png=future.result())
            if ticket.pending_preview is not None:
                pending, ticket.pending_preview = ticket.pending_preview, None
                self._render_preview(ticket, *pending)

        rendering.add_done_callback(rendered)

    def _event(self, ticket: Ticket, kind: str, **fields: Any) -> None:
        self._observe("on_request_event", ticket, kind, fields)

    # -- observing --------------------------------------------------------------------------
    def _stage(self, stage: str, seconds: float) -> None:
        self._observe("on_stage", stage, seconds)

    def _report_queue(self) -> None:
        self._observe("on_queue", *self.queue_depth)
        self._report_positions()

    def _observe(self, method: str, *args: Any) -> None:
        """Report to the observer; a failing observer is logged and never fails a request."""
        if self.observer is None:
            return
        if method in OPTIONAL_OBSERVER_METHODS and not hasattr(self.observer, method):
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("engine observer %s failed", method)
