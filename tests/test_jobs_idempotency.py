"""Idempotency-Key on its own: a real store directory (and fsspec's memory://), several 'ingress replicas', the
request bodies as the routes validate them (JSON or a multipart form: one fingerprint)."""

import asyncio
import concurrent.futures
import io as bytes_io
import json
import uuid

import httpx
import pytest
from PIL import Image

from h3serve.deploy.common.args import RequestLimits
from h3serve.deploy.common.errors import APIError
from h3serve.deploy.ingress.bodies import ImagesBody, VideosBody, parse_body
from h3serve.deploy.jobs.idempotency import PENDING_S, Idempotency, fingerprint, key_of
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.model_server.h3_replica import unique_id
from tests.test_jobs_store import Clock  # a clock the test moves

WINDOW_S = 3600
UPLOADS = ("input_reference", "last_reference")


def parsed(model, fields: dict, files: dict | None = None):
    """The body as the route validates it: JSON, or a multipart form when there are files."""
    if files is None:
        headers, raw = {"content-type": "application/json"}, json.dumps(fields).encode()
    else:
        form = httpx.Request("POST", "http://h3", data={k: str(v) for k, v in fields.items()}, files=files)
        headers, raw = form.headers, form.read()
    return asyncio.run(parse_body(headers, raw, model, UPLOADS if model is VideosBody else (), RequestLimits(), []))


def png(color: str) -> bytes:
    out = bytes_io.BytesIO()
    Image.new("RGB", (32, 32), color).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(params=["dir", "memory"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "videos") if request.param == "dir" else f"memory://h3serve-idem-{uuid.uuid4().hex}"


def ingresses(url: str, n: int = 2) -> tuple[Clock, list[Idempotency]]:
    clock = Clock()
    return clock, [Idempotency(MediaStore(url), WINDOW_S, clock) for _ in range(n)]


async def io(fn, *args):
    return fn(*args)


async def post(keys: Idempotency, headers: dict, body, answer: dict, route: str = "videos") -> dict:
    """What a route does: the replay, or its own answer (kept for the retries)."""
    async with keys.use(io, headers, route, body) as once:
        if once.replay is not None:
            return once.replay
        once.response = answer
    return once.response


def test_a_retried_post_gets_the_first_answer_on_any_ingress_and_another_body_is_a_422(url):
    clock, (a, b) = ingresses(url)
    body = parsed(VideosBody, {"prompt": "a red circle", "seconds": 2})
    first = asyncio.run(post(a, {"idempotency-key": "k-1"}, body, {"id": "video_1"}))
    again = asyncio.run(
        post(b, {"idempotency-key": "k-1"}, parsed(VideosBody, {"seconds": 2.0, "prompt": "a red circle"}), {"id": "2"})
    )
    assert first == again == {"id": "video_1"}  # the other replica answers the retry with the first job
    with pytest.raises(APIError) as refused:
        asyncio.run(post(b, {"idempotency-key": "k-1"}, parsed(VideosBody, {"prompt": "blue"}), {"id": "3"}))
    assert (refused.value.status, refused.value.param) == (422, "Idempotency-Key")
    # the same key on the other route is another key; no key: nothing kept
    assert asyncio.run(
        post(b, {"idempotency-key": "k-1"}, parsed(ImagesBody, {"prompt": "x"}), {"i": 1}, "images")
    ) == {"i": 1}
    assert asyncio.run(post(a, {}, body, {"id": "video_4"})) == {"id": "video_4"}
    clock.now += WINDOW_S + 1  # past the window the key is new again
    assert asyncio.run(post(b, {"idempotency-key": "k-1"}, body, {"id": "video_5"})) == {"id": "video_5"}
    clock.now += WINDOW_S + PENDING_S + 1
    a.sweep()
    assert not [n for n in MediaStore(url).names() if n.startswith("idem_")]


def test_uploads_count_by_their_bytes_and_a_refused_request_frees_its_key(url):
    _, (a, b) = ingresses(url)
    with_png = parsed(VideosBody, {"prompt": "p"}, {"input_reference": ("a.png", png("red"), "image/png")})
    renamed = parsed(VideosBody, {"prompt": "p"}, {"input_reference": ("b.png", png("red"), "image/png")})
    other_png = parsed(VideosBody, {"prompt": "p"}, {"input_reference": ("a.png", png("blue"), "image/png")})
    assert fingerprint("videos", with_png) == fingerprint("videos", renamed)  # a new boundary, another file name
    assert fingerprint("videos", with_png) != fingerprint("videos", other_png)

    async def refused():
        async with a.use(io, {"idempotency-key": "k-2"}, "videos", with_png):
            raise APIError(503, "the queue is full; retry later")

    with pytest.raises(APIError):
        asyncio.run(refused())
    # nothing was answered: the retry runs (and may carry another body, as nothing was kept)
    assert asyncio.run(post(b, {"idempotency-key": "k-2"}, other_png, {"id": "video_9"})) == {"id": "video_9"}


def test_a_retry_while_the_first_runs_is_a_409_and_a_dead_requests_key_is_taken_over(url):
    clock, (a, b) = ingresses(url)
    body = parsed(ImagesBody, {"prompt": "a bell"})
    assert a.begin("images", "k-3", fingerprint("images", body)) is None  # pending: its request runs
    with pytest.raises(APIError) as busy:
        b.begin("images", "k-3", fingerprint("images", body))
    assert busy.value.status == 409 and busy.value.headers == {"Retry-After": "1"}
    clock.now += PENDING_S + 1  # its ingress died mid-request: the key is free again
    assert b.begin("images", "k-3", fingerprint("images", body)) is None


def test_one_key_sent_at_once_from_many_threads_is_taken_by_one(tmp_path):
    """On a directory the key is taken by an exclusive create: one request runs, the others get 409."""
    _, keys = ingresses(str(tmp_path / "videos"), n=8)
    digest = fingerprint("videos", parsed(VideosBody, {"prompt": "p"}))

    def take(k: Idempotency) -> str:
        try:
            return "ran" if k.begin("videos", "k-4", digest) is None else "replayed"
        except APIError as e:
            return str(e.status)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = sorted(pool.map(take, keys))
    assert outcomes == ["409"] * 7 + ["ran"], outcomes


def test_a_malformed_key_is_a_400_naming_the_header():
    assert key_of({}) is None and key_of({"idempotency-key": "a" * 255}) == "a" * 255
    for bad in ("", "a" * 256, "has space", "é"):
        with pytest.raises(APIError) as refused:
            key_of({"idempotency-key": bad})
        assert (refused.value.status, refused.value.param) == (400, "Idempotency-Key")


def test_two_requests_with_one_request_id_keep_their_own_tickets():
    serving = {"client-id": object()}
    assert unique_id("client-id", serving) == "client-id~2"
    serving["client-id~2"] = object()
    assert unique_id("client-id", serving) == "client-id~3"
    assert unique_id("other", serving) == "other" and unique_id(None, serving) is None
