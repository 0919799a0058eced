"""Faults injected into a rank's step at named points, for tests only: raise, hang, freeze or kill there.

Nothing in a deployment can arm one: no serve config field, deploy arg or ``ReplicaSpec`` field reaches this module,
and ``h3serve/deploy/`` never imports it. A test arms a fault on a live group (``WorkerGroup.arm``), which hands it to
the
rank's ``UlyssesGroup``; the fault then fires once, in the real step path of that rank, and is spent. A replacement
group starts with none.

Points (where in a step, on the rank that holds the fault):

- ``before_first_collective``: at the step's start, before the pack's broadcast (the step's first collective);
- ``receive_buffer``: a worker's allocation of its side of the pack's broadcast (action ``oom``: the receive buffer
  does not fit);
- ``between_all_to_alls``: in block ``block``'s attention, after its first all-to-all and before its second (a pack
  without step caching runs four all-to-alls a block: q, k, v there and the output back);
- ``after_attention``: in block ``block``, after its attention's last all-to-all, where its SwiGLU (the step's memory
  peak) runs next;
- ``final_gather``: just before the gather of the output rows onto rank 0;
- ``all_gather``: step caching under Ulysses, before all-gather ``block`` of the step (0: the blocks' input rows; then
  one at each transition) makes its [T, hidden] buffer, the step cache's peak;
- ``step_cache_decision``: at a step-cache decision under Ulysses (action ``disagree`` only);
- ``join``: a worker's join, after the rendezvous and before the communicator's first all-reduce (armed on the worker
  before a replacement it joins: a communicator that does not come up);
- ``abort``: on the thread that aborts the rank's communicator, before the abort (action ``freeze`` only: an abort
  that does not return).

Actions:

- ``raise``: ``InjectedFault`` (a bad kernel argument on that rank);
- ``oom``: ``torch.OutOfMemoryError``, the type the caching allocator raises (what a pack too large for the memory
  plan does there);
- ``hang``: the rank stops there, as a rank waiting in a collective or a host sync for a peer that never comes:
  until its communicator is aborted (``release``), then it raises; at most ``hang_s``;
- ``freeze``: the rank's step thread stops there for ``hang_s`` whatever happens, as a kernel that never ends: an
  abort does not bring it back (its process is killed and replaced);
- ``kill``: the process exits at once (``os._exit``), as a rank lost with its node or to the OOM killer;
- ``disagree``: this rank's own step-cache decisions are inverted before ranks agree on them (a non-deterministic
  reduction, a NaN on one rank);
- ``cuda_fatal``: ``InjectedDeviceError`` raised there (a ``torch.AcceleratorError``: an illegal address, a
  device-side assert);
- ``cuda_fatal_late``: nothing there; the same error surfaces at the rank's next sync (the device wait that ends its
  step), as an asynchronous kernel fault does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Literal, get_args

import torch

from .cuda_faults import InjectedDeviceError

logger = logging.getLogger(__name__)

# the points inside a step's forward (where ``oom`` and ``cuda_fatal`` fit), then the others
StepPoint = Literal[
    "before_first_collective",
    "receive_buffer",
    "between_all_to_alls",
    "after_attention",
    "final_gather",
    "all_gather",
]
Point = Literal[StepPoint, "step_cache_decision", "join", "abort"]
Action = Literal["raise", "oom", "hang", "freeze", "kill", "disagree", "cuda_fatal", "cuda_fatal_late"]
STEP_POINTS: tuple[str, ...] = get_args(StepPoint)
BLOCK_POINTS = ("between_all_to_alls", "after_attention", "all_gather")  # ``Fault.block`` says which one
ALL_TO_ALLS_PER_BLOCK = 4  # q, k, v to heads, the output back to rows


class InjectedFault(RuntimeError):
    """What an armed fault raises (``raise``, or ``hang`` once released)."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault: on ``rank``, at ``point`` (block ``block`` for ``between_all_to_alls``), do ``action`` once."""

    rank: int
    point: Point
    action: Action
    block: int = 0
    hang_s: float = 120.0  # the longest a hang or a freeze holds the rank

    def __post_init__(self):
        if (self.action == "disagree") != (self.point == "step_cache_decision"):
            raise ValueError(f"action {self.action!r} does not fit point {self.point!r}")
        if self.point == "abort" and self.action != "freeze":
            raise ValueError(f"action {self.action!r} does not fit point 'abort' (only 'freeze')")
        if (self.action.startswith("cuda_fatal") or self.action == "oom") and self.point not in STEP_POINTS:
            raise ValueError(f"action {self.action!r} does not fit point {self.point!r}")

    def __str__(self) -> str:
        where = f"{self.point} of block {self.block}" if self.point in BLOCK_POINTS else self.point
        return f"{self.action} on rank {self.rank} at {where}"


class FaultInjector:
    """One rank's armed faults; ``UlyssesGroup`` calls ``at`` at each point of its step."""

    def __init__(self, rank: int):
        self.rank = rank
        self.armed: list[Fault] = []
        self.fired: list[Fault] = []
        self._released = threading.Event()  # set when this rank's communicator is aborted
        self.poisoned: Fault | None = None  # a ``cuda_fatal_late`` that fired: it surfaces at the next ``sync``

    def arm(self, fault: Fault) -> None:
        if fault.rank != self.rank:
            raise ValueError(f"fault {fault} armed on rank {self.rank}")
        self.armed.append(fault)

    def release(self) -> None:
        """The rank's communicator was aborted: a ``hang`` ends (a ``freeze`` does not)."""
        self._released.set()

    def _take(self, point: str, block: int | None = None) -> Fault | None:
        for fault in self.armed:
            if fault.point == point and (block is None or fault.block == block):
                self.armed.remove(fault)
                self.fired.append(fault)
                logger.warning("injected fault fires: %s", fault)
                return fault
        return None

    def at(self, point: Point, block: int | None = None) -> None:
        """Fire the fault armed for ``point`` (and ``block``), if any."""
        if not self.armed:
            return
        fault = self._take(point, block)
        if fault is None:
            return
        if fault.action == "cuda_fatal":
            raise InjectedDeviceError(f"CUDA error: an illegal memory access was encountered (injected: {fault})")
        if fault.action == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected: {fault})")
        if fault.action == "cuda_fatal_late":
            self.poisoned = fault  # the kernels "ran"; the fault shows at the next sync
            return
        if fault.action == "kill":
            os._exit(17)  # no cleanup: a process lost mid-step leaves no goodbye
        if fault.action == "freeze":
            threading.Event().wait(fault.hang_s)  # nothing sets it: only the process's death ends it early
            raise InjectedFault(f"injected fault: {fault} (froze {fault.hang_s:g} s)")
        if fault.action == "hang":
            released = self._released.wait(fault.hang_s)
            raise InjectedFault(f"injected fault: {fault} ({'released by abort' if released else 'hang timed out'})")
        raise InjectedFault(f"injected fault: {fault}")

    def sync(self) -> None:
        """A device sync point: a ``cuda_fatal_late`` that fired earlier in the step surfaces here."""
        fault, self.poisoned = self.poisoned, None
        if fault is not None:
            raise InjectedDeviceError(f"CUDA error: unspecified launch failure (injected, surfacing at sync: {fault})")

    def decisions(self, skips: list[bool]) -> list[bool]:
        """This rank's step-cache decisions, inverted when a ``disagree`` fault is armed."""
        if self.armed and self._take("step_cache_decision") is not None:
            return [not skip for skip in skips]
        return skips
