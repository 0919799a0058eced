"""Scheduling policies, preemption and stages off the step loop.

The policies' orderings and their starvation bounds are checked on the pure ``schedule`` function with an
explicit clock; pause/resume, policies end to end, the stage worker and drain on a real engine over a real
sp=1 worker group of the tiny checkpoint (one rank: no Ray cluster needed)."""

import asyncio
import itertools
import math
import random
import threading

import numpy as np
import pydantic
import pytest

from h3serve.pipelines.h3 import RequestError
from h3serve.replicas import (
    MAX_PRIORITY,
    MIN_PRIORITY,
    POLICIES,
    DeadlineExceeded,
    Engine,
    EngineDraining,
    EngineLimits,
    StepBoundary,
    StepGate,
    WorkerGroup,
)
from h3serve.replicas.scheduler import Budget, RequestView, rank, schedule
from tests.test_engine_faults import Recorder, assert_same_media
from tests.test_replicas import request, spec

# --- the scheduler alone: constructed queues, an explicit clock ----------------------------------


def view(order: int, rows: int = 100, steps_left: int = 10, priority: int = 0, submitted: float = 0.0, **kw):
    return RequestView(
        id=f"r{order}", order=order, submitted=submitted, rows=rows, steps_left=steps_left, priority=priority, **kw
    )


def ids(views) -> list[str]:
    return [v.id for v in views]


ROOMY = Budget(max_requests=16, max_rows=100_000)


def test_fcfs_serves_submission_order_and_never_displaces_a_running_request():
    running = [view(0, rows=400, steps_left=40, priority=-5, running=True), view(1, rows=300, running=True)]
    later = [view(2, rows=10, steps_left=1, priority=10), view(3, rows=10, steps_left=1, priority=10)]
    plan = schedule(later + running, Budget(max_requests=2, max_rows=10_000), "fcfs", now=100.0, aging_s=1.0)
    assert ids(plan.batch) == ["r0", "r1"] and plan.preempted == ()
    # room for one more: the earliest of the later ones, whatever its priority or size
    plan = schedule(later + running, Budget(max_requests=3, max_rows=10_000), "fcfs", now=100.0, aging_s=1.0)
    assert ids(plan.batch) == ["r0", "r1", "r2"]


def test_srpt_serves_least_remaining_work_first_and_pauses_the_running_request_with_more():
    queue = [
        view(0, rows=100, steps_left=40, running=True),  # work 4000
        view(1, rows=400, steps_left=2),  # 800
        view(2, rows=50, steps_left=10),  # 500
        view(3, rows=100, steps_left=5),  # 500: ties with r2, submitted later
        view(4, rows=1000, steps_left=1),  # 1000
    ]
    assert ids(rank(queue, "srpt", now=0.0, aging_s=60.0)) == ["r2", "r3", "r1", "r4", "r0"]
    plan = schedule(queue, Budget(max_requests=3, max_rows=10_000), "srpt", now=0.0, aging_s=60.0)
    assert ids(plan.batch) == ["r2", "r3", "r1"]
    assert ids(plan.preempted) == ["r0"]


