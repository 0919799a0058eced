"""``GET /v1/videos/{id}/content``'s answer as HTTP caches and resuming downloaders expect it (RFC 9110).

A strong ``ETag`` (the file's sha256), ``If-None-Match`` answered 304, ``Accept-Ranges: bytes``, one ``Range``
answered 206 with ``Content-Range`` (``If-Range`` with the current ETag, else the whole file), an unsatisfiable range
416 with ``Content-Range: bytes */size``. A Range that does not parse, another unit, or several ranges get the whole
file (200): RFC 9110 lets a server ignore Range, and a multipart answer buys a video player nothing. ``?variant=``
picks the MP4 or an image made from its frames (``h3serve.deploy.jobs.variants``).

While the job decodes, the video is its fragmented MP4 as the decode makes it (``streamed``:
``h3serve.deploy.jobs.live``; from memory on the ingress replica running the job, from the job store on the others),
from its first byte: no length, ETag or ranges yet (the bytes are not
all known), and not cached. A stream cut short (the job failed, was cancelled) raises in the response's body
(``StreamBroken``) rather than ending it as a whole one.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from h3serve.deploy.common.errors import RETRY_AFTER_S, APIError
from h3serve.deploy.jobs.variants import VARIANTS

RANGE = re.compile(r"bytes=(\d*)-(\d*)")
# a finished clip never changes, but it expires and is another tenant's business: only the caller's own cache keeps it
CACHE_CONTROL = "private, max-age=3600"


def variant_of(request: Request) -> str:
    """``?variant=`` (default video); anything else is a 400 naming the field and the values it takes."""
    variant = request.query_params.get("variant", "video")
    if variant not in VARIANTS:
        allowed = ", ".join(VARIANTS)
        raise APIError(400, f"variant: {variant[:40]!r} is not one of {allowed}", "variant")
    return variant


def not_ready(video: dict, variant: str) -> APIError:
    """409 for a job that is not completed. An unfinished one's says when to come back (``Retry-After``): its video
    streams from its ``decoding`` event on, from any ingress replica (the one running it from memory, the others from
    the job store).
    """
    video_id, status = video["id"], video["status"]
    if status in ("completed", "failed", "cancelled") or variant != "video":
        return APIError(409, f"video {video_id} is {status}, not completed", "video_id")
    where = "it streams from its decoding event on; retry then"
    return APIError(
        409, f"video {video_id} is {status}, not completed: {where}", "video_id", headers={"Retry-After": RETRY_AFTER_S}
    )


def missing(video: dict, variant: str) -> APIError:
    """Why a completed job has no ``variant``: removed (TTL, byte cap, DELETE) since its record was read, or, for
    ``joined``, never made (not an extension asked with ``join: true``, or its source was removed before it
    completed)."""
    video_id = video["id"]
    if variant == "joined" and not video.get("join"):
        why = "its source was removed before it completed" if "join" in video else "it is not an extend with join"
        return APIError(404, f"video {video_id} has no joined clip: {why}", "variant")
    return APIError(404, f"video {video_id} has expired", "video_id")


def etag(digest: str) -> str:
    return f'"{digest}"'


def matches(header: str, tag: str) -> bool:
    """Whether an If-None-Match list names ``tag`` (weak comparison, as RFC 9110 asks for it) or is ``*``."""
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or tag in tags


def byte_range(header: str, size: int) -> tuple[int, int] | None:
    """The inclusive (first, last) byte of a single ``bytes=`` range over ``size`` bytes; None to send the whole
    file (no usable range); a 416 APIError when it is well-formed but starts past the end (or asks for 0 bytes)."""
    found = RANGE.fullmatch(header.strip().replace(" ", ""))
    if found is None or found.groups() == ("", ""):
        return None
    first, last = found.groups()
    if first == "":  # bytes=-N: the last N bytes
        length = int(last)
        if length == 0:
            raise unsatisfiable(header, size)
        return max(size - length, 0), size - 1
    start = int(first)
    end = size - 1 if last == "" else min(int(last), size - 1)
    if last != "" and int(last) < start:
        return None  # invalid (last before first): ignored, as RFC 9110 says
    if start >= size:
        raise unsatisfiable(header, size)
    return start, end


def unsatisfiable(header: str, size: int) -> APIError:
    return APIError(
        416,
        f"Range {header[:60]!r} is past the end of the {size} bytes of this content",
        "Range",
        headers={"Content-Range": f"bytes */{size}"},
    )


def answer(request: Request, data: bytes, digest: str, variant: str) -> Response:
    """``data`` (sha256 ``digest``) as 200, 206 or 304, as the request's conditional and Range headers ask."""
    tag, media_type = etag(digest), VARIANTS[variant][1]
    headers = {"ETag": tag, "Accept-Ranges": "bytes", "Cache-Control": CACHE_CONTROL}
    if matches(request.headers.get("if-none-match", ""), tag):
        return Response(status_code=304, headers=headers)
    asked = request.headers.get("range")
    if_range = request.headers.get("if-range")
    if asked is None or (if_range is not None and if_range.strip() != tag):  # If-Range: strong comparison only
        return Response(data, media_type=media_type, headers=headers)
    span = byte_range(asked, len(data))
    if span is None:
        return Response(data, media_type=media_type, headers=headers)
    first, last = span
    headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
    return Response(data[first : last + 1], status_code=206, media_type=media_type, headers=headers)


def streamed(chunks: AsyncIterator[bytes], replica: str) -> StreamingResponse:
    """The decoding clip's fragmented MP4 from its first byte, each run as it comes (``LiveClip.read`` on the job's
    runner, ``follow_stored`` on another ingress replica: the same bytes). ``X-H3serve-Replica`` names the ingress
    replica that answers (an operator's, and a test's, way to tell which one Serve's proxy picked)."""
    headers = {
        "Cache-Control": "no-store",
        "Accept-Ranges": "none",
        "X-H3serve-Stream": "fragmented-mp4",
        "X-H3serve-Replica": replica,
    }
    return StreamingResponse(chunks, media_type=VARIANTS["video"][1], headers=headers)
