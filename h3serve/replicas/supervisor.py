"""Rank 0's SP group across failures: a broken group is replaced in this process, on the same placement group.

A step that breaks the group (``WorkerGroupBroken``) has already aborted every rank's communicator and waited for
every rank's side of the step; ``replace`` builds the next group: the workers whose step came back are kept (their
models stay loaded: on a GPU that saves reloading the transformer; they only join a new communicator), the lost ones
(dead, or stuck past the abort) are killed and new actors start in their bundles, and every rank meets on a new port.
The new actors load in their own processes while rank 0 waits for them without holding a thread (``recover``): its
model thread, the event loop, health checks and the queue go on. Rank 0's pipeline (its models, its requests' states)
stays. A group whose rank 0 did not come back cannot be replaced here, nor one whose replacement fails to build: the
engine then stops, health fails and Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import ray

from .worker_group import LoadReport, WorkerGroup, WorkerGroupBroken, describe, run_sync

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Replacement:
    """One broken group and how it was replaced."""

    reason: str
    broken_after_s: float  # from the broken step's start to every rank aborted and back (or declared lost)
    kept: tuple[int, ...]  # worker ranks whose actors joined the new group
    started: tuple[int, ...]  # worker ranks given new actors
    seconds: float  # from the start of the replacement to the new group's rendezvous


class GroupSupervisor:
    """Holds the replica's current ``WorkerGroup`` and replaces it when it breaks."""

    ping_timeout_s = 5.0  # a kept worker must answer this fast, or it is replaced too

    def __init__(self, group: WorkerGroup, startup_timeout_s: float = 600.0):
        self.group = group
        self.startup_timeout_s = startup_timeout_s  # building new workers (loading the checkpoint) and rendezvous
        self.history: list[Replacement] = []
        self.replacing_since: float | None = None
        self.failed: str | None = None  # why the last broken group could not be replaced

    def replace(self, broken: WorkerGroupBroken) -> WorkerGroup:
        """``recover``, blocking (tests, tools): the rendezvous on a thread of its own."""
        return run_sync(self.recover(broken))

    async def recover(
        self, broken: WorkerGroupBroken, run_blocking: Callable[..., Awaitable[Any]] | None = None
    ) -> WorkerGroup:
        """The next group; WorkerGroupBroken when it cannot be built. The aborts and kills run on a thread of their
        own, the new workers' loads (a GPU's transformer: minutes) are awaited on the event loop, holding no thread,
        and only the rendezvous runs on ``run_blocking`` (the engine's model thread; None: a thread of its own): the
        replica answers health, reports and new requests while a replacement loads."""
        old = self.group
        if not broken.recoverable or old.placement is None:
            self.fail(broken)
        started = time.monotonic()
        self.replacing_since = started
        placement, old.placement = old.placement, None  # the new group owns it from here
        # a step that broke it aborted it already (each abort runs once); a group a health check broke is aborted here
        aborted, aborts = await asyncio.to_thread(old.abort)
        if not aborted:  # rank 0's communicator may still be live in this process: no new one beside it
            placement.release()
            self.fail(WorkerGroupBroken(f"{broken.reason}; rank 0's abort did not return", lost=broken.lost))
        kept: dict[int, Any] = {}
        launched: dict[int, tuple[Any, ray.ObjectRef]] = {}
        try:
            lost = await asyncio.to_thread(self._lost, old, broken, aborts)
            for rank in sorted(lost):
                old.kill(rank)
            kept = {rank: w for rank, w in enumerate(old.workers, start=1) if rank not in lost}
            old.workers = []
            launched = WorkerGroup.spawn(old.spec, placement, sorted(lost))
            loads = await self._loads(launched)
            workers = {**kept, **{rank: actor for rank, (actor, _) in launched.items()}}
            join = functools.partial(WorkerGroup.join, kept=len(kept), steps=old.steps)
            args = (old.spec, old.pipeline, placement, workers, loads)
            new = await (run_blocking(join, *args) if run_blocking is not None else asyncio.to_thread(join, *args))
            new.abort_grace_s = old.abort_grace_s
            self.group = new  # before the replacement ends: a health check never sees the old group unattended
        except Exception as e:
            for actor in [*kept.values(), *(actor for actor, _ in launched.values())]:
                ray.kill(actor, no_restart=True)
            placement.release()
            self.failed = f"{broken.reason}; building its replacement failed: {describe(e)}"
            raise WorkerGroupBroken(self.failed) from None
        finally:
            self.replacing_since = None
        replacement = Replacement(
            broken.reason, broken.after_s, tuple(sorted(kept)), tuple(sorted(lost)), time.monotonic() - started
        )
        self.history.append(replacement)
        logger.warning(
            "SP group replaced in %.2f s, %.2f s after its step began (workers kept %s, started %s) after: %s",
            replacement.seconds,
            replacement.broken_after_s,
            list(replacement.kept),
            list(replacement.started),
            broken.reason,
        )
        return new

    def _lost(self, old: WorkerGroup, broken: WorkerGroupBroken, aborts: dict[int, ray.ObjectRef]) -> set[int]:
        """The worker ranks to replace: lost in the step, stuck in their abort, or not answering a ping."""
        return set(broken.lost) | self._stuck(aborts, old.abort_grace_s) | self._unreachable(old, broken.lost)

    async def _loads(self, launched: dict[int, tuple[Any, ray.ObjectRef]]) -> dict[int, LoadReport]:
        """The new workers' loads, awaited without a thread, within ``startup_timeout_s``; raises a load's error."""
        if not launched:
            return {}
        futures = {asyncio.wrap_future(ref.future()): rank for rank, (_, ref) in launched.items()}
        done, pending = await asyncio.wait(futures, timeout=self.startup_timeout_s)
        if pending:
            ranks = sorted(futures[f] for f in pending)
            raise TimeoutError(f"worker rank(s) {ranks} did not load within {self.startup_timeout_s:g} s")
        return {futures[f]: f.result() for f in done}

    def fail(self, broken: WorkerGroupBroken) -> NoReturn:
        """``broken`` cannot be replaced in this process (rank 0's own side of the step is stuck): health fails from
        now on, so Serve replaces the replica."""
        self.failed = broken.reason
        raise broken

    @staticmethod
    def _stuck(aborts: dict[int, ray.ObjectRef], grace_s: float) -> set[int]:
        """Worker ranks whose abort did not return within its deadline: their process is given up, never kept."""
        stuck = set()
        for rank, ref in aborts.items():
            try:
                if ray.get(ref, timeout=grace_s + 2.0) is False:
                    stuck.add(rank)
            except Exception:
                stuck.add(rank)
        return stuck

    def _unreachable(self, group: WorkerGroup, known: frozenset[int]) -> set[int]:
        """Worker ranks (beyond ``known``) whose actors do not answer a ping: they are replaced, not kept."""
        pings = {rank: w.ping.remote() for rank, w in enumerate(group.workers, start=1) if rank not in known}
        unreachable = set()
        for rank, ref in pings.items():
            try:
                ray.get(ref, timeout=self.ping_timeout_s)
            except Exception:
                unreachable.add(rank)
        return unreachable

    def check_health(self) -> None:
        """The current group's health. Healthy while a group a step broke is aborted and replaced, within bounds
        (Serve replaces a replica after three failed checks: a recovery in progress must not look like a dead one)."""
        if self.failed:
            raise WorkerGroupBroken(self.failed)
        now, group = time.monotonic(), self.group
        since = self.replacing_since
        if since is not None:
            if now - since > self.startup_timeout_s + self.ping_timeout_s:
                raise WorkerGroupBroken(
                    f"the SP group's replacement has been building for over {self.startup_timeout_s:g} s"
                )
            return
        if group.broken_in_step and group.broken_at is not None:
            # the step's abort waits up to three graces (aborts, workers, rank 0), then the engine replaces the group
            if now - group.broken_at > 3 * group.abort_grace_s + 2 * self.ping_timeout_s:
                raise WorkerGroupBroken(f"{group.broken_reason}; no replacement started")
            return
        try:
            group.check_health()
        except WorkerGroupBroken:
            # a step in flight finds the lost rank itself (within its bound) and replaces the group; or one broke it
            # meanwhile and it is being replaced
            if group.stepping or group.broken_in_step or self.group is not group:
                return
            raise
