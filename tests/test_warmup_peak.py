"""The warm-up at the row budget (issue 53), on a real sp=2 group over gloo: the first pack of ``max_rows_per_step``
rows is the warm-up's, on every rank, with and without LoRA; each rank's device is then measured (a CPU rank has no
``torch.cuda.mem_get_info``: nothing measured, nothing checked; ``tests/test_memory_plan.py`` feeds a plan and
measured numbers through the check itself). On the CPU it is asked for: by default it runs on CUDA only."""

import asyncio

import numpy as np
import pytest

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
        assert group.steps == before + 2  # both launched on every rank (the workers number steps alike)
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
