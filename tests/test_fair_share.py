"""Fair sharing between tenants (issue 55): the rule on the pure scheduler with an explicit clock, then a real engine
over a real sp=1 worker group of the tiny checkpoint (one rank: no Ray cluster) where one tenant floods.

The rule (``h3serve/replicas/scheduler.py``): tenants of one priority class take turns, one request a turn, the turn
going to the tenant charged the fewest row-steps (a request charges its whole work when it first enters a pack); a
running request the policy ranks first keeps its place; one tenant (or none) is the policy alone."""

import asyncio
import dataclasses
import random

import pytest

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.replicas import MAX_PRIORITY, MIN_PRIORITY, POLICIES, Engine, EngineLimits, StepGate, WorkerGroup
from h3serve.replicas.scheduler import Budget, FairShare, RequestView, admit, rank, schedule
from tests.test_replicas import request, spec


def view(tenant, order, rows=100, steps_left=10, priority=0, submitted=0.0, **kw) -> RequestView:
    return RequestView(
        id=f"{tenant}{order}",
        order=order,
        submitted=submitted,
        rows=rows,
        steps_left=steps_left,
        priority=priority,
        tenant=tenant,
        **kw,
    )


def ids(views) -> list[str]:
    return [v.id for v in views]


def flood(policy_rows=100) -> list[RequestView]:
    """Tenant a queued ten requests, then tenant b two: all the same size."""
    return [view("a", i, rows=policy_rows) for i in range(10)] + [view("b", 10 + i, rows=policy_rows) for i in range(2)]


@pytest.mark.parametrize("policy", POLICIES)
def test_tenants_of_equal_priority_take_turns_instead_of_one_waiting_behind_the_others_backlog(policy):
    queue = flood()
    assert ids(rank(queue, policy, 0.0, 60.0))[:10] == [f"a{i}" for i in range(10)]  # the policy alone: b waits
    fair = ids(rank(queue, policy, 0.0, 60.0, served={"a": 0, "b": 0}))
    assert fair[:5] == ["a0", "b10", "a1", "b11", "a2"]
    plan = schedule(queue, Budget(max_requests=2, max_rows=10_000), policy, 0.0, 60.0, served={"a": 0, "b": 0})
    assert ids(plan.batch) == ["a0", "b10"]


def test_the_turn_goes_to_the_tenant_charged_fewer_row_steps_whatever_it_submitted_first():
    queue = [view("a", 0), view("b", 1)]
    assert ids(rank(queue, "fcfs", 0.0, 60.0, served={"a": 5000, "b": 0})) == ["b1", "a0"]
    # b's request costs 10x a's: a gets ten turns for b's one (deficit by row-steps, not by requests)
    queue = [view("a", i, rows=10) for i in range(12)] + [view("b", 100, rows=100), view("b", 101, rows=100)]
    fair = ids(rank(queue, "fcfs", 0.0, 60.0, served={"a": 0, "b": 0}))
    assert fair.index("b101") - fair.index("b100") == 11  # ten of a's (its 100 row-steps each) between b's two


def test_a_running_request_the_policy_ranks_first_is_never_displaced_by_another_tenants_turn():
    running = [view("a", i, running=True, started=True) for i in range(4)]
    queue = [*running, *(view("a", 4 + i) for i in range(6)), view("b", 20)]
    served = {"a": 4000, "b": 0}
    plan = schedule(queue, Budget(max_requests=4, max_rows=10_000), "fcfs", 0.0, 60.0, served)
    assert ids(plan.batch) == ["a0", "a1", "a2", "a3"] and plan.preempted == ()
    # the next free place is b's, ahead of a's backlog
    plan = schedule(queue, Budget(max_requests=5, max_rows=10_000), "fcfs", 0.0, 60.0, served)
    assert ids(plan.batch) == ["a0", "a1", "a2", "a3", "b20"]


def test_under_srpt_a_shorter_request_of_a_tenant_served_less_still_overtakes_a_long_running_one():
    queue = [view("a", 0, steps_left=40, running=True, started=True), view("b", 1, steps_left=2)]
    plan = schedule(queue, Budget(max_requests=1, max_rows=10_000), "srpt", 0.0, 60.0, {"a": 4000, "b": 0})
    assert ids(plan.batch) == ["b1"] and ids(plan.preempted) == ["a0"]


def test_tenants_share_only_within_a_priority_class_and_aging_still_crosses_classes():
    queue = [view("a", i, priority=5) for i in range(3)] + [view("b", 10, priority=0), view("b", 11, priority=5)]
    fair = ids(rank(queue, "priority", 0.0, 60.0, served={"a": 10_000, "b": 0}))
    # b's priority-5 request takes a turn among a's priority-5 ones; b's priority-0 one waits for all of them
    assert fair == ["b11", "a0", "a1", "a2", "b10"]
    # aged five levels and more, b's priority-0 request outranks a's fresh priority-5 ones, as without tenants
    aged = [view("a", i, priority=5, submitted=1000.0) for i in range(3)] + [view("b", 10, priority=0)]
    assert ids(rank(aged, "priority", 1000.0, 100.0, served={"a": 0, "b": 10_000}))[0] == "b10"


