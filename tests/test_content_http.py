"""``GET /v1/videos/{id}/content`` over real HTTP on the session's server (its "content" application, the default's
args): a download resumed with Range equals the whole, ETag and If-None-Match (304), If-Range, 416, the thumbnail
and the spritesheet made from the clip's decoded frames, a bad variant; while a job decodes, its fragmented MP4
streamed and played as it arrives (issue 58). The parts alone: tests/test_content.py."""

from __future__ import annotations

import hashlib
import io
import threading
import time

import av
import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks.stream_decode import Arriving
from h3serve.client import H3Client
from h3serve.deploy.jobs.variants import SPRITE_COLUMNS, SPRITE_ROWS, sprite_tile_size

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


@pytest.fixture(scope="module")
def clip(server):
    """A finished job of the default's smallest clip: (its id, its MP4 as one plain GET returns it)."""
    with H3Client(server.url) as api:
        job = api.wait_video(api.create_video({"prompt": "a red circle", "num_inference_steps": 2})["id"])
        assert job["status"] == "completed", job
        yield job["id"], api.content(job["id"])
        api.delete(job["id"])


def test_ranges_resume_a_download_and_etags_revalidate_it(server, clip, tmp_path):
    video_id, mp4 = clip
    url = f"/v1/videos/{video_id}/content"
    with H3Client(server.url) as api:
        whole = api.http.get(url)
        tag = whole.headers["etag"]
        assert whole.status_code == 200 and whole.content == mp4 and whole.headers["accept-ranges"] == "bytes"
        assert tag == f'"{hashlib.sha256(mp4).hexdigest()}"'  # strong: the file's digest

        half = len(mp4) // 2
        first = api.http.get(url, headers={"Range": f"bytes=0-{half - 1}"})
        rest = api.http.get(url, headers={"Range": f"bytes={half}-", "If-Range": tag})
        assert (first.status_code, rest.status_code) == (206, 206)
        assert first.headers["content-range"] == f"bytes 0-{half - 1}/{len(mp4)}"
        assert rest.headers["content-range"] == f"bytes {half}-{len(mp4) - 1}/{len(mp4)}"
        assert first.content + rest.content == mp4
        tail = api.http.get(url, headers={"Range": "bytes=-100"})
        assert tail.status_code == 206 and tail.content == mp4[-100:]

        stale = api.http.get(url, headers={"Range": f"bytes={half}-", "If-Range": '"another"'})
        assert stale.status_code == 200 and stale.content == mp4  # the partial began on other bytes: all of it

        past = api.http.get(url, headers={"Range": f"bytes={len(mp4)}-"})
        assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(mp4)}"
        assert past.json()["error"]["param"] == "Range"

        cached = api.http.get(url, headers={"If-None-Match": tag})
        assert cached.status_code == 304 and cached.content == b"" and cached.headers["etag"] == tag

        # the client resumes a .part left by a dropped download
        out = tmp_path / "clip.mp4"
        (tmp_path / "clip.mp4.part").write_bytes(mp4[:half])
        seen: list[tuple[int, int | None]] = []
        assert api.download(video_id, out, lambda got, total: seen.append((got, total))) == len(mp4)
        assert out.read_bytes() == mp4 and seen[0][0] > half and seen[-1] == (len(mp4), len(mp4))


