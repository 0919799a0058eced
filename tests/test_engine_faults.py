"""The engine's fault isolation, deadlines, drain, warm-up, watchdog and stage timings, on real parts:
a real Ray local cluster, real gloo, the real tiny checkpoint, faults through real data and real processes."""

import asyncio
import collections
import contextlib
import os
import signal
import time
import weakref

import pytest
import torch

from h3serve.replicas import (
    FAILURE_REASONS,
    STAGES,
    DeadlineExceeded,
    Engine,
    EngineDraining,
    EngineLimits,
    EngineStalled,
    EngineStopped,
    WorkerGroup,
)
from h3serve.replicas.cuda_faults import InjectedDeviceError
from tests.harness import gone
from tests.test_replicas import poison, request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


class Recorder:
    """An EngineObserver that keeps what it was told (deploy's observer exports the same calls)."""

    def __init__(self):
        self.stages: dict[str, list[float]] = collections.defaultdict(list)
        self.failed_steps: collections.Counter[str] = collections.Counter()
        self.failed_requests: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self.preempted: list[int] = []
        self.duty_cycles: list[float] = []

    def on_step(self, stats, seconds):
        self.steps += 1

    def on_queue(self, waiting, active):
        pass

    def on_stage(self, stage, seconds):
        assert stage in STAGES and seconds >= 0, (stage, seconds)
        self.stages[stage].append(seconds)

    def on_failed_step(self, reason):
        assert reason in ("pack", "worker_group"), reason
        self.failed_steps[reason] += 1

    def on_failed_request(self, reason):
        assert reason in FAILURE_REASONS, reason
        self.failed_requests[reason] += 1

    def on_preempted(self, count):
        assert count > 0, count
        self.preempted.append(count)

    def on_duty_cycle(self, fraction):
        assert 0.0 <= fraction <= 1.0, fraction
        self.duty_cycles.append(fraction)


def assert_same_media(got, want):
    # as the staggered test: packing rounds fp32 GEMMs differently, a pixel may move one uint8 step
    pixel_diff = abs(got.frames.astype(int) - want.frames.astype(int))
    assert got.frames.shape == want.frames.shape and pixel_diff.max() <= 1
    torch.testing.assert_close(torch.from_numpy(got.audio), torch.from_numpy(want.audio), rtol=0, atol=1e-4)


# --- fault isolation ----------------------------------------------------------------------


EIGHT = [request(f"clip {i}", steps=12 + i % 4, seed=i) for i in range(8)]  # long enough to share the pack
POISONED = 2


def run_eight_with_one_poisoned(group: WorkerGroup):
    EIGHT_WITH_LONG = list(EIGHT)
    EIGHT_WITH_LONG[POISONED] = request("poisoned", steps=16, seed=99)  # still running when its data turns bad

    async def scenario():
        recorder = Recorder()
        engine = Engine(group, EngineLimits(max_active=8), recorder)
        tickets = [engine.submit(r, request_id=f"clip-{i}") for i, r in enumerate(EIGHT_WITH_LONG)]
        poisoned = tickets[POISONED]
        # the stage worker prepares them one at a time and each joins at the next step boundary: poison the
        # request once all eight share the pack
        while not all(t.forwards for t in tickets):
            await asyncio.sleep(0.01)
        assert not any(t.future.done() for t in tickets), "a request finished before all eight shared the pack"
        poison(poisoned.prepared)
        results = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
        return engine, recorder, tickets, results

    return asyncio.run(scenario())


@pytest.mark.parametrize("sp", [1, 2], ids=lambda w: f"sp={w}")
def test_one_poisoned_request_among_eight_fails_alone_and_the_others_match_alone(solo, tiny_checkpoint, sp):
    alone = [solo.pipeline.generate(r) if i != POISONED else None for i, r in enumerate(EIGHT)]
    group = solo if sp == 1 else WorkerGroup.create(spec(sp, tiny_checkpoint, timeout=10.0))
    try:
        engine, recorder, tickets, results = run_eight_with_one_poisoned(group)
        group.check_health()  # a data failure never breaks the group
    finally:
        if group is not solo:
            group.shutdown()
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert [i for i, _ in failures] == [POISONED], failures
    ((_, error),) = failures
    assert type(error) is RuntimeError and "request clip-2 failed" in str(error)
    for i, (ticket, got, want) in enumerate(zip(tickets, results, alone, strict=True)):
        if i == POISONED:
            continue
        assert ticket.forwards == EIGHT[i].num_inference_steps - 1  # every step exactly once, retries included
        assert_same_media(got, want)
    assert engine.stats.failed_requests == {"error": 1}
    assert engine.stats.completed == 7
    # the pack of 8 failed, then the halves holding the poisoned request (4, 2) and the request alone
    assert engine.stats.failed_steps >= 2
    assert recorder.failed_steps == {"pack": engine.stats.failed_steps}
    assert recorder.failed_requests == {"error": 1}


