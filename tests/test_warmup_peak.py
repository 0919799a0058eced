"""The warm-up at the row budget (issue 53), on a real sp=2 group over gloo: the first pack of ``max_rows_per_step``
rows is the warm-up's, on every rank, with and without LoRA; each rank's device is then measured (a CPU rank has no
``torch.cuda.mem_get_info``: nothing measured, nothing checked; ``tests/test_memory_plan.py`` feeds a plan and
measured numbers through the check itself). On the CPU it is asked for: by default it runs on CUDA only."""

import asyncio

import numpy as np
import pytest
import ray

from h3serve.replicas import Engine, EngineLimits, WorkerGroup
from tests.test_replicas import request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]
BUDGET = 1024  # rows: the tiny warm-up request (458 rows) has fewer; padding fills the rest


def test_the_warm_up_at_the_row_budget_runs_on_every_rank_then_the_engine_serves(tiny_checkpoint, tiny_pipeline):
    group = WorkerGroup.create(spec(2, tiny_checkpoint))
    try:
        engine = Engine(group, EngineLimits(max_rows_per_step=BUDGET))
        before = group.steps
        engine.warm_up(peak=True)
        warm = engine.last_warm_up
        assert warm is not None and warm.peak is not None
        assert warm.rows < BUDGET and warm.peak.rows == BUDGET  # the small forward, then one at the budget
        # both launched on every rank (the workers number steps alike), then the step cache's three at the budget:
        # EngineLimits offers the built-in tiers (a deployment's plan then counts the cache's tensors)
        assert group.steps == before + 2 + 3 and warm.peak.step_cache is not None
        assert list(warm.peak.by_adapter) == [None]  # the base model: no adapters here
        assert warm.peak.measured == [None, None] and warm.peak.checked == []  # CPU ranks: no device to measure
        # a budget below the warm-up request: the request alone, never padded past it to the next multiple
        below = Engine(group, EngineLimits(max_rows_per_step=256))
        below.warm_up(peak=True)
        assert below.last_warm_up is not None and below.last_warm_up.peak is not None
        assert below.last_warm_up.peak.rows == below.last_warm_up.rows == warm.rows
        asyncio.run(below.close())
        wanted = request("after the warm-up", 3, seed=5)
        got = asyncio.run(serve_one(engine, wanted))
        want = tiny_pipeline.generate(wanted)
        assert np.array_equal(got.frames, want.frames)  # the padded forward left no state behind
    finally:
        group.shutdown()


def test_by_default_a_cpu_replica_warms_up_small(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    try:
        engine = Engine(group, EngineLimits(max_rows_per_step=BUDGET))
        engine.warm_up()
        assert engine.last_warm_up is not None and engine.last_warm_up.peak is None
    finally:
        group.shutdown()


async def serve_one(engine: Engine, wanted):
    try:
        return await engine.generate(wanted, request_id="after")
    finally:
        await engine.close()


def test_the_warm_up_at_the_row_budget_reaches_the_step_caches_peak_and_the_plan_counts_it(tiny_checkpoint):
    """With step-cache tiers (of different ``fn_blocks``) the warm-up at the row budget also runs the cache's peak on
    every rank: copies of the warm-up document fill the budget and hold their residuals while they compute again,
    then half of them skip (a sub-pack). What they held is what the plan counts per caching row, so a device use
    that includes it passes the check with the step-cache plan and is refused by the plan without it."""
    from h3serve.pipelines.h3.memory import (
        STEP_CACHE_HELD_ROWS,
        MeasuredUse,
        PlanExceeded,
        check_measured,
        memory_plan,
        planned_by_role,
    )
    from h3serve.pipelines.h3.step_cache import StepCachePolicy, StepCacheTiers

    tiers = StepCacheTiers(
        tiers={
            "f1": StepCachePolicy(threshold=0.1),
            "f2": StepCachePolicy(threshold=0.2, fn_blocks=2, bn_blocks=1),
        }
    )
    group = WorkerGroup.create(spec(2, tiny_checkpoint))
    try:
        engine = Engine(group, EngineLimits(max_rows_per_step=BUDGET, step_cache=tiers))
        engine.warm_up(peak=True)
        warm = engine.last_warm_up
        assert warm is not None and warm.peak is not None and warm.peak.step_cache is not None
        cached = warm.peak.step_cache
        length = warm.rows - warm.padding_rows  # the warm-up document
        assert cached.documents == BUDGET // length >= 2 and cached.caching_rows == cached.documents * length
        # every caching row held its two residuals, [S, hidden] fp32 each, while the next forward ran
        assert cached.held_bytes == STEP_CACHE_HELD_ROWS * 96 * 4 * cached.caching_rows
        # the third forward: the skipping copy (tier f1: blocks 1..3) left the other's middle to a sub-pack
        assert cached.skipped_block_rows == 3 * length
        # rank 1 held the same full rows (every rank keeps every caching document's residuals)
        held = ray.get(group.workers[0].step_cache_bytes.remote())
        assert sorted(held.values()) == [cached.held_bytes // cached.documents] * cached.documents
        assert group.steps == 2 + 3  # the small forward, the budget's, then the step cache's three
        # the states go: rank 0 freed them, rank 1 drops them with the next pack
        got = asyncio.run(serve_one(engine, request("after the warm-up", 2, seed=5)))
        assert got.frames.size and ray.get(group.workers[0].step_cache_bytes.remote()) == {}
    finally:
        group.shutdown()

    # the check fed what the warm-up held: on top of a device use the plan without caching spends to the byte
    def plan(step_cache: bool) -> dict[str, dict[str, int]]:
        return planned_by_role(
            memory_plan(
                model="tiny",
                checkpoint=str(tiny_checkpoint),
                dtype="float32",
                sp_degree=2,
                max_rows=BUDGET,
                reserve_bytes=0,
                step_cache=step_cache,
                late_decisions=True,
            )
        )

    without, with_cache = plan(False)["worker ranks"], plan(True)["worker ranks"]
    tensors = without["weights"] + without["activations"]
    use = MeasuredUse(1, 0, tensors + cached.held_bytes, tensors)
    with pytest.raises(PlanExceeded, match="rank 1"):
        check_measured(plan(False), [use])
    assert with_cache["activations"] - without["activations"] >= cached.held_bytes
    (line,) = check_measured(plan(True), [use])
    assert line.startswith("rank 1 (worker ranks)")