def test_priority_serves_higher_priority_first_ties_by_submission_and_pauses_lower_running_ones():
    queue = [
        view(0, priority=0, running=True),
        view(1, priority=-3, running=True),
        view(2, priority=5),
        view(3, priority=0),
        view(4, priority=5),
    ]
    assert ids(rank(queue, "priority", now=0.0, aging_s=60.0)) == ["r2", "r4", "r0", "r3", "r1"]
    plan = schedule(queue, Budget(max_requests=3, max_rows=10_000), "priority", now=0.0, aging_s=60.0)
    assert ids(plan.batch) == ["r2", "r4", "r0"]
    assert ids(plan.preempted) == ["r1"]  # r0 keeps running; the lower r1 pauses; r3 never ran


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_never_exceeds_the_row_budget_and_a_smaller_request_fills_what_is_left(policy):
    queue = [view(0, rows=600, steps_left=3), view(1, rows=500, steps_left=3), view(2, rows=300, steps_left=3)]
    plan = schedule(queue, Budget(max_requests=16, max_rows=1000), policy, now=0.0, aging_s=60.0)
    # srpt ranks by work (r2, r1, r0), the others by submission (r0, r1, r2): the second never fits beside the first
    assert ids(plan.batch) == (["r2", "r1"] if policy == "srpt" else ["r0", "r2"])
    assert plan.rows <= 1000

    rng = random.Random(23)
    for _ in range(300):
        candidates = [
            view(
                i,
                rows=rng.randint(64, 4000),
                steps_left=rng.randint(1, 50),
                priority=rng.randint(MIN_PRIORITY, MAX_PRIORITY),
                submitted=rng.uniform(0, 100),
                running=rng.random() < 0.5,
            )
            for i in range(rng.randint(1, 12))
        ]
        budget = Budget(max_requests=rng.randint(1, 6), max_rows=rng.randint(4000, 12000))
        plan = schedule(candidates, budget, policy, now=100.0, aging_s=rng.uniform(1, 100))
        assert 1 <= len(plan.batch) <= budget.max_requests and plan.rows <= budget.max_rows
        left_out = [v for v in candidates if v not in plan.batch]
        if len(plan.batch) < budget.max_requests:  # greedy: whatever was left out did not fit
            assert all(plan.rows + v.rows > budget.max_rows for v in left_out)
        assert set(plan.preempted) == {v for v in left_out if v.running}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_never_exceeds_the_prompt_row_budget_either(policy):
    """engine.max_text_rows_per_step bounds a pack's prompt rows (what the memory plan counts); a request whose
    prompt rows do not fit beside those taken is skipped like one whose rows do not, and a shorter one runs."""
    queue = [view(0, rows=600, text_rows=300), view(1, rows=500, text_rows=250), view(2, rows=400, text_rows=50)]
    plan = schedule(queue, Budget(max_requests=16, max_rows=10_000, max_text_rows=400), policy, 0.0, 60.0)
    assert ids(plan.batch) == (["r2", "r1"] if policy == "srpt" else ["r0", "r2"])
    assert sum(v.text_rows for v in plan.batch) <= 400
    assert len(schedule(queue, Budget(16, 10_000), policy, 0.0, 60.0).batch) == 3  # no prompt-row budget: all


def test_aging_lets_a_request_outrank_newcomers_after_the_computed_wait():
    aging_s = 10.0
    # priority: a request of priority 0 outranks a newcomer of priority 3 once it waited 3 * aging_s
    for now, first in ((29.0, "r1"), (31.0, "r0")):
        old, newcomer = view(0, priority=0, submitted=0.0), view(1, priority=3, submitted=now)
        assert ids(rank([old, newcomer], "priority", now, aging_s))[0] == first, now
    # srpt: 8x the work outranks a newcomer once it waited log2(8) * aging_s = 30 s
    for now, first in ((29.0, "r1"), (31.0, "r0")):
        old, newcomer = view(0, rows=800, steps_left=1, submitted=0.0), view(1, rows=100, steps_left=1, submitted=now)
        assert ids(rank([old, newcomer], "srpt", now, aging_s))[0] == first, now
    # two requests of the same age keep their order however long they wait: no ping-pong
    for now in (0.0, 1e3, 1e6):
        pair = [view(0, priority=0, submitted=0.0), view(1, priority=2, submitted=0.0)]
        assert ids(rank(pair, "priority", now, aging_s)) == ["r1", "r0"]


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="policy must be one of"):
        schedule([view(0)], ROOMY, "lifo", now=0.0, aging_s=1.0)  # type: ignore[arg-type]


def first_step_of_the_long_request(policy: str, aging_s: float, long: dict, short: dict, horizon_s: float):
    """A saturating stream: one short request arrives every step (``dt`` = 1 s) and needs one step, and one
    step serves one request; a long request waits from t = 0. When does it first run (None: not by horizon_s)?"""
    budget, dt = Budget(max_requests=1, max_rows=100_000), 1.0
    orders = itertools.count(1)
    long_request = view(0, submitted=0.0, **long)
    queue = [long_request]
    for step in range(int(horizon_s / dt)):
        now = step * dt
        queue.append(view(next(orders), submitted=now, steps_left=1, **short))
        (chosen,) = schedule(queue, budget, policy, now, aging_s).batch  # type: ignore[arg-type]
        if chosen is long_request:
            return now
        queue.remove(chosen)  # its one step done
    return None


