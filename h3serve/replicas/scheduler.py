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

Fair sharing between tenants (issue 55; ``served``, kept by a ``FairShare``): start-time fair queuing by row-steps.
Each tenant's requests keep the policy's order and the tenants take turns, one request a turn, the turn going to the
least tag: a started request's is its tenant's charge when it started (``start_tag``), a new one's its tenant's
charge now; a request charges its tenant its whole work (rows x steps left) when it first enters a pack. Tenants
share only within a priority class (the request's ``priority`` under "priority", one class otherwise), and a turn
never displaces a running request the policy ranks first (no tenant's backlog holds another's newcomer for more than
the requests already running). With one tenant (or none: no key file) the order is the policy's, unchanged.
docs/DESIGN.md says why this rule.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
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
    tenant: str | None = None  # who asked (a key file's tenant name; None: no tenants)
    start_tag: int = 0  # once started: its tenant's charge (``FairShare``) just before it first entered a pack

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


# the row-steps each tenant with work held has been charged (``FairShare.served``); None: fair sharing off
Served = Mapping[str | None, int] | None


def rank(
    views: Iterable[RequestView], policy: Policy, now: float, aging_s: float, served: Served = None
) -> list[RequestView]:
    """``views`` in the order ``policy`` serves them at ``now``; with ``served``, tenants of one class take turns."""
    ordered = sorted(views, key=lambda view: rank_key(view, policy, now, aging_s))
    if served is None or len({view.tenant for view in ordered}) < 2:
        return ordered  # one tenant (or none): the policy alone, exactly
    return turns(ordered, policy, now, aging_s, served)


def turns(
    ordered: list[RequestView], policy: Policy, now: float, aging_s: float, served: Mapping[str | None, int]
) -> list[RequestView]:
    """Merge the tenants' queues (each in ``ordered``'s policy order): at each pick, the policy's first head runs if
    it is running; otherwise, among the heads of its class, the one with the least tag (ties: the policy). A started
    request's tag is its tenant's charge when it started, a new one's its tenant's charge now (start-time fair
    queuing: a started request is not overtaken for the charge it brought itself). A pick that would start a request
    charges its tenant its work, so the next turn goes to another tenant."""
    queues: dict[str | None, collections.deque[RequestView]] = {}
    for view in ordered:
        queues.setdefault(view.tenant, collections.deque()).append(view)
    charged = {tenant: served.get(tenant, 0) for tenant in queues}

    def key(view: RequestView) -> tuple[float, int]:
        return rank_key(view, policy, now, aging_s)

    def cls(view: RequestView) -> int:
        return view.priority if policy == "priority" else 0

    merged: list[RequestView] = []
    while queues:
        heads = [queue[0] for queue in queues.values()]
        pick = min(heads, key=key)
        if not pick.running:  # fairness never displaces a running request the policy ranks first
            peers = (h for h in heads if cls(h) == cls(pick))
            pick = min(peers, key=lambda h: (h.start_tag if h.started else charged[h.tenant], key(h)))
        merged.append(queues[pick.tenant].popleft())
        if not queues[pick.tenant]:
            del queues[pick.tenant]
        if not pick.started:
            charged[pick.tenant] += pick.work
    return merged


class FairShare:
    """The row-steps charged to each tenant with work held: a request's whole work (rows x steps left) when it first
    enters a pack. A tenant that had nothing held starts at the virtual time, the start tag of the latest request to
    start (start-time fair queuing): level with the tenants being served, so it banks no credit while idle and takes
    the next turn, never a burst of its own."""

    def __init__(self) -> None:
        self._charged: dict[str | None, int] = {}
        self.virtual = 0

    def served(self, tenants: Iterable[str | None]) -> dict[str | None, int]:
        """The charges of ``tenants`` (those with work held now); the others are forgotten."""
        held = set(tenants)
        for gone in self._charged.keys() - held:
            del self._charged[gone]
        for new in held - self._charged.keys():
            self._charged[new] = self.virtual
        return dict(self._charged)

    def charge(self, tenant: str | None, row_steps: int) -> int:
        """Charge ``tenant`` for a request entering a pack; returns the charge before it (the request's start tag)."""
        before = self._charged.get(tenant, self.virtual)
        self._charged[tenant] = before + row_steps
        self.virtual = max(self.virtual, before)
        return before


def schedule(
    views: Sequence[RequestView], budget: Budget, policy: Policy, now: float, aging_s: float, served: Served = None
) -> Schedule:
    """One step's batch: the candidates in rank order (``served``: tenants' turns), each taken while the budget holds.

    A candidate whose rows (or prompt rows) do not fit beside those already taken is skipped and the next one
    tried, so a pack never exceeds ``budget.max_rows`` (nor ``budget.max_text_rows``) and a smaller request fills
    the rest. Running requests left out are preempted (paused).
    """
    batch: list[RequestView] = []
    rows = text_rows = 0
    max_text = budget.max_text_rows if budget.max_text_rows is not None else budget.max_rows
    for view in rank(views, policy, now, aging_s, served):
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
    resident: Sequence[S],
    candidates: Sequence[S],
    budget: Budget,
    policy: Policy,
    now: float,
    aging_s: float,
    served: Served = None,
) -> Decision[S]:
    """``schedule`` over ``candidates`` (the resident requests a gate lets in; all of them without one): a running
    request left out of the batch is paused, whether the policy or the gate left it out."""
    by_order = {request.order: request for request in candidates}
    plan = schedule([request.view() for request in candidates], budget, policy, now, aging_s, served)
    paused = [by_order[view.order] for view in plan.preempted]
    paused += [request for request in resident if request.running and request.order not in by_order]
    return Decision([by_order[view.order] for view in plan.batch], paused)


def admit(
    waiting: Sequence[S],
    prepared: Sequence[S],
    room: int,
    policy: Policy,
    now: float,
    aging_s: float,
    served: Served = None,
) -> tuple[S | None, S | None]:
    """(the waiting request to prepare next, the prepared one that gives its room to it), either None.

    The waiting request the policy serves first, while fewer than ``room`` states are prepared. At the bound, a
    prepared request that never stepped and ranks below it gives its room back; running and paused ones keep theirs
    (under fcfs nothing waiting outranks them). With ``served``, in the tenants' turns (``rank``)."""
    if not waiting:
        return None, None
    if served is not None and len({request.view().tenant for request in [*waiting, *prepared]}) > 1:
        return _admit_in_turns(waiting, prepared, room, policy, now, aging_s, served)
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


def _admit_in_turns(
    waiting: Sequence[S],
    prepared: Sequence[S],
    room: int,
    policy: Policy,
    now: float,
    aging_s: float,
    served: Mapping[str | None, int],
) -> tuple[S | None, S | None]:
    """``admit`` over the tenants' turns: the first waiting request in the merged order, and at the bound the last
    never-stepped prepared one, if it comes after."""
    by_order = {request.order: request for request in [*waiting, *prepared]}
    order = [view.order for view in rank([r.view() for r in by_order.values()], policy, now, aging_s, served)]
    queued = {request.order for request in waiting}
    best = by_order[next(o for o in order if o in queued)]
    if len(prepared) < room:
        return best, None
    never_stepped = {request.order for request in prepared if not request.view().started}
    if not never_stepped:
        return None, None
    worst = by_order[next(o for o in reversed(order) if o in never_stepped)]
    if order.index(best.order) >= order.index(worst.order):
        return None, None
    return best, worst
