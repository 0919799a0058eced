"""A decoding job's fragmented MP4, as its replica streams it to the runner, for the readers of its content.

The runner (``video_jobs``) appends each run of bytes the replica's stream brings (``fragment`` events) and ends the
clip when the job leaves decoding; any number of readers (``GET /v1/videos/{id}/content`` while it decodes) read it
from its first byte, each at its own pace, waiting on an ``asyncio.Event`` the next append sets. The bytes belong to
the job, not to a reader: a reader that goes away takes nothing with it, and one that comes later starts over. Kept in
the memory of the ingress that runs the job (the clip's MP4 size) until it ends; the readers that hold it finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


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