@pytest.mark.parametrize(
    "policy, long, short, levels",
    [
        # priority: 0 against a stream of 5s; it outranks newcomers after (5 - 0) levels of aging
        ("priority", dict(priority=0, rows=100, steps_left=10), dict(priority=5, rows=100), 5.0),
        # srpt: 16x the work of each short one; it outranks newcomers after log2(16) = 4 halvings
        ("srpt", dict(rows=400, steps_left=4), dict(rows=100), math.log2(16)),
    ],
)
def test_no_starvation_with_aging_a_long_or_low_request_runs_by_the_computed_bound(policy, long, short, levels):
    aging_s = 20.0
    bound = levels * aging_s  # after this wait it outranks every newcomer; the stream has no backlog beyond one
    started = first_step_of_the_long_request(policy, aging_s, long, short, horizon_s=10 * bound)
    assert started is not None and bound - 2.0 <= started <= bound + 2.0, (started, bound)
    # without aging worth speaking of, the same stream starves it for the whole horizon
    assert first_step_of_the_long_request(policy, 1e9, long, short, horizon_s=10 * bound) is None


# --- the engine: real pipeline, real sp=1 worker group ----------------------------------------


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


class HeldDecode:
    """The real ``pipeline.decode``, held for the request named ``prompt`` until ``release`` is set."""

    def __init__(self, pipeline, prompt: str):
        self.real, self.prompt = pipeline.decode, prompt
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, state, *args, **kwargs):
        if state.request.prompt == self.prompt:
            self.started.set()
            assert self.release.wait(timeout=300), "the test never released the decode"
        return self.real(state, *args, **kwargs)


async def until(condition, interval_s: float = 0.02) -> None:
    while not condition():
        await asyncio.sleep(interval_s)


def finish_order(tickets) -> list[str]:
    order: list[str] = []
    for ticket in tickets:
        ticket.future.add_done_callback(lambda _, name=ticket.id: order.append(name))
    return order


def test_priority_out_of_range_or_not_an_int_is_a_request_error_naming_priority(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits(policy="priority"))
        for bad in (MIN_PRIORITY - 1, MAX_PRIORITY + 1, 1.5, True, "3"):
            with pytest.raises(RequestError, match=r"priority must be an integer between -10 and 10") as error:
                engine.submit(request("x"), priority=bad)  # type: ignore[arg-type]
            assert error.value.field == "priority"
        accepted = [engine.submit(request("x", 2), priority=p) for p in (MIN_PRIORITY, MAX_PRIORITY)]
        for ticket in accepted:
            engine.cancel(ticket)
        await engine.close()
        return accepted

    assert [t.priority for t in asyncio.run(scenario())] == [MIN_PRIORITY, MAX_PRIORITY]
    for bad in (dict(policy="lifo"), dict(aging_s=0), dict(max_prepared=0)):
        with pytest.raises(pydantic.ValidationError, match=next(iter(bad))):
            EngineLimits(**bad)


def test_the_prompt_row_budget_refuses_a_longer_prompt_and_packs_within_it(solo):
    """A prompt longer than engine.max_text_rows_per_step alone is a 400 on ``prompt`` at submit (it would never
    be scheduled); two prompts that fit alone but not together never share a pack."""
    prompt = "a red circle moving left"
    text_rows = solo.pipeline.text_tokens(prompt)  # a T2VA request's prompt rows: its tokens, no template
    limits = EngineLimits(max_text_rows_per_step=text_rows)

    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, limits, recorder)
        with pytest.raises(RequestError, match="prompt rows") as refused:
            engine.submit(request(prompt + " and a blue square"))
        assert refused.value.field == "prompt"
        tickets = [engine.submit(request(prompt, 3, seed=s)) for s in (1, 2)]
        await asyncio.gather(*(t.future for t in tickets))
        await engine.close()
        return engine, tickets

    engine, tickets = asyncio.run(scenario())
    assert [t.text_rows for t in tickets] == [text_rows] * 2
    assert engine.stats.forwards == 2 * 2  # two steps each, never in one pack


def run_alone(group, req, limits: EngineLimits):
    async def scenario():
        engine = Engine(group, limits)
        return await engine.generate(req), engine

    return asyncio.run(scenario())


def assert_identical(got, want):
    assert np.array_equal(got.frames, want.frames) and np.array_equal(got.audio, want.audio)


