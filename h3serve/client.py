"""The h3serve API's client side: the HTTP calls a user makes, polling a video job, reading its event stream.

Library code shared by the benchmarks, the tests and a future CLI; it imports no server module (only httpx), so it
runs anywhere the API is reachable. ``H3Client`` is synchronous, ``AsyncH3Client`` the same calls for asyncio; both
wrap an ``httpx`` client (``.http``) whose base URL is the server's, and take ``prefix`` (a route prefix, as an
application served under ``route_prefix``) and ``headers`` (sent with every call: an API key, say).

    with H3Client("http://127.0.0.1:8000") as api:
        image = api.image({"prompt": "a red circle"})                  # POST /v1/images/generations
        job, mp4 = api.video_job({"prompt": "a red circle", "seconds": 5})   # POST, poll, GET content, DELETE
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

FINISHED = ("completed", "failed", "cancelled")  # a video job's final states


class JobFailed(RuntimeError):
    """A video job ended in a state other than ``completed``; ``job`` is its final object."""

    def __init__(self, job: dict):
        super().__init__(f"video job {job.get('id')} ended {job.get('status')}: {job.get('error')}")
        self.job = job


def parse_events(text: str) -> list[dict]:
    """A ``text/event-stream`` body -> ``[{"id", "event", "data"}]``, ``data`` parsed as JSON (comments and the
    retry line dropped): what ``GET /v1/videos/{id}/events`` sends."""
    events = []
    for block in text.split("\n\n"):
        fields: dict = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                fields[name] = value
        if "event" in fields:
            events.append({"id": fields.get("id"), "event": fields["event"], "data": json.loads(fields["data"])})
    return events


class _Routes:
    """The routes, shared by the two clients."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def images(self) -> str:
        return f"{self.prefix}/v1/images/generations"

    def videos(self) -> str:
        return f"{self.prefix}/v1/videos"

    def video(self, video_id: str, what: str = "") -> str:
        return f"{self.prefix}/v1/videos/{video_id}" + (f"/{what}" if what else "")


class H3Client:
    """The API over one ``httpx.Client``; a context manager that closes it."""

    def __init__(
        self, url: str, timeout: float = 600.0, headers: dict | None = None, prefix: str = "", **httpx_options: Any
    ):
        self.http = httpx.Client(base_url=url, timeout=timeout, headers=headers, **httpx_options)
        self.routes = _Routes(prefix)

    def __enter__(self) -> H3Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def image(self, body: dict, headers: dict | None = None) -> dict:
        """``POST /v1/images/generations``: the response object (``data[i].b64_json``)."""
        return self.http.post(self.routes.images(), json=body, headers=headers).raise_for_status().json()

    def create_video(self, body: dict, headers: dict | None = None) -> dict:
        """``POST /v1/videos``: the new job object."""
        return self.http.post(self.routes.videos(), json=body, headers=headers).raise_for_status().json()

    def video(self, video_id: str) -> dict:
        """``GET /v1/videos/{id}``: the job object."""
        return self.http.get(self.routes.video(video_id)).raise_for_status().json()

    def wait_video(
        self,
        video_id: str,
        poll_s: float = 0.05,
        timeout_s: float = 600.0,
        on_poll: Callable[[dict], None] | None = None,
    ) -> dict:
        """The job polled every ``poll_s`` until it is finished or ``timeout_s`` passed: its last object.
        ``on_poll`` sees every object polled."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.video(video_id)
            if on_poll is not None:
                on_poll(job)
            if job["status"] in FINISHED or time.monotonic() > deadline:
                return job
            time.sleep(poll_s)

    def content(self, video_id: str) -> bytes:
        """``GET /v1/videos/{id}/content``: the MP4."""
        return self.http.get(self.routes.video(video_id, "content")).raise_for_status().content

    def delete(self, video_id: str) -> None:
        self.http.delete(self.routes.video(video_id)).raise_for_status()

    def cancel(self, video_id: str) -> dict:
        return self.http.post(self.routes.video(video_id, "cancel")).raise_for_status().json()

    def events(self, video_id: str) -> list[dict]:
        """``GET /v1/videos/{id}/events`` read to its end (the stream closes when the job finishes)."""
        return parse_events(self.http.get(self.routes.video(video_id, "events")).raise_for_status().text)

    def models(self) -> dict:
        return self.http.get(f"{self.routes.prefix}/v1/models").raise_for_status().json()

    def video_job(
        self, body: dict, poll_s: float = 0.05, timeout_s: float = 600.0, headers: dict | None = None
    ) -> tuple[dict, bytes]:
        """A video as a user makes it: POST, poll until it finishes, GET its MP4, DELETE the job: (final job object,
        MP4 bytes). Raises ``JobFailed`` when it did not complete."""
        video_id = self.create_video(body, headers)["id"]
        job = self.wait_video(video_id, poll_s, timeout_s)
        if job["status"] != "completed":
            raise JobFailed(job)
        mp4 = self.content(video_id)
        self.delete(video_id)
        return job, mp4


class AsyncH3Client:
    """``H3Client``'s calls over one ``httpx.AsyncClient``; an async context manager that closes it."""

    def __init__(
        self, url: str, timeout: float = 600.0, headers: dict | None = None, prefix: str = "", **httpx_options: Any
    ):
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout, headers=headers, **httpx_options)
        self.routes = _Routes(prefix)

    async def __aenter__(self) -> AsyncH3Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def image(self, body: dict, headers: dict | None = None) -> dict:
        return (await self.http.post(self.routes.images(), json=body, headers=headers)).raise_for_status().json()

    async def create_video(self, body: dict, headers: dict | None = None) -> dict:
        return (await self.http.post(self.routes.videos(), json=body, headers=headers)).raise_for_status().json()

    async def video(self, video_id: str) -> dict:
        return (await self.http.get(self.routes.video(video_id))).raise_for_status().json()

    async def wait_video(self, video_id: str, poll_s: float = 0.05, timeout_s: float = 600.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            job = await self.video(video_id)
            if job["status"] in FINISHED or time.monotonic() > deadline:
                return job
            await asyncio.sleep(poll_s)

    async def content(self, video_id: str) -> bytes:
        return (await self.http.get(self.routes.video(video_id, "content"))).raise_for_status().content

    async def delete(self, video_id: str) -> None:
        (await self.http.delete(self.routes.video(video_id))).raise_for_status()

    async def video_job(
        self,
        body: dict,
        poll_s: float = 0.05,
        timeout_s: float = 600.0,
        headers: dict | None = None,
        on_content: Callable[[], None] | None = None,
    ) -> tuple[dict, bytes]:
        """``H3Client.video_job``; ``on_content`` is called once the MP4 is in, before the DELETE (a caller timing
        the request stops its clock there)."""
        video_id = (await self.create_video(body, headers))["id"]
        job = await self.wait_video(video_id, poll_s, timeout_s)
        if job["status"] != "completed":
            raise JobFailed(job)
        mp4 = await self.content(video_id)
        if on_content is not None:
            on_content()
        await self.delete(video_id)
        return job, mp4
