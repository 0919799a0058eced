"""The SP group's one failure semantics, end to end through the engine at sp=2 on real gloo: faults injected at named
points of the real step path (``h3serve.replicas.faults``) raise, hang, freeze or kill rank 0 or the worker, raise a
CUDA-fatal error there or at the next sync, or leave an abort stuck, one case at a time, over one group that each
broken step replaces.

Each case: two requests share a pack when the fault fires; the broken step is over (every rank aborted and back, or
killed) within ``BROKEN_BOUND_S`` and both requests are answered within ``ANSWER_BOUND_S`` (beside the time a new
worker process takes to start), far below the collective's own timeout (the stand-in for NCCL's watchdog); no
request is lost (both complete as in a run without the fault, or fail naming the cause); the group serving the next
request gives the same output as before the fault; no worker process or placement group is left behind (only the
group's own actor is alive, in the group's own placement group).
"""

import asyncio
import dataclasses
import logging
import re
import time

import numpy as np
import pytest
import ray
from ray.util.state import list_actors

from h3serve.replicas import Engine, EngineLimits, EngineStopped, StepGate, WorkerGroup
from h3serve.replicas.faults import Fault
from tests.harness import gone
from tests.test_engine_faults import assert_same_media
from tests.test_replicas import request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

COLLECTIVE_TIMEOUT_S = 30.0  # gloo's own timeout, as NCCL's watchdog: no case may come near it
STEP_BOUND_S = 2.0  # EngineLimits.step_timeout_min_s: a hung step is found this fast
# WorkerGroup.abort_grace_s: how long each rank's side of a broken step may take to come back (a released rank's Ray
# reply took over 2 s once on 2 shared cores at load 20: it was declared lost and replaced)
ABORT_GRACE_S = 4.0
# from the submit to both answers, beside the time a new worker process takes to start and load the model: the
# bound, the grace (twice: the workers, then rank 0), the rendezvous, the steps, prepares and decodes
ANSWER_BOUND_S = 20.0
BROKEN_BOUND_S = STEP_BOUND_S + 2 * ABORT_GRACE_S + 2  # from the broken step's start to every rank aborted and back
START_BOUND_S = 60.0  # a new worker process (Ray starts it, it imports torch and diffusers, loads the checkpoint)
PAIR = [request("a red kite", 3, seed=1), request("rain on a roof", 3, seed=2)]
NEXT = request("a lighthouse", 2, seed=3)


@dataclasses.dataclass(frozen=True)
class Case:
    fault: Fault
    outcome: str  # "data": PackFailed, retried in halves on the same group; "kept"/"started": the group is replaced,
    # the worker's actor kept or started anew; "stopped": rank 0 itself is stuck, the engine stops
    reason: str = ""  # what the break's reason says (a regex)
    abort: Fault | None = None  # and the abort that follows the break does not return on this rank

    def __str__(self) -> str:
        name = str(self.fault).replace(" ", "-")
        return name if self.abort is None else f"{name}+abort-stuck-on-rank-{self.abort.rank}"

    @property
    def faults(self) -> list[Fault]:
        return [self.fault] if self.abort is None else [self.fault, self.abort]


def worker(point, action, outcome, reason="", block=1, abort=None):
    return Case(Fault(1, point, action, block=block), outcome, reason, abort)


def rank0(point, action, outcome, reason="", block=1):
    return Case(Fault(0, point, action, block=block), outcome, reason)


def stuck_abort(rank: int) -> Fault:
    """The abort of ``rank``'s communicator does not return (as ncclCommAbort with a dead peer has hung)."""
    return Fault(rank, "abort", "freeze", hang_s=60.0)