def test_a_paused_and_resumed_request_equals_the_same_request_served_alone(solo):
    limits = EngineLimits(policy="priority", max_active=1, aging_s=3600)  # one request per step: a full budget
    low_request, high_request = request("low, paused", 40, seed=7), request("high", 4, seed=8)
    low_alone, alone_engine = run_alone(solo, low_request, limits)
    high_alone, _ = run_alone(solo, high_request, limits)
    assert alone_engine.stats.preemptions == 0

    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, limits, recorder)
        low = engine.submit(low_request, request_id="low", priority=0)
        await low.changed.wait()  # one step done
        high = engine.submit(high_request, request_id="high", priority=5)
        low_at_high_done = []
        high.future.add_done_callback(lambda _: low_at_high_done.append(low.forwards))
        low_media, high_media = await asyncio.gather(low.future, high.future)
        return engine, recorder, low, low_at_high_done[0], low_media, high_media

    engine, recorder, low, low_at_high_done, low_media, high_media = asyncio.run(scenario())
    assert low_at_high_done < low_request.num_inference_steps - 1  # high ran while low was paused part-way
    assert low.forwards == low_request.num_inference_steps - 1  # every step exactly once, across the pause
    assert engine.stats.preemptions == 1 and recorder.preempted == [1]
    assert_identical(low_media, low_alone)
    assert_identical(high_media, high_alone)


def test_fcfs_keeps_submission_order_and_srpt_lets_short_requests_overtake_with_the_same_outputs(solo):
    long_request, shorts = request("long", 40, seed=1), [request(f"short {i}", 3, seed=10 + i) for i in range(2)]
    alone = [solo.pipeline.generate(r) for r in (long_request, *shorts)]

    def run(policy: str):
        async def scenario():
            engine = Engine(solo, EngineLimits(policy=policy, max_active=1))
            long = engine.submit(long_request, request_id="long")
            await long.changed.wait()  # the long one runs; two short ones arrive behind it
            tickets = [long, *(engine.submit(r, request_id=f"short-{i}") for i, r in enumerate(shorts))]
            order = finish_order(tickets)
            results = await asyncio.gather(*(t.future for t in tickets))
            return engine, tickets, order, results

        return asyncio.run(scenario())

    fcfs_engine, fcfs_tickets, fcfs_order, fcfs_results = run("fcfs")
    assert fcfs_order == ["long", "short-0", "short-1"] and fcfs_engine.stats.preemptions == 0
    for ticket, got, want in zip(fcfs_tickets, fcfs_results, alone, strict=True):
        assert ticket.forwards == ticket.request.num_inference_steps - 1
        assert_same_media(got, want)  # today's engine: each as served alone

    srpt_engine, srpt_tickets, srpt_order, srpt_results = run("srpt")
    assert srpt_order == ["short-0", "short-1", "long"] and srpt_engine.stats.preemptions >= 1
    for fcfs, srpt in zip(fcfs_results, srpt_results, strict=True):
        assert_identical(srpt, fcfs)  # one request per pack either way: the order changed, no pixel did


def test_a_slow_decode_does_not_stop_the_other_requests_steps(solo, monkeypatch):
    held_decode = HeldDecode(solo.pipeline, "held")
    monkeypatch.setattr(solo.pipeline, "decode", held_decode)

    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, EngineLimits(max_active=4), recorder)
        other = engine.submit(request("other", 40), request_id="other")
        held = engine.submit(request("held", 2), request_id="held")  # one forward, then its decode is held
        try:
            assert await asyncio.to_thread(held_decode.started.wait, 120)
            at_hold, forwards_at_hold = other.forwards, engine.stats.forwards
            while other.forwards < at_hold + 3:  # the held decode would block these on a loop that decodes inline
                other.changed.clear()
                await asyncio.wait_for(other.changed.wait(), timeout=60)
            assert not held.future.done()
            advanced = other.forwards - at_hold, engine.stats.forwards - forwards_at_hold
        finally:
            held_decode.release.set()
        held_media, other_media = await asyncio.gather(held.future, other.future)
        return engine, recorder, advanced, held_media, other_media

    engine, recorder, (other_advanced, engine_advanced), held_media, other_media = asyncio.run(scenario())
    assert other_advanced >= 3 and engine_advanced >= 3
    assert held_media.frames.shape == other_media.frames.shape == (124, 64, 64, 3)
    assert engine.stats.completed == 2
    # duty cycle: time in forwards over time with work; reported after every step
    assert 0 < engine.stats.forward_s <= engine.stats.busy_s
    assert 0 < engine.stats.duty_cycle <= 1
    assert len(recorder.duty_cycles) == recorder.steps == engine.stats.forwards
    assert all(0 < fraction <= 1 for fraction in recorder.duty_cycles)


