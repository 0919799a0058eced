"""What the engine measures and tells: stats, the one measured rate, ETAs and queue positions, previews, events.

One rate (``RateMeter``): row-steps (each request's own rows, padding not counted, times the denoising steps it
advanced) per second of busy time (any work held: prepares and decodes count, as they hold the replica too),
sampled over windows of ``RATE_WINDOW_S`` busy seconds and smoothed, seeded by the warm-up's forward. The backlog the
autoscaler divides by it (``Engine.load``) and the ETAs a followed request sees (``eta_s``) are both in row-steps,
so the drain time Serve plans on and the time a user is told agree by construction.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from h3serve.pipelines.h3 import StepStats
from h3serve.pipelines.h3.lora_spec import adapter_names
from h3serve.pipelines.h3.pipeline import H3Pipeline

from . import scheduler
from .contract import EngineLimits, EngineLoad
from .requests import RequestTable, Ticket

logger = logging.getLogger(__name__)

# the rate is sampled over at least this many busy seconds (a GPU step of a released clip takes seconds), each
# sample weighing this much against the rate before it
RATE_WINDOW_S, RATE_SMOOTHING = 5.0, 0.5


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

    # after each packed forward: its seconds split by tenant, each request's share its rows' share of the pack's
    # (tenants named by the ingress from its key file, a bounded set; requests without a tenant are not reported)
    def on_tenant_forward_s(self, seconds: Mapping[str, float]) -> None: ...

    # one request's progress (REQUEST_EVENTS), for whoever follows it; on the engine's event loop
    def on_request_event(self, ticket: Ticket, kind: str, fields: dict[str, Any]) -> None: ...

    def on_cancelled(self, stage: str) -> None: ...  # stage in CANCEL_STAGES: where the request was when cancelled


# observer methods added after the first observers were written: the engine skips them on an observer without them
OPTIONAL_OBSERVER_METHODS = (
    "on_adapters",
    "on_adapter_documents",
    "on_request_event",
    "on_cancelled",
    "on_tenant_forward_s",
)


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
    group_replacements: int = 0  # SP groups replaced after a step broke them (h3serve.replicas.supervisor)
    # with stages of their own (``StageClient``): bytes handed over, by direction: "prepared" (conditioner ->
    # denoiser), "latents" (denoiser -> decoder), "media" (decoder -> replica, encoded or raw)
    handoff_bytes: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    cancelled: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)  # by CANCEL_STAGES
    # preview captures taken in a step, and previews rendered and shown: fewer when a newer capture replaced one
    # waiting for the stage worker, or a rendering ended after its request did
    preview_captures: int = 0
    previews: int = 0
    row_steps: int = 0  # rows (padding not counted) x denoising steps advanced by successful forwards
    # forward seconds by tenant (None: requests without one): each request's rows' share of each pack it was in
    tenant_forward_s: collections.defaultdict[str | None, float] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(float)
    )

    @property
    def duty_cycle(self) -> float:
        """The share of busy time the model spent in forwards (0.0 before any work)."""
        return self.forward_s / self.busy_s if self.busy_s > 0 else 0.0


class Ema:
    """An exponential moving average; ``value`` None until the first sample (or a seed)."""

    def __init__(self, weight: float):
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        value = self.value
        self.value = sample if value is None else (1 - self.weight) * value + self.weight * sample


class RateMeter:
    """The replica's row-step rate: row-steps per busy second (see the module's docstring)."""

    def __init__(self, window_s: float = RATE_WINDOW_S, weight: float = RATE_SMOOTHING):
        self.window_s, self._ema = window_s, Ema(weight)
        self._mark = (0.0, 0)  # the busy seconds and row-steps of the last sample

    @property
    def rate(self) -> float | None:
        return self._ema.value

    def seed(self, row_steps: int, seconds: float) -> None:
        """The warm-up's forward: the rate until steps are measured."""
        if seconds > 0:
            self._ema.value = row_steps / seconds

    def sample(self, busy_s: float, row_steps: int) -> None:
        """A sample once ``window_s`` busy seconds passed since the last one with steps done (unseeded: at once)."""
        busy_at, rows_at = self._mark
        unmeasured = not self._ema.value  # None, or a warm-up too fast to time
        if row_steps > rows_at and busy_s > busy_at and (busy_s - busy_at >= self.window_s or unmeasured):
            sample = (row_steps - rows_at) / (busy_s - busy_at)
            if unmeasured:
                self._ema.value = sample
            else:
                self._ema.add(sample)
            self._mark = (busy_s, row_steps)


