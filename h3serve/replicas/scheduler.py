"""Which requests one step packs: a pure function from request views and a budget to one step's batch.

Modelled on vLLM v1's scheduler: the engine builds plain views of its candidates at every step boundary
(requests that are prepared: running, paused, or ready and never stepped), ``schedule`` ranks them by
the deployment's policy and fills the budget in that order, and preemption is nothing but a state
change: a request that ran in the previous step and is not in this one is paused, its latents and
schedulers untouched in its ``RequestState``, and it resumes whenever a later ``schedule`` picks it again.
Nothing here touches a tensor, a thread or a clock: ``now`` is an argument, so tests drive it.

The policies (``rank_key``):

- ``fcfs``: submission order. A request is skipped only when its rows do not fit beside earlier ones
  (a smaller later one may run meanwhile), so a running request is never displaced by a later one.
- ``srpt``: least remaining work first, work = rows x model evaluations left, so short clips overtake
  long ones. Aging halves the key for every ``aging_s`` since submission: a long request outranks any
  newly arriving one of work ``w`` once it has waited ``aging_s * log2(its work / w)``.
- ``priority``: higher priority first, plus one level for every ``aging_s`` since submission; a
  request of priority ``p`` outranks every newly arriving one of priority ``q`` once it has waited
  ``(q - p) * aging_s``.

Age counts from submission whatever the request does (queued, running or paused): two requests' ranks
then change only as their remaining work does, never back and forth, so preemption never thrashes.
Ties go to the earlier submission. ``rank`` orders a waiting queue the same way, with the work estimated at
submit: ``admit`` names the request the stage worker prepares next, and, when the prepared states held are at their
bound, the prepared request that never stepped and gives its room to it (it waits again; only its prepare is lost).
``decide`` and ``admit`` take the engine's requests themselves (anything ``Schedulable``) and return them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Generic, Literal, Protocol, TypeVar

Policy = Literal["fcfs", "srpt", "priority"]
POLICIES: tuple[Policy, ...] = ("fcfs", "srpt", "priority")


@dataclasses.dataclass(frozen=True)
class RequestView:
    """What the scheduler knows of one request."""

    id: str
    order: int  # submission sequence number: fcfs order and every tie-break
    submitted: float  # monotonic seconds at submit; its age is ``now - submitted``
    rows: int  # rows it adds to a pack
    steps_left: int  # model evaluations (packed forwards) it still needs
    priority: int = 0
    running: bool = False  # it was in the previous step's batch
    text_rows: int = 0  # of its rows, the prompt rows
    started: bool = False  # it ever stepped (running now, or before)

    @property
    def work(self) -> int:
        """Remaining work: rows x model evaluations left."""
        return self.rows * self.steps_left


@dataclasses.dataclass(frozen=True)
class Budget:
    """One step's limits: requests in the batch, rows in its packs and prompt rows among them (all partitions
    together; ``max_text_rows`` None: only ``max_rows`` bounds them)."""

    max_requests: int
    max_rows: int
    max_text_rows: int | None = None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One step: the batch to advance, in rank order, and the running requests it pauses."""

    batch: tuple[RequestView, ...]
    preempted: tuple[RequestView, ...]

    @property
    def rows(self) -> int:
        return sum(view.rows for view in self.batch)


def rank_key(view: RequestView, policy: Policy, now: float, aging_s: float) -> tuple[float, int]:
    """Smaller ranks first; ties by submission order."""
    age_levels = max(0.0, now - view.submitted) / aging_s
    if policy == "fcfs":
        return 0.0, view.order
    if policy == "srpt":
        # work * 2**-age, in log2 so that a long wait never underflows to a tie at zero
        return math.log2(max(view.work, 1)) - age_levels, view.order
    if policy == "priority":
        return -(view.priority + age_levels), view.order
    raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")


def rank(views: Iterable[RequestView], policy: Policy, now: float, aging_s: float) -> list[RequestView]:
    """``views`` in the order ``policy`` serves them at ``now``."""
    return sorted(views, key=lambda view: rank_key(view, policy, now, aging_s))


def schedule(views: Sequence[RequestView], budget: Budget, policy: Policy, now: float, aging_s: float) -> Schedule:
    """One step's batch: the candidates in rank order, each taken while the budget holds.

    A candidate whose rows (or prompt rows) do not fit beside those already taken is skipped and the next one
    tried, so a pack never exceeds ``budget.max_rows`` (nor ``budget.max_text_rows``) and a smaller request fills
    the rest. Running requests left out are preempted (paused).
    """
    batch: list[RequestView] = []
    rows = text_rows = 0
    max_text = budget.max_text_rows if budget.max_text_rows is not None else budget.max_rows
    for view in rank(views, policy, now, aging_s):
        if len(batch) == budget.max_requests:
            break
        if rows + view.rows <= budget.max_rows and text_rows + view.text_rows <= max_text:
            batch.append(view)
            rows += view.rows
            text_rows += view.text_rows
    chosen = {view.id for view in batch}
    preempted = tuple(view for view in views if view.running and view.id not in chosen)
    return Schedule(tuple(batch), preempted)


class Schedulable(Protocol):
    """What the engine hands the scheduler for each request (a ``Ticket``): its view and the fields it maps back by."""

    @property
    def order(self) -> int: ...

    @property
    def running(self) -> bool: ...

    def view(self) -> RequestView: ...


S = TypeVar("S", bound=Schedulable)


@dataclasses.dataclass(frozen=True)
class Decision(Generic[S]):
    """One step boundary's decision: the batch in rank order, and the running requests it pauses."""

    batch: list[S]
    paused: list[S]


def decide(
    resident: Sequence[S], candidates: Sequence[S], budget: Budget, policy: Policy, now: float, aging_s: float
) -> Decision[S]:
    """``schedule`` over ``candidates`` (the resident requests a gate lets in; all of them without one): a running
    request left out of the batch is paused, whether the policy or the gate left it out."""
    by_order = {request.order: request for request in candidates}
    plan = schedule([request.view() for request in candidates], budget, policy, now, aging_s)
    paused = [by_order[view.order] for view in plan.preempted]
    paused += [request for request in resident if request.running and request.order not in by_order]
    return Decision([by_order[view.order] for view in plan.batch], paused)


def admit(
    waiting: Sequence[S], prepared: Sequence[S], room: int, policy: Policy, now: float, aging_s: float
) -> tuple[S | None, S | None]:
    """(the waiting request to prepare next, the prepared one that gives its room to it), either None.

    The waiting request the policy serves first, while fewer than ``room`` states are prepared. At the bound, a
    prepared request that never stepped and ranks below it gives its room back; running and paused ones keep theirs
    (under fcfs nothing waiting outranks them)."""
    if not waiting:
        return None, None
    best = min(waiting, key=lambda request: rank_key(request.view(), policy, now, aging_s))
    if len(prepared) < room:
        return best, None
    never_stepped = [request for request in prepared if not request.view().started]
    if not never_stepped:
        return None, None
    worst = max(never_stepped, key=lambda request: rank_key(request.view(), policy, now, aging_s))
    if rank_key(best.view(), policy, now, aging_s) >= rank_key(worst.view(), policy, now, aging_s):
        return None, None
    return best, worst