def test_a_failed_attempt_s_pack_and_activations_are_gone_before_its_halves_run(solo, monkeypatch):
    """A pack of two fails in its last block (as an out-of-memory there would); when the first half's forward starts,
    no weak reference to the failed attempt's pack or to any of its blocks' outputs is alive: the engine kept a
    description of the error, not the exception whose traceback holds the forward's frames."""
    blocks = solo.pipeline.denoiser.transformers["transformer"].transformer_blocks
    attempt: dict = {"pack": [], "outputs": []}  # weak references to the forward now running
    seen: dict = {"armed": False, "failed": None, "alive_at_retry": None}
    packs = solo.pipeline.packs

    def recording_packs(states):  # the real method; the test keeps weak references to what it made
        made = packs(states)
        attempt["pack"] = [weakref.ref(pack) for _, pack in made]
        return made

    def first_block_starts(module, args):
        if seen["failed"] is not None and seen["alive_at_retry"] is None:
            seen["alive_at_retry"] = [ref() is not None for ref in seen["failed"]]
        attempt["outputs"] = []

    def block_ran(module, args, output):
        attempt["outputs"].append(weakref.ref(output))

    def last_block_fails(module, args, output):
        if seen["armed"]:
            seen["armed"] = False
            seen["failed"] = [*attempt["pack"], *attempt["outputs"]]
            raise RuntimeError("out of memory in the last block (injected)")

    monkeypatch.setattr(solo.pipeline, "packs", recording_packs)
    hooks = [blocks[0].register_forward_pre_hook(first_block_starts)]
    hooks += [block.register_forward_hook(block_ran) for block in blocks]
    hooks.append(blocks[-1].register_forward_hook(last_block_fails))

    async def scenario():
        engine = Engine(solo, EngineLimits(max_active=2))
        tickets = [engine.submit(request(f"clip {i}", 8, seed=i)) for i in range(2)]
        while not all(t.forwards for t in tickets):  # both share the pack (each has steps left)
            await asyncio.sleep(0.01)
        assert not any(t.future.done() for t in tickets)
        seen["armed"] = True
        return engine, await asyncio.gather(*(t.future for t in tickets))

    try:
        engine, media = asyncio.run(scenario())
    finally:
        for hook in hooks:
            hook.remove()
    assert seen["failed"] is not None and len(seen["failed"]) == 1 + len(blocks)  # the pack, each block's output
    assert seen["alive_at_retry"] == [False] * len(seen["failed"])  # all gone before the first half ran
    assert engine.stats.failed_steps == 1 and engine.stats.completed == 2  # both halves then went on
    assert all(m.frames.shape == (124, 64, 64, 3) for m in media)


# --- deadlines ----------------------------------------------------------------------------


def test_deadlines_fail_a_waiting_and_an_active_request_and_leave_the_others_alone(solo):
    keep_request = request("keep", 60, seed=5)  # busy past the waiting one's 0.5 s on a quiet machine too
    keep_alone = solo.pipeline.generate(keep_request)

    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, EngineLimits(max_active=2, default_deadline_s=0.5), recorder)
        with pytest.raises(ValueError, match="timeout_s must be a positive number"):
            engine.submit(request("never"), deadline_s=0)
        keep = engine.submit(keep_request, request_id="keep", deadline_s=600)  # explicit beats the default
        slow = engine.submit(request("slow", 300), request_id="slow", deadline_s=3.0)
        await keep.changed.wait()
        started = time.monotonic()
        waiting = engine.submit(request("waiting"), request_id="waiting")  # the default: 0.5 s; no slot frees
        with pytest.raises(DeadlineExceeded, match="request waiting passed its deadline of 0.5 s before it started"):
            await waiting.future
        waited = time.monotonic() - started
        with pytest.raises(DeadlineExceeded, match="request slow passed its deadline of 3 s in the pack"):
            await slow.future
        slow_forwards = slow.forwards
        media = await keep.future
        await asyncio.sleep(0.5)
        return engine, recorder, waited, slow_forwards, slow, media

    engine, recorder, waited, slow_forwards, slow, media = asyncio.run(scenario())
    assert 0.5 <= waited < 2.5, waited  # at its deadline, while both slots were taken
    assert slow.forwards == slow_forwards < 299  # it left the pack
    assert engine.queue_depth == (0, 0)
    assert_same_media(media, keep_alone)
    assert engine.stats.failed_requests == {"deadline": 2} and recorder.failed_requests == {"deadline": 2}


