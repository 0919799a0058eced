"""Server-Sent Events of a video job (``GET /v1/videos/{id}/events``), resumable with ``Last-Event-ID``.

The ingress that runs a job (its runner, ``video_jobs``) receives the engine's events for it through the replica's
stream (``H3Replica.generate_video``; they come from the engine's observer) and publishes each here with the next
id of the job's log: ``queued`` (position in its replica's queue, ``eta_s``), ``started``, ``step`` (``step`` of
``steps``, ``eta_s``), ``preview`` (a PNG strip as a data: URL), ``decoding``, ``requeued`` (its replica was lost
under it: ``reason``, ``attempt`` of ``max_attempts``; ``queued``, ``started``... follow from the next replica), then
one of ``completed``, ``failed``,
``cancelled`` carrying the job's video object, after which the stream ends. A reader replays what the log still
holds after its ``Last-Event-ID`` (every event but superseded previews: the newest preview stays), then follows
live. An idle reader waits on an ``asyncio.Event``: nothing polls, and the engine never waits for a reader.

The log is kept in the job store too (``<id>.events``: the whole log, rewritten by the runner at most every
``FLUSH_S`` and once more at its end; bounded like the log itself), so an ingress replica that does not run the job
(several ingress replicas, or one that restarted) serves the same stream: the same kinds, the same ids, resumable
with the same ``Last-Event-ID``, ending with the record's final status (``follow_store``). A job taken over by
another ingress keeps the stored events and numbers its new ones past them.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from h3serve.deploy.common.errors import APIError

logger = logging.getLogger(__name__)
TERMINAL = ("completed", "failed", "cancelled")
KINDS = ("queued", "requeued", "started", "step", "preview", "decoding", *TERMINAL)
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
RETAIN_S = 300.0  # a finished job's log stays this long for late and resuming readers
MAX_EVENTS = 512  # per job; more than a 50-step job's events, so a reader can resume from any of them
STORE_POLL_S = 0.5  # the pace at which a replica that does not run the job reads its stored log and record
FLUSH_S = 0.5  # the runner writes the log to the store at most this often (and at its end)
# a stored log that lacks the final event its record already has: its runner writes it within a FLUSH_S or so; a
# reader waits this long before it ends the stream with the record's status itself (the runner died in between)
FINAL_GRACE_S = 3.0
RETRY_MS = 2000  # the reconnection delay an EventSource is told
EVENT_ID = re.compile(r"[0-9]{1,9}")


def last_event_id(value: str | None) -> int:
    """The event id a reader resumes after (0: from the start); a 400 naming Last-Event-ID when malformed."""
    if value is None or value == "":
        return 0
    if not EVENT_ID.fullmatch(value.strip()):
        raise APIError(
            400,
            f"Last-Event-ID must be the id of an event of this stream (a decimal integer), got {value[:40]!r}",
            "Last-Event-ID",
        )
    return int(value)


def past_last_event(after: int, last_id: int) -> APIError:
    return APIError(
        400,
        f"Last-Event-ID {after} is past this job's last event ({last_id}); resume from an id it sent",
        "Last-Event-ID",
    )


def encode(kind: str, data: dict[str, Any], event_id: int | None = None) -> bytes:
    """One event in the text/event-stream format (one data line: JSON has no raw newlines)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def event_data(event: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A replica stream's event as (kind, SSE data): progress as [done, total], a preview's PNG as a data: URL."""
    kind = event["event"]
    data = {k: v for k, v in event.items() if k not in ("event", "queued", "png")}
    if "png" in event:
        data["image"] = "data:image/png;base64," + base64.b64encode(event["png"]).decode()
    return kind, data


@dataclasses.dataclass(frozen=True)
class Event:
    id: int
    kind: str
    data: dict[str, Any]

    def encode(self) -> bytes:
        return encode(self.kind, self.data, self.id)

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "data": self.data}


def dump_log(events: list[Event], last_id: int) -> bytes:
    """A log as the store keeps it (``<id>.events``): its events and the last id it gave."""
    return json.dumps({"last_id": last_id, "events": [e.as_json() for e in events]}, separators=(",", ":")).encode()


def load_log(raw: bytes | None) -> tuple[list[Event], int]:
    """A stored log's events and last id; ([], 0) for none (a job stored before logs were, or not started)."""
    if raw is None:
        return [], 0
    stored = json.loads(raw)
    return [Event(e["id"], e["kind"], e["data"]) for e in stored["events"]], int(stored["last_id"])


class EventLog:
    """One job's events, numbered from 1, bounded, waking its readers on each new one."""

    def __init__(self):
        self.events: collections.deque[Event] = collections.deque(maxlen=MAX_EVENTS)
        self.last_id = 0
        self.finished_at: float | None = None
        self._changed = asyncio.Event()

    def publish(self, kind: str, data: dict[str, Any]) -> Event:
        if self.finished_at is not None:
            raise RuntimeError(f"event {kind!r} after the job's final event")
        if kind == "preview":  # only the newest preview is worth replaying: drop the older one
            self.events = collections.deque((e for e in self.events if e.kind != "preview"), maxlen=MAX_EVENTS)
        self.last_id += 1
        event = Event(self.last_id, kind, data)
        self.events.append(event)
        if kind in TERMINAL:
            self.finished_at = time.monotonic()
        self._changed.set()  # wake every reader, then arm a fresh event for the next wait
        self._changed = asyncio.Event()
        return event

    def since(self, after: int) -> list[Event]:
        return [e for e in self.events if e.id > after]

    def dump(self) -> bytes:
        return dump_log(list(self.events), self.last_id)

    async def changed(self, after: int) -> None:
        """Return once the log holds an event past ``after``."""
        while self.last_id <= after:
            await self._changed.wait()

    async def follow(self, after: int, keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[bytes]:
        """Events after ``after``, then live ones, until the final event; a comment every ``keepalive_s`` idle."""
        yield f"retry: {RETRY_MS}\n\n".encode()
        while True:
            changed = self._changed  # taken before reading: a publish in between sets this one
            for event in self.since(after):
                yield event.encode()
                after = event.id
                if event.kind in TERMINAL:
                    return
            try:
                await asyncio.wait_for(changed.wait(), keepalive_s)
            except asyncio.TimeoutError:  # not the builtin TimeoutError on Python 3.10
                yield b": keep-alive\n\n"


class JobEvents:
    """The event logs of the jobs this ingress replica runs (and ran, for ``RETAIN_S``)."""

    def __init__(self):
        self.logs: dict[str, EventLog] = {}

    def start(self, job_id: str, after: int = 0, stored: tuple[Event, ...] = ()) -> EventLog:
        """The job's log, its ids following ``after`` (a job taken over from another ingress continues past the ids
        that one sent, so a reader resuming with Last-Event-ID reads on), holding the ``stored`` events that one
        left (a reader from the start replays them)."""
        self._prune()
        log = self.logs.get(job_id)
        if log is None or log.finished_at is not None:
            log = self.logs[job_id] = EventLog()
            log.events.extend(e for e in stored if e.kind not in TERMINAL)
            log.last_id = max([after, *(e.id for e in stored)])
        return log

    def get(self, job_id: str) -> EventLog | None:
        return self.logs.get(job_id)

    def publish(self, job_id: str, kind: str, data: dict[str, Any]) -> None:
        log = self.logs.get(job_id)
        if log is not None and log.finished_at is None:
            log.publish(kind, data)

    def finish(self, job_id: str, kind: str, video: dict[str, Any]) -> None:
        """The final event: the job's video object."""
        assert kind in TERMINAL, kind
        self.publish(job_id, kind, {"video": video})

    def _prune(self) -> None:
        now = time.monotonic()
        for job_id, log in list(self.logs.items()):
            if log.finished_at is not None and now - log.finished_at > RETAIN_S:
                del self.logs[job_id]


async def follow_store(
    read: Callable[[], Awaitable[tuple[dict | None, bytes | None]]],
    after: int,
    poll_s: float = STORE_POLL_S,
    grace_s: float = FINAL_GRACE_S,
) -> AsyncIterator[bytes]:
    """The stream of a job another ingress replica runs (or ran): its stored log every ``poll_s``, the same events
    with the same ids as the runner's stream, to the final event. ``read`` gives (the job's video object or None when
    it was deleted, its stored log). A log that lacks the final event its record has (the runner died before its last
    write) ends, after ``grace_s``, with the record's status itself: as the runner ends a deleted job, cancelled."""
    yield f"retry: {RETRY_MS}\n\n".encode()
    quiet, final_since, seen = 0.0, None, None
    while True:
        video, raw = await read()
        seen = video or seen
        events, last_id = load_log(raw)
        for event in events:
            if event.id > after:
                quiet, after = 0.0, event.id
                yield event.encode()
                if event.kind in TERMINAL:
                    return
        if video is None or video["status"] in TERMINAL:
            final_since = time.monotonic() if final_since is None else final_since
            if time.monotonic() - final_since >= grace_s:
                final = {**seen, "status": "cancelled"} if video is None and seen is not None else video
                kind = "cancelled" if final is None else final["status"]
                yield encode(kind, {"video": final}, max(after, last_id) + 1)
                return
        elif quiet >= KEEPALIVE_S:
            quiet = 0.0
            yield b": keep-alive\n\n"
        await asyncio.sleep(poll_s)
        quiet += poll_s


async def keep_stored(
    log: EventLog, save: Callable[[bytes], Awaitable[None]], fenced: type[Exception], every_s: float = FLUSH_S
) -> None:
    """The runner's side: ``save`` the log to the store whenever it has grown, at most every ``every_s``, until
    cancelled (the job leaves this ingress, which saves it a last time) or ``fenced`` (another ingress runs it now:
    its log is that one's to write). A failed write is logged and left to the next one."""
    written = 0
    while True:
        await log.changed(written)
        upto = log.last_id
        try:
            await save(log.dump())
            written = upto
        except fenced:
            return
        except Exception:
            logger.exception("writing a video job's event log failed; the next write retries")
        await asyncio.sleep(every_s)


async def job_stream(
    log: EventLog | None,
    finished: bool,
    after: int,
    read_log: Callable[[], Awaitable[bytes | None]],
    read_both: Callable[[], Awaitable[tuple[dict | None, bytes | None]]],
) -> AsyncIterator[bytes]:
    """A job's stream after ``after``: live from ``log`` where this ingress runs (or ran) it, else from the store
    (``follow_store``); the same events with the same ids either way. A 400 naming Last-Event-ID when ``after`` is
    past the last event of the live log, or of a stored log that has ended."""
    if log is not None:
        if after > log.last_id:
            raise past_last_event(after, log.last_id)
        return log.follow(after)
    if finished:
        events, last_id = load_log(await read_log())
        if after > last_id and any(e.kind in TERMINAL for e in events):
            raise past_last_event(after, last_id)
    return follow_store(read_both, after)
