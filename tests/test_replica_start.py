"""A replica's start and a worker's replacement, on a real local Ray cluster and real gloo: rank 0 loads while its
workers load (each rank's ``LoadReport``), and a replacement worker loads while rank 0's model thread, health checks,
reports and the queue go on (a worker killed with SIGKILL, as a lost GPU process is).
"""

import asyncio
import os
import signal
import time

import pytest

from h3serve.replicas import Engine, EngineLimits, WorkerGroup
from tests.harness import gone
from tests.test_replicas import request, spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]


def test_rank0_and_its_workers_load_at_the_same_time(tiny_checkpoint):
    """Each rank's load is reported; every worker's load was asked for before rank 0 began its own, so the workers'
    processes start and load while rank 0 loads. Serial (rank 0 first, then its workers) would ask after rank 0's load
    had finished. (Here rank 0's tiny load ends before a worker's process is up, ~3 s: the overlap of the loads
    themselves shows on a large checkpoint, ``benchmarks/cold_start.py``.)"""
    group = WorkerGroup.create(spec(2, tiny_checkpoint))
    try:
        loads = group.loads
        assert sorted(loads) == [0, 1]
        rank0, worker = loads[0], loads[1]
        assert rank0.requested == rank0.started < rank0.finished
        assert worker.requested <= rank0.started, (rank0, worker)
        assert worker.requested < worker.started < worker.finished
    finally:
        group.shutdown()


def test_a_replacement_worker_loads_while_the_replica_answers(tiny_checkpoint):
    """The worker is killed; the step that finds it breaks the group and a new worker process starts and loads (Ray
    starts it, it imports torch and loads the checkpoint: seconds here, minutes on a GPU). Meanwhile rank 0's model
    thread takes work within a moment, health passes though the stall window is far shorter than the load, ``load()``
    answers, and a new request is queued and prepared; then every request completes on the new group."""
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=30.0))
    limits = EngineLimits(step_timeout_min_s=5.0, stall_min_s=0.5, stall_factor=1.0, max_active=4)

    async def scenario():
        engine = Engine(group, limits)
        try:
            pid, _ = group.processes[1]
            os.kill(pid, signal.SIGKILL)
            first = engine.submit(request("a red kite", 2, seed=1), request_id="first")
            deadline = time.monotonic() + 30
            while engine.supervisor.replacing_since is None:  # the step finds the lost rank and starts the replacement
                assert time.monotonic() < deadline and not first.future.done(), "no replacement started"
                await asyncio.sleep(0.05)
            assert gone(pid)
            second = engine.submit(request("rain on a roof", 2, seed=2), request_id="second")
            answered, prepared = 0, False
            while engine.supervisor.replacing_since is not None:
                started = time.monotonic()
                await engine.executor.run_blocking(time.monotonic)  # the model thread is not held by the load
                assert time.monotonic() - started < 1.0
                engine.check_health()  # no stall, though nothing stepped for longer than the stall window
                assert engine.load() is not None
                answered += 1
                prepared = prepared or second.state is not None
                await asyncio.sleep(0.2)
            # the replacement took long enough to be watched answering (a new process imports torch: seconds)
            assert answered >= 3, answered
            assert engine.supervisor.history[-1].started == (1,)
            assert prepared  # queued and prepared meanwhile, on the stage thread
            results = await asyncio.gather(first.future, second.future)
            assert all(r.frames.size for r in results)
            assert engine.group is not group and engine.group.loads.keys() == {1}  # the new worker's load only
            engine.check_health()
        finally:
            await engine.close()
            engine.group.shutdown()

    asyncio.run(scenario())
