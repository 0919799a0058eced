"""A decoding job's fragmented MP4, as its replica streams it to the runner, for the readers of its content.

The runner (``video_jobs``) appends each run of bytes the replica's stream brings (``fragment`` events) and ends the
clip when the job leaves decoding; any number of readers (``GET /v1/videos/{id}/content`` while it decodes) read it
from its first byte, each at its own pace, waiting on an ``asyncio.Event`` the next append sets. The bytes belong to
the job, not to a reader: a reader that goes away takes nothing with it, and one that comes later starts over. Kept in
the memory of the ingress that runs the job (the clip's MP4 size) until it ends; the readers that hold it finish.

The runner writes the same bytes to the job store too (``StoredClip``), so an ingress replica that does not run the
job serves the same stream (``follow_stored``), as ``events.follow_store`` serves the job's events.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.records import FINISHED


class StreamBroken(RuntimeError):
    """The job failed, was cancelled or moved to another replica before its stream ended: the bytes read so far are
    not a whole MP4 (the reader's connection is cut rather than ended cleanly)."""


class LiveClip:
    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.frames = 0  # encoded so far
        self.done = False
        self.broken: str | None = None
        self._changed = asyncio.Event()

    def append(self, data: bytes, frames: int) -> None:
        if self.done:
            raise RuntimeError("bytes appended to a stream that ended")
        if data:
            self.parts.append(data)
            self.size += len(data)
        self.frames = frames
        self._wake()

    def end(self, broken: str | None = None) -> None:
        """The stream is whole (``broken`` None) or cut short, saying why."""
        if not self.done:
            self.done, self.broken = True, broken
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()  # the next wait waits for the next change

    async def read(self) -> AsyncIterator[bytes]:
        """Every byte from the first, as it comes; StreamBroken where the stream was cut short."""
        sent = 0
        while True:
            changed = self._changed
            while sent < len(self.parts):
                yield self.parts[sent]
                sent += 1
            if self.done:
                if self.broken is not None:
                    raise StreamBroken(self.broken)
                return
            await changed.wait()


class LiveClips:
    """The live clips of the jobs this ingress replica runs, by video id."""

    def __init__(self) -> None:
        self.clips: dict[str, LiveClip] = {}

    def get(self, video_id: str) -> LiveClip | None:
        return self.clips.get(video_id)

    def start(self, video_id: str) -> LiveClip:
        """A new clip for the job (an earlier one, from a replica that was lost mid-decode, is cut off: its bytes and
        the new attempt's would not make one MP4)."""
        self.end(video_id, "the job's decode started again on another replica")
        clip = self.clips[video_id] = LiveClip()
        return clip

    def end(self, video_id: str, broken: str | None = None) -> None:
        clip = self.clips.pop(video_id, None)
        if clip is not None:
            clip.end(broken)


# -- the same clip through the job store, for the ingress replicas that do not run the job --------------------------
# The runner writes each run of bytes as a numbered object (``<id>.live<n>``: object stores cannot append) and a
# marker (``<id>.live``) naming the stream: a token new with each attempt (a job re-run elsewhere starts a new stream,
# which its old readers must not read on into), and once the stream ends, its parts and whether it is whole. Each
# part starts with the token, so a part an earlier attempt left under the same number is told apart from this one's.
LIVE = ".live"
STORE_POLL_S = 0.2  # the pace at which another ingress looks for the next part (the decode's chunks are ~0.1-1 s)
LIVE_KEEP_S = 60.0  # a completed job's parts stay this long for the readers still behind (then its MP4 serves)
TOKEN_BYTES = 32
LIVE_PART = re.compile(r"(video_[0-9a-f]{32})\.live[0-9]*")


def part_name(job_id: str, n: int) -> str:
    return f"{job_id}{LIVE}{n}"


def live_names(store: MediaStore, job_id: str) -> list[str]:
    """The marker and the parts it counts (an unended stream's parts are not counted: the sweeper finds those)."""
    raw = store.get(f"{job_id}{LIVE}")
    parts = (json.loads(raw).get("parts") or 0) if raw is not None else 0
    return [f"{job_id}{LIVE}", *(part_name(job_id, n) for n in range(parts))]


def sweep_live(store: MediaStore, names: list[str], records: dict[str, dict], now: float) -> dict[str, list[str]]:
    """The sweeper's part: removes a finished job's live parts once its late readers had LIVE_KEEP_S (its MP4 serves
    now); the parts of jobs with no finished record (``records``: by job id), by job, for the orphans' rule."""
    live: dict[str, list[str]] = {}
    for name in names:
        if (part := LIVE_PART.fullmatch(name)) is not None:
            live.setdefault(part.group(1), []).append(name)
    for job_id, parts in list(live.items()):
        record = records.get(job_id)
        if record is not None and record["video"]["status"] in FINISHED:
            if now - (record["video"]["completed_at"] or 0) > LIVE_KEEP_S:
                store.delete(*parts)
            del live[job_id]
    return live


class StoredClip:
    """The runner's side: one attempt's stream in the store (each method a blocking store write: run off the loop)."""

    def __init__(self, store: MediaStore, job_id: str, attempt: dict[str, int]):
        self.store, self.job_id, self.attempt = store, job_id, attempt
        self.token = secrets.token_hex(TOKEN_BYTES // 2)
        self.parts = 0
        self.ended = False

    def _mark(self, **end: Any) -> None:
        marker = {"stream": self.token, "attempt": self.attempt, **end}
        self.store.put(f"{self.job_id}{LIVE}", json.dumps(marker).encode())

    def start(self) -> None:
        self._mark()

    def append(self, data: bytes) -> None:
        if data:
            self.store.put(part_name(self.job_id, self.parts), self.token.encode() + data)
            self.parts += 1

    def end(self, broken: str | None = None) -> None:
        """Its parts counted (every one written before: a reader that read them all has the stream), whole or not."""
        if not self.ended:
            self.ended = True
            self._mark(parts=self.parts, broken=broken)


def stored_marker(store: MediaStore, job_id: str) -> dict | None:
    raw = store.get(f"{job_id}{LIVE}")
    return None if raw is None else json.loads(raw)


async def follow_stored(
    token: str,
    read_part: Callable[[int], Awaitable[bytes | None]],
    read_state: Callable[[], Awaitable[tuple[dict | None, dict | None]]],
    poll_s: float = STORE_POLL_S,
) -> AsyncIterator[bytes]:
    """The stream ``token`` from the store, from its first byte: each part as it is there, else a look at (the job's
    video object or None, the marker) every ``poll_s``; ends when the marker counts every part read and says whole,
    StreamBroken when it says broken, names another stream (the job runs again), or the job left decoding otherwise
    (failed, cancelled, deleted, requeued: its runner died before it could say)."""
    sent = 0
    while True:
        part = await read_part(sent)
        if part is not None and part[:TOKEN_BYTES] == token.encode():
            yield part[TOKEN_BYTES:]
            sent += 1
            continue
        video, marker = await read_state()
        if marker is None or marker["stream"] != token:
            raise StreamBroken("the job's decode started again, or the job was removed")
        if "parts" in marker:
            if marker["broken"] is not None:
                raise StreamBroken(marker["broken"])
            if sent >= marker["parts"]:
                return
            if part is None or part[:TOKEN_BYTES] != token.encode():  # counted but gone: removed under the reader
                again = await read_part(sent)
                if again is None or again[:TOKEN_BYTES] != token.encode():
                    raise StreamBroken("the stream's parts were removed before they were read")
            continue
        if video is None or video["status"] != "in_progress":
            raise StreamBroken(f"the job is {'removed' if video is None else video['status']} before its video ended")
        await asyncio.sleep(poll_s)
