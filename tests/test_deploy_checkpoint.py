"""A checkpoint h3serve did not write (diffusers' and transformers' own save_pretrained) serves unchanged, at dims of
its own (FOREIGN_DIMS, no preset's) when the config says so: ``model: auto``."""

import copy

import pytest
from diffusers.modular_pipelines import MiniMaxH3Blocks

from pipelines.h3 import preset
from pipelines.h3.checkpoint import tiny_components
from pipelines.h3.media import probe_media
from tests.harness import FOREIGN_DIMS, ServeProcess, client, default_config, free_port, wait_for, write_config

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def library_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("library") / "MiniMax-H3-foreign"
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.register_to_config(**preset("tiny").pipeline_config)
    pipe.update_components(**tiny_components(seed=11, transformer=FOREIGN_DIMS))
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)  # diffusers' own index, absolute paths
    return directory


@pytest.fixture(scope="module")
def server(ray_cluster, library_checkpoint, tmp_path_factory):
    config = copy.deepcopy(default_config())
    config["applications"][0]["args"].update(checkpoint=str(library_checkpoint), model="auto")
    port = free_port()
    process = ServeProcess(write_config(tmp_path_factory.mktemp("config"), config, port), ray_cluster.address, port)
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


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
