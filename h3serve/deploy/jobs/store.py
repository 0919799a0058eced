"""Video jobs, shared by every ingress replica through a media store: ``<id>.json`` (the record) and ``<id>.mp4``.

No lock and no actor: each running job has one writer, its *runner* (the ingress that accepted it), which rewrites
the record on progress and at least every ``lease_s / 4`` (a heartbeat). Any replica reading a record whose heartbeat
is older than ``lease_s`` saves it as failed (cancelled, with a cancel pending): its runner died; fenced like a
take-over (the reader that creates the next epoch's lease writes it, once, and its ingress sends the job's webhook). A
runner that has not written for ``lease_s / 2`` stops on its own, so it never overwrites that verdict. DELETE of a
running job writes a tombstone (``<id>.deleted``) that the runner sees at its next write; finished jobs have no writer
and are removed at once. A cancel asked on an ingress that is not the job's runner writes ``<id>.cancel``, which the
runner sees at its next write (a progress write, at most ``lease_s / 4`` away) and answers by stopping the job and
recording it ``cancelled``. A sweeper on every replica applies the TTL, the byte cap (oldest finished first) and the
job count, and clears what crashed writers left behind.
Retention: a finished job stays until its ``expires_at`` (``ttl_s``) unless the byte cap needs its MP4's room (oldest
first); nothing is removed to make room for a new job. Unfinished jobs have their own cap (``max_unfinished``): a
new one over it is refused (the route answers 429). The cap is read from a listing, not a lock: ingress replicas
creating jobs at the same instant may pass it by one each.
Timestamps are wall-clock seconds: replicas' clocks must agree to well within ``lease_s``.

Take-over: a job's request is stored beside its record (``<id>.request``, JSON) before it is acknowledged. A lapsed
record with its request and attempts left does not read failed: any ingress's sweeper takes it over (``take_over``)
by creating ``<id>.lease<epoch + 1>`` (exclusive: one ingress wins), writes the record with that epoch and runs the
job again. Every runner write first reads the stored epoch and refuses (LeaseLost) when it is past its own, so a
runner that lost its lease never overwrites its successor. An ingress that stops cleanly dates its jobs' records
back past their lease (``hand_over``) so that the next sweep anywhere takes them over. A completed job's request is
kept as ``<id>.settings`` until the job goes (``settings``): remix and extend start from it.

What a record is (its id rule, states, shape) is ``records``; the webhook deliveries' markers beside a finished
record are ``webhook_markers`` (``JobStore.webhook_markers``, given this store's listing of live records).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable

from h3serve.deploy.jobs.live import live_names, sweep_live
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.records import FINISHED, JOB_ID, RUNNER_LOST, is_record, job_id_of, owned
from h3serve.deploy.jobs.variants import MAKERS, VARIANTS
from h3serve.deploy.jobs.webhook_markers import DELIVERY_FILES, WebhookMarkers

logger = logging.getLogger(__name__)
# what a job keeps beside its record and MP4, removed with it (or, without a record, as a crashed writer's leftovers)
SIDE_FILES = (".request", ".settings", ".events", *DELIVERY_FILES, *(s for s, _ in VARIANTS.values() if s != ".mp4"))


@dataclasses.dataclass(frozen=True)
class JobPolicy:
    ttl_s: float  # finished jobs (and their MP4s) are removed this long after they finished
    max_bytes: int  # MP4 bytes kept; beyond it the oldest finished jobs go first
    lease_s: float  # an unfinished job whose record is older than this has lost its runner
    max_unfinished: int  # queued or in_progress jobs at once; one more is refused (finished ones are not counted)
    max_attempts: int = 3  # runs of a job on a replica, counting those lost under it (a poison job stops here)
    idempotency_window_s: float = 86400.0  # an Idempotency-Key answers its retries this long (idempotency.py)


class JobGone(Exception):
    """The job was deleted: its runner stops generating."""


class JobCancelled(Exception):
    """A cancel was asked on another ingress replica (``<id>.cancel``): the runner stops and records it cancelled."""


class LeaseLost(Exception):
    """The runner could not write for half its lease: readers may have failed the job, so it stops."""


def epoch_seconds() -> int:
    return int(time.time())


class JobStore:
    def __init__(self, store: MediaStore, policy: JobPolicy, clock=time.time, runner: dict | None = None):
        """``runner``: who this ingress replica is (its Serve replica id, node, pid), written into the records of the
        jobs it runs, so an operator (and a chaos test) can tell which process runs a job; None outside Serve."""
        self.store, self.policy, self.clock, self.runner = store, policy, clock, runner
        self._finished: dict[str, dict] = {}  # finished records never change: read each once
        self._orphans: set[str] = set()  # MP4s without a record at the last sweep
        self._skipped: set[str] = set()  # files that are not job records, logged once each
        self._sweeping = threading.Lock()
        # its finished jobs' webhook deliveries (``<id>.webhook<n>``), read from the records listed here
        self.webhook_markers = WebhookMarkers(store, self._live_records, clock, runner)
        # called (on the thread that wrote it) with a record this store made final without its runner: a lapsed lease,
        # a cancel found at a take-over; the ingress sends its webhook (``video_jobs``). Never raises into the write.
        self.on_final: Callable[[dict], None] | None = None

    def _skip(self, name: str, why: str) -> None:
        """A file in the store that is not one of our records is left alone; say so once, not on every listing."""
        if name not in self._skipped:
            self._skipped.add(name)
            logger.error("%s in the video job store %s %s; skipping it (remove it by hand)", name, self.store.url, why)

    # -- records ------------------------------------------------------------------------------
    def _read(self, job_id: str, listed: bool = False) -> dict | None:
        """The record; a finished one from the cache only when a listing just showed its file is still there."""
        if listed and job_id in self._finished:
            return self._finished[job_id]
        raw = self.store.get(f"{job_id}.json")
        if raw is None:
            return None
        try:
            record = json.loads(raw)
        except ValueError:  # writes are atomic: only a hand-edited file gets here
            self._skip(f"{job_id}.json", "is not JSON")
            return None
        if not is_record(record):
            self._skip(f"{job_id}.json", "is JSON but not a video job record")
            return None
        if record["video"]["status"] in FINISHED:
            self._finished[job_id] = record
        return record

    def _write(self, record: dict) -> None:
        self.store.put(f"{record['video']['id']}.json", json.dumps(record).encode())

    def _lapsed(self, record: dict) -> bool:
        return record["video"]["status"] not in FINISHED and self.clock() - record["updated_at"] > record["lease_s"]

    def _takeable(self, record: dict) -> bool:
        """A lapsed job another ingress can run again: its request is stored and it has attempts left."""
        return (
            self._lapsed(record)
            and record.get("attempts", 1) < record.get("max_attempts", 1)
            and self.store.exists(f"{record['video']['id']}.request")
        )

    def _expire(self, record: dict) -> dict:
        """An unfinished record past its lease is failed (cancelled, when a cancel was asked of it), and saved so (a
        finished record never changes); one an ingress can take over (``take_over``) stays as it is until one does."""
        video, now = record["video"], self.clock()
        if not self._lapsed(record) or self._takeable(record):
            return record
        silent = now - record["updated_at"]
        ended = {"completed_at": int(now), "expires_at": int(now + self.policy.ttl_s)}
        # fenced like a take-over: the one reader that creates the next epoch's lease writes the final record (and
        # sends its webhook); the others answer with what it writes, or will write
        epoch = record.get("epoch", 1) + 1
        record = {**record, "epoch": epoch}
        won = self.store.put_new(f"{video['id']}.lease{epoch}", b"")
        if not won:
            stored = self._read(video["id"])
            if stored is not None and stored["video"]["status"] in FINISHED:
                return stored
        cancelled = self.store.exists(f"{video['id']}.cancel")  # its caller asked for its end before anyone ran it
        if cancelled:
            final: dict = {"status": "cancelled", "queue_position": None, "eta_seconds": None}
        else:
            final = {
                "status": "failed",
                "error": {
                    "code": RUNNER_LOST,
                    "message": f"the server running this job stopped updating it {silent:.0f} "
                    f"s ago (its lease is {record['lease_s']:g} s): it crashed or was restarted. Resubmit the "
                    "request",
                },
            }
        record = {**record, "updated_at": now, "video": {**video, **ended, **final}}
        if not won:
            return record
        logger.warning(
            "video job %s lost its runner %.0f s ago%s: %s",
            video["id"],
            silent,
            " with a cancel pending" if cancelled else "",
            final["status"],
        )
        self._write(record)
        if cancelled:
            self.store.delete(f"{video['id']}.cancel", f"{video['id']}.request")
        self._finished[video["id"]] = record
        self.ended(record)
        return record

    def ended(self, record: dict) -> None:
        """Tell the ingress (``on_final``) that this store wrote ``record``'s final status without a runner."""
        if self.on_final is not None and record.get("webhook"):
            try:
                self.on_final(record)
            except Exception:  # the sweeper's pickup (``WebhookMarkers.pending``) delivers it then
                logger.exception("video job %s: its webhook could not be started", record["video"]["id"])

    def create(
        self,
        video: dict,
        request_id: str | None = None,
        priority: int = 0,
        job: bytes | None = None,
        tenant: str | None = None,
        row_steps: int = 0,
        webhook: str | None = None,
    ) -> JobRunner | None:
        """Store a new job and return its runner; None when ``max_unfinished`` unfinished jobs exist (answer 429).

        ``request_id`` (the HTTP request's X-Request-Id, in every log line about the job) is kept in the
        record beside the video object, with ``submissions``: how often it was sent to a replica (a draining
        replica hands back a job it never started, and the runner submits it again), and the ``priority``
        every submission carries. ``job``: what another ingress needs to run it again (``video_jobs``), stored as
        ``<id>.request`` before the record, so a job acknowledged can always be taken over. ``tenant``: who owns it
        (None: no tenants, open to every caller); ``row_steps``: its work as admitted (rows x steps), counted against
        its tenant's quota while it is unfinished. ``webhook``: the URL its final object is POSTed to (``webhooks``)."""
        if self.unfinished() >= self.policy.max_unfinished:
            return None
        if job is not None:
            self.store.put(f"{video['id']}.request", job)
        record = {
            "video": dict(video),
            "updated_at": self.clock(),
            "lease_s": self.policy.lease_s,
            "bytes": 0,
            "request_id": request_id,
            "submissions": 1,
            "attempts": 1,
            "max_attempts": self.policy.max_attempts,
            "priority": priority,
            "epoch": 1,  # the lease's fencing token: a take-over writes epoch + 1; an older runner's writes are refused
            "event_id": 0,  # the last event id its runner had published at its last write
            "tenant": tenant,
            "row_steps": row_steps,
            "webhook": webhook,
            "runner": self.runner,
        }
        runner = JobRunner(self, record)
        self._write(record)
        return runner

    def get(self, job_id: str, tenant: str | None = None) -> dict | None:
        """The job's OpenAI video object, or None (no such job, deleted, not an id this store makes, or ``tenant``
        given and the job is another tenant's: its existence is not told)."""
        if not JOB_ID.fullmatch(job_id):
            return None
        record = self._read(job_id)
        if record is None or not owned(record, tenant) or self.store.exists(f"{job_id}.deleted"):
            return None
        return self._expire(record)["video"]

    def content(self, job_id: str) -> bytes | None:
        return self.store.get(f"{job_id}.mp4") if JOB_ID.fullmatch(job_id) else None

    def media(self, job_id: str, variant: str = "video") -> tuple[bytes, str] | None:
        """A finished job's ``variant`` (``variants.VARIANTS``) and its sha256 (hex); None when its MP4 is gone. The
        MP4's digest is the record's (written at completion); an image variant is made from the MP4 on its first
        request and stored beside it (``<id>.thumbnail.png``...), outside the byte cap's count (a few percent of it);
        an extension's ``joined`` clip is made when it completes (``JobRunner.complete``), None when it has none."""
        if not JOB_ID.fullmatch(job_id):
            return None
        if variant == "video":
            mp4 = self.store.get(f"{job_id}.mp4")
            if mp4 is None:
                return None
            record = self._read(job_id)
            digest = record.get("sha256") if record is not None else None
            return mp4, digest or hashlib.sha256(mp4).hexdigest()  # a record written before digests were kept
        name = f"{job_id}{VARIANTS[variant][0]}"
        data = self.store.get(name)
        if data is None and variant not in MAKERS:  # made with the MP4 or not at all (``joined``)
            return None
        if data is None:
            mp4 = self.store.get(f"{job_id}.mp4")
            if mp4 is None:
                return None
            data = MAKERS[variant](mp4)
            self.store.put(name, data)  # a racing maker writes the same bytes
        return data, hashlib.sha256(data).hexdigest()

    def settings(self, job_id: str) -> bytes | None:
        """A completed job's stored request (``<id>.settings``: its ``<id>.request`` as it ran, uploads included), kept
        with its clip for ``POST /v1/videos/{id}/remix`` and ``/extend``; None for any other job."""
        return self.store.get(f"{job_id}.settings") if JOB_ID.fullmatch(job_id) else None

    def events(self, job_id: str) -> bytes | None:
        """The job's stored event log (``events.dump_log``), as its runner last wrote it; None before the first."""
        return self.store.get(f"{job_id}.events") if JOB_ID.fullmatch(job_id) else None

    def video_and_events(self, job_id: str) -> tuple[dict | None, bytes | None]:
        """What a replica that does not run the job streams from: its video object (None: deleted) and its log."""
        return self.get(job_id), self.events(job_id)

    def delete(self, job_id: str, tenant: str | None = None) -> bool:
        """False when there is no such job (of ``tenant``). A running job is tombstoned; its runner stops at its next
        write."""
        video = self.get(job_id, tenant)
        if video is None:
            return False
        if video["status"] in FINISHED:
            self._remove(job_id)
        else:
            self.store.put(f"{job_id}.deleted", json.dumps({"deleted_at": self.clock()}).encode())
        return True

    def request_cancel(self, job_id: str) -> None:
        """Ask the job's runner, wherever it runs, to cancel it (it sees this at its next write)."""
        self.store.put(f"{job_id}.cancel", json.dumps({"cancelled_at": self.clock()}).encode())

    def _remove(self, job_id: str) -> None:
        self._finished.pop(job_id, None)
        # the record first: 404 at once
        self.store.delete(f"{job_id}.json", f"{job_id}.mp4", f"{job_id}.deleted", f"{job_id}.cancel")
        self.store.delete(
            *(f"{job_id}{suffix}" for suffix in SIDE_FILES),
            *(f"{job_id}.lease{e}" for e in range(2, self.policy.max_attempts + 2)),
            *live_names(self.store, job_id),  # its live stream's parts (``live``); an unended one's: the sweeper's
        )

    # -- take-over -----------------------------------------------------------------------------
    def takeable(self) -> builtins.list[str]:
        """The jobs whose runner stopped writing (its ingress died, or handed them over on a clean stop) and that
        can run again here."""
        names = self.store.names()
        present = set(names)
        return [
            job_id
            for job_id, record in self._live_records(names).items()
            if f"{job_id}.request" in present and self._takeable(record)
        ]

    def take_over(self, job_id: str) -> tuple[JobRunner, bytes] | None:
        """Become the runner of a lapsed job: the record's epoch + 1, taken by creating ``<id>.lease<epoch>`` (one
        ingress wins), one more attempt counted, the record queued again. None when it is not takeable (any more),
        or another ingress took it first. Returns the runner and the stored request."""
        record = self._read(job_id)
        if record is None or not self._takeable(record):
            return None
        epoch = record.get("epoch", 1) + 1
        if not self.store.put_new(f"{job_id}.lease{epoch}", b""):
            return None
        job = self.store.get(f"{job_id}.request")
        if job is None:
            return None
        runner = JobRunner(self, {**record, "epoch": epoch})
        with runner._lock:
            runner.record = {
                **runner.record,
                "attempts": record.get("attempts", 1) + 1,
                "submissions": record.get("submissions", 1) + 1,
                "runner": self.runner,
            }
            try:
                runner.update(status="queued", progress=0, queue_position=None, eta_seconds=None)
            except JobCancelled:  # cancelled while it had no runner: that is its end
                runner.cancel()
                self.ended(runner.record)
                return None
        logger.warning("video job %s: its runner stopped writing; taken over here (epoch %d)", job_id, epoch)
        return runner, job

    def list(self, tenant: str | None = None) -> list[dict]:
        """Every live job's video object (of ``tenant``, when given), newest first."""
        records = self._live_records(self.store.names()).values()
        videos = [r["video"] for r in records if owned(r, tenant)]
        return sorted(videos, key=lambda v: (v["created_at"], v["id"]), reverse=True)

    def usage(self, tenant: str) -> tuple[int, int]:
        """(unfinished jobs, their row-steps) of ``tenant``: what its quotas count."""
        unfinished = [
            r
            for r in self._live_records(self.store.names()).values()
            if owned(r, tenant) and r["video"]["status"] not in FINISHED
        ]
        return len(unfinished), sum(r.get("row_steps", 0) for r in unfinished)

    # -- bounds ------------------------------------------------------------------------------
    def _records(self, names: builtins.list[str]) -> dict[str, dict]:
        records = {}
        for name in names:
            if not name.endswith(".json"):
                continue
            job_id = job_id_of(name, ".json")
            if job_id is None:
                self._skip(name, "is not named like a video job record (video_<32 hex digits>.json)")
                continue
            record = self._read(job_id, listed=True)
            if record is not None:
                records[job_id] = self._expire(record)
        return records

    def _live_records(self, names: builtins.list[str]) -> dict[str, dict]:
        """The records of jobs not deleted (no tombstone beside them)."""
        present = set(names)
        return self._records([n for n in names if f"{n.removesuffix('.json')}.deleted" not in present])

    @staticmethod
    def _oldest_finished(records: dict[str, dict]) -> builtins.list[tuple[float, str]]:
        """(completed_at, id) of the finished jobs, oldest first: the order every bound removes them in."""
        return sorted(
            (r["video"]["completed_at"] or 0, job_id)
            for job_id, r in records.items()
            if r["video"]["status"] in FINISHED
        )

    def unfinished(self) -> int:
        """How many jobs are queued or in progress (deleted ones not counted)."""
        records = self._live_records(self.store.names())
        return sum(r["video"]["status"] not in FINISHED for r in records.values())

    def sweep(self) -> None:
        """TTL, byte cap, expired leases, tombstones and leftovers; safe on every replica at once."""
        if not self._sweeping.acquire(blocking=False):
            return
        try:
            self._sweep()
        finally:
            self._sweeping.release()

    def _sweep(self) -> None:
        names = self.store.names()
        now, present = self.clock(), set(names)
        for job_id in list(self._finished):
            if f"{job_id}.json" not in present:
                del self._finished[job_id]
        for name in names:  # a deleted job's runner can no longer write once its lease has passed
            deleted_id = job_id_of(name, ".deleted")
            if deleted_id is not None:
                raw = self.store.get(name)
                deleted_at = None if raw is None else self._deleted_at(name, raw)
                if deleted_at is not None and now - deleted_at > self.policy.lease_s:
                    self._remove(deleted_id)
        records = self._live_records(names)
        finished = self._oldest_finished(records)
        total = sum(r["bytes"] for r in records.values())
        for completed_at, job_id in finished:
            expired = now - completed_at > self.policy.ttl_s
            if not expired and total <= self.policy.max_bytes:
                break  # oldest first: everything after is younger
            logger.info("removing video job %s (%s)", job_id, "expired" if expired else "over the byte cap")
            total -= records[job_id]["bytes"]
            self._remove(job_id)
        # an MP4 without a record: a runner died between the two writes, or a delete half-done. Its
        # record may be about to appear, so it goes only if it is still an orphan one sweep later.
        # a stored request without a record alike (create died between the two writes), and an event log (a deleted
        # job's runner writes its last one after removing the record)
        # the live streams' parts (``live``): a finished job's go here; a job's without a record, as its leftovers
        live = sweep_live(self.store, names, records, now)
        suffixes = (".mp4", *SIDE_FILES)
        mp4s = {found for n in names for s in suffixes if (found := job_id_of(n, s)) is not None} | live.keys()
        orphans = {mp4_id for mp4_id in mp4s if f"{mp4_id}.json" not in present}
        for job_id in orphans & self._orphans:
            self.store.delete(*(f"{job_id}{s}" for s in suffixes), *live.get(job_id, []))
        self._orphans = orphans - self._orphans
        self.store.remove_stale_temporaries(self.policy.lease_s)

    def _deleted_at(self, name: str, raw: bytes) -> float | None:
        """When a tombstone was written; None (skipped, and logged) for a file this store did not write."""
        try:
            return float(json.loads(raw)["deleted_at"])
        except (ValueError, TypeError, KeyError):
            self._skip(name, "is not a tombstone this store wrote")
            return None


