"""LoRA adapters over HTTP against a running `h3serve serve`: listed as model ids, picked by a request's `model`,
their steps by default, refused ids and steps as 400s in the API's error shape, counted by model id."""

import time

import pytest

from tests.harness import (
    client,
    error_of,
    requests_counted,
    scrape,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
BASE_ID = "minimax-h3-tiny"


@pytest.fixture(scope="module")
def server(served):
    """The default config with test_lora's two adapters (``served_apps``: application "lora")."""
    with served.module(__name__) as app:
        yield app


def generations_counted(server, models: list[str]) -> dict[str, float]:
    """This application's 200s on the images route by model id (one scrape; other modules' apps serve the base id)."""
    scraped = scrape(server.metrics_port)
    labels = {"application": server.name, "route": "/v1/images/generations", "status": "200"}
    return {model: requests_counted(scraped, model=model, **labels) for model in models}


def adapter_documents(server) -> dict[str, float]:
    """ray_h3serve_adapter_document_steps_total by adapter ("" for the base model), summed over this application's
    replicas."""
    counted: dict[str, float] = {}
    for sample in scrape(server.metrics_port).get("ray_h3serve_adapter_document_steps_total", []):
        if sample.labels.get("application") == server.name:
            counted[sample.labels["adapter"]] = counted.get(sample.labels["adapter"], 0.0) + sample.value
    return counted


def test_adapters_are_model_ids_and_a_request_picks_one(server):
    with client(server.url) as http:
        models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
        ids = list(models)  # the base model first, then the adapters in the config's order
        assert ids[0] == BASE_ID and sorted(ids[1:]) == [f"{BASE_ID}:style", f"{BASE_ID}:turbo"]
        assert [models[f"{BASE_ID}:{n}"]["parent"] for n in ("turbo", "style")] == [BASE_ID, BASE_ID]
        assert [models[f"{BASE_ID}:{n}"]["num_inference_steps"] for n in ("turbo", "style")] == [3, None]
        assert "parent" not in models[BASE_ID]
        doc = http.get("/openapi.json").json()
        for path in ("/v1/images/generations", "/v1/videos"):
            fields = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
            assert fields["model"]["enum"] == ids

        error = error_of(http.post("/v1/images/generations", json={"prompt": "x", "model": f"{BASE_ID}:anime"}), 400)
        assert error["param"] == "model" and f"valid ids: {', '.join(ids)}" in error["message"], error
        error = error_of(http.post("/v1/videos", data={"prompt": "x", "model": "dall-e-3"}), 400)
        assert error["param"] == "model", error
        body = {"prompt": "x", "model": f"{BASE_ID}:turbo", "num_inference_steps": 12}
        error = error_of(http.post("/v1/images/generations", json=body), 400)
        assert error["param"] == "num_inference_steps", error
        assert "distilled for 3 steps; the request asks for 12" in error["message"], error

        def generated(model: str, **fields) -> int:
            response = http.post(
                "/v1/images/generations", json={"prompt": "a bell", "size": "64x64", "model": model, **fields}
            )
            assert response.status_code == 200, response.text
            assert response.json()["data"][0]["b64_json"]
            return 1

        # 200s only: the refused requests above are counted too (status 400), and Ray's export may add them late
        before = generations_counted(server, ids)
        documents_before = adapter_documents(server)
        generated(f"{BASE_ID}:turbo")  # its own 3 steps, though the deployment's default is 50
        generated(f"{BASE_ID}:style", num_inference_steps=3)
        generated(BASE_ID, num_inference_steps=3)

        video = http.post("/v1/videos", data={"prompt": "a bell", "size": "64x64", "model": f"{BASE_ID}:turbo"})
        assert video.status_code == 200, video.text
        assert video.json()["model"] == f"{BASE_ID}:turbo"

    def counted():
        now = generations_counted(server, ids)
        return now if all(now[m] - before[m] >= 1 for m in ids) else None

    wait_for(counted, timeout=60, what="request counters labelled by model id")
    time.sleep(3)
    after = generations_counted(server, ids)
    assert {m: after[m] - before[m] for m in ids} == dict.fromkeys(ids, 1)

    # the engine's own view, by adapter name: the adapters the replica serves, and one document per request in each
    # of its packed forwards (3 steps: 2 model evaluations); turbo ran an image and a video
    expected = {"": 2.0, "turbo": 4.0, "style": 2.0}

    def documented():
        now = adapter_documents(server)
        delta = {a: now.get(a, 0.0) - documents_before.get(a, 0.0) for a in expected}
        return delta if all(delta[a] >= expected[a] for a in expected) else None

    wait_for(documented, timeout=60, what="documents per adapter")
    time.sleep(3)
    documents = adapter_documents(server)
    assert {a: documents.get(a, 0.0) - documents_before.get(a, 0.0) for a in expected} == expected
    served = {
        s.labels["adapter"]: s.value
        for s in scrape(server.metrics_port).get("ray_h3serve_lora_adapters", [])
        if s.labels.get("application") == server.name
    }
    assert served == {"turbo": 1.0, "style": 1.0}


def rows_per_step_count(server) -> float:
    """The forwards this application's replicas ran (ray_h3serve_rows_per_step's count: one sample per forward)."""
    return sum(
        s.value
        for s in scrape(server.metrics_port).get("ray_h3serve_rows_per_step_count", [])
        if s.labels.get("application") == server.name
    )


def test_composed_lists_in_a_pack_beside_base_requests_equal_diffusers_set_adapters(server):
    """Three requests at once (a base one, one composing turbo with style, one with style at a negative weight), packed
    together by the engine; each PNG equals diffusers' pipeline with the request's adapters loaded by
    ``load_lora_weights``, activated by ``set_adapters(names, weights)`` and fused, frames within one uint8 step."""
    import base64
    import copy
    import io
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from diffusers.modular_pipelines import MiniMaxH3Blocks
    from PIL import Image

    from h3serve.attention import get_backend
    from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
    from h3serve.pipelines.h3.attention_processor import install

    bodies = [
        {"num_inference_steps": 8},
        {"lora": [{"name": "style", "scale": -0.5}], "num_inference_steps": 8},
        {"lora": [{"name": "turbo"}, {"name": "style", "scale": 0.6}]},  # turbo's own 3 steps, its scale 0.7
    ]
    with client(server.url) as http:
        refused = http.post("/v1/images/generations", json={"prompt": "x", "lora": [{"name": "anime"}]})
        error = error_of(refused, 400)
        assert error["param"] == "lora" and "no adapter 'anime'" in error["message"], error
        assert "its adapters: style, turbo" in error["message"], error
        forwards_before = rows_per_step_count(server)

        def generate(body: dict) -> np.ndarray:
            response = http.post(
                "/v1/images/generations", json={"prompt": "a bell", "size": "64x64", "seed": 4, **body}
            )
            assert response.status_code == 200, response.text
            png = base64.b64decode(response.json()["data"][0]["b64_json"])
            return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)

        with ThreadPoolExecutor(len(bodies)) as pool:
            served_pngs = list(pool.map(generate, bodies))
    # packed: fewer forwards than the requests' model evaluations one at a time (7 + 7 + 2)
    wait_for(lambda: rows_per_step_count(server) > forwards_before, timeout=60, what="forwards counted")
    time.sleep(3)
    assert rows_per_step_count(server) - forwards_before < 16

    # diffusers: the deployment's adapter files (the session server wrote them under its tmp), fused per request
    loras_dir = server.store.parent.parent / "loras"
    scales = {"turbo": 0.7, "style": 1.0}  # tests.test_lora.ADAPTERS' deploy-time scales
    pipeline = H3Pipeline.load(None, "torch_sdpa")  # the served default: the built-in tiny checkpoint
    base = pipeline.denoiser.transformers["transformer"]
    for body, got in zip(bodies, served_pngs, strict=True):
        uses = [(use["name"], use.get("scale", scales[use["name"]])) for use in body.get("lora", [])]
        if uses:
            pipe = MiniMaxH3Blocks().init_pipeline()
            pipe.update_components(transformer=copy.deepcopy(base))
            for name, _ in uses:
                pipe.load_lora_weights(loras_dir / name, adapter_name=name)
            pipe.set_adapters([n for n, _ in uses], [w for _, w in uses])
            pipe.fuse_lora(components=["transformer"], adapter_names=[n for n, _ in uses])
            install(pipe.transformer, get_backend("torch_sdpa").make_impl())
            pipeline.denoiser.transformers["transformer"] = pipe.transformer
        request = GenerationRequest(
            prompt="a bell", width=64, height=64, seed=4, num_inference_steps=body.get("num_inference_steps", 3)
        )
        expected = np.asarray(Image.open(io.BytesIO(pipeline.generate(request).png())).convert("RGB"), dtype=np.int16)
        pipeline.denoiser.transformers["transformer"] = base
        assert np.abs(got - expected).max() <= 1, body