class Progress:
    """Stats, the rate, the decode time and every report of the engine: the queue, a request's events, previews."""

    def __init__(
        self,
        table: RequestTable,
        limits: EngineLimits,
        pipeline: H3Pipeline,
        observer: EngineObserver | None,
        on_stage_thread: Callable[..., asyncio.Future[Any]],
    ):
        """``on_stage_thread``: runs a function on the stage worker's thread (``StageWorker.run``): previews render
        there."""
        self.table, self.limits, self.pipeline, self.observer = table, limits, pipeline, observer
        self._on_stage_thread = on_stage_thread
        self.stats = EngineStats()
        self.meter = RateMeter()
        self.decode_s = Ema(0.2)  # an EMA of decodes: the last leg of every ETA
        self._pack_rows = 0  # the last pack's rows, padding not counted: a running request's steps cost this much
        self._busy_since: float | None = None  # when the current stretch of busy time began (stats.busy_s)

    # -- busy time and the rate ---------------------------------------------------------------
    def account_busy(self, busy: bool) -> None:
        """Add the busy time since the last call to ``stats.busy_s``; a stretch ends when no work is left."""
        now = time.monotonic()
        if self._busy_since is not None:
            self.stats.busy_s += now - self._busy_since
        self._busy_since = now if busy else None

    def start_busy(self) -> None:
        if self._busy_since is None:  # busy time runs from the first submitted request to the last finished one
            self._busy_since = time.monotonic()

    def busy_s(self) -> float:
        """Busy seconds so far, the current stretch included."""
        return self.stats.busy_s + (time.monotonic() - self._busy_since if self._busy_since is not None else 0.0)

    def forward(
        self, tickets: Sequence[Ticket], errors: Sequence[Exception | None], stats: StepStats, seconds: float
    ) -> None:
        """One packed forward ran: each request advanced one step, or failed applying its share (the others of the
        pack advanced all the same)."""
        self._pack_rows = stats.rows - stats.padding_rows
        self.stats.skipped_block_rows += stats.skipped_block_rows
        self.stats.forwards += 1
        self.stats.rows += stats.rows
        self.stats.padding_rows += stats.padding_rows
        self.stats.row_steps += stats.rows - stats.padding_rows
        self.stats.forward_s += seconds
        self.meter.sample(self.busy_s(), self.stats.row_steps)
        self.observe("on_step", stats, seconds)
        # by adapter name (a composed request's document counts once for each of its adapters; None: the base model)
        adapters = collections.Counter(name for t in tickets for name in adapter_names(t.adapter))
        self.observe("on_adapter_documents", adapters)
        self.tenant_shares(tickets, seconds)
        self.stage("step", seconds)
        for ticket, error in zip(tickets, errors, strict=True):
            if ticket.future.done():  # cancelled or past its deadline during the forward: it has left
                continue
            if error is not None:  # its own velocities failed to apply
                logger.error("request %s: applying its step failed: %s: %s", ticket.id, type(error).__name__, error)
                self.fail(ticket, RuntimeError(f"request {ticket.id} failed: {error}"), "error")
            else:
                self.stepped(ticket)

    def tenant_shares(self, tickets: Sequence[Ticket], seconds: float) -> None:
        """A forward's seconds split among its requests' tenants by rows (padding shared in proportion)."""
        rows = sum(t.rows for t in tickets)
        if not rows:
            return
        shares: collections.defaultdict[str | None, float] = collections.defaultdict(float)
        for ticket in tickets:
            shares[ticket.request.tenant] += seconds * ticket.rows / rows
        for tenant, share in shares.items():
            self.stats.tenant_forward_s[tenant] += share
        named = {tenant: s for tenant, s in shares.items() if tenant is not None}
        if named:
            self.observe("on_tenant_forward_s", named)

    def load(self) -> EngineLoad:
        """The backlog (rows x steps left of every request held, an adapter's own step count included), the
        measured rate, the oldest wait of a request not started and the tightest deadline slack."""
        now, held = time.monotonic(), self.table.held()
        slacks = [t.submitted + t.deadline_s - now for t in held if t.deadline_s is not None]
        waiting, active = self.table.depth()
        return EngineLoad(
            backlog_row_steps=sum(t.work for t in held),
            row_step_rate=self.meter.rate or 0.0,
            oldest_wait_s=max((now - t.submitted for t in held if not t.started), default=0.0),
            deadline_slack_s=min(slacks, default=None),
            waiting=waiting,
            active=active,
        )

    # -- ETAs and queue positions -------------------------------------------------------------
    def queued(self) -> list[Ticket]:
        """Requests that never started, in the order the policy (and the tenants' turns) would start them."""
        now, policy, aging_s = time.monotonic(), self.limits.policy, self.limits.aging_s
        unstarted = {t.order: t for t in self.table.unstarted()}
        served = self.table.served(self.limits.fair_share)
        return [
            unstarted[v.order]
            for v in scheduler.rank([t.view() for t in unstarted.values()], policy, now, aging_s, served)
        ]

    def queue_position(self, ticket: Ticket) -> int | None:
        """1 for the next request to start; None once it started (or finished)."""
        queued = self.queued()
        return queued.index(ticket) + 1 if ticket in queued else None

    def eta_s(self, ticket: Ticket) -> float | None:
        """Seconds until its media is decoded, from the measured rate; None before any rate was measured.

        Queued: the row-steps of every started request and of those queued ahead of it, then its own. Running: its
        steps left at the last pack's rows. An EMA of decodes is added."""
        rate, decode = self.meter.rate, self.decode_s.value or 0.0
        if ticket.future.done() or rate is None:
            return None
        if ticket.state is not None and ticket.state.done:
            return decode
        if ticket.started:
            done, total = ticket.progress
            return (total - done) * max(self._pack_rows, ticket.rows) / rate + decode
        ahead = sum(t.work for t in self.table.held() if t.started)
        for other in self.queued():
            ahead += other.work
            if other is ticket:
                break
        return ahead / rate + decode

    def report_queue(self) -> None:
        """The queue's depth, and a queued event for each request whose position changed, or whose ETA moved a second
        (at most 1/s)."""
        self.observe("on_queue", *self.table.depth())
        if self.observer is None or not hasattr(self.observer, "on_request_event"):
            return
        rate, decode = self.meter.rate, self.decode_s.value or 0.0
        ahead = sum(t.work for t in self.table.held() if t.started)
        now = time.monotonic()
        for position, ticket in enumerate(self.queued(), 1):
            ahead += ticket.work
            eta = None if rate is None else ahead / rate + decode
            last = ticket.reported
            moved = last is not None and eta is not None and abs(eta - last[1]) >= 1.0 and now - last[2] >= 1.0
            if last is None or last[0] != position or moved:
                ticket.reported = (position, -1.0 if eta is None else eta, now)
                self.event(ticket, "queued", position=position, eta_s=eta)

    # -- a request's steps and previews -------------------------------------------------------
    def previews(self, ticket: Ticket) -> bool:
        return ticket.preview and self.limits.preview.enabled and self.pipeline.preview_map is not None

    def prepared(self, ticket: Ticket) -> None:
        if self.previews(ticket):  # its first step shows the first clean prediction
            self.pipeline.request_preview(ticket.prepared, self.limits.preview.frames)

    def stepped(self, ticket: Ticket) -> None:
        """After a step of ``ticket``: its marks, its step event, the render of a preview captured in it, and whether
        its next step captures one (``limits.preview``: every N steps or S seconds, whichever first; one rendering at
        a time)."""
        ticket.forwards += 1
        ticket.marks["last_step"] = time.monotonic()
        if not ticket.first_step_done:
            ticket.first_step_done = True
            ticket.marks["first_step"] = ticket.marks["last_step"]
            self.stage("first_step", time.monotonic() - ticket.submitted)
            self.event(ticket, "started")
        state = ticket.prepared
        done, total = state.progress
        every_s, now = self.limits.step_events_every_s, time.monotonic()
        if state.done or not every_s or now - ticket.step_event_at >= every_s:
            ticket.step_event_at = now
            self.event(ticket, "step", step=done, steps=total, eta_s=self.eta_s(ticket))
        if state.preview is not None:
            self.stats.preview_captures += 1
            rows, state.preview = state.preview, None
            ticket.last_preview = (done, time.monotonic())
            if ticket.previewing:  # the stage worker is busy (a decode, a prepare): the newest capture waits
                ticket.pending_preview = (rows, done, total)
            else:
                self._render_preview(ticket, rows, done, total)
        if self.previews(ticket) and not state.done and state.preview_index is None:
            policy, (last_step, last_at) = self.limits.preview, ticket.last_preview
            due_steps = policy.every_steps is not None and done + 1 - last_step >= policy.every_steps
            due_time = policy.every_s is not None and time.monotonic() - last_at >= policy.every_s
            if due_steps or due_time:
                self.pipeline.request_preview(state, policy.frames)
        ticket.changed.set()

    def _render_preview(self, ticket: Ticket, rows: torch.Tensor, step: int, steps: int) -> None:
        """The map's matmul and a PNG on the stage worker; reported when done, unless the request finished."""
        ticket.previewing = True
        layout = self.pipeline.preview_layout(ticket.prepared)
        rendering = self._on_stage_thread(self.pipeline.render_preview, rows, layout)

        def rendered(future: asyncio.Future[bytes]) -> None:
            ticket.previewing = False
            if future.cancelled() or ticket.future.done():
                ticket.pending_preview = None
                return
            if future.exception() is not None:  # a preview never fails its request
                logger.warning("request %s: preview failed: %r", ticket.id, future.exception())
            else:
                self.stats.previews += 1
                self.event(ticket, "preview", step=step, steps=steps, png=future.result())
            if ticket.pending_preview is not None:
                pending, ticket.pending_preview = ticket.pending_preview, None
                self._render_preview(ticket, *pending)

        rendering.add_done_callback(rendered)

    def fail(self, ticket: Ticket, error: Exception, reason: str) -> None:
        """``ticket`` fails (a no-op once finished), counted by ``reason`` (FAILURE_REASONS)."""
        if ticket.future.done():
            return
        ticket.future.set_exception(error)
        self.stats.failed_requests[reason] += 1
        self.observe("on_failed_request", reason)
        if reason != "error":  # isolation logged the request's own failure with its traceback
            logger.warning("request %s failed (%s): %s", ticket.id, reason, error)

    # -- telling the observer -----------------------------------------------------------------
    def event(self, ticket: Ticket, kind: str, **fields: Any) -> None:
        self.observe("on_request_event", ticket, kind, fields)

    def stage(self, stage: str, seconds: float) -> None:
        self.observe("on_stage", stage, seconds)

    def observe(self, method: str, *args: Any) -> None:
        """Report to the observer; a failing observer is logged and never fails a request."""
        if self.observer is None:
            return
        if method in OPTIONAL_OBSERVER_METHODS and not hasattr(self.observer, method):
            return
        try:
            getattr(self.observer, method)(*args)
        except Exception:
            logger.exception("engine observer %s failed", method)
