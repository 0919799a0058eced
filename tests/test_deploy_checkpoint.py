"""A checkpoint h3serve did not write (diffusers' and transformers' own save_pretrained) serves unchanged, at dims of
its own (FOREIGN_DIMS, no preset's) when the config says so: ``model: auto``."""

import pytest

from h3serve.pipelines.h3.media import probe_media
from tests.harness import client, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(served):
    """The default config with ``checkpoint`` a library-saved checkpoint of FOREIGN_DIMS and ``model: auto``
    (``served_apps``: application "foreign")."""
    with served.module(__name__) as app:
        yield app


def test_a_library_saved_checkpoint_of_its_own_dims_serves_a_clip_through_h3serve_serve(server):
    assert "checkpoint" in server.output() and "4 heads x 24, 3 layers, hidden 64" in server.output()
    with client(server.url) as http:
        (model,) = http.get("/v1/models").json()["data"]
        assert model["id"] == "MiniMax-H3-foreign"  # model: auto serves under the checkpoint's folder name
        body = {"prompt": "a small boat", "num_inference_steps": 2, "seed": 4, "size": "64x64"}
        created = http.post("/v1/videos", json=body)
        assert created.status_code == 200, created.text
        video_id = created.json()["id"]

        def finished():
            job = http.get(f"/v1/videos/{video_id}").json()
            return job if job["status"] in ("completed", "failed") else None

        job = wait_for(finished, timeout=180, interval=0.5, what="the video job")
        assert job["status"] == "completed", job
        content = http.get(f"/v1/videos/{video_id}/content")
    assert content.status_code == 200
    info = probe_media(content.content)
    assert (info.width, info.height, info.frames, info.fps) == (64, 64, 124, 24.0)
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 2, 8000)
