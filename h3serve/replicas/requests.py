"""The request table: every ticket the engine holds, and the one place that says where each one is.

A ticket moves through the stages in order (``Stage``); the table keeps one ordered set per stage, so the step loop
and the stage worker read plain lists and every "which requests are still live" question has one answer
(``live``, ``held``). A ticket whose future is done (completed, failed, cancelled) may still sit at its stage until
that stage's next boundary (``drop_finished``): a resident one keeps its state until no forward can read it.

Where a request is, as callers name it (``place``: CANCEL_STAGES), follows from whether it ever stepped and whether
its schedule is done, not from its list: a request prepared but never stepped is still "waiting" (drain hands it
back, the queue counts it), one whose schedule finished mid-step is already "decoding".
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Iterable

import torch

from h3serve.pipelines.h3 import EncodedMedia, GeneratedMedia, GenerationRequest, RequestError, RequestState
from h3serve.pipelines.h3.step_cache_tiers import StepCachePolicy

from .contract import DeadlineExceeded, EngineLimits
from .scheduler import FairShare, RequestView


class Stage(enum.Enum):
    WAITING = "waiting"  # submitted, not prepared yet
    PREPARING = "preparing"  # on the stage worker: diffusers' blocks run for it
    RESIDENT = "resident"  # prepared, schedule not done: ready (never stepped), running or paused
    DENOISED = "denoised"  # schedule done: waits for the stage worker to decode it
    DECODING = "decoding"  # on the stage worker: its VAE decodes run
    DONE = "done"  # left the table


# the order in which ``held`` lists the stages (the queued ones first, the two stage-worker slots last)
HELD_ORDER = (Stage.WAITING, Stage.RESIDENT, Stage.DENOISED, Stage.PREPARING, Stage.DECODING)


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
        self.stage = Stage.WAITING  # kept by the RequestTable
        self.text_rows = 0  # its prompt rows, known once prepared (the scheduler sees prepared requests only)
        self.priority, self.order = priority, order  # order: the engine's submission sequence number
        self.step_cache: StepCachePolicy | None = None  # its step-cache tier's policy (None: off)
        self.adapter: str | None = None  # the LoRA adapter it runs on (None: the base model)
        self.output: str | None = None  # "png"/"mp4": a decoder stage encodes it (the future holds EncodedMedia)
        self.future: asyncio.Future[GeneratedMedia | EncodedMedia] = loop.create_future()
        self.state: RequestState | None = None
        self.forwards = 0  # how many packed forwards this request was part of
        self.running = False  # in the batch of the current (or last) step
        self.changed = asyncio.Event()  # set after each of its forwards (benchmarks follow steps by it)
        self.submitted = time.monotonic()
        # time.monotonic() of each stage's edge (TICKET_MARKS): where its latency went, for benchmarks.served_trace
        self.marks: dict[str, float] = {"submitted": self.submitted}
        self.first_step_done = False
        self.step_event_at = -math.inf  # time.monotonic() of its last step event (limits.step_events_every_s)
        self.prepares = 0  # more than one when it gave its prepared room to a request that outranks it
        # followed by a client (video jobs): previews under ``limits.preview``, and where it was last reported
        self.preview = False
        self.stream = False  # followed video: its MP4 streamed while it decodes (``fragment`` events)
        self.previewing = False  # a preview of it is being rendered (one at a time)
        self.pending_preview: tuple[torch.Tensor, int, int] | None = None  # the newest capture waiting for that one
        self.last_preview: tuple[int, float] = (0, 0.0)  # (step, time.monotonic()) of its last capture
        self.reported: tuple[int, float, float] | None = None  # queued: (position, eta_s, when) last reported
        self.start_tag = 0  # its tenant's fair-share charge when it first entered a pack (``scheduler.FairShare``)
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

    @property
    def work(self) -> int:
        """Its remaining row-steps (0 once its schedule is done)."""
        done, total = self.progress
        return self.rows * max(total - done, 0)

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
            started=self.started,
            tenant=self.request.tenant,
            start_tag=self.start_tag,
        )


def place(ticket: Ticket) -> str:
    """Where a request is, in CANCEL_STAGES' words: "waiting" (never stepped), "running" (its schedule not done:
    in the pack, or paused), "decoding" (its schedule done)."""
    if not ticket.started:
        return "waiting"
    if ticket.state is not None and ticket.state.done:
        return "decoding"
    return "running"


class RequestTable:
    """Every ticket the engine holds, by stage, each stage in the order its tickets arrived there."""

    def __init__(self) -> None:
        # one insertion-ordered set per stage (a dict's keys)
        self._at: dict[Stage, dict[Ticket, None]] = {stage: {} for stage in Stage if stage is not Stage.DONE}
        self.fair = FairShare()  # the row-steps charged to each tenant with work held (``served``)

    def add(self, ticket: Ticket) -> None:
        ticket.stage = Stage.WAITING
        self._at[Stage.WAITING][ticket] = None

    def move(self, ticket: Ticket, stage: Stage) -> None:
        """``ticket`` leaves its stage for the end of ``stage`` (DONE: it leaves the table)."""
        if ticket.stage is not Stage.DONE:
            self._at[ticket.stage].pop(ticket, None)
        ticket.stage = stage
        if stage is not Stage.DONE:
            self._at[stage][ticket] = None

    def at(self, stage: Stage) -> list[Ticket]:
        """The tickets at ``stage``, finished ones included (they leave at the stage's next boundary)."""
        return list(self._at[stage])

    def live(self, stage: Stage) -> list[Ticket]:
        """The tickets at ``stage`` that have not finished."""
        return [t for t in self._at[stage] if not t.future.done()]

    def first(self, stage: Stage) -> Ticket | None:
        return next(iter(self._at[stage]), None)

    def held(self) -> list[Ticket]:
        """Every request the engine holds, whatever its stage, that has not finished."""
        return [t for stage in HELD_ORDER for t in self._at[stage] if not t.future.done()]

    def unstarted(self) -> list[Ticket]:
        """Held requests that never stepped (queued, being prepared, prepared but never stepped)."""
        return [t for t in self.held() if not t.started]

    def served(self, fair_share: bool) -> dict[str | None, int] | None:
        """What the scheduler's tenant turns read (``scheduler.FairShare``); None when ``fair_share`` is off."""
        return self.fair.served(t.request.tenant for t in self.held()) if fair_share else None

    def depth(self) -> tuple[int, int]:
        """(waiting, active): held requests that never started, and those that did (running, paused, decoding)."""
        held = self.held()
        started = sum(t.started for t in held)
        return len(held) - started, started

    def drop_finished(self, stage: Stage) -> list[Ticket]:
        """Finished tickets leave ``stage``; returns them."""
        gone = [t for t in self._at[stage] if t.future.done()]
        for ticket in gone:
            self.move(ticket, Stage.DONE)
        return gone

    def leave_pack(self) -> None:
        """At a step boundary (no forward in flight): finished resident requests leave, their states freed (their
        step caches, rows and schedulers)."""
        for ticket in self.drop_finished(Stage.RESIDENT):
            if ticket.state is not None:
                ticket.state.free_step_cache()
                ticket.state = None

    def with_states(self) -> list[Ticket]:
        """The requests whose states may hold step caches (resident and denoised ones)."""
        return [*self._at[Stage.RESIDENT], *self._at[Stage.DENOISED]]

    def hand_back(self) -> list[Ticket]:
        """Every held request that never started, out of the table (a drain fails them); one being prepared stays
        until its prepare ends."""
        unstarted = self.unstarted()
        for ticket in [*self._at[Stage.WAITING], *self._at[Stage.RESIDENT]]:
            if not ticket.started:
                self.move(ticket, Stage.DONE)
        return unstarted

    def clear(self, stages: Iterable[Stage]) -> None:
        for stage in stages:
            for ticket in self.at(stage):
                self.move(ticket, Stage.DONE)


def deadline_error(ticket: Ticket) -> DeadlineExceeded:
    where = {"waiting": "before it started", "running": "in the pack", "decoding": "while decoding"}[place(ticket)]
    return DeadlineExceeded(
        f"request {ticket.id} passed its deadline of {ticket.deadline_s:g} s {where} "
        f"(step {ticket.progress[0]} of {ticket.progress[1]})"
    )


def check_rows(limits: EngineLimits, rows: int, text_rows: int | None) -> None:
    """RequestError when a request's rows (or its prompt rows: None, not known yet) exceed a pack's budget: it would
    never be scheduled."""
    if rows > limits.max_rows_per_step:
        raise RequestError(
            "size",
            f"request needs {rows} rows per step, above this replica's budget of "
            f"{limits.max_rows_per_step}; ask for fewer pixels, frames or prompt tokens",
        )
    limit = limits.max_text_rows_per_step
    if limit is not None and text_rows is not None and text_rows > limit:
        raise RequestError(
            "prompt",
            f"request needs {text_rows} prompt rows per step (its prompt's tokens and its keyframes' vision "
            f"tokens), above this replica's budget of {limit}; shorten the prompt",
        )
