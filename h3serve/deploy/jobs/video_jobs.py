"""The video jobs one ingress replica runs: the replica's stream into the job's record, its event log
(``events``: what ``GET /v1/videos/{id}/events`` streams) and its MP4 into the store, a heartbeat per job,
the sweeper, and stopping jobs on cancel, DELETE or shutdown.

What a record holds and how replicas share the store without a lock is ``jobs``'s; this module is the
asyncio side of it. Store calls block, so they run on a thread pool.

Near 800 lines on purpose: one job's life (submit, follow, re-queue, resubmit, take over, cancel, hand over,
fail) is one state machine over one runner; its pure parts live beside it (``store``: the record and its fencing;
``events``: the log, storing it, streaming it; ``idempotency``).
"""

import asyncio
import base64
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from h3serve.deploy.common.errors import QUEUE_FULL, UNAVAILABLE, APIError, http_error, root_cause
from h3serve.deploy.common.metrics import RequestMetrics
from h3serve.deploy.common.retry import Backoff, retry
from h3serve.deploy.common.serve_logging import audit
from h3serve.deploy.jobs.events import TERMINAL, EventLog, JobEvents, event_data, job_stream, keep_stored, load_log
from h3serve.deploy.jobs.idempotency import Idempotency
from h3serve.deploy.jobs.live import LIVE, LiveClips, StoredClip, follow_stored, stored_marker
from h3serve.deploy.jobs.records import FINISHED, REPLICA_LOST, RUNNER_LOST
from h3serve.deploy.jobs.store import JobCancelled, JobGone, JobRunner, JobStore, LeaseLost
from h3serve.deploy.jobs.variants import join
from h3serve.deploy.jobs.webhooks import Delivery, WebhookSender
from h3serve.pipelines.h3 import GenerationRequest
from h3serve.replicas import DeadlineExceeded, EngineDraining

logger = logging.getLogger(__name__)
PROGRESS_EVERY_S = 0.5  # progress is written at most this often; the heartbeat covers the rest
JOB_ROUTE = "/v1/videos:job"  # the route tag a job's outcome is counted under
# A handed-back job is submitted again while no replica can take it (queues full, replicas draining or being
# replaced), backing off as RESUBMIT says, for at most its for_s; then it fails (503).
RETRYABLE = QUEUE_FULL + UNAVAILABLE
RESUBMIT = Backoff(first_s=0.5, max_s=5.0, for_s=600.0)
# A job taken over from a lost ingress numbers its events from the last id its stored log (or record) held plus this:
# more than the events one log write can be behind (every FLUSH_S: at most a few steps and previews), so a reader
# that resumes with the last id the lost ingress sent it misses none of the new runner's.
EVENT_ID_GAP = 100
# A replica lost under a job it had accepted (its process died or was killed, its worker group broke, it stopped or
# Serve replaced it as unhealthy, a stage's replicas kept dying): the job is queued again, up to its record's
# max_attempts (a job that kills every replica it runs on stops there).
LOST = UNAVAILABLE


def lost_cause(error: BaseException) -> str:
    """Why a job's replica was lost, for its ``requeued`` event and its error: the exception's class, never its text
    (a remote traceback, actor names)."""
    return type(root_cause(error)).__name__


class ReplicaLost(RuntimeError):
    """A job's replica was lost under it on every one of its attempts (failed with code ``replica_lost``)."""


def dump_job(request: GenerationRequest, **fields) -> bytes:
    """What another ingress needs to run a job again, as JSON (uploads in base64): no pickle in a shared store."""
    as_json = {"request": request.model_dump(), **fields}
    return json.dumps(as_json, default=lambda b: {"__b64__": base64.b64encode(b).decode()}).encode()


def load_job(raw: bytes) -> dict:
    job = json.loads(raw, object_hook=lambda d: base64.b64decode(d["__b64__"]) if d.keys() == {"__b64__"} else d)
    return {**job, "request": GenerationRequest.model_validate(job["request"])}


def not_cancellable(video: dict) -> APIError:
    return APIError(
        409,
        f"video {video['id']} is {video['status']}: only a queued or in_progress job can be cancelled",
        "video_id",
    )


def rounded(seconds: float | None) -> float | None:
    """An ETA as the API shows it: tenths of a second."""
    return None if seconds is None else round(seconds, 1)