def test_a_request_past_its_deadline_while_decoding_fails_then(solo, monkeypatch):
    held_decode = HeldDecode(solo.pipeline, "held")
    monkeypatch.setattr(solo.pipeline, "decode", held_decode)

    async def scenario():
        engine = Engine(solo, EngineLimits())
        held = engine.submit(request("held", 2), request_id="held", deadline_s=3.0)
        try:
            with pytest.raises(DeadlineExceeded, match="request held passed its deadline of 3 s while decoding"):
                await held.future  # at its deadline, while the decode still runs
            assert held_decode.started.is_set() and not held_decode.release.is_set()
        finally:
            held_decode.release.set()
        after = await engine.generate(request("after", 2))  # the stage worker carries on
        return engine, after

    engine, after = asyncio.run(scenario())
    assert after.frames.shape == (124, 64, 64, 3)
    assert engine.stats.failed_requests == {"deadline": 1} and engine.stats.completed == 1


def test_drain_hands_back_prepared_requests_and_lets_paused_ones_finish_within_the_prepared_bound(solo):
    limits = EngineLimits(policy="priority", max_active=1, max_prepared=2, aging_s=3600)

    async def scenario():
        engine = Engine(solo, limits)
        # low has steps to spare while high is prepared beside it, however slow the machine
        low = engine.submit(request("low", 80), request_id="low", priority=0)
        await low.changed.wait()
        high = engine.submit(request("high", 30), request_id="high", priority=5)
        await high.changed.wait()  # low is paused
        later = [engine.submit(request(f"later {i}", 3), request_id=f"later-{i}", priority=-5) for i in range(2)]
        await asyncio.wait_for(until(lambda: later[0].state is not None), timeout=60)
        for _ in range(3):  # steps go on; the stage worker is idle at its bound
            high.changed.clear()
            await high.changed.wait()
        # at most max_active + max_prepared = 3 prepared states: high runs, low is paused, later-0 is ready
        prepared = [t.id for t in (low, high, *later) if t.state is not None and not t.state.done]
        assert prepared == ["low", "high", "later-0"], prepared
        assert engine.queue_depth == (2, 2)  # two never started (one prepared, one waiting), two started
        drain = asyncio.create_task(engine.drain(timeout_s=120))
        await asyncio.sleep(0)
        for ticket in later:
            with pytest.raises(EngineDraining, match="never started"):
                ticket.future.result()
        await drain
        return engine, low, high

    engine, low, high = asyncio.run(scenario())
    assert low.future.result().frames.shape == high.future.result().frames.shape == (124, 64, 64, 3)
    assert (low.forwards, high.forwards) == (79, 29)
    assert engine.stats.preemptions == 1
    assert engine.stats.failed_requests == {"draining": 2}


def test_cancelled_prepared_requests_free_their_room_for_a_waiting_one(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits(max_active=1, max_prepared=1))
        running = engine.submit(request("running", 300), request_id="running")
        await running.changed.wait()
        ready = engine.submit(request("ready", 3), request_id="ready")
        waiting = engine.submit(request("waiting", 3), request_id="waiting")
        await asyncio.wait_for(until(lambda: ready.state is not None), timeout=60)
        for _ in range(3):  # the stage worker is at its bound: one running, one prepared
            running.changed.clear()
            await running.changed.wait()
        assert waiting.state is None
        engine.cancel(running)
        engine.cancel(ready)
        return await asyncio.wait_for(waiting.future, timeout=120), engine

    media, engine = asyncio.run(scenario())
    assert media.frames.shape == (124, 64, 64, 3)
    assert engine.stats.completed == 1 and engine.queue_depth == (0, 0)


def test_a_higher_priority_request_takes_the_prepared_room_of_a_lower_one_that_never_stepped(solo):
    # one running, one prepared: the bound. Without giving room back, "high" would wait for "low" to finish.
    limits = EngineLimits(policy="priority", max_active=1, max_prepared=1, aging_s=3600)

    async def scenario():
        engine = Engine(solo, limits)
        low = engine.submit(request("low", 40), request_id="low", priority=0)
        await low.changed.wait()
        ready = engine.submit(request("ready", 3), request_id="ready", priority=-1)
        await asyncio.wait_for(until(lambda: ready.state is not None), timeout=60)
        high = engine.submit(request("high", 3), request_id="high", priority=5)
        order = finish_order([low, ready, high])
        await asyncio.gather(low.future, ready.future, high.future)
        return engine, order, (low, ready, high)

    engine, order, (low, ready, high) = asyncio.run(scenario())
    assert order == ["high", "low", "ready"]
    assert engine.stats.preemptions == 1  # high paused low; ready never ran before low finished
    assert (low.prepares, ready.prepares, high.prepares) == (1, 2, 1)
    assert [t.forwards for t in (low, ready, high)] == [39, 2, 2]


