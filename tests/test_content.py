"""A finished clip's content on its own: the Range header's parsing, the image variants made from a real MP4
(h3serve's own encoder, decoded back with PyAV), and the job store keeping them beside the MP4 and removing them
with it. The same over real HTTP: tests/test_content_http.py."""

import hashlib
import io
import uuid

import av
import numpy as np
import pytest
from PIL import Image

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.ingress.content import byte_range, matches
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from h3serve.deploy.jobs.variants import (
    SPRITE_COLUMNS,
    SPRITE_ROWS,
    sprite_indices,
    sprite_tile_size,
    spritesheet,
    thumbnail,
)
from h3serve.pipelines.h3.media import encode_mp4

FRAMES, HEIGHT, WIDTH = 13, 64, 96


@pytest.fixture(scope="module")
def mp4() -> bytes:
    """A clip whose every frame differs (a bar moving right, a brightness ramp), as the replica encodes one."""
    frames = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)  # [F, H, W, 3]
    for i in range(FRAMES):
        frames[i, :, :, 0] = 10 * i
        frames[i, :, 6 * i : 6 * i + 8, 1] = 255
    return encode_mp4(frames, fps=24)


def decoded(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.mark.parametrize(
    "header, span",
    [
        ("bytes=0-99", (0, 99)),
        ("bytes=100-", (100, 999)),
        ("bytes=-10", (990, 999)),
        ("bytes=-5000", (0, 999)),
        ("bytes=900-5000", (900, 999)),
        ("bytes=999-999", (999, 999)),
        ("bytes=5-2", None),  # last before first: ignored (the whole file)
        ("bytes=0-1,5-9", None),  # several ranges: the whole file
        ("items=0-1", None),
        ("bytes=-", None),
        ("bytes=abc", None),
    ],
)
def test_byte_range(header, span):
    assert byte_range(header, 1000) == span


@pytest.mark.parametrize("header", ["bytes=1000-", "bytes=1000-2000", "bytes=-0"])
def test_an_unsatisfiable_range_is_a_416_with_the_size(header):
    with pytest.raises(APIError) as raised:
        byte_range(header, 1000)
    assert raised.value.status == 416 and raised.value.headers == {"Content-Range": "bytes */1000"}


def test_if_none_match():
    assert matches('"a", "b"', '"b"') and matches('W/"b"', '"b"') and matches("*", '"b"')
    assert not matches("", '"b"') and not matches('"a"', '"b"')


def test_the_thumbnail_is_the_middle_frame_pixel_for_pixel(mp4):
    frames = decoded(mp4)
    image = np.asarray(Image.open(io.BytesIO(thumbnail(mp4))).convert("RGB"))
    assert np.array_equal(image, frames[len(frames) // 2])
    assert not np.array_equal(image, frames[len(frames) // 2 + 1])  # it is that frame, not any frame


def test_the_spritesheet_is_a_grid_of_evenly_spaced_frames(mp4):
    assert sprite_indices(FRAMES) == [0, 2, 3, 4, 6, 8, 9, 10, 12]
    assert sprite_indices(3) == [0, 0, 0, 1, 1, 1, 2, 2, 2]  # a short clip repeats frames
    sheet = Image.open(io.BytesIO(spritesheet(mp4)))
    tile_w, tile_h = sprite_tile_size(WIDTH, HEIGHT)
    assert sheet.format == "JPEG" and sheet.size == (SPRITE_COLUMNS * tile_w, SPRITE_ROWS * tile_h) == (288, 192)
    pixels, frames = np.asarray(sheet.convert("RGB")).astype(int), decoded(mp4)
    for slot, index in enumerate(sprite_indices(FRAMES)):  # each tile's red (the ramp) is its frame's, within JPEG's
        row, column = divmod(slot, SPRITE_COLUMNS)
        tile = pixels[row * tile_h : (row + 1) * tile_h, column * tile_w : (column + 1) * tile_w]
        assert abs(np.median(tile[..., 0]) - np.median(frames[index][..., 0])) <= 4, (slot, index)


def test_the_store_makes_each_variant_once_and_removes_it_with_the_job(tmp_path, mp4):
    store = JobStore(MediaStore(str(tmp_path)), JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=9))
    job_id = f"video_{uuid.uuid4().hex}"
    runner = store.create({"id": job_id, "object": "video", "status": "queued", "progress": 0, "created_at": 0})
    assert runner is not None and store.media(job_id) is None
    runner.complete(mp4)
    assert store.media(job_id) == (mp4, hashlib.sha256(mp4).hexdigest())
    png, digest = store.media(job_id, "thumbnail")
    assert (tmp_path / f"{job_id}.thumbnail.png").read_bytes() == png and digest == hashlib.sha256(png).hexdigest()
    (tmp_path / f"{job_id}.thumbnail.png").write_bytes(b"kept")  # the stored one is served, not made again
    assert store.media(job_id, "thumbnail")[0] == b"kept"
    store.media(job_id, "spritesheet")
    assert store.delete(job_id)
    assert not list(tmp_path.glob(f"{job_id}*"))
