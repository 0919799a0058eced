"""The default config, served by `h3serve serve` and used over real HTTP, as a user would."""

import base64
import io
import time

import httpx
import openai
import pytest
import ray
from PIL import Image
from ray import serve

from pipelines.h3.media import probe_media
from serving import ServeProcess, client, default_config, free_port, start_cluster, wait_for, write_config

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    address = start_cluster()
    port = free_port()
    # the embedded default, unchanged but for a free port
    config = write_config(tmp_path_factory.mktemp("default"), default_config(), port)
    process = ServeProcess(config, address, port)
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()
        serve.shutdown()
        ray.shutdown()


def test_openai_client_gets_a_png_of_the_requested_size(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    result = api.images.generate(model="h3-tiny", prompt="a lighthouse at dusk", size="256x128",
                                 response_format="b64_json", n=2, extra_body={"seed": 3, "num_inference_steps": 4})
    assert len(result.data) == 2
    images = [Image.open(io.BytesIO(base64.b64decode(d.b64_json))) for d in result.data]
    assert all(i.format == "PNG" and i.size == (256, 128) for i in images)
    assert images[0].tobytes() != images[1].tobytes()  # n images use seeds 3 and 4
    assert [m.id for m in api.models.list()] == ["h3-tiny"]


def test_plain_http_like_curl(server):
    with client(server.url) as http:
        response = http.post("/v1/images/generations", json={"prompt": "a red fox", "size": "64x64"})
        assert response.status_code == 200
        png = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert Image.open(io.BytesIO(png)).size == (64, 64)
        health = http.get("/health").json()
        assert health == {"status": "ok", "model": "h3-tiny", "backend": "torch_sdpa"}


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "size": "abc"}, 400, "size"),
    ({"prompt": "x", "size": "100x64"}, 400, "size"),            # not a multiple of the latent grid
    ({"prompt": "x", "size": "4096x4096"}, 400, "size"),         # beyond max_pixels
    ({"prompt": "x", "n": 9}, 400, "n"),
    ({"prompt": "x", "n": 0}, 422, "n"),
    ({"prompt": "x" * 1001}, 400, "prompt"),
    ({"prompt": "   "}, 400, "prompt"),
    ({"prompt": "x", "num_inference_steps": 500}, 400, "num_inference_steps"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
    ({"prompt": "x", "seed": -1}, 422, "seed"),
    ({"size": "64x64"}, 422, "prompt"),
])
def test_bad_image_requests_get_4xx_naming_the_field(server, body, status, param):
    with client(server.url) as http:
        response = http.post("/v1/images/generations", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] or error["param"] == param


def test_malformed_json_is_a_4xx(server):
    with client(server.url) as http:
        response = http.post("/v1/images/generations", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422


def wait_video(http: httpx.Client, video_id: str, timeout: float = 120) -> dict:
    seen = set()

    def finished():
        job = http.get(f"/v1/videos/{video_id}").json()
        seen.add(job["progress"])
        return job if job["status"] in ("completed", "failed") else None

    job = wait_for(finished, timeout=timeout, interval=0.2, what="video job")
    job["progress_seen"] = sorted(seen)
    return job


def test_video_job_lifecycle_down_to_a_playable_mp4_with_audio(server):
    with client(server.url) as http:
        created = http.post("/v1/videos", json={"prompt": "waves on a beach", "seconds": 2, "size": "128x96",
                                                "fps": 8, "steps": 6, "seed": 1})
        assert created.status_code == 200, created.text
        job = created.json()
        assert job["object"] == "video" and job["status"] in ("queued", "in_progress")
        early = http.get(f"/v1/videos/{job['id']}/content")
        assert early.status_code in (409, 200)
        done = wait_video(http, job["id"])
        assert done["status"] == "completed" and done["progress"] == 100
        content = http.get(f"/v1/videos/{job['id']}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        info = probe_media(content.content)
        assert (info.width, info.height, info.frames) == (128, 96, 16)  # exactly 2 s at 8 fps
        assert info.duration_s == pytest.approx(2.0, abs=0.01)
        assert info.audio_codec == "aac" and info.audio_duration_s == pytest.approx(2.0, abs=0.05)
        deleted = http.delete(f"/v1/videos/{job['id']}")
        assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
        assert http.get(f"/v1/videos/{job['id']}").status_code == 404
        assert http.delete(f"/v1/videos/{job['id']}").status_code == 404


def test_openai_client_creates_a_video_job(server):
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    video = api.videos.create(prompt="a train", seconds="1", size="64x64", extra_body={"steps": 2})
    assert video.status in ("queued", "in_progress")
    with client(server.url) as http:
        assert wait_video(http, video.id)["status"] == "completed"
    assert api.videos.retrieve(video.id).status == "completed"
    content = api.videos.download_content(video.id).read()
    assert probe_media(content).audio_codec == "aac"


def test_deleting_a_running_job_stops_it(server):
    with client(server.url) as http:
        job = http.post("/v1/videos", json={"prompt": "long", "seconds": 4, "size": "256x256", "steps": 50}).json()
        wait_for(lambda: http.get(f"/v1/videos/{job['id']}").json()["progress"] > 0, timeout=60, interval=0.1,
                 what="progress")
        assert http.delete(f"/v1/videos/{job['id']}").status_code == 200
        # the engine drops it: a fresh request is served promptly, not after 50 steps of the deleted one
        started = time.perf_counter()
        assert http.post("/v1/images/generations", json={"prompt": "next", "size": "64x64",
                                                           "num_inference_steps": 2}).status_code == 200
        assert time.perf_counter() - started < 30


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "seconds": 100}, 400, "seconds"),
    ({"prompt": "x", "seconds": 0}, 422, "seconds"),
    ({"prompt": "x", "fps": 500}, 400, "fps"),
    ({"prompt": "x", "size": "7x7"}, 400, "size"),
    ({"prompt": "x", "seconds": "four"}, 422, "seconds"),
])
def test_bad_video_requests_get_4xx(server, body, status, param):
    with client(server.url) as http:
        response = http.post("/v1/videos", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_video_is_404(server):
    with client(server.url) as http:
        assert http.get("/v1/videos/video_nope").status_code == 404
        assert http.get("/v1/videos/video_nope/content").status_code == 404
