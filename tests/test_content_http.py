"""``GET /v1/videos/{id}/content`` over real HTTP on the session's server (its "content" application, the default's
args): a download resumed with Range equals the whole, ETag and If-None-Match (304), If-Range, 416, the thumbnail
and the spritesheet made from the clip's decoded frames, a bad variant. The parts alone: tests/test_content.py."""

from __future__ import annotations

import hashlib
import io

import av
import numpy as np
import pytest
from PIL import Image

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
    assert names["variant"]["schema"]["enum"] == ["video", "thumbnail", "spritesheet"]
    assert {"Range", "If-Range", "If-None-Match"} <= names.keys()
    assert {"200", "206", "304", "416"} <= content["responses"].keys()
