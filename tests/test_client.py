"""The client library's transport behaviour over real HTTP, no Ray: 429/503 retried as the server asks (Retry-After)
with one Idempotency-Key, other errors not retried, an event stream that drops reconnected after its last id.

The server here is a small ``http.server`` on 127.0.0.1 scripted per test (the refusals and drops a busy h3serve or
a proxy produces, on demand); the client is the library's own, unchanged."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from h3serve.client import H3Client
from h3serve.client.http import IDEMPOTENCY_HEADER

Reply = Callable[[BaseHTTPRequestHandler, int], None]  # (handler, index of the request) -> writes the answer


@contextmanager
def scripted(reply: Reply) -> Iterator[tuple[str, list[dict]]]:
    """A server answering each request with ``reply``; (its URL, the requests seen: method, path, headers)."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _any(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body})
            reply(self, len(seen) - 1)

        do_GET = do_POST = do_DELETE = _any

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def answer(handler: BaseHTTPRequestHandler, status: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    for name, value in {"content-type": "application/json", **(headers or {})}.items():
        handler.send_header(name, value)
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def refusal(status: int) -> dict:
    return {"error": {"message": "busy", "type": "server_error", "param": None, "code": str(status)}}


def test_a_refused_create_is_retried_after_retry_after_with_one_idempotency_key():
    def reply(handler, i):
        if i < 2:  # a full queue, then a replica still loading: both say when to come back
            status = (429, 503)[i]
            answer(handler, status, refusal(status), {"Retry-After": "1"})
        else:
            answer(handler, 200, {"id": "video_1", "status": "queued"})

    with scripted(reply) as (url, seen), H3Client(url, timeout=10) as api:
        start = time.monotonic()
        job = api.create_video({"prompt": "a red circle"})
        waited = time.monotonic() - start
    assert job["id"] == "video_1"
    assert [r["method"] for r in seen] == ["POST"] * 3
    keys = {r["headers"][IDEMPOTENCY_HEADER] for r in seen}
    assert len(keys) == 1 and len(keys.pop()) == 32, "every try carries the same key: a retried create is one job"
    assert waited >= 2.0, f"Retry-After: 1 twice was not honoured ({waited:.2f} s)"
    assert all(json.loads(r["body"]) == {"prompt": "a red circle"} for r in seen)


def test_a_bad_request_is_not_retried_and_a_caller_key_is_kept():
    def reply(handler, i):
        answer(handler, 400, refusal(400))

    with scripted(reply) as (url, seen), H3Client(url, timeout=10) as api:
        with pytest.raises(httpx.HTTPStatusError) as raised:
            api.create_video({"prompt": "x"}, idempotency_key="my-key-1")
    assert raised.value.response.status_code == 400
    assert len(seen) == 1 and seen[0]["headers"][IDEMPOTENCY_HEADER] == "my-key-1"


def test_retries_run_out_and_zero_means_once():
    def reply(handler, i):
        answer(handler, 503, refusal(503), {"Retry-After": "0"})

    with scripted(reply) as (url, seen):
        with H3Client(url, timeout=10, retries=2) as api, pytest.raises(httpx.HTTPStatusError):
            api.video("video_1")
        assert len(seen) == 3  # the call and two retries
        with H3Client(url, timeout=10, retries=0) as api, pytest.raises(httpx.HTTPStatusError):
            api.video("video_1")
        assert len(seen) == 4


def test_the_api_key_is_a_bearer_token():
    def reply(handler, i):
        answer(handler, 200, {"object": "list", "data": [], "has_more": False})

    with scripted(reply) as (url, seen), H3Client(url, timeout=10, api_key="k-123") as api:
        assert api.list_videos(limit=5, after="video_9")["data"] == []
    assert seen[0]["headers"]["Authorization"] == "Bearer k-123"
    assert seen[0]["path"] == "/v1/videos?limit=5&after=video_9"


def sse(handler: BaseHTTPRequestHandler, events: list[tuple[str | None, str, dict]]) -> None:
    """An event stream that sends ``events`` and closes (mid-job when the last is not final: a dropped stream)."""
    handler.send_response(200)
    handler.send_header("content-type", "text/event-stream")
    handler.end_headers()
    for event_id, kind, data in events:
        head = f"id: {event_id}\n" if event_id else ""
        handler.wfile.write(f"{head}event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        handler.wfile.flush()
    handler.close_connection = True


def test_a_dropped_event_stream_resumes_after_its_last_id():
    def reply(handler, i):
        if i == 0:
            sse(handler, [("1", "queued", {"position": 0}), ("2", "step", {"progress": [1, 3]})])
        else:
            sse(handler, [("3", "step", {"progress": [2, 3]}), ("4", "completed", {"status": "completed"})])

    with scripted(reply) as (url, seen), H3Client(url, timeout=10) as api:
        events = list(api.follow("video_1"))
    kinds = [(e["id"], e["event"]) for e in events]
    assert kinds == [("1", "queued"), ("2", "step"), ("3", "step"), ("4", "completed")]
    assert "Last-Event-ID" not in seen[0]["headers"] and seen[1]["headers"]["Last-Event-ID"] == "2"
    assert all(r["path"] == "/v1/videos/video_1/events" for r in seen)