def model_enum(http) -> list[str]:
    """The ids /openapi.json lets a generation request's `model` name."""
    doc = http.get("/openapi.json").json()
    body = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return body["properties"]["model"]["enum"]


def test_adapters_load_and_unload_at_run_time_under_load_and_no_request_fails(server, tmp_path):
    """POST /v1/adapters loads an adapter (made with peft, saved by diffusers) while base requests keep coming; a
    job runs on it; DELETE refuses new requests on it at once and answers once that job finished with it. Every
    request of the load ends 200, and the job completes."""
    import threading

    from diffusers import MiniMaxH3Transformer3DModel
    from peft import LoraConfig

    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint
    from tests.harness import FOREIGN_DIMS, wait_video
    from tests.test_h3_forward import CONFIG
    from tests.test_lora import EVERY_LAYER, lora_state_dict, save

    base = MiniMaxH3Transformer3DModel.from_pretrained(random_tiny_checkpoint() / "transformer").eval()
    config = LoraConfig(r=4, lora_alpha=4, target_modules=EVERY_LAYER)
    detail = save(tmp_path / "detail", lora_state_dict(base, config, 7), config)
    other = MiniMaxH3Transformer3DModel(**{**CONFIG, **FOREIGN_DIMS}).eval()
    foreign_config = LoraConfig(r=4, target_modules=["attn.to_q"])
    foreign = save(tmp_path / "foreign", lora_state_dict(other, foreign_config, 8), foreign_config)

    statuses: list[int] = []
    stop = threading.Event()

    def load():  # base requests, one after another, for the whole test
        with client(server.url) as http:
            while not stop.is_set():
                body = {"prompt": "a bell", "size": "64x64", "num_inference_steps": 3}
                statuses.append(http.post("/v1/images/generations", json=body).status_code)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        with client(server.url, timeout=300) as http:
            added = http.post("/v1/adapters", json={"name": "detail", "path": str(detail), "scale": 0.8})
            assert added.status_code == 200, added.text
            assert added.json()["id"] == f"{BASE_ID}:detail" and added.json()["bytes"] > 0
            assert f"{BASE_ID}:detail" in [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert f"{BASE_ID}:detail" in model_enum(http)
            error = error_of(http.post("/v1/adapters", json={"name": "foreign", "path": str(foreign)}), 400)
            assert error["param"] == "path" and "transformer_blocks.0.attn.to_q" in error["message"], error
            error = error_of(http.post("/v1/adapters", json={"name": "detail", "path": str(detail)}), 409)
            assert error["param"] == "name", error

            body = {"prompt": "a bell", "size": "64x64", "num_inference_steps": 12, "lora": ["detail", "style"]}
            job = http.post("/v1/videos", json=body)
            assert job.status_code == 200, job.text
            job_id = job.json()["id"]
            wait_for(lambda: http.get(f"/v1/videos/{job_id}").json()["progress"] > 0, timeout=120, what="the job runs")
            deleted: dict = {}
            deleting = threading.Thread(
                target=lambda: deleted.update(response=client(server.url, timeout=300).delete("/v1/adapters/detail"))
            )
            deleting.start()

            def refused():
                response = http.post("/v1/images/generations", json={"prompt": "x", "lora": ["detail"]})
                return response if response.status_code == 400 else None

            error = error_of(wait_for(refused, timeout=30, interval=0.2, what="new requests refused"), 400)
            assert error["param"] == "lora" and "no adapter 'detail'" in error["message"], error
            finished = wait_video(http, job_id)
            assert finished["status"] == "completed", finished  # it finished with the adapter
            deleting.join(timeout=120)
            assert deleted["response"].status_code == 200, deleted["response"].text
            assert f"{BASE_ID}:detail" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
            assert f"{BASE_ID}:detail" not in model_enum(http)
            assert error_of(http.delete("/v1/adapters/detail"), 404)
            # a remix of the job made with it runs on its adapters: one is gone, so refused, not run without it
            error = error_of(http.post(f"/v1/videos/{job_id}/remix", json={"prompt": "a gong"}), 409)
            assert error["param"] == "video_id" and "'detail" in error["message"], error
    finally:
        stop.set()
        loader.join(timeout=120)
    assert statuses and set(statuses) == {200}, statuses


def test_a_remix_of_a_video_made_with_a_lora_list_runs_on_the_same_adapters(server):
    """remix (issue 58) of a clip whose request named a ``lora`` list on the base model: its adapters at its weights
    and a new prompt, the frames of that list and prompt sent to POST /v1/videos."""
    import io

    import av
    import numpy as np

    from tests.harness import wait_video

    def made(http, response) -> np.ndarray:
        assert response.status_code == 200, response.text
        job = wait_video(http, response.json()["id"])
        assert job["status"] == "completed", job
        with av.open(io.BytesIO(http.get(f"/v1/videos/{job['id']}/content").content)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

    body = {"prompt": "a bell", "size": "64x64", "seed": 3, "num_inference_steps": 2}
    listed = {**body, "lora": [{"name": "style", "scale": -0.5}]}
    with client(server.url, timeout=300) as http:
        source = http.post("/v1/videos", json=listed)
        source_frames = made(http, source)
        remix = made(http, http.post(f"/v1/videos/{source.json()['id']}/remix", json={"prompt": "a gong"}))
        direct = made(http, http.post("/v1/videos", json={**listed, "prompt": "a gong"}))
        base = made(http, http.post("/v1/videos", json={**body, "prompt": "a gong"}))
    assert np.array_equal(remix, direct)  # the same adapters at the same weight
    assert not np.array_equal(remix, base) and not np.array_equal(remix, source_frames)


def test_a_run_time_adapter_survives_a_killed_replica_and_is_in_the_openapi_document(server, ray_cluster, tmp_path):
    """POST /v1/adapters records the adapter in the application's registry: after kill -9 of the H3Replica process,
    the replica Serve starts in its place loads it before it serves (and warms it up), and the same seeded request
    on it gives the same PNG. The POST body's schema is in /openapi.json; an fsspec URL is a 400 on path."""
    import os
    import signal

    from diffusers import MiniMaxH3Transformer3DModel
    from peft import LoraConfig
    from ray.util.state import list_actors

    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint
    from tests.test_lora import EVERY_LAYER, lora_state_dict, save

    base = MiniMaxH3Transformer3DModel.from_pretrained(random_tiny_checkpoint() / "transformer").eval()
    config = LoraConfig(r=4, lora_alpha=4, target_modules=EVERY_LAYER)
    grain = save(tmp_path / "grain", lora_state_dict(base, config, 11), config)

    def replica_pid() -> int | None:
        actors = list_actors(address=ray_cluster.address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        pids = [a.pid for a in actors if a.class_name == f"ServeReplica:{server.name}:H3Replica"]
        return pids[0] if len(pids) == 1 else None

    body = {"prompt": "a gong", "size": "64x64", "num_inference_steps": 3, "seed": 5, "lora": ["grain", "style"]}
    with client(server.url, timeout=300) as http:
        doc = http.get("/openapi.json").json()
        schema = doc["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema["required"] == ["name", "path"] and {"scale", "steps", "shift"} <= set(schema["properties"])
        error = error_of(http.post("/v1/adapters", json={"name": "grain", "path": "memory://grain"}), 400)
        assert error["param"] == "path", error

        added = http.post("/v1/adapters", json={"name": "grain", "path": str(grain)})
        assert added.status_code == 200, added.text
        assert added.json()["generation"] >= 1
        before = http.post("/v1/images/generations", json=body)
        assert before.status_code == 200, before.text
        pid = replica_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: replica_pid() not in (None, pid), timeout=120, interval=0.5, what="another H3Replica")

        def served():
            response = http.post("/v1/images/generations", json=body)
            return response if response.status_code == 200 else None

        after = wait_for(served, timeout=300, interval=2.0, what="the new replica serves the adapter")
        assert after.json()["data"][0]["b64_json"] == before.json()["data"][0]["b64_json"]
        deleted = http.delete("/v1/adapters/grain")
        assert deleted.status_code == 200, deleted.text
        error = error_of(http.delete("/v1/adapters/style"), 409)  # declared at deploy: the config's to change
        assert "args.loras" in error["message"], error