BOUND = r"did not finish within its bound"
LOST = r"rank 1 was lost( in step \d+)?: \w*Actor\w*Error"  # its death reported first, or rank 0's own error
IN_BLOCK = r"failed in step \d+ after \d+ collective\(s\), past the step's agreement: InjectedFault"
FATAL = r"hit a CUDA-fatal error in step \d+ after \d+ collective\(s\): its process is lost: " + (
    r"InjectedDeviceError: CUDA error"
)
CASES = [
    worker("before_first_collective", "raise", "data"),
    worker("before_first_collective", "hang", "kept", BOUND),
    worker("before_first_collective", "kill", "started", LOST),
    worker("between_all_to_alls", "raise", "kept", "rank 1 " + IN_BLOCK),
    worker("between_all_to_alls", "hang", "kept", BOUND),
    worker("between_all_to_alls", "kill", "started", LOST),
    worker("between_all_to_alls", "freeze", "started", BOUND),
    worker("final_gather", "raise", "kept", "rank 1 " + IN_BLOCK),
    worker("final_gather", "hang", "kept", BOUND),
    worker("final_gather", "kill", "started", LOST),
    # CUDA-fatal on the worker, raised (before the first collective: it leaves at the agreement with its peer, yet its
    # process is poisoned) or surfacing at its next sync (the device wait after the gather): it is lost, replaced
    worker("before_first_collective", "cuda_fatal", "started", "rank 1 " + FATAL),
    worker("between_all_to_alls", "cuda_fatal", "started", "rank 1 " + FATAL),
    worker("between_all_to_alls", "cuda_fatal_late", "started", "rank 1 " + FATAL),
    # the worker's abort does not return within its deadline: given up, killed and replaced like a lost rank
    worker("between_all_to_alls", "raise", "started", "rank 1 " + IN_BLOCK, abort=stuck_abort(1)),
    # an out-of-memory is the pack's wherever it surfaces (issue 53): making the worker's side of the broadcast (carried
    # to the agreement before it), in a block's attention or where its SwiGLU runs, before the gather (the rank enters
    # the step's remaining collectives with scratch buffers): the pack halves on the same group
    worker("receive_buffer", "oom", "data"),
    worker("between_all_to_alls", "oom", "data"),
    worker("after_attention", "oom", "data"),
    worker("final_gather", "oom", "data"),
    rank0("between_all_to_alls", "oom", "data"),
    rank0("after_attention", "oom", "data"),
    rank0("before_first_collective", "raise", "data"),
    rank0("before_first_collective", "hang", "kept", BOUND),
    rank0("between_all_to_alls", "raise", "kept", "rank 0 " + IN_BLOCK),
    rank0("between_all_to_alls", "hang", "kept", BOUND),
    rank0("final_gather", "raise", "kept", "rank 0 " + IN_BLOCK),
    rank0("final_gather", "hang", "kept", BOUND),
]


class Together(StepGate):
    """The prepared requests step only once nothing is waiting to be prepared: the fault meets a pack of all of them."""

    def candidates(self, boundary):
        return () if boundary.waiting else boundary.prepared


LIMITS = EngineLimits(step_timeout_min_s=STEP_BOUND_S, max_active=4)


async def serve(group: WorkerGroup, *faults: Fault):
    """The pair (with ``fault`` armed), then the next request alone, Serve's health check polled meanwhile: the
    engine, the pair's results, seconds from the pair's submit to both answers, the next request's media (None when
    the engine stopped), and what the health checks raised."""
    engine = Engine(group, LIMITS, gate=Together())
    for fault in faults:
        group.arm(fault)
    unhealthy: list[str] = []

    async def health():  # as Serve calls it (H3Replica.check_health: on a thread), more often
        while True:
            try:
                await asyncio.to_thread(engine.check_health)
            except Exception as e:
                unhealthy.append(f"{type(e).__name__}: {e}")
            await asyncio.sleep(0.2)

    checks = asyncio.ensure_future(health())
    started = time.monotonic()
    tickets = [engine.submit(r, request_id=f"pair-{i}") for i, r in enumerate(PAIR)]
    results = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
    answered = time.monotonic() - started
    stopped = any(isinstance(r, EngineStopped) for r in results)
    following = None if stopped else await engine.generate(NEXT, request_id="next")
    checks.cancel()
    await engine.close()
    return engine, results, answered, following, unhealthy


