"""Rules above the engine's policy, for benchmarks and tests: a ``StepGate`` (``Engine(gate=...)``, none by default).

The engine core asks a gate through one seam (``gated``) at each step boundary, and runs its ``before_forward`` on
the model thread before the batch's forwards. The LoRA benchmark's one-adapter-per-batch and merge-swap modes are
gates.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

from . import scheduler
from .requests import RequestTable, Stage, Ticket
from .scheduler import Policy


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


def acts_before_forward(gate: StepGate) -> bool:
    """Whether ``gate.before_forward`` is overridden (the engine skips the model thread's round trip otherwise)."""
    return type(gate).before_forward is not StepGate.before_forward


def gated(gate: StepGate, table: RequestTable, policy: Policy, aging_s: float) -> list[Ticket]:
    """The prepared requests ``gate`` lets into this step, in held order; RuntimeError for one it invents."""
    boundary = StepBoundary(
        prepared=tuple(table.live(Stage.RESIDENT)),
        waiting=tuple([*table.live(Stage.WAITING), *table.live(Stage.PREPARING)]),
        now=time.monotonic(),
        policy=policy,
        aging_s=aging_s,
    )
    allowed = set(map(id, gate.candidates(boundary)))
    prepared = set(map(id, boundary.prepared))
    if not allowed <= prepared:
        raise RuntimeError(f"the step gate {type(gate).__name__} named requests that are not prepared")
    return [t for t in boundary.prepared if id(t) in allowed]