def caused_by(error: BaseException, kinds) -> bool:
    """Whether ``error``, or the replica's exception inside Ray's wrapper, is one of ``kinds``."""
    return isinstance(error, kinds) or isinstance(root_cause(error), kinds)


def ingress_identity() -> dict:
    """Who this ingress replica is, for the records of the jobs it runs (``JobStore.runner``): its Serve replica id,
    its node and its process."""
    context = serve.get_replica_context()
    return {
        "replica": context.replica_id.unique_id,
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
    }


class VideoJobs:
    def __init__(
        self, store: JobStore, replica: DeploymentHandle, metrics: RequestMetrics, webhooks: WebhookSender | None = None
    ):
        self.store, self.replica, self.metrics = store, replica, metrics
        self.webhooks = webhooks  # None: this deployment sends none (no jobs.webhooks.secret_env)
        self.io = ThreadPoolExecutor(max_workers=16, thread_name_prefix="h3serve-jobs")
        self.tasks: dict[str, asyncio.Task] = {}  # video id -> its job, for the jobs this replica runs
        self.runners: dict[str, JobRunner] = {}
        self.flushers: dict[str, asyncio.Task] = {}  # video id -> the task writing its event log to the store
        self.events = JobEvents()  # the event logs of the jobs this replica runs
        self.live = LiveClips()  # their fragmented MP4s while they decode (``live``)
        self.stored: dict[str, StoredClip] = {}  # the same, in the store for the other ingress replicas' readers
        self.keys = Idempotency(store.store, store.policy.idempotency_window_s)  # POSTs' Idempotency-Keys
        self._sweeper: asyncio.Task | None = None
        self.closing = False  # Serve stops this replica: it takes nothing over any more
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's, once it ran a store call
        store.on_final = self._ended_elsewhere

    async def _io(self, fn: Callable, *args) -> Any:
        self.loop = asyncio.get_running_loop()
        return await self.loop.run_in_executor(self.io, fn, *args)

    # -- what the routes ask ---------------------------------------------------------------------
    def idempotent(self, headers, route: str, body):
        """Around a POST: its Idempotency-Key's replay, or its answer kept for the retries (``idempotency``)."""
        return self.keys.use(self._io, headers, route, body)

    async def submit(
        self,
        video: dict,
        request: GenerationRequest,
        request_id: str,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
        queue_now: bool = True,
        tenant: str | None = None,
        row_steps: int = 0,
        webhook: str | None = None,
    ) -> bool:
        """Queue ``request`` on a replica, then record ``video`` as queued and follow it; False when the store
        holds too many unfinished jobs. ``queue_now`` False (no replica runs: they scaled to zero): record it as
        queued at once, and queue it on a replica once one serves (waiting at the handle starts one). ``priority``
        goes with it to every replica it is submitted to (a re-submission after a drain keeps it) and is kept in the
        record; so does ``adapter`` (the LoRA adapter it runs on, None: the base model). ``tenant`` owns it and
        ``row_steps`` counts against its quota (``JobStore.create``); ``webhook``: where its final object is POSTed.

        The replica's first event says its engine accepted the request, so QueueFull, EngineDraining,
        DeploymentUnavailableError... raise here, before any record exists: the route answers 503, never a
        queued job that fails later."""
        deadline = None if deadline_s is None else time.time() + deadline_s  # wall-clock: the replica counts it too
        if queue_now:
            stream, first = await self._start(request, request_id, deadline, priority, adapter)
            video.update(queue_position=first.get("position"), eta_seconds=rounded(first.get("eta_s")))
        else:  # no replica runs: queued here; its place in a replica's queue comes once one serves (_resubmit)
            stream, first = None, {"queued": True, "event": "queued"}
        job = dump_job(
            request, request_id=request_id, deadline=deadline, priority=priority, adapter=adapter, model=video["model"]
        )
        try:
            runner = await self._io(self.store.create, video, request_id, priority, job, tenant, row_steps, webhook)
        except BaseException:
            if stream is not None:
                stream.cancel()
            raise
        if runner is None:
            if stream is not None:
                stream.cancel()
            return False
        logger.info("video job %s (request %s) queued", runner.job_id, request_id)
        self._follow_here(runner).publish(*event_data(first))
        run = self._run(runner, request, request_id, deadline, priority, stream, adapter, video["model"])
        self.tasks[runner.job_id] = asyncio.get_running_loop().create_task(run)
        return True

    def _follow_here(self, runner: JobRunner, after: int = 0, stored: tuple = ()) -> EventLog:
        """Run the job's record and event log here (its record keeps the log's last id for a later take-over), the
        log written to the store as it grows, for the other ingress replicas' readers."""
        self.runners[runner.job_id] = runner
        log = self.events.start(runner.job_id, after, stored)
        runner.last_event = lambda: log.last_id
        flusher = self.flushers.pop(runner.job_id, None)
        if flusher is not None:
            flusher.cancel()
        save = functools.partial(self._io, runner.save_events)
        self.flushers[runner.job_id] = asyncio.get_running_loop().create_task(keep_stored(log, save, LeaseLost))
        return log

    async def _save_log(self, runner: JobRunner) -> None:
        """The job leaves this ingress (finished, handed over, stopped): its log's last write, awaited, so that
        another replica's readers end with the same final event."""
        flusher = self.flushers.pop(runner.job_id, None)
        if flusher is not None:
            flusher.cancel()
        log = self.events.get(runner.job_id)
        if log is None:
            return
        try:
            await asyncio.shield(self._io(runner.save_events, log.dump()))
        except LeaseLost:
            pass
        except Exception:
            logger.exception("writing the last event log of video job %s failed", runner.job_id)

    async def event_stream(self, video_id: str, video: dict, after: int) -> AsyncIterator[bytes]:
        """The job's Server-Sent Events after ``after`` (``events.job_stream``): from its log where it runs (or ran)
        here, else from the store."""
        return await job_stream(
            self.events.get(video_id),
            video["status"] in FINISHED,
            after,
            lambda: self._io(self.store.events, video_id),
            lambda: self._io(self.store.video_and_events, video_id),
        )

    async def take_over(self) -> None:
        """Run here the jobs whose ingress stopped writing their records (it died, or handed them over as it stopped):
        each is queued again on a replica, with a ``requeued`` event (reason ``ingress_lost``), its log's ids going on
        past the ones the lost ingress sent (EVENT_ID_GAP: those it sent after its last record write are unknown)."""
        for job_id in await self._io(self.store.takeable):
            if job_id in self.tasks or self.closing:
                continue
            try:
                taken = await self._io(self.store.take_over, job_id)
            except (JobGone, LeaseLost, JobCancelled) as e:  # deleted or cancelled meanwhile: its next reader sees it
                logger.info("video job %s not taken over: %r", job_id, e)
                continue
            if taken is None:
                continue  # another ingress took it first
            runner, raw = taken
            try:
                job = load_job(raw)
            except Exception:
                logger.exception("video job %s: its stored request cannot be read; failed", job_id)
                await self._io(
                    runner.fail, RUNNER_LOST, "the server running this job stopped and it could not be resumed"
                )
                self._notify(runner.record)
                continue
            stored, stored_last = load_log(await self._io(self.store.events, job_id))
            after = max(stored_last, runner.record.get("event_id", 0)) + EVENT_ID_GAP
            log = self._follow_here(runner, after, tuple(stored))
            attempt, limit = runner.record["attempts"], runner.record["max_attempts"]
            log.publish("requeued", {"reason": "ingress_lost", "attempt": attempt, "max_attempts": limit})
            run = self._run(
                runner,
                job["request"],
                job["request_id"],
                job["deadline"],
                job["priority"],
                None,
                job["adapter"],
                job["model"],
            )
            self.tasks[job_id] = asyncio.get_running_loop().create_task(run)

    async def _start(
        self, request: GenerationRequest, request_id: str, deadline: float | None, priority: int, adapter: str | None
    ) -> tuple[DeploymentResponseGenerator, dict]:
        """The replica's event stream and its first event ({"queued": True, ...}), once that has arrived. ``deadline``
        (wall-clock) bounds the wait too: for a replica to start, in the router's queue."""
        stream = self.replica.options(stream=True).generate_video.remote(
            request, request_id, None, priority, adapter, deadline_at=deadline
        )
        try:
            left = None if deadline is None else max(deadline - time.time(), 0.0)
            first = await asyncio.wait_for(stream.__anext__(), left)
        except asyncio.TimeoutError:
            stream.cancel()
            raise DeadlineExceeded(f"request {request_id} passed its deadline waiting for a replica") from None
        except StopAsyncIteration:
            raise RuntimeError(f"request {request_id}: the replica's stream ended before it queued") from None
        except BaseException:
            stream.cancel()
            raise
        if not first.get("queued"):
            stream.cancel()
            raise RuntimeError(f"request {request_id}: the replica's first event was {sorted(first)}, not queued")
        return stream, first

    async def get(self, video_id: str, tenant: str | None = None) -> dict | None:
        """The job's video object; None when there is none, or it is not ``tenant``'s (None: any tenant's)."""
        return await self._io(self.store.get, video_id, tenant)

    async def list(self, tenant: str | None = None) -> list[dict]:
        return await self._io(self.store.list, tenant)

    async def usage(self, tenant: str) -> tuple[int, int]:
        """(unfinished jobs, their row-steps) of ``tenant``, across every ingress."""
        return await self._io(self.store.usage, tenant)

    async def settings(self, video_id: str) -> dict | None:
        """A completed job's request and run settings as ``load_job`` reads them (``store.JobStore.settings``)."""
        raw = await self._io(self.store.settings, video_id)
        return None if raw is None else load_job(raw)

    async def media(self, video_id: str, variant: str = "video") -> tuple[bytes, str] | None:
        """(bytes, sha256) of the finished job's ``variant``, made on first request (``store.JobStore.media``)."""
        return await self._io(self.store.media, video_id, variant)

    async def delete(self, video_id: str, tenant: str | None = None) -> bool:
        """Remove the job (False: none of ``tenant``'s); if it runs here, stop it now (elsewhere its runner sees the
        tombstone)."""
        if not await self._io(self.store.delete, video_id, tenant):
            return False
        task, runner = self.tasks.get(video_id), self.runners.get(video_id)
        if task is not None and runner is not None:
            runner.stopping = "deleted"
            task.cancel()
        return True

    async def cancel(self, video_id: str, tenant: str | None = None) -> dict | None:
        """Cancel a queued or running job and return its video object, ``cancelled``; None when there is no such job,
        a 409 APIError when it has finished. Here, its request leaves the engine (the queue at once, the pack at the
        next step boundary) before this returns; on another ingress replica, its runner sees the request at its next
        write and this waits for the record to say so (at most 1.5 x ``lease_s``: a dead runner loses its lease, and the
        job is then cancelled here, not run again). ``tenant``: another tenant's job is None, as if there were none."""
        video = await self.get(video_id, tenant)
        if video is None:
            return None
        if video["status"] in FINISHED:
            raise not_cancellable(video)
        task, runner = self.tasks.get(video_id), self.runners.get(video_id)
        if task is not None and runner is not None:
            runner.stopping = "cancelled"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            video = runner.record["video"]
        else:
            await self._io(self.store.request_cancel, video_id)
            # a live runner sees the request within lease_s / 4, then a step; a dead one's record lapses within
            # lease_s of its last write, and is cancelled here then (or by the reads below, with no attempts left)
            give_up = time.monotonic() + self.store.policy.lease_s * 1.5
            while time.monotonic() < give_up:
                await self._io(self._cancel_lapsed, video_id)
                video = await self.get(video_id)
                if video is None or video["status"] in FINISHED:
                    break
                await asyncio.sleep(0.25)
            else:
                video = await self.get(video_id)
        if video is not None and video["status"] in FINISHED and video["status"] != "cancelled":
            raise not_cancellable(video)  # it completed (or failed) before the cancel reached it: the record's truth
        return video

    def _cancel_lapsed(self, video_id: str) -> None:
        """A job whose runner died with a cancel pending ends cancelled here, without waiting for a sweeper to take it
        over: the take-over (one ingress wins its lease) finds the cancel and records it (``store.take_over``)."""
        if video_id in self.tasks:
            return
        taken = self.store.take_over(video_id)
        if taken is not None:  # the cancel was withdrawn meanwhile (never by a caller): it is still asked of it
            taken[0].cancel()
            self.store.ended(taken[0].record)

    # -- the sweeper -------------------------------------------------------------------------------
    def start_sweeper(self) -> None:
        """TTL, byte cap and lost runners without waiting for a reader; every replica sweeps, harmlessly."""
        if self._sweeper is None and not self.closing:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            await self.sweep_once()
            await asyncio.sleep(self.store.policy.lease_s / 2)

    async def sweep_once(self) -> None:
        try:
            await self._io(self.store.sweep)
            await self._io(self.keys.sweep)
            await self.take_over()
            await self._resume_webhooks()
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
        stream: DeploymentResponseGenerator | None,
        adapter: str | None = None,
        model: str = "",
    ) -> None:
        """Follow the job to its MP4; a replica that hands it back unstarted (it drains) gets it re-submitted.
        ``stream`` None: not queued on a replica yet (none ran at submit); queued here first."""
        started, code = time.perf_counter(), 500
        job = asyncio.current_task()
        assert job is not None  # submit's task
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(runner, job))
        try:
            if stream is None:
                stream = await self._resubmit(runner, request, request_id, deadline, priority, adapter, again=False)
            while True:
                try:
                    await self._follow(runner, stream)
                    break
                except Exception as e:
                    if caused_by(e, EngineDraining):
                        logger.info(
                            "video job %s (request %s): its replica drains and handed it back unstarted; "
                            "submitting it again",
                            runner.job_id,
                            request_id,
                        )
                        stream = await self._resubmit(runner, request, request_id, deadline, priority, adapter)
                    elif caused_by(e, LOST):
                        stream = None
                        await self._requeue(runner, request_id, e)
                        stream = await self._resubmit(
                            runner, request, request_id, deadline, priority, adapter, again=False
                        )
                    else:
                        raise
            code = 200
            self._finished(runner)
            asyncio.get_running_loop().create_task(self.sweep_once())  # the byte cap, now
        except JobCancelled:  # asked on another ingress replica
            code = 499
            if stream is not None:
                stream.cancel()
            await self._cancelled(runner)
        except (JobGone, LeaseLost) as e:
            code = 499  # deleted, or this runner lost its lease: stop generating
            logger.info("video job %s (request %s) stopped: %r", runner.job_id, request_id, e)
            if stream is not None:
                stream.cancel()
            self._stopped(runner, "deleted" if isinstance(e, JobGone) else "lease lost")
        except asyncio.CancelledError:
            code = 499
            if stream is not None:  # None: still waiting for a first replica
                stream.cancel()  # the replica's stream ends: its request leaves the engine (engine.cancel)
            if runner.stopping == "cancelled":
                await self._cancelled(runner)
                return  # this replica cancelled it on purpose: the task ends normally
            if runner.stopping == "shutdown":
                await self._hand_over(runner)
            else:
                self._stopped(runner, runner.stopping)
            raise
        except ReplicaLost as e:
            code = 503
            await self._fail(runner, REPLICA_LOST, str(e))
        except Exception as e:
            error = http_error(e, f"video job {runner.job_id} (request {request_id})")
            code = error.status
            timed_out = caused_by(e, DeadlineExceeded)
            await self._fail(runner, "timeout" if timed_out else str(code), error.message)
        finally:
            heartbeat.cancel()
            try:
                await self._save_log(runner)  # its last events, for the other replicas' readers
            finally:  # even when a cancel interrupts that write
                # completed: every fragment came before the MP4 (a cancel that raced its record write lost)
                whole = runner.record["video"]["status"] == "completed"
                self.live.end(runner.job_id, None if whole else f"the job ended before its video did (HTTP {code})")
                stored = self.stored.pop(runner.job_id, None)
                if stored is not None and not stored.ended:  # its other readers end now, not at their next poll
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self._io(stored.end, f"the job ended before its video did (HTTP {code})"))
                self.tasks.pop(runner.job_id, None)
                self.runners.pop(runner.job_id, None)
                self._notify(runner.record)
                self.metrics.observe(JOB_ROUTE, code, time.perf_counter() - started, model)
                outcome = runner.record["video"]["status"] if code != 499 else runner.stopping or "stopped"
                audit(runner.record.get("tenant"), runner.job_id, "run", outcome, request_id)

    async def _follow(self, runner: JobRunner, stream: DeploymentResponseGenerator) -> None:
        """The replica's events into the job's event log and (at most every PROGRESS_EVERY_S, and at once when it
        starts) its record, then its MP4 into the store."""
        written, status = 0.0, runner.record["video"]["status"]
        self.live.end(runner.job_id, "the job's decode started again on another replica")
        await self._end_stored(runner, "the job's decode started again on another replica")
        async for event in stream:
            if "mp4" in event:
                joined = await self._joined(runner, event["mp4"])
                await self._write_stored(runner.job_id, StoredClip.end, None)  # every part written: read to the end
                await self._io(runner.complete, event["mp4"], joined)
                self.live.end(runner.job_id)  # whole: its readers read on to the end
                return
            if "event" not in event:
                continue
            if event["event"] == "fragment":  # bytes for the content's readers, not an event of the log
                clip = self.live.get(runner.job_id) or self.live.start(runner.job_id)
                clip.append(event["data"], event["frames"])
                await self._write_stored(runner.job_id, StoredClip.append, event["data"])  # in order: by number
                continue
            if event["event"] == "decoding" and event.get("streamed"):  # a decode split over ranks is not
                self.live.start(runner.job_id)
                await self._start_stored(runner)
            kind, data = event_data(event)
            if kind not in TERMINAL:
                self.events.publish(runner.job_id, kind, data)
            started = status == "queued" and kind in ("started", "step")
            if kind == "preview" or (time.monotonic() - written < PROGRESS_EVERY_S and not started):
                continue
            written = time.monotonic()
            done, total = event["progress"]
            if kind == "queued":
                fields = dict(queue_position=data.get("position"), eta_seconds=rounded(data.get("eta_s")))
            else:
                status = "in_progress"
                fields = dict(
                    status=status,
                    progress=int(100 * done / max(total, 1)),
                    queue_position=None,
                    eta_seconds=rounded(data.get("eta_s")),
                )
            await self._write(runner, **fields)
        raise RuntimeError("the replica's stream ended without a video")

    async def _start_stored(self, runner: JobRunner) -> None:
        """The attempt's stream in the store (``live.StoredClip``); a failed write leaves the other replicas' readers
        without it (they get the 409 and then the finished MP4), not the job."""
        record = runner.record
        stored = StoredClip(
            self.store.store, runner.job_id, {"attempts": record.get("attempts", 1), "epoch": record.get("epoch", 1)}
        )
        try:
            await self._io(stored.start)
        except Exception:
            logger.exception(
                "video job %s: writing its live stream's marker failed; it streams from here only", runner.job_id
            )
            return
        self.stored[runner.job_id] = stored

    async def _write_stored(self, job_id: str, write: Callable[[StoredClip, Any], None], arg: Any) -> None:
        """``StoredClip.append`` or ``end`` on the job's stored stream, if it has one. A failed write costs the other
        replicas' readers their stream (they end when the record leaves in_progress; the finished MP4 serves), never
        the job, as a failed marker write at the start (``_start_stored``)."""
        stored = self.stored.get(job_id)
        if stored is None:
            return
        try:
            await self._io(write, stored, arg)
        except Exception:
            logger.exception("video job %s: writing its live stream failed; it streams from here only", job_id)
            self.stored.pop(job_id, None)

    async def _end_stored(self, runner: JobRunner, broken: str) -> None:
        """An earlier attempt's stream is cut (its readers end broken); one that never ended on a replica lost before it
        could say so, too (its marker is removed: a reader of the new attempt must not open the old one)."""
        stored = self.stored.pop(runner.job_id, None)
        if stored is not None:
            await self._io(stored.end, broken)
        elif runner.record.get("attempts", 1) > 1:
            await self._io(self.store.store.delete, f"{runner.job_id}{LIVE}")

    async def live_from_store(self, video_id: str) -> AsyncIterator[bytes] | None:
        """The decoding clip of a job another ingress replica runs, from the store (``live.follow_stored``); None when
        its stream has not started (or has ended: then the record says so at once)."""
        marker = await self._io(stored_marker, self.store.store, video_id)
        if marker is None or "parts" in marker:
            return None

        async def state() -> tuple[dict | None, dict | None]:
            return await self._io(self.store.get, video_id), await self._io(stored_marker, self.store.store, video_id)

        return follow_stored(marker["stream"], lambda n: self._io(self.store.store.get, f"{video_id}{LIVE}{n}"), state)

    async def _joined(self, runner: JobRunner, mp4: bytes) -> bytes | None:
        """An extension asked with ``join``: its source then it, one MP4 (``variants.join``); None for any other job,
        or when the source was removed before it completed (its object says so: ``join`` reads false)."""
        video = runner.record["video"]
        if not video.get("join"):
            return None
        source = await self._io(self.store.content, video["extended_from_video_id"])
        if source is None:
            logger.warning("video job %s: its source was removed before it completed; not joined", runner.job_id)
            runner.record["video"] = {**video, "join": False}
            return None
        return await self._io(join, source, mp4)

    async def _resubmit(
        self,
        runner: JobRunner,
        request: GenerationRequest,
        request_id: str,
        deadline: float | None,
        priority: int,
        adapter: str | None = None,
        again: bool = True,
    ) -> DeploymentResponseGenerator:
        """Queue a handed-back job on another replica with the same priority, waiting out full queues and draining
        replicas for up to RESUBMIT.for_s (the job stays queued meanwhile; its heartbeat keeps the lease).
        ``again`` False: its first submission (none ran when it was accepted), not counted as a re-submission; the
        wait for a replica to load is the stream's first event, not a retry."""

        async def start():
            if deadline is not None and deadline <= time.time():  # not retryable: raised as it is
                raise DeadlineExceeded(f"request {request_id} passed its deadline while it was handed back")
            return await self._start(request, request_id, deadline, priority, adapter)

        def again_later(error: Exception, attempt: int, wait_s: float) -> None:
            logger.info("video job %s (request %s): no replica took it yet (%r)", runner.job_id, request_id, error)

        stream, first = await retry(start, RESUBMIT, lambda e: caused_by(e, RETRYABLE), again_later)
        try:
            if again:
                await self._io(runner.resubmitted)
        except BaseException:
            stream.cancel()
            raise
        self.events.publish(runner.job_id, *event_data(first))  # its place in the new replica's queue
        return stream

    async def _requeue(self, runner: JobRunner, request_id: str, error: Exception) -> None:
        """Count the lost attempt in the record and say ``requeued`` on the job's stream; ReplicaLost after the last."""
        cause = lost_cause(error)
        if not await self._io(runner.requeue):
            attempts = runner.record.get("attempts", 1)
            logger.warning(
                "video job %s (request %s): its replica was lost (%s) on its last attempt of %d: failed",
                runner.job_id,
                request_id,
                cause,
                attempts,
            )
            raise ReplicaLost(
                f"the model replica running this job was lost on each of its {attempts} attempts (the last: {cause}); "
                "resubmit the request"
            ) from error
        attempt, limit = runner.record["attempts"], runner.record["max_attempts"]
        logger.warning(
            "video job %s (request %s): its replica was lost (%s: %s); queued again, attempt %d of %d",
            runner.job_id,
            request_id,
            cause,
            root_cause(error),
            attempt,
            limit,
        )
        self.events.publish(runner.job_id, "requeued", {"reason": cause, "attempt": attempt, "max_attempts": limit})

    async def _heartbeat(self, runner: JobRunner, job: asyncio.Task) -> None:
        """Rewrite the record every lease_s/4, also while the job waits in the engine's queue."""
        while True:
            await asyncio.sleep(runner.record["lease_s"] / 4)
            try:
                await self._io(runner.update)
            except JobCancelled:  # asked on another ingress replica: stop the job, which records it cancelled
                logger.info("video job %s: cancel asked on another ingress", runner.job_id)
                runner.stopping = "cancelled"
                job.cancel()
                return
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
        except (JobGone, LeaseLost, JobCancelled):
            raise
        except Exception:
            logger.exception("writing video job %s failed", runner.job_id)

    async def _final_write(self, fn: Callable, *args) -> None:
        """A final record write that runs to its end even when the job's task is cancelled meanwhile (a cancel racing
        it), so that the event stream then ends with what the record says; the cancellation is raised after."""
        write = asyncio.ensure_future(self._io(fn, *args))
        interrupted = False
        while not write.done():
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                interrupted = True
            except Exception:
                break
        try:
            write.result()
        finally:
            if interrupted:
                raise asyncio.CancelledError

    def _notify(self, record: dict, owner: int = 1, webhook_id: str | None = None) -> None:
        """The job's webhook, when it has one and its record is final: sent from here when this ingress wins its
        delivery (``WebhookMarkers.claim``: owner 1 is the writer of the final record; a later owner takes over a
        delivery whose ingress died, ``_resume_webhooks``)."""
        url, video = record.get("webhook"), record["video"]
        if self.webhooks is None or url is None or video["status"] not in FINISHED:
            return
        job_id, markers = video["id"], self.store.webhook_markers
        self.webhooks.start(
            Delivery(
                url,
                video,
                functools.partial(markers.claim, job_id, owner, webhook_id),
                functools.partial(markers.beat, job_id),
                functools.partial(markers.record, job_id),
                self._io,
                self.store.policy.lease_s / 4,
            )
        )

    def _ended_elsewhere(self, record: dict) -> None:
        """``JobStore.on_final``, on a store thread: a final record this ingress wrote without running the job (its
        lease lapsed, a cancel found at a take-over); its webhook goes from here, on the event loop."""
        if self.loop is not None and not self.closing:
            self.loop.call_soon_threadsafe(self._notify, record)

    async def _resume_webhooks(self) -> None:
        """Deliver the webhooks that no live ingress delivers (their writer or owner died): at least once."""
        if self.webhooks is None or self.closing:
            return
        for record, owner, webhook_id in await self._io(self.store.webhook_markers.pending):
            logger.warning(
                "video job %s: no live ingress delivers its webhook; here (owner %d)", record["video"]["id"], owner
            )
            self._notify(record, owner, webhook_id)

    def _finished(self, runner: JobRunner) -> None:
        """The job's final event: its record's final status (the first one written wins a race with a cancel)."""
        video = runner.record["video"]
        if video["status"] in FINISHED:
            self.events.finish(runner.job_id, video["status"], video)

    async def _fail(self, runner: JobRunner, code: str, message: str) -> None:
        try:
            await self._final_write(runner.fail, code, message)
        except (JobGone, LeaseLost):
            pass
        except Exception:  # the lease will fail it for readers
            logger.exception("recording the failure of video job %s failed", runner.job_id)
        finally:
            video = runner.record["video"]
            if video["status"] in FINISHED:
                self._finished(runner)
            else:  # not written: as readers will see it once the lease runs out
                self.events.finish(runner.job_id, "failed", {**video, "status": "failed"})

    def _stopped(self, runner: JobRunner, why: str | None) -> None:
        """The final event of a job stopped without a record write: deleted reads cancelled; a lost lease reads
        failed, as the store's readers will fail it (without this its live readers would wait forever)."""
        video = runner.record["video"]
        if why == "deleted":
            self.events.finish(runner.job_id, "cancelled", {**video, "status": "cancelled"})
            return
        error = {
            "code": RUNNER_LOST,
            "message": f"the runner of this job stopped ({why or 'cancelled'}); resubmit the request",
        }
        self.events.finish(runner.job_id, "failed", {**video, "status": "failed", "error": error})

    async def _cancelled(self, runner: JobRunner) -> None:
        """Record the job cancelled (its request has left the engine) and say so on its event stream."""
        logger.info("video job %s cancelled", runner.job_id)
        try:
            await self._final_write(runner.cancel)
        except (JobGone, LeaseLost):
            pass
        except Exception:
            logger.exception("recording the cancel of video job %s failed", runner.job_id)
        finally:
            video = runner.record["video"]
            if video["status"] in FINISHED:  # cancelled, or completed/failed when that was written first
                self._finished(runner)
            else:
                self.events.finish(runner.job_id, "cancelled", {**video, "status": "cancelled"})

    async def _hand_over(self, runner: JobRunner) -> None:
        """This ingress stops: its job's record is dated back past its lease, so another ingress (or this one's
        successor) takes it over at its next sweep; a job that cannot run again (no stored request) fails now."""
        await self._save_log(runner)  # before the record says it is handed over: the successor reads on from it
        try:
            await self._final_write(runner.hand_over)
            logger.info("video job %s handed over: another ingress takes it over", runner.job_id)
        except LeaseLost:
            await self._fail(runner, "server_stopped", "the server stopped while this job ran; resubmit it")
        except Exception:
            logger.exception("handing over video job %s failed; its lease will", runner.job_id)

    async def close(self) -> None:
        """Serve stops this replica: hand its running jobs over to the other (or the next) ingress now rather than
        after their lease. The sweeper stops first: it must not take back what this replica hands over."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for video_id, task in list(self.tasks.items()):
            runner = self.runners.get(video_id)
            if runner is not None:
                runner.stopping = "shutdown"
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.webhooks is not None:  # deliveries still retrying stop here; another ingress resumes them
            await self.webhooks.close()
        self.io.shutdown(wait=False)
