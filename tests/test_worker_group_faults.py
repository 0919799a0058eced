"""The SP worker group's one failure semantics, with real processes: a real Ray local cluster and real gloo.

A step whose ranks all finish without a collective error is a data failure of its pack (PackFailed; the
group stays healthy); a dead rank, a rank past the bound or a collective error break the group for good.
"""

import os
import signal
import time

import pytest
import ray
import torch

from pipelines.h3 import GenerationRequest
from replicas import PackFailed, WorkerGroup, WorkerGroupBroken
from tests.test_replicas import poison, request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

COLLECTIVE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


@pytest.fixture
def pair(tiny_checkpoint):
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=COLLECTIVE_TIMEOUT_S))
    yield group
    group.shutdown()


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


def test_a_rank_that_fails_before_a_collective_its_peer_entered_breaks_the_group(pair):
    # Two documents: the larger one fills rank 0's half of the pack, so the second lives on rank 1 only.
    big = pair.pipeline.prepare(
        GenerationRequest(prompt="big", width=64, height=64, num_frames=141, num_inference_steps=3)
    )
    small = pair.pipeline.prepare(request("small"))
    assert big.rows > small.rows
    # Modality tags out of range on the small document: rank 1's first AdaLN lookup raises, before its
    # first all-to-all; rank 0 waits in that all-to-all for its peer until the collective timeout.
    small.layout["token_tags"] = torch.full_like(small.layout["token_tags"], 1000)
    pack = one_pack(pair, [big, small])
    assert pack.lengths[0] >= pack.total_rows // 2  # the bad rows are rank 1's alone
    started = time.perf_counter()
    with pytest.raises(WorkerGroupBroken, match="collective failed on rank 0"):
        pair(pack)
    elapsed = time.perf_counter() - started
    assert COLLECTIVE_TIMEOUT_S * 0.9 < elapsed < COLLECTIVE_TIMEOUT_S + 5, elapsed
    with pytest.raises(WorkerGroupBroken):  # broken for good: health fails, nothing more is launched
        pair.check_health()
    with pytest.raises(WorkerGroupBroken):
        pair.launch(pack)


def test_forwards_are_serial_on_every_rank_and_ping_answers_while_one_runs(pair, solo):
    states = [pair.pipeline.prepare(request("a", seed=1)), pair.pipeline.prepare(request("b", seed=2))]
    first, second = one_pack(pair, states[:1]), one_pack(pair, states)
    # Both steps are on the worker before rank 0 starts either: the worker sits in the first one's
    # all-to-all, waiting for rank 0, and the second must wait its turn, not interleave its collectives.
    first_refs, second_refs = pair.launch(first), pair.launch(second)
    time.sleep(0.5)
    started = time.perf_counter()
    pair.check_health(timeout_s=2.0)  # its own concurrency group: it answers while a forward runs
    assert time.perf_counter() - started < 2.0
    out_first = pair.forward_rank0(first)
    out_second = pair.forward_rank0(second)
    outcomes = pair.collect(first_refs) + pair.collect(second_refs)
    assert [(o.step, o.error) for o in outcomes] == [(1, None), (2, None)]
    for out, documents in ((out_first, states[:1]), (out_second, states)):
        want = solo.forward_rank0(one_pack(solo, documents))
        torch.testing.assert_close(out[0], want[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[1], want[1], rtol=0, atol=1e-5)


def test_a_rank_that_does_not_finish_its_side_of_a_failed_step_within_the_bound_breaks_the_group(pair):
    (worker,) = pair.workers
    pid = ray.get(worker.__ray_call__.remote(lambda _: os.getpid()))
    pair.settle_margin_s = 1.0  # the bound: collective timeout + 1 s
    bad = pair.pipeline.prepare(request("bad"))
    poison(bad)  # rank 0 fails before any collective, so only the bound can tell a hung peer
    pack = one_pack(pair, [bad])
    os.kill(pid, signal.SIGSTOP)  # rank 1 never gets to its side of the step
    started = time.perf_counter()
    try:
        with pytest.raises(WorkerGroupBroken, match=r"did not finish step \d+ within 6 s"):
            pair(pack)
        elapsed = time.perf_counter() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert pair.settle_bound_s <= elapsed < pair.settle_bound_s + 3, elapsed
    with pytest.raises(WorkerGroupBroken):
        pair.check_health()
