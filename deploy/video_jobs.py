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

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pipelines.h3 import GenerationRequest
from replicas import DeadlineExceeded, EngineDraining

from .errors import QUEUE_FULL, UNAVAILABLE, http_error, root_cause
from .jobs import JobGone, JobRunner, JobStore, LeaseLost
from .metrics import RequestMetrics

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 0.5  # progress is written at most this often; the heartbeat covers the rest
JOB_ROUTE = "/v1/videos:job"  # the route tag a job's outcome is counted under
# A handed-back job is submitted again while no replica can take it (queues full, replicas draining or being
# replaced), backing off from the first wait to the second, for at most RESUBMIT_FOR_S; then it fails (503).
RETRYABLE = QUEUE_FULL + UNAVAILABLE
RESUBMIT_BACKOFF_S = (0.5, 5.0)
RESUBMIT_FOR_S = 600.0


def caused_by(error: BaseException, kinds) -> bool:
    """Whether ``error``, or the replica's exception inside Ray's wrapper, is one of ``kinds``."""
    return isinstance(error, kinds) or isinstance(root_cause(error), kinds)


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
    async def submit(
        self,
        video: dict,
        request: GenerationRequest,
        request_id: str,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
    ) -> bool:
        """Queue ``request`` on a replica, then record ``video`` as queued and follow it; False when the store
        holds too many unfinished jobs. ``priority`` goes with it to every replica it is submitted to (a
        re-submission after a drain keeps it) and is kept in the record; so does ``adapter`` (the LoRA adapter
        it runs on, None: the base model).

        The replica's first event says its engine accepted the request, so QueueFull, EngineDraining,
        DeploymentUnavailableError... raise here, before any record exists: the route answers 503, never a
        queued job that fails later."""
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        stream = await self._start(request, request_id, deadline_s, priority, adapter)
        try:
            runner = await self._io(self.store.create, video, request_id, priority)
        except BaseException:
            stream.cancel()
            raise
        if runner is None:
            stream.cancel()
            return False
        logger.info("video job %s (request %s) queued", runner.job_id, request_id)
        self.runners[runner.job_id] = runner
        job = self._run(runner, request, request_id, deadline, priority, stream, adapter, video["model"])
        self.tasks[runner.job_id] = asyncio.get_running_loop().create_task(job)
        return True

    async def _start(
        self, request: GenerationRequest, request_id: str, deadline_s: float | None, priority: int, adapter: str | None
    ) -> DeploymentResponseGenerator:
        """The replica's progress stream, once its first event ({"queued": True, ...}) has arrived."""
        stream = self.replica.options(stream=True).generate_video.remote(
            request, request_id, deadline_s, priority, adapter
        )
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            raise RuntimeError(f"request {request_id}: the replica's stream ended before it queued") from None
        except BaseException:
            stream.cancel()
            raise
        if not first.get("queued"):
            stream.cancel()
            raise RuntimeError(f"request {request_id}: the replica's first event was {sorted(first)}, not queued")
        return stream

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
    async def _run(
        self,
        runner: JobRunner,
        request: GenerationRequest,
        request_id: str,
        deadline: float | None,
        priority: int,
        stream: DeploymentResponseGenerator,
        adapter: str | None = None,
        model: str = "",
    ) -> None:
        """Follow the job to its MP4; a replica that hands it back unstarted (it drains) gets it re-submitted."""
        started, code = time.perf_counter(), 500
        job = asyncio.current_task()
        assert job is not None  # submit's task
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(runner, job))
        try:
            while True:
                try:
                    await self._follow(runner, stream)
                    break
                except Exception as e:
                    if not caused_by(e, EngineDraining):
                        raise
                    logger.info(
                        "video job %s (request %s): its replica drains and handed it back unstarted; "
                        "submitting it again",
                        runner.job_id,
                        request_id,
                    )
                    stream = await self._resubmit(runner, request, request_id, deadline, priority, adapter)
            code = 200
            asyncio.get_running_loop().create_task(self.sweep_once())  # the byte cap, now
        except (JobGone, LeaseLost) as e:
            code = 499  # deleted, or this runner lost its lease: stop generating
            logger.info("video job %s (request %s) stopped: %r", runner.job_id, request_id, e)
            stream.cancel()
        except asyncio.CancelledError:
            code = 499
            stream.cancel()
            if runner.stopping == "shutdown":
                await self._fail(runner, "server_stopped", "the server stopped while this job ran; resubmit it")
            raise
        except Exception as e:
            error = http_error(e, f"video job {runner.job_id} (request {request_id})")
            code = error.status
            timed_out = caused_by(e, DeadlineExceeded)
            await self._fail(runner, "timeout" if timed_out else str(code), error.message)
        finally:
            heartbeat.cancel()
            self.tasks.pop(runner.job_id, None)
            self.runners.pop(runner.job_id, None)
            self.metrics.observe(JOB_ROUTE, code, time.perf_counter() - started, model)

    async def _follow(self, runner: JobRunner, stream: DeploymentResponseGenerator) -> None:
        """The replica's progress into the record, then its MP4 into the store."""
        written = 0.0
        async for event in stream:
            if "mp4" in event:
                await self._io(runner.complete, event["mp4"])
                return
            done, total = event["progress"]
            if time.monotonic() - written >= PROGRESS_EVERY_S:
                written = time.monotonic()
                await self._write(runner, status="in_progress", progress=int(100 * done / max(total, 1)))
        raise RuntimeError("the replica's stream ended without a video")

    async def _resubmit(
        self,
        runner: JobRunner,
        request: GenerationRequest,
        request_id: str,
        deadline: float | None,
        priority: int,
        adapter: str | None = None,
    ) -> DeploymentResponseGenerator:
        """Queue a handed-back job on another replica with the same priority, waiting out full queues and draining
        replicas for up to RESUBMIT_FOR_S (the job stays queued meanwhile; its heartbeat keeps the lease)."""
        give_up, wait = time.monotonic() + RESUBMIT_FOR_S, RESUBMIT_BACKOFF_S[0]
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"request {request_id} passed its deadline while it was handed back")
            try:
                stream = await self._start(request, request_id, remaining, priority, adapter)
            except Exception as e:
                if not caused_by(e, RETRYABLE) or time.monotonic() + wait > give_up:
                    raise
                logger.info("video job %s (request %s): no replica took it yet (%r)", runner.job_id, request_id, e)
                await asyncio.sleep(wait)
                wait = min(2 * wait, RESUBMIT_BACKOFF_S[1])
                continue
            try:
                await self._io(runner.resubmitted)
            except BaseException:
                stream.cancel()
                raise
            return stream

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