@pytest.mark.parametrize("policy", POLICIES)
def test_one_tenant_or_none_is_the_policy_alone_and_a_fair_batch_keeps_every_budget(policy):
    rng = random.Random(55)
    for _ in range(300):
        tenant = rng.choice([None, "a"])
        candidates = [
            view(
                tenant,
                i,
                rows=rng.randint(64, 4000),
                steps_left=rng.randint(1, 50),
                priority=rng.randint(MIN_PRIORITY, MAX_PRIORITY),
                submitted=rng.uniform(0, 100),
                running=rng.random() < 0.5,
                text_rows=rng.randint(0, 64),
            )
            for i in range(rng.randint(1, 12))
        ]
        budget = Budget(max_requests=rng.randint(1, 6), max_rows=rng.randint(4000, 12000), max_text_rows=200)
        aging_s = rng.uniform(1, 100)
        alone = schedule(candidates, budget, policy, 100.0, aging_s)
        assert schedule(candidates, budget, policy, 100.0, aging_s, served={tenant: 123}) == alone
        # several tenants: a permutation of the candidates, the budget kept, what is left out did not fit
        mixed = [dataclasses.replace(v, tenant=rng.choice("abc")) for v in candidates]
        served = {t: rng.randint(0, 10_000) for t in "abc"}
        assert sorted(ids(rank(mixed, policy, 100.0, aging_s, served))) == sorted(ids(mixed))
        plan = schedule(mixed, budget, policy, 100.0, aging_s, served)
        assert len(plan.batch) <= budget.max_requests and plan.rows <= budget.max_rows
        assert sum(v.text_rows for v in plan.batch) <= 200
        left_out = [v for v in mixed if v not in plan.batch]
        if len(plan.batch) < budget.max_requests:
            assert all(
                plan.rows + v.rows > budget.max_rows or sum(b.text_rows for b in plan.batch) + v.text_rows > 200
                for v in left_out
            )
        assert set(plan.preempted) == {v for v in left_out if v.running}


def test_a_tenant_coming_back_from_idle_starts_at_the_virtual_time_and_gone_tenants_are_forgotten():
    fair = FairShare()
    assert fair.served(["a"]) == {"a": 0}
    assert fair.charge("a", 500) == 0 and fair.charge("a", 500) == 500  # start tags: the charge before
    assert fair.charge("b", 900) == 500  # new: it starts at the virtual time; not held, it is forgotten next look
    # c starts at the virtual time (the latest start tag, 500): below a's 1000, so it takes the next turn, and
    # banked nothing for the time it had no work
    assert fair.served(["a", "c"]) == {"a": 1000, "c": 500}
    fair.charge("c", 100)
    assert fair.served(["c"]) == {"c": 600}
    assert fair.served([]) == {} and fair.served(["d"]) == {"d": 500}


def simulate(fair_share: bool, steps_each: int = 4) -> dict[str, int]:
    """Step the pure scheduler as the engine does (one request a pack, charged when it starts): tenant a queues
    twelve requests, then b three. Returns the step at which each request finished."""
    queue = [view("a", i, steps_left=steps_each) for i in range(12)] + [
        view("b", 20 + i, steps_left=steps_each) for i in range(3)
    ]
    fair, finished, step = FairShare(), {}, 0
    while queue:
        served = fair.served(v.tenant for v in queue) if fair_share else None
        (chosen,) = schedule(queue, Budget(max_requests=1, max_rows=10_000), "fcfs", float(step), 60.0, served).batch
        tag = fair.charge(chosen.tenant, chosen.work) if not chosen.started else chosen.start_tag
        step += 1
        left = dataclasses.replace(chosen, steps_left=chosen.steps_left - 1, running=True, started=True, start_tag=tag)
        queue = [left if v.id == chosen.id else dataclasses.replace(v, running=False) for v in queue]
        if left.steps_left == 0:
            finished[chosen.id] = step
            queue.remove(left)
    return finished


def test_a_tenants_few_requests_finish_beside_a_flood_within_one_of_the_floods_requests_each():
    fair, unfair = simulate(True), simulate(False)
    # alone, b's three requests would finish at steps 4, 8, 12; beside the flood each waits for one of a's at most
    assert [fair[f"b{20 + i}"] for i in range(3)] == [8, 16, 24]
    assert [unfair[f"b{20 + i}"] for i in range(3)] == [52, 56, 60]  # the policy alone: behind a's whole backlog
    assert max(fair.values()) == max(unfair.values()) == 60  # the same work, in a fairer order: nothing idles