def live_workers(before: set, expected: int | None = None, timeout_s: float = 5.0) -> list:
    """This module's SPWorker actors alive in the session's cluster: those in placement groups made since ``before``
    (waiting up to ``timeout_s`` for ``expected`` of them: the state API learns of a death a moment after it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("class_name", "=", "SPWorker"), ("state", "=", "ALIVE")],
            detail=True,  # with each actor's placement group
            raise_on_missing_output=False,
        )
        alive = [a for a in alive if a.placement_group_id not in before]
        if expected is None or len(alive) == expected or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def live_groups(before: set) -> list:
    return [pg for pg, g in ray.util.placement_group_table().items() if pg not in before and g["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def matrix(tiny_checkpoint):
    """One sp=2 group, replaced as cases break it; the fault-free outputs; the placement groups before it."""
    before = set(ray.util.placement_group_table())
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=COLLECTIVE_TIMEOUT_S))
    group.abort_grace_s = ABORT_GRACE_S
    _, results, _, following, _ = asyncio.run(serve(group))
    state = {"group": group, "pair": results, "next": following, "before": before, "times": []}
    yield state
    state["group"].shutdown()
    print("\nfault matrix (s): " + "; ".join(state["times"]))
    assert not live_groups(before), "a placement group outlived its SP group"
    assert not live_workers(before, expected=0), "an SP worker outlived its group"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_fault_is_answered_within_its_bound_and_loses_no_request(matrix, case, caplog):
    group: WorkerGroup = matrix["group"]
    old_pid, _ = group.processes[1]
    with caplog.at_level(logging.INFO, logger="h3serve.replicas"):
        engine, results, answered, following, unhealthy = asyncio.run(serve(group, *case.faults))
    matrix["group"] = new = engine.group
    replaced = engine.supervisor.history
    how = f" (broken after {replaced[0].broken_after_s:.1f}, replaced in {replaced[0].seconds:.1f})" if replaced else ""
    matrix["times"].append(f"{case} {answered:.1f}{how}")

    starting = sum(r.seconds for r in replaced if r.started)  # a new process for the worker: machine-bound
    assert answered - starting < ANSWER_BOUND_S < COLLECTIVE_TIMEOUT_S, (answered, starting)
    for got, want in zip(results, matrix["pair"], strict=True):  # no request lost: both complete, as without it
        assert not isinstance(got, BaseException), got
        assert_same_media(got, want)
    assert engine.stats.failed_requests == {}
    assert not unhealthy, unhealthy  # healthy throughout: Serve never sees a replica whose group is being replaced
    # the next request, on the group now serving, gives the same output as before the fault
    assert np.array_equal(following.frames, matrix["next"].frames)
    assert np.array_equal(following.audio, matrix["next"].audio)
    if case.outcome == "data":  # every rank left at the agreement: retried in halves on the same group
        assert not replaced and new is group and engine.stats.failed_steps >= 1
        assert engine.stats.group_replacements == 0
        assert not [r for r in caplog.records if "SP group broken" in r.getMessage()]  # what a break logs first
        if case.fault.action == "oom":  # the pack of two failed once, on the OOM, and each half ran alone
            assert engine.stats.failed_steps == 1, engine.stats.failed_steps
            halved = [r.getMessage() for r in caplog.records if "retrying them in halves" in r.getMessage()]
            assert len(halved) == 1 and f"rank {case.fault.rank}: OutOfMemoryError" in halved[0], halved
    else:
        (replacement,) = replaced
        assert re.search(case.reason, replacement.reason), replacement.reason
        assert replacement.broken_after_s < BROKEN_BOUND_S, replacement.broken_after_s
        new_pid, _ = new.processes[1]
        if case.outcome == "kept":  # its step came back after the abort: the same process joined the new group
            assert replacement.kept == (1,) and new_pid == old_pid
        else:  # dead, or stuck past the abort: killed, and a new actor took its bundle
            assert replacement.started == (1,) and new_pid != old_pid and gone(old_pid)
            assert replacement.seconds < START_BOUND_S, replacement.seconds
    # nothing left behind: one live worker (the group's), in the one placement group the group reserved
    assert new.placement is not None and live_groups(matrix["before"]) == [new.placement.pg.id.hex()]
    (alive,) = live_workers(matrix["before"], expected=1)
    assert (alive.pid, alive.placement_group_id) == (new.processes[1][0], new.placement.pg.id.hex())


RANK0_LOST = [
    (Fault(0, "between_all_to_alls", "cuda_fatal", block=1), r"rank 0 " + FATAL),
    (Fault(0, "final_gather", "cuda_fatal_late"), r"rank 0 " + FATAL),
    # a worker breaks the step, and rank 0's own abort does not return: its communicator may still be live here
    (
        Fault(1, "between_all_to_alls", "raise", block=1),
        r"rank 1 " + IN_BLOCK + r".*; rank 0's abort did not return within",
    ),
]


@pytest.mark.parametrize(
    "fault, reason", RANK0_LOST, ids=["cuda_fatal-rank0", "cuda_fatal_late-rank0", "abort-stuck-rank0"]
)
def test_rank0_lost_stops_the_engine_retryably_fails_health_and_leaves_nothing_behind(
    matrix, tiny_checkpoint, fault, reason
):
    """Rank 0 is the replica: a CUDA-fatal error there, or its own abort stuck, cannot be mended in this process. The
    engine stops at once, every request of the pack fails with EngineStopped (503: run again on another replica, never
    failed as its own data), health fails (Serve replaces the replica), and nothing is left behind."""
    group: WorkerGroup = matrix["group"]
    old_pid, _ = group.processes[1]
    faults = [fault] if fault.rank == 0 else [fault, stuck_abort(0)]
    engine, results, answered, _, unhealthy = asyncio.run(serve(group, *faults))
    matrix["times"].append(f"{'+'.join(str(f).replace(' ', '-') for f in faults)} {answered:.1f}")
    assert answered < ANSWER_BOUND_S, answered
    for result in results:
        assert isinstance(result, EngineStopped), result
        assert re.search(r"SP worker group failed: " + reason, str(result)), result
    assert engine.stats.failed_requests == {"worker_group": 2}  # never "error": not the requests' data
    with pytest.raises(EngineStopped):  # Serve sees it, and replaces the replica
        engine.check_health()
    group.shutdown()  # what the replica's teardown does
    assert gone(old_pid) and not live_workers(matrix["before"], expected=0) and not live_groups(matrix["before"])
    matrix["group"] = fresh = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=COLLECTIVE_TIMEOUT_S))
    fresh.abort_grace_s = ABORT_GRACE_S


def test_rank0_stuck_past_the_abort_stops_the_engine_naming_the_cause_and_leaves_nothing_behind(matrix):
    """The one fault no replacement in this process can mend: rank 0's own step thread does not come back."""
    group: WorkerGroup = matrix["group"]
    old_pid, _ = group.processes[1]
    fault = Fault(0, "between_all_to_alls", "freeze", block=1, hang_s=2 * STEP_BOUND_S + 3 * ABORT_GRACE_S)
    engine, results, answered, _, unhealthy = asyncio.run(serve(group, fault))
    matrix["times"].append(f"{Case(fault, 'stopped')} {answered:.1f}")
    assert answered < ANSWER_BOUND_S, answered
    for result in results:
        assert isinstance(result, EngineStopped), result
        assert re.search(r"SP worker group failed: step \d+ did not finish within its bound", str(result)), result
    with pytest.raises(EngineStopped):  # Serve sees it, and replaces the replica
        engine.check_health()
    group.shutdown()  # what the replica's teardown does
    assert gone(old_pid) and not live_workers(matrix["before"], expected=0) and not live_groups(matrix["before"])
    matrix["group"] = group
