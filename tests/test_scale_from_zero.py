"""Scale from zero (args.autoscaling.min_replicas 0), on the CPU default served by `h3serve serve` over real HTTP:
while no H3Replica runs, a video job is accepted and queued at once and completes once the first replica has
loaded; an image request gets 503 with a Retry-After from the expected load time and starts a replica (or, as
configured, waits for it); /health answers without waking one; idle, the deployment goes back to zero.

Its applications live on the session's server (``served_apps``: "coldstart" and "coldwait"): they scale
themselves, the test never stops or reconfigures the server."""

import base64
import io
import json
import time

import pytest
from PIL import Image

from h3serve.pipelines.h3.media import probe_media
from tests.harness import client, serve_status, wait_for, wait_video
from tests.served_apps import COLD_AUTOSCALING

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
IMAGE = {"prompt": "a blue square", "size": "64x64", "num_inference_steps": 2}


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def replicas(app: str) -> dict[str, int]:
    return dict(serve_status().applications[app].deployments["H3Replica"].replica_states)


def test_a_video_job_is_queued_while_the_first_replica_loads_and_an_image_gets_503_with_retry_after(server):
    assert replicas(server.name).get("RUNNING", 0) == 0  # min_replicas 0: nothing started with the deployment
    with client(server.url) as http:
        health = http.get("/health")  # a liveness probe neither fails nor wakes a replica
        assert health.status_code == 200 and health.json()["replicas"] == 0, health.text
        # nor do the reads an open playground tab polls (stats every 2 s): answered from the ingress's own state
        for _ in range(8):
            stats = http.get("/v1/stats")
            assert stats.status_code == 200 and stats.json()["replica"] is None, stats.text
            assert http.get("/v1/videos").status_code == 200 and http.get("/v1/models").status_code == 200
            time.sleep(0.5)
        assert not replicas(server.name), replicas(server.name)  # none started, none starting

        refused = http.post("/v1/images/generations", json=IMAGE)
        assert refused.status_code == 503, refused.text
        # nothing measured yet: the configured expected load time, counted down from the wake this request sent
        assert 1 <= int(refused.headers["retry-after"]) <= COLD_AUTOSCALING["expected_load_s"]
        assert "scaled to zero" in refused.json()["error"]["message"]

        # timeout_s counts from arrival, the wait for the first replica included: a job that cannot start in time
        # fails then (code timeout), not timeout_s after the replica has loaded
        hurried = http.post("/v1/videos", json={"prompt": "in a hurry", "num_inference_steps": 3, "timeout_s": 2})
        assert hurried.status_code == 200, hurried.text
        late = wait_video(http, hurried.json()["id"], timeout=30)
        assert late["status"] == "failed" and late["error"]["code"] == "timeout", late
        assert late["completed_at"] - late["created_at"] <= 4, late  # 2 s, and whole seconds on each side

        accepted = http.post("/v1/videos", json={"prompt": "a red circle moving left", "num_inference_steps": 3})
        assert accepted.status_code == 200, accepted.text
        video = accepted.json()
        assert video["status"] == "queued" and video["size"] == "128x64" and video["seconds"] == "5.16667", video
        # accepted before any replica serves, and kept queued (not failed, not lost) while the first one loads
        assert replicas(server.name).get("RUNNING", 0) == 0
        assert http.get(f"/v1/videos/{video['id']}").json()["status"] == "queued"

        done = wait_video(http, video["id"], timeout=240)
        assert done["status"] == "completed", done
        info = probe_media(http.get(f"/v1/videos/{video['id']}/content").content)
        assert (info.frames, info.width, info.height) == (124, 128, 64)
        # its live events (replayed, the job done): queued while no replica ran (no place yet), then its place in the
        # first replica's queue once that served, then its steps, and completed
        with http.stream("GET", f"/v1/videos/{video['id']}/events") as response:
            lines = response.read().decode().splitlines()
        kinds = [line.partition(": ")[2] for line in lines if line.startswith("event: ")]
        data = [json.loads(line.partition(": ")[2]) for line in lines if line.startswith("data: ")]
        assert kinds[:2] == ["queued", "queued"] and "step" in kinds and kinds[-1] == "completed", kinds
        assert "position" not in data[0] and "position" in data[1], data[:2]

        served = http.post("/v1/images/generations", json=IMAGE)  # a replica runs now: served at once
        assert served.status_code == 200, served.text
        png = Image.open(io.BytesIO(base64.b64decode(served.json()["data"][0]["b64_json"])))
        assert png.size == (64, 64)

        # idle: the backlog policy asks for 0, and Serve goes there after downscale_delay_s
        wait_for(lambda: not replicas(server.name), timeout=60, interval=0.5, what="the deployment back at zero")
        again = http.post("/v1/images/generations", json=IMAGE)
        assert again.status_code == 503, again.text
        # now counted down from the load time this ingress measured (seconds on the tiny model, never above it)
        assert 1 <= int(again.headers["retry-after"]) <= COLD_AUTOSCALING["expected_load_s"]


def test_an_image_waits_for_the_first_replica_when_configured_to(server, served):
    app = served.app("coldwait")
    assert replicas(app.name).get("RUNNING", 0) == 0
    with client(app.url, timeout=240) as http:
        response = http.post("/v1/images/generations", json=IMAGE)  # held at the handle while a replica loads
        assert response.status_code == 200, response.text
        assert len(response.json()["data"]) == 1
