"""The SP worker group's one failure semantics, with real processes: a real Ray local cluster and real gloo.

A step whose ranks all leave at its agreement is a data failure of its pack (PackFailed; the group stays healthy);
a rank that fails past the agreement, dies, or a step past its bound break the group at once: every communicator
is aborted and rank 0 learns which ranks came back (tests/test_sp_fault_matrix.py: the engine replaces it).
"""

import contextlib
import os
import signal
import time

import pytest
import ray
import torch

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.replicas import PackFailed, WorkerGroup, WorkerGroupBroken
from h3serve.replicas.faults import Fault
from h3serve.replicas.supervisor import GroupSupervisor
from tests.harness import gone
from tests.test_replicas import poison, request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

COLLECTIVE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def supervised(tiny_checkpoint):
    """One sp=2 group for the module, replaced as the engine replaces it (``GroupSupervisor``)."""
    supervisor = GroupSupervisor(WorkerGroup.create(spec(2, tiny_checkpoint, timeout=COLLECTIVE_TIMEOUT_S)))
    yield supervisor
    supervisor.group.shutdown()


@pytest.fixture
def pair(supervised):
    """A healthy sp=2 group: a test that broke the last one gets its replacement on a new communicator, the worker
    kept when its step came back (no new process: each start imports torch, ~7 s on 2 cores)."""
    group = supervised.group
    if group.broken_reason:
        group = supervised.replace(WorkerGroupBroken(group.broken_reason, recoverable=True))
    group.check_health()
    return group


def one_pack(group: WorkerGroup, states):
    ((_, pack),) = group.pipeline.packs(states)
    return pack


def test_a_pack_whose_data_fails_on_every_rank_fails_alone_and_the_group_stays_healthy(pair, solo):
    bad = pair.pipeline.prepare(request("bad"))
    poison(bad)  # the context embedder raises on both ranks, before any collective
    started = time.perf_counter()
    with pytest.raises(PackFailed) as failed:
        pair(one_pack(pair, [bad]))
    assert set(failed.value.errors) == {0, 1}, failed.value.errors  # both ranks raised, from the data
    assert all("shapes cannot be multiplied" in e for e in failed.value.errors.values()), failed.value.errors
    assert time.perf_counter() - started < COLLECTIVE_TIMEOUT_S  # nobody waited on a collective
    assert pair.broken_reason is None
    pair.check_health()

    good = [pair.pipeline.prepare(r) for r in (request("good", seed=1), request("also good", seed=2))]
    video, audio = pair(one_pack(pair, good))  # the very next pack runs on the same group
    video_1, audio_1 = solo.forward_rank0(one_pack(solo, good))
    torch.testing.assert_close(video, video_1, rtol=0, atol=1e-5)
    torch.testing.assert_close(audio, audio_1, rtol=0, atol=1e-5)


def test_a_rank_that_fails_past_the_agreement_breaks_the_group_at_once_and_every_rank_comes_back(pair):
    # Two documents: the larger one fills rank 0's half of the pack, so the second lives on rank 1 only.
    big = pair.pipeline.prepare(
        GenerationRequest(prompt="big", width=64, height=64, num_frames=141, num_inference_steps=3)
    )
    small = pair.pipeline.prepare(request("small"))
    assert big.rows > small.rows
    # Modality tags out of range on the small document: rank 1's first AdaLN lookup raises, in block 0, after the
    # step's agreement; rank 0 meanwhile waits for it in block 0's first all-to-all.
    small.layout["token_tags"] = torch.full_like(small.layout["token_tags"], 1000)
    pack = one_pack(pair, [big, small])
    assert pack.lengths[0] >= pack.total_rows // 2  # the bad rows are rank 1's alone
    started = time.perf_counter()
    # its collectives by then: the agreement before the broadcast, the broadcast, the agreement after the prologue
    with pytest.raises(WorkerGroupBroken, match=r"rank 1 failed in step \d+ after 3 collective\(s\)") as broken:
        pair(pack)
    elapsed = time.perf_counter() - started
    # known from rank 1's own report, not from rank 0's collective timing out: the abort released rank 0
    assert elapsed < COLLECTIVE_TIMEOUT_S / 2, elapsed
    assert broken.value.recoverable and broken.value.lost == frozenset()  # every rank's side came back
    with pytest.raises(WorkerGroupBroken):  # broken for good: health fails, nothing more is launched
        pair.check_health()
    with pytest.raises(WorkerGroupBroken):
        pair.launch(pack, 1.0)


