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
