"""Replicas on a real local Ray cluster: Ulysses SP over gloo, the packed engine, faults, backpressure."""

import asyncio
import time

import pytest
import ray
import torch

from h3serve.attention import AdmissionError, Platform, Resolution, resolve
from h3serve.pipelines.h3 import REQUIREMENTS, GenerationRequest
from h3serve.replicas import Engine, EngineLimits, QueueFull, ReplicaSpec, WorkerGroup, WorkerGroupBroken
from h3serve.replicas.sequence_parallel import UlyssesGroup

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

RESOLUTION = resolve(REQUIREMENTS, "auto", Platform.cpu(), model="minimax-h3-tiny", head_dim=32)


def spec(sp: int, checkpoint, timeout: float = 10.0, resolution: Resolution = RESOLUTION) -> ReplicaSpec:
    return ReplicaSpec(
        resolution=resolution,
        checkpoint=str(checkpoint),
        model_name="minimax-h3-tiny",
        num_heads=4,
        head_dim=32,
        num_layers=4,
        hidden_size=96,
        sp_degree=sp,
        collective_timeout_s=timeout,
        rank_resources={"CPU": 0.25},
    )


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


def mixed_requests():
    return [
        GenerationRequest(prompt="a small red boat", num_inference_steps=6, seed=1),  # the longest: others join it
        GenerationRequest(prompt="waves", width=64, height=64, num_frames=141, num_inference_steps=5, seed=2),
        GenerationRequest(prompt="a very long prompt " * 5, width=96, height=64, num_inference_steps=4, seed=3),
        GenerationRequest(prompt="a lighthouse", width=64, height=128, num_inference_steps=2, seed=4),
    ]


def request(prompt: str = "x", steps: int = 3, **kwargs) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, width=64, height=64, num_inference_steps=steps, **kwargs)


# --- Ulysses preconditions -------------------------------------------------------------


def test_ulysses_preconditions_are_clear_errors():
    with pytest.raises(ValueError, match="num_heads % sp_degree"):
        UlyssesGroup(sp_degree=3, rank=0, num_heads=4)
    group = UlyssesGroup(sp_degree=2, rank=0, num_heads=4)
    with pytest.raises(ValueError, match="does not split over 2 ranks"):
        group.check_rows(127)


# --- SP: sp=W equals sp=1 --------------------------------------------------------------


@pytest.mark.parametrize("sp", [2, 4], ids=lambda w: f"sp={w}")
def test_sequence_parallel_matches_single_rank(solo, tiny_checkpoint, sp):
    group = WorkerGroup.create(spec(sp, tiny_checkpoint))
    try:
        assert group.sp_degree == sp and len(group.workers) == sp - 1
        states = [group.pipeline.prepare(r) for r in mixed_requests()]
        ((_, pack),) = group.pipeline.packs(states)
        assert pack.total_rows % sp == 0 and pack.padding_rows < sp  # padded only as far as SP needs
        ((_, solo_pack),) = solo.pipeline.packs(states)
        assert solo_pack.padding_rows == 0  # on one rank a pack has no padding at all
        video_sp, audio_sp = group(pack)
        video_1, audio_1 = solo.forward_rank0(solo_pack)
        torch.testing.assert_close(video_sp, video_1, rtol=0, atol=1e-5)
        torch.testing.assert_close(audio_sp, audio_1, rtol=0, atol=1e-5)
        assert video_1.abs().max() > 0.1
    finally:
        group.shutdown()


# --- the engine -----------------------------------------------------------------------


async def _staggered(engine: Engine, requests):
    """Each next request joins while the first one is still running."""
    tickets = [engine.submit(requests[0])]
    for r in requests[1:]:
        await tickets[0].changed.wait()  # the next one joins a pack that is already running
        tickets[0].changed.clear()
        tickets.append(engine.submit(r))
    return [await t.future for t in tickets], tickets


def test_engine_packs_staggered_requests_and_matches_each_alone(solo):
    requests = mixed_requests()
    alone = [solo.pipeline.generate(r) for r in requests]
    engine = Engine(solo, EngineLimits())
    results, tickets = asyncio.run(_staggered(engine, requests))
    for r, got, want in zip(requests, results, alone, strict=True):
        # fp32 GEMMs over different row counts round differently (~1e-6 in the latents), so a pixel
        # may land one step over a uint8 rounding boundary; nothing more may differ
        pixel_diff = abs(got.frames.astype(int) - want.frames.astype(int))
        assert got.frames.shape == want.frames.shape and pixel_diff.max() <= 1, r
        torch.testing.assert_close(torch.from_numpy(got.audio), torch.from_numpy(want.audio), rtol=0, atol=1e-4)
    steps = [r.num_inference_steps - 1 for r in requests]  # model evaluations per request
    assert [t.forwards for t in tickets] == steps
    assert engine.stats.forwards < sum(steps)  # they shared forwards
    print(f"\nengine: {sum(steps)} request-steps in {engine.stats.forwards} packed forwards")


def test_engine_reports_progress_and_cancelled_requests_leave_the_pack(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits())
        keep, drop = engine.submit(request("keep", 7)), engine.submit(request("drop", 7))
        # each joins the pack at the first step boundary after the stage worker prepared it
        await drop.changed.wait()
        assert keep.progress[0] >= drop.progress[0] >= 1 and drop.progress[1] == 6
        engine.cancel(drop)
        await keep.future
        return keep, drop

    keep, drop = asyncio.run(scenario())
    assert keep.progress == (6, 6) and keep.forwards == 6
    assert drop.cancelled and drop.forwards < 6