# --- drain --------------------------------------------------------------------------------


def test_drain_hands_back_waiting_requests_lets_active_ones_finish_and_refuses_new_ones(solo):
    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, EngineLimits(max_active=1), recorder)
        active = engine.submit(request("active", 6), request_id="active")
        await active.changed.wait()
        waiting = [engine.submit(request(f"w{i}"), request_id=f"w{i}") for i in range(2)]
        drain = asyncio.create_task(engine.drain(timeout_s=120))
        await asyncio.sleep(0)  # drain runs up to its wait
        assert all(t.future.done() for t in waiting)  # handed back at once, never started here
        for t in waiting:
            with pytest.raises(EngineDraining, match="never started"):
                t.future.result()
        with pytest.raises(EngineDraining):
            engine.submit(request("new"))
        assert not active.future.done()
        await drain
        with pytest.raises(EngineStopped):  # drained: closed for good
            engine.submit(request("later"))
        return engine, recorder, active.future.result()

    engine, recorder, media = asyncio.run(scenario())
    assert media.frames.shape == (124, 64, 64, 3)
    assert engine.stats.completed == 1
    assert engine.stats.failed_requests == {"draining": 2} and recorder.failed_requests == {"draining": 2}


def test_drain_past_its_timeout_stops_what_is_still_running(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits())
        long = engine.submit(request("long", 300), request_id="long")
        await long.changed.wait()
        started = time.monotonic()
        await engine.drain(timeout_s=0.5)
        drained_after = time.monotonic() - started
        with pytest.raises(EngineStopped) as stopped:
            long.future.result()
        return engine, drained_after, stopped.value

    engine, drained_after, error = asyncio.run(scenario())
    assert type(error) is EngineStopped and "drained" in str(error)
    assert 0.5 <= drained_after < 3.0, drained_after
    assert engine.stats.failed_requests == {"shutdown": 1}


# --- warm-up and stage timings ----------------------------------------------------------------


def test_warm_up_runs_one_real_forward_and_every_stage_is_timed(solo):
    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, EngineLimits(), recorder)
        steps_before = solo.steps
        seconds = engine.warm_up()
        assert solo.steps == steps_before + 1  # one packed forward launched on the group
        assert seconds > 0 and engine.expected_step_s == seconds
        assert engine.stall_window_s == max(120.0, 20.0 * seconds)
        media = await engine.generate(request("after warm-up", 4), request_id="timed")
        with pytest.raises(RuntimeError, match="before the first submit"):
            engine.warm_up()
        return recorder, media

    recorder, media = asyncio.run(scenario())
    assert media.frames.shape == (124, 64, 64, 3)
    assert {stage: len(times) for stage, times in recorder.stages.items()} == {
        "queue_wait": 1,
        "prepare": 1,
        "first_step": 1,
        "step": 3,
        "decode": 1,
        "end_to_end": 1,
    }
    assert recorder.stages["first_step"][0] >= recorder.stages["prepare"][0]
    assert recorder.stages["end_to_end"][0] >= recorder.stages["first_step"][0] + recorder.stages["decode"][0]


# --- the watchdog -------------------------------------------------------------------------