# --- the step gate: a public rule over which prepared requests may join a step -----------------------


class HoldBack(StepGate):
    """Lets ``held`` in only when no other request is prepared or waiting; records every batch and its thread."""

    def __init__(self, held: str):
        self.held = held
        self.batches: list[list[str]] = []
        self.threads: set[str] = set()
        self.held_everything = 0  # boundaries at which it let no prepared request in

    def candidates(self, boundary: StepBoundary):
        others = [t for t in (*boundary.prepared, *boundary.waiting) if t.id != self.held]
        allowed = [t for t in boundary.prepared if t.id != self.held or not others]
        self.held_everything += bool(boundary.prepared) and not allowed
        return allowed

    def before_forward(self, batch):
        self.batches.append([t.id for t in batch])
        self.threads.add(threading.current_thread().name)


def test_a_request_the_gate_refuses_waits_prepared_and_runs_after_the_others_with_nothing_lost(solo):
    requests = {name: request(name, 3, seed=seed) for seed, name in enumerate(("held", "a", "b"), 1)}
    alone = {name: solo.pipeline.generate(r) for name, r in requests.items()}
    gate = HoldBack("held")

    async def scenario():
        engine = Engine(solo, EngineLimits(max_active=4), gate=gate)  # fcfs: without the gate "held" runs first
        tickets = [engine.submit(r, request_id=name) for name, r in requests.items()]
        order = finish_order(tickets)
        results = await asyncio.wait_for(asyncio.gather(*(t.future for t in tickets)), timeout=300)
        return engine, tickets, order, dict(zip(requests, results, strict=True))

    engine, tickets, order, results = asyncio.run(scenario())
    assert order[-1] == "held" and engine.stats.completed == 3 and engine.queue_depth == (0, 0)
    assert gate.held_everything >= 1  # "held" was prepared first, alone: the loop slept until "a" was prepared
    with_held = [i for i, batch in enumerate(gate.batches) if "held" in batch]
    assert all(gate.batches[i] == ["held"] for i in with_held)  # never beside a request still running
    assert min(with_held) > max(i for i, batch in enumerate(gate.batches) if "held" not in batch)
    assert [t.forwards for t in tickets] == [2, 2, 2] and engine.stats.preemptions == 0
    assert len(gate.threads) == 1 and next(iter(gate.threads)).startswith("h3-engine")  # the model thread
    for name, media in results.items():
        assert_same_media(media, alone[name])


class PauseFor(StepGate):
    """Leaves ``paused`` out while ``first`` is prepared or waiting."""

    def __init__(self, paused: str, first: str):
        self.paused, self.first = paused, first
        self.batches: list[list[str]] = []

    def candidates(self, boundary: StepBoundary):
        first_pending = any(t.id == self.first for t in (*boundary.prepared, *boundary.waiting))
        return [t for t in boundary.prepared if t.id != self.paused or not first_pending]

    def before_forward(self, batch):
        self.batches.append([t.id for t in batch])


def test_a_running_request_the_gate_leaves_out_pauses_and_resumes_with_the_same_output(solo):
    limits = EngineLimits(max_active=4)
    long_request, short_request = request("long", 12, seed=3), request("short", 3, seed=4)
    long_alone, _ = run_alone(solo, long_request, limits)

    async def scenario():
        recorder = Recorder()
        engine = Engine(solo, limits, recorder, gate=gate)
        long = engine.submit(long_request, request_id="long")
        await long.changed.wait()  # one step done
        short = engine.submit(short_request, request_id="short")
        long_media, _ = await asyncio.wait_for(asyncio.gather(long.future, short.future), timeout=300)
        return engine, recorder, long, long_media

    gate = PauseFor("long", "short")
    engine, recorder, long, long_media = asyncio.run(scenario())
    assert gate.batches.count(["short"]) == short_request.num_inference_steps - 1  # "short" ran alone
    short_steps = [i for i, batch in enumerate(gate.batches) if batch == ["short"]]
    long_steps = [i for i, batch in enumerate(gate.batches) if batch == ["long"]]
    assert len(long_steps) + len(short_steps) == len(gate.batches)  # never together
    assert min(long_steps) < min(short_steps) and max(short_steps) < max(long_steps)  # paused part-way, resumed
    assert long.forwards == long_request.num_inference_steps - 1  # every step exactly once, across the pause
    assert engine.stats.preemptions == 1 and recorder.preempted == [1]
    assert_identical(long_media, long_alone)  # alone in every pack, paused or not: the same bits
