"""The default config, served by `h3serve serve` and used over real HTTP and the openai client, as a user would.

The tiny MiniMax-H3 makes what the released model makes, smaller: clips of 5 to ~14.4 s at 24 fps in
17n+5 frames, on a 128x64 canvas, with stereo AAC at its audio VAE's 8 kHz; an image is the middle
frame of the shortest clip (124 frames, 5.17 s).
"""

import base64
import io
import json

import av
import numpy as np
import openai
import pytest
from PIL import Image
from ray import serve

from h3serve.pipelines.h3.media import probe_media
from tests.harness import (
    client,
    error_of,
    finished_video,
    wait_for,
    wait_video,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
MODEL = "minimax-h3-tiny"
SHORTEST = 124  # frames: 17 * 7 + 5, the first 17n+5 count of at least 5 s at 24 fps


@pytest.fixture(scope="module")
def server(served):
    """The embedded default, at /default with a job store of its own (``served_apps``: application "default")."""
    with served.module(__name__) as app:
        yield app


@pytest.fixture()
def api(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def decode_frames(mp4: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(mp4)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def assert_clip(mp4: bytes, frames: int) -> None:
    info = probe_media(mp4)
    assert (info.container, info.video_codec, info.width, info.height) == ("mp4", "h264", 128, 64)
    assert (info.fps, info.frames) == (24.0, frames)
    assert info.duration_s == pytest.approx(frames / 24, abs=1e-3)
    assert (info.audio_codec, info.audio_sample_rate, info.audio_channels) == ("aac", 8000, 2)
    assert info.audio_duration_s == pytest.approx(frames / 24, abs=0.05)


def test_openai_client_gets_pngs_of_the_requested_size(api):
    result = api.images.generate(
        model=MODEL,
        prompt="a lighthouse at dusk",
        size="64x64",
        response_format="b64_json",
        n=2,
        extra_body={"seed": 3, "num_inference_steps": 4},
    )
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    assert [(i.format, i.size) for i in images] == [("PNG", (64, 64))] * 2
    assert images[0].tobytes() != images[1].tobytes()  # n images use seeds 3 and 4
    assert [m.id for m in api.models.list()] == [MODEL]


def test_plain_http_like_curl(server):
    with client(server.url) as http:
        response = http.post("/v1/images/generations", json={"prompt": "a red fox", "num_inference_steps": 2})
        assert response.status_code == 200, response.text
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(png)).size == (128, 64)  # no size: the model's own canvas
        assert http.get("/health").json() == {"status": "ok", "model": MODEL, "backend": "torch_sdpa"}


def test_an_image_is_the_middle_frame_of_the_shortest_clip(server):
    same = {"prompt": "a red square moving right", "seed": 5, "num_inference_steps": 8}
    with client(server.url) as http:
        png = base64.b64decode(http.post("/v1/images/generations", json=same).json()["data"][0]["b64_json"])
        video = http.post("/v1/videos", json=same).json()  # no seconds: the shortest clip
        assert video["seconds"] == f"{SHORTEST / 24:g}" and video["size"] == "128x64"
        assert wait_video(http, video["id"])["status"] == "completed"
        frames = decode_frames(http.get(f"/v1/videos/{video['id']}/content").content)
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32)
    errors = [np.abs(frame.astype(np.float32) - image).mean() for frame in frames]
    assert len(frames) == SHORTEST
    # H.264 is lossy, and neighbouring frames of the trained model's slow motion differ by less than its error: the
    # still is the closest frame to within that error, and far from the clip's ends (the square crosses the canvas)
    middle = errors[SHORTEST // 2]
    assert middle <= min(errors) + 0.1 and min(errors[0], errors[-1]) > middle + 5, errors


def test_video_job_lifecycle_down_to_a_playable_mp4_with_stereo_audio(server):
    with client(server.url) as http:
        created = http.post(
            "/v1/videos",
            json={"prompt": "waves on a beach", "seconds": 5, "size": "128x64", "num_inference_steps": 6, "seed": 1},
        )
        assert created.status_code == 200, created.text
        job = created.json()
        assert (job["object"], job["model"], job["status"], job["progress"]) == ("video", MODEL, "queued", 0)
        assert (job["seconds"], job["size"]) == ("5.16667", "128x64")  # 5 s rounds up to 124 frames
        done = wait_video(http, job["id"])
        assert (done["status"], done["progress"], done["error"]) == ("completed", 100, None)
        assert done["seen"] == sorted(done["seen"])  # progress never goes back
        content = http.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        assert_clip(content.content, SHORTEST)
        assert job["id"] in [v["id"] for v in http.get("/v1/videos").json()["data"]]
        deleted = http.delete(f"/v1/videos/{job['id']}")
        assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
            assert error_of(http.request(method, f"/v1/videos/{job['id']}{path}"), 404)["param"] == "video_id"


def test_openai_client_creates_retrieves_and_downloads_a_video(api, server):
    video = api.videos.create(prompt="a train", seconds="8", size="128x64", extra_body={"num_inference_steps": 2})
    assert (video.status, video.seconds, video.size) == ("queued", "8", "128x64")  # 8 s is 192 = 17 * 11 + 5
    assert finished_video(api, video.id).status == "completed"
    assert_clip(api.videos.download_content(video.id).read(), 192)
    paged = [v.id for v in api.videos.list(limit=1)]  # one per page: the client follows last_id and has_more
    assert video.id in paged and paged == [v.id for v in api.videos.list(limit=100).data]


def test_deleting_a_running_job_takes_it_out_of_the_engine(server):
    replica = serve.get_deployment_handle("H3Replica", app_name=server.name)
    with client(server.url) as http:
        job = http.post("/v1/videos", json={"prompt": "long", "seconds": 14, "num_inference_steps": 50}).json()
        wait_for(
            lambda: http.get(f"/v1/videos/{job['id']}").json()["progress"] > 0,
            timeout=60,
            interval=0.1,
            what="progress",
        )
        early = error_of(http.get(f"/v1/videos/{job['id']}/content"), 409)
        assert "in_progress, not completed" in early["message"]
        assert http.delete(f"/v1/videos/{job['id']}").status_code == 200
        error_of(http.get(f"/v1/videos/{job['id']}"), 404)

    def idle():
        info = replica.diagnostics.remote().result()
        return (info["waiting"], info["active"]) == (0, 0)

    wait_for(idle, timeout=20, interval=0.2, what="the engine to drop the deleted job")


IMAGE_ERRORS = [  # body, status, param, words in the message
    ({"prompt": "x", "size": "abc"}, 400, "size", "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "100x64"}, 400, "size", "multiples of 32"),
    ({"prompt": "x", "size": "256x256"}, 400, "size", "larger than the model's canvas"),
    ({"prompt": "x", "size": "4096x4096"}, 400, "size", "this server allows"),
    ({"prompt": "x", "n": 9}, 400, "n", "n=9 exceeds"),
    ({"prompt": "x", "n": 0}, 400, "n", "n: Input should be greater than or equal to 1"),
    ({"prompt": "x" * 4001}, 400, "prompt", "4001 characters"),
    ({"prompt": "   "}, 400, "prompt", "blank"),
    ({"size": "64x64"}, 400, "prompt", "prompt: Field required"),
    ({"prompt": "x", "num_inference_steps": 500}, 400, "num_inference_steps", "exceeds this server's limit"),
    ({"prompt": "x", "num_inference_steps": 1}, 400, "num_inference_steps", "greater than or equal to 2"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format", "b64_json"),
    ({"prompt": "x", "model": "dall-e-3"}, 400, "model", "'dall-e-3' is not served here; valid ids: minimax-h3-tiny"),
    ({"prompt": "x", "seed": -1}, 400, "seed", "seed: Input should be greater than or equal to 0"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed", "seed: must be at most 9223372036854775806 with n=2"),
    ({"prompt": "x", "seed": 2**63}, 400, "seed", "less than or equal to 9223372036854775807"),
    ({"prompt": "x", "timeout_s": 3601}, 400, "timeout_s", "timeout_s=3601 exceeds this server's limit of 3600"),
    ({"prompt": "x", "timeout_s": 0}, 400, "timeout_s", "greater than 0"),
    ({"prompt": "x", "guidance_scale": 5.0}, 400, "guidance_scale", "guidance-distilled"),
    ({"prompt": "x", "negative_prompt": "blur"}, 400, "negative_prompt", "guidance-distilled"),
]


@pytest.mark.parametrize("body,status,param,words", IMAGE_ERRORS, ids=[str(b) for b, *_ in IMAGE_ERRORS])
def test_bad_image_requests_get_4xx_naming_the_field(server, body, status, param, words):
    with client(server.url) as http:
        error = error_of(http.post("/v1/images/generations", json=body), status)
    assert error["param"] == param
    assert words in error["message"]


VIDEO_ERRORS = [
    ({"prompt": "x", "seconds": 100}, "seconds", "exceeds this server's limit of 15"),
    ({"prompt": "x", "seconds": 2}, "seconds", "outside what the model generates: 5.16667 to 14.375 s"),
    ({"prompt": "x", "seconds": 14.9}, "seconds", "outside what the model generates"),  # under the server's 15
    ({"prompt": "x", "seconds": 0}, "seconds", "positive number"),
    ({"prompt": "x", "seconds": "four"}, "seconds", "seconds: Input should be a valid number"),
    ({"prompt": "x", "fps": 8}, "fps", "fixed 24 fps"),
    ({"prompt": "x", "size": "7x7"}, "size", "multiples of 32"),
    ({"prompt": "x", "guidance_scale": 1.0}, "guidance_scale", "takes no guidance_scale"),
    ({"prompt": "x", "input_reference": "not base64!"}, "input_reference", "base64"),
    ({"prompt": "x", "timeout_s": "later"}, "timeout_s", "valid number"),
    ({"prompt": "x", "timeout_s": 1e9}, "timeout_s", "exceeds this server's limit of 3600 seconds"),
]


@pytest.mark.parametrize("body,param,words", VIDEO_ERRORS, ids=[str(b) for b, *_ in VIDEO_ERRORS])
def test_bad_video_requests_get_400_naming_the_field(server, body, param, words):
    with client(server.url) as http:
        error = error_of(http.post("/v1/videos", json=body), 400)
    assert error["param"] == param
    assert words in error["message"]


def test_the_largest_seed_still_makes_an_image(server):
    with client(server.url) as http:
        response = http.post(
            "/v1/images/generations", json={"prompt": "x", "seed": 2**63 - 2, "n": 2, "num_inference_steps": 2}
        )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2


def test_a_request_past_its_timeout_gets_504_of_type_timeout(server):
    """The deadline leaves the engine: an image answers 504 in OpenAI's shape, a video job fails with 'timeout'."""
    slow = {"prompt": "x", "num_inference_steps": 50, "timeout_s": 0.5}
    with client(server.url) as http:
        response = http.post("/v1/images/generations", json=slow, headers={"X-Request-Id": "late-image"})
        assert response.status_code == 504, response.text
        assert response.json() == {
            "error": {
                "message": "the request did not finish within its deadline (timeout_s)",
                "type": "timeout",
                "param": "timeout_s",
                "code": 504,
            }
        }
        assert response.headers.get_list("x-request-id") == ["late-image"]
        job = http.post("/v1/videos", json={**slow, "seconds": 14}).json()
        failed = wait_video(http, job["id"])
        assert (failed["status"], failed["error"]["code"]) == ("failed", "timeout"), failed


def test_a_video_job_records_the_request_id(server):
    with client(server.url) as http:
        job = http.post("/v1/videos", json={"prompt": "x", "num_inference_steps": 2}, headers={"X-Request-Id": "job-7"})
        assert job.status_code == 200 and job.headers.get_list("x-request-id") == ["job-7"]
        assert wait_video(http, job.json()["id"])["status"] == "completed"
    record = json.loads((server.store / f"{job.json()['id']}.json").read_text())
    assert record["request_id"] == "job-7"
