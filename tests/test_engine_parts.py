"""The engine's parts alone, without a model: the request table (where a request is), the scheduler's admission
(what to prepare next, what gives its room) and the one measured rate (``progress.RateMeter``)."""

import asyncio
import types

import pytest

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.replicas.progress import RateMeter
from h3serve.replicas.requests import RequestTable, Stage, Ticket, deadline_error, place
from h3serve.replicas.scheduler import admit


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def ticket(loop, order: int, rows: int = 100, steps: int = 11, priority: int = 0, submitted: float = 0.0) -> Ticket:
    request = GenerationRequest(prompt="p", num_inference_steps=steps)
    made = Ticket(f"r{order}", request, rows, loop, 30.0, priority, order)
    made.submitted = submitted
    return made


def test_the_table_says_where_each_request_is_once(loop):
    table = RequestTable()
    waiting, prepared, running, finished = (ticket(loop, i) for i in range(4))
    for t in (waiting, prepared, running, finished):
        table.add(t)
    table.move(prepared, Stage.RESIDENT)
    table.move(running, Stage.RESIDENT)
    running.running = True
    table.move(finished, Stage.DENOISED)
    finished.forwards, finished.state = 10, types.SimpleNamespace(done=True, progress=(10, 10))
    assert [place(t) for t in (waiting, prepared, running, finished)] == ["waiting", "waiting", "running", "decoding"]
    assert table.depth() == (2, 2)  # a prepared request that never stepped still waits
    assert [t.id for t in table.unstarted()] == ["r0", "r1"]
    assert "while decoding" in str(deadline_error(finished)) and "before it started" in str(deadline_error(prepared))
    # a cancelled request is not held any more, and leaves its stage at that stage's next boundary
    waiting.future.cancel()
    assert waiting not in table.held() and waiting in table.at(Stage.WAITING)
    assert table.drop_finished(Stage.WAITING) == [waiting] and table.at(Stage.WAITING) == []
    # a drain hands back what never started: the waiting and the prepared-but-never-stepped
    assert table.hand_back() == [prepared] and table.at(Stage.RESIDENT) == [running]


def test_admit_prepares_the_first_ranked_while_there_is_room_then_evicts_one_that_never_stepped(loop):
    big, small = ticket(loop, 0, rows=1000), ticket(loop, 1, rows=10)
    assert admit([big, small], [], room=2, policy="srpt", now=0.0, aging_s=60.0) == (small, None)
    assert admit([big, small], [], room=2, policy="fcfs", now=0.0, aging_s=60.0) == (big, None)
    # at the bound: a never-stepped prepared request that ranks below the best waiting one gives its room
    prepared = ticket(loop, -1, rows=5000)  # submitted before them
    assert admit([small], [prepared], room=1, policy="srpt", now=0.0, aging_s=60.0) == (small, prepared)
    assert admit([small], [prepared], room=1, policy="fcfs", now=0.0, aging_s=60.0) == (None, None)
    prepared.forwards = 1  # one that stepped keeps its room
    assert admit([small], [prepared], room=1, policy="srpt", now=0.0, aging_s=60.0) == (None, None)


def test_the_rate_is_row_steps_per_busy_second_over_windows_seeded_by_the_warm_up():
    meter = RateMeter(window_s=5.0, weight=0.5)
    assert meter.rate is None
    meter.seed(row_steps=100, seconds=0.5)
    assert meter.rate == 200.0
    meter.sample(busy_s=2.0, row_steps=1000)  # under the window: the seed stands
    assert meter.rate == 200.0
    meter.sample(busy_s=5.0, row_steps=1000)  # 1000 row-steps in 5 busy seconds, half against the seed
    assert meter.rate == pytest.approx(0.5 * 200.0 + 0.5 * 200.0)
    meter.sample(busy_s=10.0, row_steps=4000)
    assert meter.rate == pytest.approx(0.5 * 200.0 + 0.5 * 600.0)
    unseeded = RateMeter()
    unseeded.sample(busy_s=1.0, row_steps=300)  # nothing measured yet: the first step's sample at once
    assert unseeded.rate == 300.0