def test_admit_prepares_the_next_tenants_turn_and_takes_the_room_of_the_flood_s_last_prepared_request():
    class Ticket:
        def __init__(self, v: RequestView):
            self._view, self.order, self.running = v, v.order, v.running

        def view(self) -> RequestView:
            return self._view

    prepared = [Ticket(view("a", i)) for i in range(3)]
    waiting = [Ticket(view("a", 3 + i)) for i in range(5)] + [Ticket(view("b", 10))]
    assert admit(waiting, prepared, 3, "fcfs", 0.0, 60.0) == (None, None)  # the policy alone: b waits its turn
    best, worst = admit(waiting, prepared, 3, "fcfs", 0.0, 60.0, served={"a": 0, "b": 0})
    assert (best.view().id, worst.view().id) == ("b10", "a2")
    best, worst = admit(waiting, prepared, 4, "fcfs", 0.0, 60.0, served={"a": 0, "b": 0})
    assert (best.view().id, worst) == ("b10", None)


# --- a real engine: one tenant floods, another sends two --------------------------------------------------------


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


def test_on_a_real_engine_the_other_tenants_requests_finish_between_the_floods_and_gpu_seconds_split_by_tenant(solo):
    def run(fair_share: bool):
        async def scenario():
            engine = Engine(solo, EngineLimits(policy="fcfs", max_active=1, fair_share=fair_share))
            tickets = [engine.submit(request(f"a {i}", 3, seed=i, tenant="a"), f"a{i}") for i in range(5)]
            tickets += [engine.submit(request(f"b {i}", 3, seed=9 + i, tenant="b"), f"b{i}") for i in range(2)]
            order: list[str] = []
            for ticket in tickets:
                ticket.future.add_done_callback(lambda _, name=ticket.id: order.append(name))
            await asyncio.gather(*(t.future for t in tickets))
            await engine.close()
            return engine, order

        return asyncio.run(scenario())

    engine, order = run(fair_share=True)
    assert order == ["a0", "b0", "a1", "b1", "a2", "a3", "a4"], order
    assert engine.stats.preemptions == 0  # turns are taken at request boundaries: nothing paused
    # the forwards' seconds by tenant: every second goes to someone (the split by rows is exact: the test below; the
    # seconds themselves are wall-clock, so no ratio of them is asserted here)
    by_tenant = engine.stats.tenant_forward_s
    assert set(by_tenant) == {"a", "b"} and min(by_tenant.values()) > 0
    assert sum(by_tenant.values()) == pytest.approx(engine.stats.forward_s)

    _, order = run(fair_share=False)
    assert order == ["a0", "a1", "a2", "a3", "a4", "b0", "b1"], order  # the policy alone: b behind a's backlog


def test_requests_sharing_a_pack_split_its_seconds_by_rows(solo):
    class Shares:
        def __init__(self):
            self.steps: list[float] = []
            self.shares: list[dict[str, float]] = []

        def __getattr__(self, name):  # the observer's other calls: nothing to keep
            return lambda *args: None

        def on_step(self, stats, seconds):
            self.steps.append(seconds)

        def on_tenant_forward_s(self, seconds):
            self.shares.append(dict(seconds))

    class AllThree(StepGate):
        """No step until the three requests are prepared: then every pack holds all three (they finish together)."""

        def candidates(self, boundary):
            return boundary.prepared if len(boundary.prepared) == 3 else ()

    async def scenario():
        shares = Shares()
        engine = Engine(solo, EngineLimits(max_active=4), observer=shares, gate=AllThree())
        small = engine.submit(GenerationRequest(prompt="small", width=64, height=32, num_inference_steps=3, tenant="a"))
        large = engine.submit(request("large", 3, tenant="b"))
        unnamed = engine.submit(request("no tenant", 3))
        await asyncio.gather(small.future, large.future, unnamed.future)
        await engine.close()
        return engine, shares, (small.rows, large.rows, unnamed.rows)

    engine, shares, (a_rows, b_rows, none_rows) = asyncio.run(scenario())
    assert len(shares.shares) == len(shares.steps) == engine.stats.forwards == 2  # 3 steps: 2 model evaluations
    for share, seconds in zip(shares.shares, shares.steps, strict=True):
        assert set(share) == {"a", "b"}  # the request without a tenant is never exported
        assert share["b"] / share["a"] == pytest.approx(b_rows / a_rows)
        assert share["a"] + share["b"] == pytest.approx(seconds * (a_rows + b_rows) / (a_rows + b_rows + none_rows))
    by_tenant = engine.stats.tenant_forward_s
    assert sum(by_tenant.values()) == pytest.approx(engine.stats.forward_s)  # every forward second goes to someone
    assert by_tenant[None] == pytest.approx(engine.stats.forward_s * none_rows / (a_rows + b_rows + none_rows))
