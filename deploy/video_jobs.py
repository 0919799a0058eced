"""The video jobs one ingress replica runs: the replica's progress stream into the job's record and its
MP4 into the store, a heartbeat per job, the sweeper, and stopping jobs on DELETE or shutdown.

What a record holds and how replicas share the store without a lock is ``jobs``'s; this module is the
asyncio side of it. Store calls block, so they run on a thread pool.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.serve.handle import DeploymentHandle

from pipelines.h3 import GenerationRequest

from .errors import http_error
from .jobs import JobGone, JobRunner, JobStore, LeaseLost
from .metrics import RequestMetrics

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 0.5  # progress is written at most this often; the heartbeat covers the rest
JOB_ROUTE = "/v1/videos:job"  # the route tag a job's outcome is counted under


class VideoJobs:
    def __init__(self, store: JobStore, replica: DeploymentHandle, metrics: RequestMetrics):
        self.store, self.replica, self.metrics = store, replica, metrics
        self.io = ThreadPoolExecutor(max_workers=16, thread_name_prefix="h3serve-jobs")
        self.tasks: dict[str, asyncio.Task] = {}  # video id -> its job, for the jobs this replica runs
        self.runners: dict[str, JobRunner] = {}
        self._sweeper: asyncio.Task | None = None

    async def _io(self, fn: Callable, *args) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.io, fn, *args)

    # -- what the routes ask ---------------------------------------------------------------------
    async def submit(self, video: dict, request: GenerationRequest) -> bool:
        """Record ``video`` as queued and start generating it; False when the store holds too many unfinished."""
        runner = await self._io(self.store.create, video)
        if runner is None:
            return False
        self.runners[runner.job_id] = runner
        self.tasks[runner.job_id] = asyncio.get_running_loop().create_task(self._run(runner, request))
        return True

    async def get(self, video_id: str) -> dict | None:
        return await self._io(self.store.get, video_id)

    async def list(self) -> list[dict]:
        return await self._io(self.store.list)

    async def content(self, video_id: str) -> bytes | None:
        return await self._io(self.store.content, video_id)

    async def delete(self, video_id: str) -> bool:
        """Remove the job; if it runs here, stop it now (elsewhere its runner sees the tombstone)."""
        if not await self._io(self.store.delete, video_id):
            return False
        task, runner = self.tasks.get(video_id), self.runners.get(video_id)
        if task is not None and runner is not None:
            runner.stopping = "deleted"
            task.cancel()
        return True

    # -- the sweeper -------------------------------------------------------------------------------
    def start_sweeper(self) -> None:
        """TTL, byte cap and lost runners without waiting for a reader; every replica sweeps, harmlessly."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await self.sweep_once()
            await asyncio.sleep(self.store.policy.lease_s / 2)

    async def sweep_once(self) -> None:
        try:
            await self._io(self.store.sweep)
        except Exception:
            logger.exception("sweeping the video job store failed; the next sweep retries")

    # -- one job -----------------------------------------------------------------------------------
    async def _run(self, runner: JobRunner, request: GenerationRequest) -> None:
        """Stream the replica's progress into the job's record; the MP4 into the store."""
        started, code, written = time.perf_counter(), 500, 0.0
        stream = self.replica.options(stream=True).generate_video.remote(request)
        job = asyncio.current_task()
        assert job is not None  # submit's task
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(runner, job))
        try:
            async for event in stream:
                if "mp4" in event:
                    await self._io(runner.complete, event["mp4"])
                    code = 200
                    break
                done, total = event["progress"]
                if time.monotonic() - written >= PROGRESS_EVERY_S:
                    written = time.monotonic()
                    await self._write(runner, status="in_progress", progress=int(100 * done / max(total, 1)))
            if code != 200:
                raise RuntimeError("the replica's stream ended without a video")
            asyncio.get_running_loop().create_task(self.sweep_once())  # the byte cap, now
        except (JobGone, LeaseLost) as e:
            code = 499  # deleted, or this runner lost its lease: stop generating
            logger.info("video job %s stopped: %r", runner.job_id, e)
            stream.cancel()
        except asyncio.CancelledError:
            code = 499
            stream.cancel()
            if runner.stopping == "shutdown":
                await self._fail(runner, "server_stopped", "the server stopped while this job ran; resubmit it")
            raise
        except Exception as e:
            error = http_error(e, f"video job {runner.job_id}")
            code = error.status
            await self._fail(runner, str(code), error.message)
        finally:
            heartbeat.cancel()
            self.tasks.pop(runner.job_id, None)
            self.runners.pop(runner.job_id, None)
            self.metrics.observe(JOB_ROUTE, code, time.perf_counter() - started)

    async def _heartbeat(self, runner: JobRunner, job: asyncio.Task) -> None:
        """Rewrite the record every lease_s/4, also while the job waits in the engine's queue."""
        while True:
            await asyncio.sleep(runner.record["lease_s"] / 4)
            try:
                await self._io(runner.update)
            except (JobGone, LeaseLost) as e:
                logger.info("video job %s stopped: %r", runner.job_id, e)
                runner.stopping = "deleted" if isinstance(e, JobGone) else "lease lost"
                job.cancel()
                return
            except Exception:
                logger.exception("heartbeat of video job %s failed; retrying", runner.job_id)

    async def _write(self, runner: JobRunner, **fields) -> None:
        """A progress write; a store hiccup is logged and left to the next write (the lease allows for it)."""
        try:
            await self._io(lambda: runner.update(**fields))
        except (JobGone, LeaseLost):
            raise
        except Exception:
            logger.exception("writing video job %s failed", runner.job_id)

    async def _fail(self, runner: JobRunner, code: str, message: str) -> None:
        try:
            await self._io(runner.fail, code, message)
        except (JobGone, LeaseLost):
            pass
        except Exception:  # the lease will fail it for readers
            logger.exception("recording the failure of video job %s failed", runner.job_id)

    async def close(self) -> None:
        """Serve stops this replica: fail its running jobs now rather than after their lease."""
        for video_id, task in list(self.tasks.items()):
            runner = self.runners.get(video_id)
            if runner is not None:
                runner.stopping = "shutdown"
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.io.shutdown(wait=False)