def test_backpressure_rejects_a_burst_at_once_and_completes_the_accepted(solo):
    async def burst():
        engine = Engine(solo, EngineLimits(max_queue=3, max_active=2))
        accepted, rejected = [], 0
        started = time.perf_counter()
        for i in range(8):
            try:
                accepted.append(engine.submit(request(f"p{i}", 2)))
            except QueueFull as e:
                assert "queue is full" in str(e)
                rejected += 1
        submit_seconds = time.perf_counter() - started
        return accepted, rejected, await asyncio.gather(*(t.future for t in accepted)), submit_seconds

    accepted, rejected, results, submit_seconds = asyncio.run(burst())
    assert len(accepted) == 5 and rejected == 3  # a full pack (max_active) plus the queue (max_queue)
    assert submit_seconds < 1.0  # refused at once, not after a wait
    assert all(r.frames.shape == (124, 64, 64, 3) for r in results)


def test_oversized_and_invalid_requests_are_refused_at_submit(solo):
    async def submit(limits, r):
        return Engine(solo, limits).submit(r)

    with pytest.raises(ValueError, match="budget of 64"):
        asyncio.run(submit(EngineLimits(max_rows_per_step=64), request()))
    with pytest.raises(ValueError, match="multiples of 32"):
        asyncio.run(submit(EngineLimits(), GenerationRequest(prompt="x", width=100, height=64)))


def test_cancelled_waiting_requests_do_not_hold_queue_slots(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits(max_queue=2, max_active=1))
        running = engine.submit(request("running", 30))
        await running.changed.wait()  # it is in the pack; the next ones wait behind max_active
        waiting = [engine.submit(request(f"w{i}")) for i in range(2)]
        with pytest.raises(QueueFull):
            engine.submit(request("full"))
        for ticket in waiting:
            engine.cancel(ticket)
        again = engine.submit(request("after the cancels"))  # the cancelled ones freed their slots
        engine.cancel(running)
        return await again.future

    assert asyncio.run(scenario()).frames.shape == (124, 64, 64, 3)


def poison(state) -> None:
    """Real bad data in a prepared request: prompt embeddings one column short of the text encoder's width.

    The context embedder refuses them on every rank, before any collective; next to other documents the
    pack cannot even be built (the embeddings do not concatenate)."""
    state.layout["prompt_embeds"] = state.layout["prompt_embeds"][:, :-1]


def test_a_failed_step_does_not_stall_the_requests_waiting_behind_it(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits(max_queue=4, max_active=1))
        first, second = engine.submit(request("first", 6)), engine.submit(request("second"))
        await first.changed.wait()  # in the pack, one step done
        poison(first.prepared)  # a later step of it fails
        with pytest.raises(RuntimeError, match=f"request {first.id} failed"):
            await first.future
        media = await asyncio.wait_for(second.future, timeout=60)  # the old engine left it waiting forever
        return engine, media

    engine, media = asyncio.run(scenario())
    assert media.frames.shape == (124, 64, 64, 3)
    assert engine.stats.failed_steps == 1 and engine.stats.completed == 1
    assert engine.stats.failed_requests == {"error": 1}


# --- fail closed at build ---------------------------------------------------------------


def test_a_replica_refuses_an_incapable_backend_at_build(tiny_checkpoint):
    incapable = Resolution(**{**RESOLUTION.model_dump(), "backend": "sage_attn"})  # a spec the driver never makes
    with pytest.raises(AdmissionError, match="does not implement packed varlen attention") as error:
        WorkerGroup.create(spec(1, tiny_checkpoint, resolution=incapable))
    assert error.value.reason == "incapable"


def test_a_placement_group_that_never_fits_is_removed(tiny_checkpoint):
    impossible = spec(2, tiny_checkpoint).model_copy(update={"rank_resources": {"CPU": 64.0}})
    earlier = set(ray.util.placement_group_table())  # the session's cluster: other modules' groups, all removed
    with pytest.raises(ray.exceptions.GetTimeoutError):
        WorkerGroup.create(impossible, placement_timeout_s=2.0)
    states = [g["state"] for pg, g in ray.util.placement_group_table().items() if pg not in earlier]
    assert states and all(state == "REMOVED" for state in states), states


# --- faults ---------------------------------------------------------------------------


def test_a_worker_killed_mid_request_is_replaced_and_the_request_completes_as_alone(solo, tiny_checkpoint):
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=30.0))
    want = solo.pipeline.generate(request("long", 8))

    async def in_flight():
        engine = Engine(group, EngineLimits(step_timeout_min_s=5.0))
        ticket = engine.submit(request("long", 8))
        await ticket.changed.wait()
        ray.kill(group.workers[0])
        return engine, await ticket.future

    engine, media = asyncio.run(in_flight())
    try:
        assert engine.group is not group and engine.stats.group_replacements == 1
        assert [r.started for r in engine.supervisor.history] == [(1,)]  # the dead rank got a new actor
        assert engine.stats.failed_requests == {}
        engine.group.check_health()
        pixel_diff = abs(media.frames.astype(int) - want.frames.astype(int))
        assert media.frames.shape == want.frames.shape and pixel_diff.max() <= 1
    finally:
        engine.group.shutdown()


def test_health_check_notices_a_killed_idle_worker(tiny_checkpoint):
    group = WorkerGroup.create(spec(2, tiny_checkpoint))
    try:
        group.check_health()
        ray.kill(group.workers[0])  # asynchronous: the actor dies a moment later
        killed = time.perf_counter()
        with pytest.raises(WorkerGroupBroken, match="health check"):
            while time.perf_counter() - killed < 10:  # Serve's period is 5 s; poll faster than that
                group.check_health(timeout_s=2.0)
                time.sleep(0.1)
        assert time.perf_counter() - killed < 5.0
        with pytest.raises(WorkerGroupBroken):  # and it stays broken
            group.check_health()
    finally:
        group.shutdown()
