"""The h3serve API's client side: the HTTP calls a user makes, polling a video job, following its event stream.

Library code shared by the benchmarks, the tests and the ``h3serve video`` CLI; it imports no server module (httpx,
httpx-retries, httpx-sse), so it runs anywhere the API is reachable. ``H3Client`` is synchronous, ``AsyncH3Client``
the same calls for asyncio; both wrap an ``httpx`` client (``.http``) whose base URL is the server's, and take
``prefix`` (a route prefix, as an application served under ``route_prefix``), ``api_key`` (sent as a bearer token)
and ``headers`` (sent with every call).

Overload is answered, not dropped: a 429 or 503 (a full queue, a replica still loading) is retried ``retries`` times
with exponential backoff and jitter, waiting what ``Retry-After`` says when the server says it (httpx-retries).
Retrying a POST is safe because every create carries an ``Idempotency-Key`` (a new one per call unless the caller
passes its own): a retried create gets the same job, never a second one holding the GPUs.

    with H3Client("http://127.0.0.1:8000") as api:
        image = api.image({"prompt": "a red circle"})                  # POST /v1/images/generations
        job, mp4 = api.video_job({"prompt": "a red circle", "seconds": 5})   # POST, poll, GET content, DELETE
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from http import HTTPMethod
from pathlib import Path
from typing import Any

import httpx
from httpx_retries import Retry, RetryTransport
from httpx_sse import connect_sse

FINISHED = ("completed", "failed", "cancelled")  # a video job's final states
RETRY_STATUSES = (429, 503)  # refused before any work began: overload, a replica loading, a quota
RETRIES = 5  # with backoff 0.5 s doubling (jittered) up to 30 s, or Retry-After: about a minute in all
RECONNECTS = 20  # an event stream dropped mid-job is opened again with Last-Event-ID this many times
IDEMPOTENCY_HEADER = "Idempotency-Key"


class JobFailed(RuntimeError):
    """A video job ended in a state other than ``completed``; ``job`` is its final object."""

    def __init__(self, job: dict):
        super().__init__(f"video job {job.get('id')} ended {job.get('status')}: {job.get('error')}")
        self.job = job


def retry_policy(retries: int) -> Retry:
    """429/503 retried on every method (creates carry an Idempotency-Key, cancel and delete are idempotent), waiting
    Retry-After when the server sends one, else 0.5 s doubling with jitter, at most 30 s a wait."""
    return Retry(
        total=retries,
        status_forcelist=RETRY_STATUSES,
        allowed_methods=[HTTPMethod.GET, HTTPMethod.HEAD, HTTPMethod.DELETE, HTTPMethod.POST],
        backoff_factor=0.5,
        max_backoff_wait=30.0,
        respect_retry_after_header=True,
    )


def client_options(
    api_key: str | None, headers: dict | None, retries: int, asynchronous: bool, options: dict[str, Any]
) -> dict[str, Any]:
    """httpx client options: the bearer token among the headers, the retrying transport around the caller's (or a
    default one, built with the caller's ``limits``)."""
    headers = dict(headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    inner = options.pop("transport", None)
    if inner is None:
        limits = options.pop("limits", httpx.Limits())
        inner = httpx.AsyncHTTPTransport(limits=limits) if asynchronous else httpx.HTTPTransport(limits=limits)
    return {"headers": headers, "transport": RetryTransport(transport=inner, retry=retry_policy(retries)), **options}


def with_idempotency_key(headers: dict | None, key: str | None) -> dict:
    """The caller's headers plus an Idempotency-Key: ``key``, the caller's own, or a new random one."""
    headers = dict(headers or {})
    headers.setdefault(IDEMPOTENCY_HEADER, key or uuid.uuid4().hex)
    return headers


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


class _Client:
    """What both clients are made of: an httpx client of ``HTTPX`` (sync or async) with the bearer token, the headers
    and the retrying transport (``client_options``), and the routes under ``prefix``. ``retries=0`` sends each call
    once (a benchmark counting refusals)."""

    HTTPX: type[httpx.Client] | type[httpx.AsyncClient]

    def __init__(
        self,
        url: str,
        timeout: float = 600.0,
        headers: dict | None = None,
        prefix: str = "",
        api_key: str | None = None,
        retries: int = RETRIES,
        **httpx_options: Any,
    ):
        asynchronous = self.HTTPX is httpx.AsyncClient
        options = client_options(api_key, headers, retries, asynchronous, httpx_options)
        self.http = self.HTTPX(base_url=url, timeout=timeout, **options)
        self.routes = _Routes(prefix)


class H3Client(_Client):
    """The API over one ``httpx.Client``; a context manager that closes it."""

    HTTPX = httpx.Client
    http: httpx.Client

    def __enter__(self) -> H3Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def image(self, body: dict, headers: dict | None = None, idempotency_key: str | None = None) -> dict:
        """``POST /v1/images/generations``: the response object (``data[i].b64_json``)."""
        headers = with_idempotency_key(headers, idempotency_key)
        return self.http.post(self.routes.images(), json=body, headers=headers).raise_for_status().json()

    def create_video(self, body: dict, headers: dict | None = None, idempotency_key: str | None = None) -> dict:
        """``POST /v1/videos``: the new job object (a retried call returns the same job: its Idempotency-Key)."""
        headers = with_idempotency_key(headers, idempotency_key)
        return self.http.post(self.routes.videos(), json=body, headers=headers).raise_for_status().json()

    def remix_video(
        self, video_id: str, body: dict, headers: dict | None = None, idempotency_key: str | None = None
    ) -> dict:
        """``POST /v1/videos/{id}/remix``: a new job, the completed source's seed and settings with ``body``'s prompt
        (its object's ``remixed_from_video_id`` names the source)."""
        headers = with_idempotency_key(headers, idempotency_key)
        return (
            self.http.post(self.routes.video(video_id, "remix"), json=body, headers=headers).raise_for_status().json()
        )

    def extend_video(
        self, video_id: str, body: dict, headers: dict | None = None, idempotency_key: str | None = None
    ) -> dict:
        """``POST /v1/videos/{id}/extend``: a new job starting from the completed source's last frame (FL2VA) with
        ``body``'s prompt (its object's ``extended_from_video_id`` names the source)."""
        headers = with_idempotency_key(headers, idempotency_key)
        url = self.routes.video(video_id, "extend")
        return self.http.post(url, json=body, headers=headers).raise_for_status().json()

    def list_videos(self, limit: int = 20, after: str | None = None) -> dict:
        """``GET /v1/videos``: one page, newest first (``data``, ``has_more``, ``last_id`` for the next ``after``)."""
        params: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
        return self.http.get(self.routes.videos(), params=params).raise_for_status().json()

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

    def download(
        self,
        video_id: str,
        path: str | Path,
        on_bytes: Callable[[int, int | None], None] | None = None,
        variant: str = "video",
    ) -> int:
        """The MP4 streamed into ``path`` (written beside it as ``<path>.part``, then renamed: a failed download leaves
        no file under that name); its size. A ``.part`` left by an earlier try is resumed with a Range request (a
        finished clip never changes; the server answers 206 from where it stopped, or 200 and it starts over).
        ``on_bytes(received, total)`` sees each chunk (total None when unknown). ``variant``: the MP4 (``video``), or
        ``thumbnail`` (PNG) or ``spritesheet`` (JPEG) made from its frames."""
        path = Path(path)
        part = path.with_name(path.name + ".part")
        offset = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        params = {} if variant == "video" else {"variant": variant}
        url = self.routes.video(video_id, "content")
        with self.http.stream("GET", url, headers=headers, params=params) as response:
            if response.status_code == 416:  # the part is not a prefix of this clip (or all of it): start over
                part.unlink()
                return self.download(video_id, path, on_bytes, variant)
            response.raise_for_status()
            resumed = response.status_code == 206
            received = offset if resumed else 0
            if resumed:  # Content-Range: bytes first-last/size
                total: int | None = int(response.headers["content-range"].rsplit("/", 1)[1])
            else:
                length = response.headers.get("content-length")
                total = int(length) if length and length.isdigit() else None
            with part.open("ab" if resumed else "wb") as out:
                for chunk in response.iter_bytes():
                    out.write(chunk)
                    received += len(chunk)
                    if on_bytes is not None:
                        on_bytes(received, total)
        part.replace(path)
        return received

    def follow(self, video_id: str, last_event_id: str | None = None) -> Iterator[dict]:
        """The job's events as they happen (``{"id", "event", "data"}``), until its final one (``completed``,
        ``failed``, ``cancelled``). A stream that drops mid-job is opened again after the last id seen
        (``Last-Event-ID``), up to RECONNECTS times, so no event is missed or repeated."""
        reconnects = 0
        while True:
            headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
            try:
                with connect_sse(self.http, "GET", self.routes.video(video_id, "events"), headers=headers) as source:
                    source.response.raise_for_status()
                    for sse in source.iter_sse():
                        if not sse.data:  # the stream's `retry:` line alone, not an event
                            continue
                        if sse.id:
                            last_event_id = sse.id
                        event = {"id": sse.id or None, "event": sse.event, "data": json.loads(sse.data)}
                        yield event
                        if sse.event in FINISHED:
                            return
            except (httpx.TransportError, httpx.RemoteProtocolError):
                if reconnects >= RECONNECTS:
                    raise
            reconnects += 1  # the stream ended (or dropped) before a final event: open it again where it was
            time.sleep(min(0.5 * reconnects, 5.0))

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


class AsyncH3Client(_Client):
    """``H3Client``'s calls over one ``httpx.AsyncClient``; an async context manager that closes it."""

    HTTPX = httpx.AsyncClient
    http: httpx.AsyncClient

    async def __aenter__(self) -> AsyncH3Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.aclose()

    async def image(self, body: dict, headers: dict | None = None, idempotency_key: str | None = None) -> dict:
        headers = with_idempotency_key(headers, idempotency_key)
        return (await self.http.post(self.routes.images(), json=body, headers=headers)).raise_for_status().json()

    async def create_video(self, body: dict, headers: dict | None = None, idempotency_key: str | None = None) -> dict:
        headers = with_idempotency_key(headers, idempotency_key)
        return (await self.http.post(self.routes.videos(), json=body, headers=headers)).raise_for_status().json()

    async def remix_video(
        self, video_id: str, body: dict, headers: dict | None = None, idempotency_key: str | None = None
    ) -> dict:
        headers = with_idempotency_key(headers, idempotency_key)
        url = self.routes.video(video_id, "remix")
        return (await self.http.post(url, json=body, headers=headers)).raise_for_status().json()

    async def extend_video(
        self, video_id: str, body: dict, headers: dict | None = None, idempotency_key: str | None = None
    ) -> dict:
        headers = with_idempotency_key(headers, idempotency_key)
        url = self.routes.video(video_id, "extend")
        return (await self.http.post(url, json=body, headers=headers)).raise_for_status().json()

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