def decoded(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def audio_packets(mp4: bytes) -> list[bytes]:
    with av.open(io.BytesIO(mp4)) as container:
        return [bytes(packet) for packet in container.demux(audio=0) if packet.size]


def test_the_thumbnail_and_spritesheet_are_the_clips_frames(server, clip, tmp_path):
    video_id, mp4 = clip
    frames = decoded(mp4)
    with H3Client(server.url) as api:
        thumb = api.http.get(f"/v1/videos/{video_id}/content", params={"variant": "thumbnail"})
        assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/png"
        image = np.asarray(Image.open(io.BytesIO(thumb.content)).convert("RGB"))
        assert np.array_equal(image, frames[len(frames) // 2])  # the decoded middle frame, not the preview map
        again = api.http.get(f"/v1/videos/{video_id}/content?variant=thumbnail", headers={"Range": "bytes=0-9"})
        assert again.status_code == 206 and again.content == thumb.content[:10]  # made once, the same bytes
        assert again.headers["etag"] == thumb.headers["etag"] != f'"{hashlib.sha256(mp4).hexdigest()}"'

        out = tmp_path / "thumb.png"  # the client's download, a variant of the clip
        assert api.download(video_id, out, variant="thumbnail") == len(thumb.content)
        assert out.read_bytes() == thumb.content

        sheet = api.http.get(f"/v1/videos/{video_id}/content?variant=spritesheet")
        assert sheet.status_code == 200 and sheet.headers["content-type"] == "image/jpeg"
        height, width, _ = frames[0].shape
        tile_w, tile_h = sprite_tile_size(width, height)
        assert Image.open(io.BytesIO(sheet.content)).size == (SPRITE_COLUMNS * tile_w, SPRITE_ROWS * tile_h)

        bad = api.http.get(f"/v1/videos/{video_id}/content?variant=poster")
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["param"] == "variant", error
        assert all(v in error["message"] for v in ("video", "thumbnail", "spritesheet")), error


def test_the_openapi_document_names_the_variants_and_range(server):
    with H3Client(server.url) as api:
        doc = api.http.get("/openapi.json").raise_for_status().json()
    content = doc["paths"]["/v1/videos/{video_id}/content"]["get"]
    names = {p["name"]: p for p in content["parameters"]}
    assert names["variant"]["schema"]["enum"] == ["video", "thumbnail", "spritesheet", "joined"]
    assert {"Range", "If-Range", "If-None-Match"} <= names.keys()
    assert {"200", "206", "304", "416"} <= content["responses"].keys()


def test_a_decoding_clip_streams_as_a_fragmented_mp4_that_plays_before_the_job_completes(server):
    """GET content while the job decodes: a fragmented MP4 parsed by PyAV as it arrives, frames decoded from it before
    the job is completed, and all of them the finished clip's frames (its sound the same AAC packets)."""
    with H3Client(server.url) as api:
        video_id = api.create_video({"prompt": "a blue square moving right", "num_inference_steps": 2, "seconds": 14})[
            "id"
        ]
        for event in api.follow(video_id):  # the stream opens once the job decodes
            assert event["event"] not in ("completed", "failed", "cancelled"), event
            if event["event"] == "decoding":
                break
        done_at: list[float] = []

        def watch() -> None:  # when the record first reads completed
            with H3Client(server.url) as poller:
                poller.wait_video(video_id, poll_s=0.02)
                done_at.append(time.monotonic())

        arriving, frames = Arriving(), []

        def parse() -> None:
            with av.open(arriving, "r", format="mp4") as container:
                for frame in container.decode(video=0):
                    frames.append((time.monotonic(), frame.to_ndarray(format="rgb24")))

        threads = [threading.Thread(target=watch), threading.Thread(target=parse)]
        for thread in threads:
            thread.start()
        received: list[tuple[float, bytes]] = []
        with api.http.stream("GET", f"/v1/videos/{video_id}/content") as response:
            assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
            assert response.headers["x-h3serve-stream"] == "fragmented-mp4" and "content-length" not in response.headers
            for chunk in response.iter_bytes():
                received.append((time.monotonic(), chunk))
                arriving.chunks.put(chunk)
        arriving.chunks.put(None)
        for thread in threads:
            thread.join(timeout=120)
        assert done_at, "the job never completed"
        before = [len(chunk) for at, chunk in received if at < done_at[0]]
        assert len(before) >= 2, (before, len(received))  # chunks arrived while it still decoded
        assert frames and frames[0][0] < done_at[0]  # and PyAV made frames of them before the job completed

        finished = api.content(video_id)  # the completed job's MP4
        whole = decoded(finished)
        assert len(frames) == len(whole) > 10 * 24
        assert all(np.array_equal(got, want) for (_, got), want in zip(frames, whole, strict=True))  # frame-exact
        assert audio_packets(b"".join(chunk for _, chunk in received)) == audio_packets(finished)
        api.delete(video_id)


def test_an_unfinished_job_not_decoding_yet_answers_409_with_retry_after(server):
    """Before its decode streams, a job's content is a 409 that says when to come back (Retry-After), not a bare
    refusal; once it finished unsuccessfully, a plain 409."""
    with H3Client(server.url) as api:
        video_id = api.create_video({"prompt": "not yet", "num_inference_steps": 50, "seconds": 14})["id"]
        early = api.http.get(f"/v1/videos/{video_id}/content")
        error = early.json()["error"]
        assert early.status_code == 409 and early.headers["retry-after"] == "2", early.text
        assert error["param"] == "video_id" and "streams from its decoding event on" in error["message"]
        assert api.cancel(video_id)["status"] == "cancelled"
        late = api.http.get(f"/v1/videos/{video_id}/content")
        assert late.status_code == 409 and "retry-after" not in late.headers, late.text
        api.delete(video_id)


def test_a_stream_cut_short_by_a_cancel_is_aborted_not_ended_and_the_job_says_why(server):
    """A client reading the stream when the job is cancelled mid-decode: the chunked body is aborted (httpx's
    RemoteProtocolError, no terminating chunk: a player does not take the bytes for the whole file), those bytes hold
    fewer frames than the clip, and the job reads cancelled. The cancel is sent after the first bytes; a decode that
    finished first (the tiny model's 14 s clip decodes in about half a second) ended its stream whole and the job
    completed: then a new job tries again, at most three times."""
    with H3Client(server.url) as api:
        for _ in range(3):
            video_id = api.create_video({"prompt": "a cut short", "num_inference_steps": 2, "seconds": 14})["id"]
            for event in api.follow(video_id):
                assert event["event"] not in ("completed", "failed", "cancelled"), event
                if event["event"] == "decoding":
                    break
            received: list[bytes] = []
            cancel: list[int] = []
            aborted: httpx.RemoteProtocolError | None = None
            try:
                with api.http.stream("GET", f"/v1/videos/{video_id}/content") as response:
                    assert response.headers["x-h3serve-stream"] == "fragmented-mp4", response.headers
                    for chunk in response.iter_bytes():
                        received.append(chunk)
                        if not cancel:  # the first bytes are here: the clip decodes
                            cancel.append(api.http.post(f"/v1/videos/{video_id}/cancel").status_code)
            except httpx.RemoteProtocolError as e:
                aborted = e
            job = api.wait_video(video_id)
            if job["status"] == "completed":  # the decode won the race: its stream ended whole
                assert aborted is None and cancel == [409], (aborted, cancel)
                assert len(decoded(b"".join(received))) == round(float(job["seconds"]) * 24)
                api.delete(video_id)
                continue
            assert job["status"] == "cancelled" and cancel == [200], (job, cancel)
            assert aborted is not None and "incomplete chunked read" in str(aborted), aborted
            assert len(received_frames(b"".join(received))) < round(float(job["seconds"]) * 24)  # not the whole
            api.delete(video_id)
            return
        pytest.fail("the decode finished before the cancel three times")


def received_frames(data: bytes) -> list:
    """The frames PyAV decodes from a stream's bytes as far as they go (a cut one ends mid-fragment)."""
    frames = []
    try:
        with av.open(io.BytesIO(data), "r", format="mp4") as container:
            for frame in container.decode(video=0):
                frames.append(frame)
    except av.FFmpegError:
        pass
    return frames