def test_forwards_are_serial_on_every_rank_and_ping_answers_while_one_runs(pair, solo):
    states = [pair.pipeline.prepare(request("a", seed=1)), pair.pipeline.prepare(request("b", seed=2))]
    first, second = one_pack(pair, states[:1]), one_pack(pair, states)
    # Both steps are on the worker before rank 0 starts either: the worker sits in the first one's
    # broadcast, waiting for rank 0, and the second must wait its turn, not interleave its collectives.
    before = pair.steps  # a replacement group goes on numbering its predecessor's steps
    first_refs, second_refs = pair.launch(first, COLLECTIVE_TIMEOUT_S), pair.launch(second, COLLECTIVE_TIMEOUT_S)
    time.sleep(0.5)
    started = time.perf_counter()
    pair.check_health(timeout_s=2.0)  # its own concurrency group: it answers while a forward runs
    assert time.perf_counter() - started < 2.0
    out_first = pair.forward_rank0(first)
    out_second = pair.forward_rank0(second)
    outcomes = ray.get(first_refs + second_refs, timeout=COLLECTIVE_TIMEOUT_S)
    assert [(o.step, o.error) for o in outcomes] == [(before + 1, None), (before + 2, None)]
    for out, documents in ((out_first, states[:1]), (out_second, states)):
        want = solo.forward_rank0(one_pack(solo, documents))
        torch.testing.assert_close(out[0], want[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[1], want[1], rtol=0, atol=1e-5)


def test_a_rank_that_does_not_finish_within_the_step_bound_breaks_the_group_and_is_killed(pair):
    (worker,) = pair.workers
    pid, _ = pair.processes[1]
    pair.abort_grace_s = 1.0
    bad = pair.pipeline.prepare(request("bad"))
    poison(bad)  # rank 0 fails before any collective, so only the bound can tell a hung peer
    pack = one_pack(pair, [bad])
    os.kill(pid, signal.SIGSTOP)  # rank 1 never gets to its side of the step
    started = time.perf_counter()
    try:
        with pytest.raises(WorkerGroupBroken, match=r"step \d+ did not finish within its bound of 2 s") as broken:
            pair(pack, bound_s=2.0)
        elapsed = time.perf_counter() - started
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed, as it should be
            os.kill(pid, signal.SIGCONT)
    # the bound, then the worker's grace after the abort; rank 0 comes back once the killed worker's sockets close
    assert 2.0 <= elapsed < 2.0 + 2 * pair.abort_grace_s + 3, elapsed
    assert broken.value.lost == frozenset({1}) and broken.value.recoverable
    assert gone(pid)  # a frozen process cannot run Ray's own exit: it was killed by its id
    with pytest.raises(WorkerGroupBroken):
        pair.check_health()


def test_a_worker_whose_communicator_does_not_come_up_fails_the_join_within_its_bound(supervised):
    """Last in the module: the supervised group is left without a replacement. A kept worker joins the replacement's
    rendezvous and stops before the communicator's first all-reduce: rank 0's join fails within the collective timeout
    (never the first step), the replacement fails naming the join, and the stuck worker is killed."""
    group = supervised.group
    if group.broken_reason:
        group = supervised.replace(WorkerGroupBroken(group.broken_reason, recoverable=True))
    pid, _ = group.processes[1]
    group.arm(Fault(1, "join", "freeze", hang_s=60.0))
    group.mark_broken("broken by the test, to be replaced")
    started = time.monotonic()
    with pytest.raises(WorkerGroupBroken, match=r"building its replacement failed: JoinFailed: rank 0: the SP group"):
        supervised.replace(WorkerGroupBroken(group.broken_reason, recoverable=True))
    elapsed = time.monotonic() - started
    assert COLLECTIVE_TIMEOUT_S <= elapsed < COLLECTIVE_TIMEOUT_S + 5, elapsed
    assert gone(pid)  # killed, not left frozen in its join
    with pytest.raises(WorkerGroupBroken, match="building its replacement failed"):  # health fails: Serve replaces it
        supervised.check_health()