def test_watchdog_reports_a_stall_when_a_rank_hangs_then_the_step_bound_replaces_the_group(tiny_checkpoint):
    timeout_s = 30.0  # the collective's own timeout (NCCL's watchdog on a GPU): never reached here
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=timeout_s))
    group.abort_grace_s = 1.0
    pid, _ = group.processes[1]

    async def scenario():
        engine = Engine(group, EngineLimits(stall_min_s=1.5, stall_factor=1.0, step_timeout_min_s=4.0))
        engine.warm_up()  # one forward on both ranks seeds the expected step time
        ticket = engine.submit(request("long", 12), request_id="long")
        await ticket.changed.wait()
        await asyncio.to_thread(engine.check_health)  # steps complete: healthy
        window = engine.stall_window_s
        assert window + 1.0 < engine.step_bound_s < timeout_s  # the stall shows before the bound breaks the group
        os.kill(pid, signal.SIGSTOP)  # rank 1 freezes; rank 0 waits for it in the next collective
        stopped = time.monotonic()
        try:
            await asyncio.sleep(window + 1.0)
            with pytest.raises(EngineStalled, match="no step completed"):
                engine.check_health()
            media = await ticket.future  # the bound broke the group; a new one finished the request
            finished_after = time.monotonic() - stopped
        finally:
            with contextlib.suppress(ProcessLookupError):  # killed and replaced, as it should be
                os.kill(pid, signal.SIGCONT)
        await asyncio.to_thread(engine.check_health)  # healthy again
        return engine, window, finished_after, media

    engine, window, finished_after, media = asyncio.run(scenario())
    try:
        assert window == max(1.5, engine.expected_step_s)
        assert engine.stats.group_replacements == 1 and engine.stats.failed_requests == {}
        (replaced,) = engine.supervisor.history
        # broken by the bound and the abort (4 s, then a grace of 1 s for the frozen rank), never by the collective
        # timeout; the new worker process's start (imports and checkpoint: machine-bound) is left out of the bound
        assert replaced.broken_after_s < 4.0 + 2 * group.abort_grace_s + 2, replaced
        assert finished_after - replaced.seconds < timeout_s / 2, (finished_after, replaced)
        assert media.frames.shape == (124, 64, 64, 3)
        assert gone(pid)  # the frozen process was killed, not left behind
    finally:
        engine.group.shutdown()


# --- CUDA-fatal outside a step ------------------------------------------------------------


def test_a_cuda_fatal_error_in_a_decode_stops_the_engine_retryably_and_fails_its_health(tiny_checkpoint, monkeypatch):
    """A decode on rank 0 that raises a CUDA-fatal error (as an illegal address in the VAE would) poisons the replica's
    process, not the request: the engine stops at once, every request it holds fails with EngineStopped (503, run
    again elsewhere; counted as ``worker_group``, never ``decode``), and health fails so Serve replaces the replica."""
    group = WorkerGroup.create(spec(1, tiny_checkpoint))  # its own: the engine gives it up
    decode = group.pipeline.decode

    def poisoned_once(state, *args, **kwargs):  # the real decode, after one injected device fault
        if not seen:
            seen.append(state)
            raise InjectedDeviceError("CUDA error: an illegal memory access was encountered (injected in a decode)")
        return decode(state, *args, **kwargs)

    seen: list = []
    monkeypatch.setattr(group.pipeline, "decode", poisoned_once)

    async def scenario():
        recorder = Recorder()
        engine = Engine(group, EngineLimits(max_active=2), recorder)
        tickets = [engine.submit(request(f"clip {i}", 3, seed=i), request_id=f"clip-{i}") for i in range(2)]
        started = time.monotonic()
        results = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
        with pytest.raises(EngineStopped, match="rank 0 hit a CUDA-fatal error"):  # Serve's health check
            await asyncio.to_thread(engine.check_health)
        with pytest.raises(EngineStopped):
            engine.submit(request("after"))
        await engine.close()
        return engine, recorder, results, time.monotonic() - started

    try:
        engine, recorder, results, seconds = asyncio.run(scenario())
    finally:
        group.shutdown()
    assert seconds < 30, seconds
    for result in results:
        assert isinstance(result, EngineStopped), result
        assert "rank 0 hit a CUDA-fatal error: its process is lost: InjectedDeviceError" in str(result), result
    assert engine.stats.failed_requests == {"worker_group": 2} and recorder.failed_requests == {"worker_group": 2}
    # the poisoning, and the step in flight then when clip-1 (prepared after clip-0) was a step behind: never "pack"
    assert set(recorder.failed_steps) == {"worker_group"} and recorder.failed_steps["worker_group"] in (1, 2)