class JobRunner:
    """The one writer of a running job's record: progress, heartbeats, the result; fenced by its lease."""

    def __init__(self, jobs: JobStore, record: dict):
        self.jobs, self.record = jobs, record
        self.job_id = record["video"]["id"]
        self.last_write = time.monotonic()
        self.last_event: Callable[[], int] | None = None  # the id of the last event its log published
        self.handed_over = False
        self.gone = False
        self.stopping: str | None = None  # why the ingress cancels it: "deleted", "shutdown", "lease lost"
        self._lock = threading.RLock()  # complete and requeue hold it across their write

    def update(self, final: bool = False, **fields) -> None:
        """Write the record with ``fields``; JobGone if it was deleted, LeaseLost if readers may have failed it,
        JobCancelled if a cancel was asked. ``final``: the job's outcome (completed, failed), written even when a
        cancel is pending: the first final status the record takes is the truth, a later cancel finds it finished."""
        with self._lock:
            if self.record["video"]["status"] in FINISHED:
                return  # a heartbeat that raced the result: the record is final (and may be deleted by now)
            started = time.monotonic()
            if self.handed_over:
                raise LeaseLost(f"video job {self.job_id} was handed over to another ingress")
            if started - self.last_write > self.record["lease_s"] / 2:
                raise LeaseLost(f"video job {self.job_id}: no heartbeat for {started - self.last_write:.0f} s")
            if self.gone or self.jobs.store.exists(f"{self.job_id}.deleted"):
                self.gone = True  # the tombstone stays until the sweeper sees no runner can write
                self.jobs.store.delete(f"{self.job_id}.json", f"{self.job_id}.mp4")
                raise JobGone(self.job_id)
            if not final and self.stopping != "cancelled" and self.jobs.store.exists(f"{self.job_id}.cancel"):
                raise JobCancelled(self.job_id)
            self._fence()
            event_id = self.last_event() if self.last_event is not None else self.record.get("event_id", 0)
            self.record = {
                **self.record,
                "updated_at": self.jobs.clock(),
                "event_id": event_id,
                "video": {**self.record["video"], **fields},
            }
            self.jobs._write(self.record)
            self.last_write = started

    def _fence(self) -> None:
        """LeaseLost when another ingress took the job over (the stored epoch is past this runner's): its write would
        overwrite the new runner's record."""
        raw = self.jobs.store.get(f"{self.job_id}.json")
        stored = json.loads(raw).get("epoch", 1) if raw is not None else 1
        if stored > self.record.get("epoch", 1):
            raise LeaseLost(f"video job {self.job_id}: taken over by another ingress (epoch {stored})")

    def save_events(self, log: bytes) -> None:
        """Write the job's event log (``<id>.events``) for the other ingress replicas' readers; LeaseLost when another
        ingress took the job over (its log is the successor's to write) or this one handed it over."""
        with self._lock:
            if self.handed_over:
                raise LeaseLost(f"video job {self.job_id} was handed over to another ingress")
            self._fence()
            self.jobs.store.put(f"{self.job_id}.events", log)

    def hand_over(self) -> None:
        """This ingress stops cleanly: date the record back past its lease so that another ingress takes the job over
        at its next sweep, instead of failing it (only when its request is stored: else it could not run again)."""
        with self._lock:
            if self.record["video"]["status"] in FINISHED or not self.jobs.store.exists(f"{self.job_id}.request"):
                raise LeaseLost(f"video job {self.job_id} cannot be handed over")
            self._fence()
            self.record = {**self.record, "updated_at": self.jobs.clock() - self.record["lease_s"] - 1}
            self.jobs._write(self.record)
            self.handed_over = True  # nothing more from this runner

    def resubmitted(self) -> None:
        """A replica handed the job back unstarted (it drains): count the next submission in the record."""
        with self._lock:
            self.record = {**self.record, "submissions": self.record.get("submissions", 1) + 1}
        self.update()

    def requeue(self) -> bool:
        """The job's replica was lost under it (died, its worker group broke, it stopped): True and the record reads
        queued again with one more attempt counted, or False when it has had ``max_attempts`` (the caller fails it)."""
        with self._lock:
            attempts = self.record.get("attempts", 1)
            if attempts >= self.record.get("max_attempts", 1):
                return False
            self.record = {
                **self.record,
                "attempts": attempts + 1,
                "submissions": self.record.get("submissions", 1) + 1,
            }
            self.update(status="queued", progress=0, queue_position=None, eta_seconds=None)
            return True

    def complete(self, mp4: bytes, joined: bytes | None = None) -> None:
        """The MP4 (and an extension's ``joined`` clip, counted in its bytes) first, then the record that says it is
        there; nothing when the record is final already (a cancel won the race). Under the lock throughout, so a cancel
        on another thread comes wholly before or after."""
        with self._lock:
            if self.record["video"]["status"] in FINISHED:
                return
            if joined is not None:
                self.jobs.store.put(f"{self.job_id}{VARIANTS['joined'][0]}", joined)
            self.jobs.store.put(f"{self.job_id}.mp4", mp4)
            size = len(mp4) + (0 if joined is None else len(joined))
            self.record = {**self.record, "bytes": size, "sha256": hashlib.sha256(mp4).hexdigest()}  # the ETag
            now = int(self.jobs.clock())
            self.update(
                final=True,
                status="completed",
                progress=100,
                completed_at=now,
                expires_at=int(now + self.jobs.policy.ttl_s),
                queue_position=None,
                eta_seconds=None,
            )
            request = self.jobs.store.get(f"{self.job_id}.request")
            if request is not None:  # what remix and extend start from, kept as long as the clip (``settings``)
                self.jobs.store.put(f"{self.job_id}.settings", request)
            self.jobs.store.delete(f"{self.job_id}.request")  # final: it never runs again

    def cancel(self) -> None:
        """Record the job cancelled (its request left the engine), then drop the cancel request if one was written."""
        now = int(self.jobs.clock())
        self.stopping = "cancelled"
        self.update(
            status="cancelled",
            completed_at=now,
            expires_at=int(now + self.jobs.policy.ttl_s),
            queue_position=None,
            eta_seconds=None,
        )
        self.jobs.store.delete(f"{self.job_id}.cancel", f"{self.job_id}.request")

    def fail(self, code: str, message: str) -> None:
        now = int(self.jobs.clock())
        self.update(
            final=True,
            status="failed",
            completed_at=now,
            expires_at=int(now + self.jobs.policy.ttl_s),
            error={"code": code, "message": message},
            queue_position=None,
            eta_seconds=None,
        )
        self.jobs.store.delete(f"{self.job_id}.request")
