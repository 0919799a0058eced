"""The HTTP surface against a running `h3serve serve`: malformed input, body limits, auth on every route,
request metrics, and a schema fuzz. Two apps: the default config at / (open) and a token-locked copy at /locked."""

import io
import json
import subprocess
import time
from pathlib import Path

import pytest
from PIL import Image
from ray.util.state import list_actors

from h3serve.deploy.ingress.openapi import REQUEST_ID
from h3serve.deploy.ingress.routes import PUBLIC_ROUTES
from tests.harness import (
    SCHEMATHESIS,
    bomb_png,
    browser_or_skip,
    client,
    error_of,
    requests_counted,
    scrape,
    truncated_png,
    wait,
    wait_for,
    wait_video,
)
from tests.served_apps import KEY, LOCKED_BODY_LIMIT

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(served):
    """The default config at / and "locked" at /locked: a bearer token and a small body limit (``served_apps``)."""
    with served.module(__name__) as app:
        yield app


def test_the_running_ingress_never_loaded_torch(server, ray_cluster):
    # importing h3serve.deploy.ingress.routes loads no model library (test_ingress_imports); here the ingress's own
    # process,
    # as Serve started it and after it served a request, is held to it: torch's shared library is not mapped into it
    with client(server.url) as http:
        assert http.get("/health").status_code == 200
    actors = list_actors(address=ray_cluster.address, filters=[("state", "=", "ALIVE")], detail=True, limit=10000)
    ingresses = [a for a in actors if a.class_name == f"ServeReplica:{server.name}:H3Ingress"]
    assert ingresses, [a.class_name for a in actors]
    for actor in ingresses:
        maps = Path(f"/proc/{actor.pid}/maps").read_text()
        assert "libtorch" not in maps, f"ingress pid {actor.pid} has torch loaded"


def multipart(boundary: str, body: bytes) -> dict:
    return {"content": body, "headers": {"content-type": f"multipart/form-data; boundary={boundary}"}}


PART = b'--b0\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhello\r\n'
# (name, method, path, request kwargs, status, words the message holds, param)
MALFORMED = [
    (
        "lone surrogate",
        "POST",
        "/v1/images/generations",
        {"content": b'{"prompt": "\\ud800"}', "headers": JSON},
        400,
        "lone surrogate",
        "prompt",
    ),
    (
        "lone surrogate in a video",
        "POST",
        "/v1/videos",
        {"content": b'{"prompt": "a \\udfff b"}', "headers": JSON},
        400,
        "lone surrogate",
        "prompt",
    ),
    (
        "size of thousands of digits",
        "POST",
        "/v1/images/generations",
        {"json": {"prompt": "x", "size": "9" * 5000 + "x64"}},
        400,
        "WIDTHxHEIGHT",
        "size",
    ),
    (
        "size of thousands of digits, form",
        "POST",
        "/v1/videos",
        {"data": {"prompt": "x", "size": "64x" + "9" * 5000}},
        400,
        "WIDTHxHEIGHT",
        "size",
    ),
    (
        "an integer of thousands of digits",
        "POST",
        "/v1/videos",
        {"content": b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "headers": JSON},
        400,
        "JSON object",
        None,
    ),
    (
        "arrays nested 100000 deep",
        "POST",
        "/v1/images/generations",
        {"content": b"[" * 100000, "headers": JSON},
        400,
        "nested too deeply",
        None,
    ),
    (
        "multipart without its closing boundary",
        "POST",
        "/v1/videos",
        multipart("b0", PART),
        400,
        "no closing boundary",
        None,
    ),
    ("multipart without a boundary", "POST", "/v1/videos", multipart("", PART), 400, "malformed form body", None),
    (
        "multipart part without a name",
        "POST",
        "/v1/videos",
        multipart("b0", b"--b0\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b0--\r\n"),
        400,
        "",
        None,
    ),
    (
        "non-UTF-8 JSON",
        "POST",
        "/v1/images/generations",
        {"content": b'{"prompt": "\xff\xfe"}', "headers": JSON},
        400,
        "not UTF-8",
        None,
    ),
    (
        "truncated JSON",
        "POST",
        "/v1/images/generations",
        {"content": b'{"prompt": "x"', "headers": JSON},
        400,
        "the body must be a JSON object",
        None,
    ),
    (
        "truncated JSON video",
        "POST",
        "/v1/videos",
        {"content": b'{"prompt": "x", "seconds": ', "headers": JSON},
        400,
        "the body must be a JSON object",
        None,
    ),
    ("a JSON array", "POST", "/v1/images/generations", {"json": [{"prompt": "x"}]}, 400, "JSON object", None),
    (
        "text/plain",
        "POST",
        "/v1/images/generations",
        {"content": b"prompt=a fox", "headers": {"content-type": "text/plain"}},
        400,
        "the body must be a JSON object",
        None,
    ),
    (
        "a form on the JSON-only route",
        "POST",
        "/v1/images/generations",
        {"data": {"prompt": "x"}},
        415,
        "application/json",
        None,
    ),
    (
        "an image content type",
        "POST",
        "/v1/videos",
        {"content": b"\x89PNG", "headers": {"content-type": "image/png"}},
        415,
        "multipart/form-data",
        None,
    ),
    ("unknown route", "GET", "/v2/nothing", {}, 404, "Not Found", None),
    ("wrong method", "PUT", "/v1/videos", {}, 405, "Method Not Allowed", None),
    ("wrong method on a job", "POST", "/v1/videos/video_x", {"json": {}}, 405, "Method Not Allowed", None),
    ("a job id that is a path", "GET", "/v1/videos/..%2F..%2Fetc%2Fpasswd", {}, 404, "", None),
    ("list limit", "GET", "/v1/videos?limit=100000000000000000000", {}, 400, "limit", "limit"),
]


@pytest.mark.parametrize("name,method,path,kwargs,status,words,param", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_requests_get_a_4xx_in_openai_shape(server, name, method, path, kwargs, status, words, param):
    with client(server.url) as http:
        error = error_of(http.request(method, path, **kwargs), status)
    assert words in error["message"] and error["param"] == param, error


def test_bodies_over_the_limit_get_413_with_or_without_content_length(server):
    over = b'{"prompt": "' + b"x" * LOCKED_BODY_LIMIT + b'"}'

    def chunked():  # no Content-Length: the limit must hold while streaming
        for i in range(0, len(over), 4096):
            yield over[i : i + 4096]

    with client(server.url) as http:
        error = error_of(http.post("/locked/v1/images/generations", content=over, headers={**AUTH, **JSON}), 413)
        assert f"at most {LOCKED_BODY_LIMIT}" in error["message"]
        request = http.build_request("POST", "/locked/v1/videos", content=chunked(), headers={**AUTH, **JSON})
        assert "content-length" not in request.headers and request.headers["transfer-encoding"] == "chunked"
        error = error_of(http.send(request), 413)
        assert f"over {LOCKED_BODY_LIMIT} bytes" in error["message"]
        # under the limit the same route parses the body: a long prompt is a 400 naming it, not a 413
        error_of(http.post("/locked/v1/images/generations", json={"prompt": "x" * 5000}, headers=AUTH), 400)
        # the default app's limit is the configured default (16 MiB), so this body is fine there
        error_of(http.post("/v1/images/generations", content=over, headers=JSON), 400)


def test_every_route_needs_the_token_but_health(server):
    """One request per route of the app, without, with a wrong and with the right token."""
    with client(server.url) as http:
        video = http.post("/locked/v1/videos", json={"prompt": "a bell", "num_inference_steps": 2}, headers=AUTH)
        assert video.status_code == 200, video.text
        video_id = video.json()["id"]
        assert wait_video(http, video_id, headers=AUTH, prefix="/locked", timeout=120)["status"] == "completed"
        expected = {  # (method, path) -> (request path, kwargs, status with the token)
            ("POST", "/v1/images/generations"): (
                "/v1/images/generations",
                {"json": {"prompt": "x", "size": "64x64", "num_inference_steps": 2}},
                200,
            ),
            ("POST", "/v1/videos"): ("/v1/videos", {"json": {"prompt": "x", "seconds": 100}}, 400),
            ("GET", "/v1/videos"): ("/v1/videos", {}, 200),
            ("GET", "/v1/videos/{video_id}"): (f"/v1/videos/{video_id}", {}, 200),
            ("GET", "/v1/videos/{video_id}/content"): (f"/v1/videos/{video_id}/content", {}, 200),
            ("GET", "/v1/videos/{video_id}/events"): (f"/v1/videos/{video_id}/events", {}, 200),
            ("POST", "/v1/videos/{video_id}/cancel"): (f"/v1/videos/{video_id}/cancel", {}, 409),  # it completed
            # a setting the source fixed: refused before any job is made
            ("POST", "/v1/videos/{video_id}/remix"): (
                f"/v1/videos/{video_id}/remix",
                {"json": {"prompt": "x", "seed": 1}},
                400,
            ),
            ("POST", "/v1/videos/{video_id}/extend"): (
                f"/v1/videos/{video_id}/extend",
                {"json": {"prompt": "x", "size": "64x64"}},
                400,
            ),
            ("DELETE", "/v1/videos/{video_id}"): (f"/v1/videos/{video_id}", {}, 200),
            ("GET", "/v1/models"): ("/v1/models", {}, 200),
            ("GET", "/v1/me"): ("/v1/me", {}, 200),  # api_key_env's key: tenant admin
            # admin: an adapter directory that is not there (the replica reads nothing), and one never served
            ("POST", "/v1/adapters"): ("/v1/adapters", {"json": {"name": "x", "path": "/no/such/adapter"}}, 400),
            ("DELETE", "/v1/adapters/{name}"): ("/v1/adapters/none", {}, 404),
            ("GET", "/health"): ("/health", {}, 200),
            ("GET", "/v1/stats"): ("/v1/stats", {}, 200),
            ("GET", "/"): ("/", {}, 200),  # the playground page: public, it asks for the key itself
            ("GET", "/openapi.json"): ("/openapi.json", {}, 200),
            ("GET", "/docs"): ("/docs", {}, 200),
            ("GET", "/redoc"): ("/redoc", {}, 200),
        }
        served = http.get("/locked/openapi.json", headers=AUTH).json()["paths"]
        routes = {(method.upper(), path) for path, methods in served.items() for method in methods}
        assert set(expected) == routes, "a route without an auth check here"
        for (method, route), (path, kwargs, status) in expected.items():
            public = route in PUBLIC_ROUTES
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = http.request(method, f"/locked{path}", headers=headers, **kwargs)
                if public:
                    assert response.status_code == 200, (method, route, response.text)
                else:
                    error_of(response, 401)
                    assert response.headers["www-authenticate"] == "Bearer", (method, route)
            response = http.request(method, f"/locked{path}", headers=AUTH, **kwargs)
            assert response.status_code == status, (method, route, response.status_code, response.text[:300])
        assert PUBLIC_ROUTES == ("/health", "/")
        # nothing there, with or without a token
        error_of(http.get("/locked/v1/nothing"), 404)


def test_401s_and_4xxs_are_counted_by_route_and_status(server):
    series = {
        "401": ("/v1/models", "401"),
        "400": ("/v1/images/generations", "400"),
        "404": ("unmatched", "404"),
        "405": ("unmatched", "405"),
        "413": ("/v1/videos", "413"),
    }

    def counts() -> dict[str, float]:
        scraped = scrape(server.metrics_port)
        return {
            key: requests_counted(scraped, application="locked", route=route, status=status)
            for key, (route, status) in series.items()
        }

    def settled():  # earlier tests' requests may still be on their way to the export port
        first = counts()
        time.sleep(3)
        return first if counts() == first else None

    before = wait_for(settled, timeout=60, interval=0, what="request counters to settle")
    with client(server.url) as http:
        for _ in range(3):
            error_of(http.get("/locked/v1/models"), 401)
        for _ in range(2):
            error_of(http.post("/locked/v1/images/generations", json={"prompt": ""}, headers=AUTH), 400)
        error_of(http.get("/locked/v1/no/such/route", headers=AUTH), 404)
        error_of(http.put("/locked/v1/models"), 405)
        error_of(http.post("/locked/v1/videos", content=b"x" * (LOCKED_BODY_LIMIT + 1), headers={**AUTH, **JSON}), 413)
    want = {"401": 3, "400": 2, "404": 1, "405": 1, "413": 1}

    def counted():
        now = counts()
        return now if all(now[k] - before[k] >= want[k] for k in want) else None

    now = wait_for(counted, timeout=60, what="request counters on the metrics export port")
    time.sleep(3)  # and no more than that
    assert {k: counts()[k] - before[k] for k in want} == want, now


def test_the_openapi_document_describes_the_bodies_the_routes_parse(server):
    with client(server.url) as http:
        doc = http.get("/openapi.json").json()
        locked = http.get("/locked/openapi.json", headers=AUTH).json()
    images = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]
    assert list(images) == ["application/json"]
    assert images["application/json"]["schema"]["required"] == ["prompt"]
    assert images["application/json"]["schema"]["properties"]["n"]["maximum"] == 4
    videos = doc["paths"]["/v1/videos"]["post"]["requestBody"]["content"]
    assert sorted(videos) == ["application/json", "multipart/form-data"]
    form = videos["multipart/form-data"]["schema"]["properties"]
    assert form["input_reference"]["format"] == "binary"
    assert videos["application/json"]["schema"]["properties"]["seconds"]["minimum"] == 5  # the model's rule
    assert "guidance_scale" not in videos["application/json"]["schema"]["properties"]
    listing = {p["name"] for p in doc["paths"]["/v1/videos"]["get"]["parameters"]}
    assert listing == {"limit", "after", "order", "X-Request-Id"}
    assert all("422" not in op["responses"] for path in doc["paths"].values() for op in path.values())
    assert locked["servers"] == [{"url": "/locked"}]
    for schema in (images["application/json"], videos["application/json"], videos["multipart/form-data"]):
        priority = schema["schema"]["properties"]["priority"]
        assert (priority["type"], priority["minimum"], priority["maximum"], priority["default"]) == (
            "integer",
            -10,
            10,
            0,
        )


# -- priority ---------------------------------------------------------------------------------
# (route, request kwargs carrying a bad priority, how the value is shown in the message)
BAD_PRIORITIES = [
    *(
        ("/v1/images/generations", {"json": {"prompt": "x", "priority": v}}, shown)
        for v, shown in (
            (11, "11"),
            (-11, "-11"),
            (1.5, "1.5"),
            ("3", "'3'"),
            (True, "True"),
            (None, "None"),
            ([1], "[1]"),
        )
    ),
    ("/v1/videos", {"json": {"prompt": "x", "priority": 2**70}}, str(2**70)),
    ("/v1/videos", {"json": {"prompt": "x", "priority": 7.0}}, "7.0"),  # a JSON float is not an integer
    ("/v1/videos", {"data": {"prompt": "x", "priority": "11"}}, "11"),  # a form's text, parsed, out of range
    ("/v1/videos", {"data": {"prompt": "x", "priority": "high"}}, "'high'"),
    ("/v1/videos", {"data": {"prompt": "x", "priority": "9" * 5000}}, "'999"),  # never parsed as an int
]


@pytest.mark.parametrize("path,kwargs,shown", BAD_PRIORITIES, ids=[f"{p} {k}"[:60] for p, k, _ in BAD_PRIORITIES])
def test_a_priority_out_of_range_or_not_an_integer_is_a_400_naming_it(server, path, kwargs, shown):
    with client(server.url) as http:
        error = error_of(http.post(path, **kwargs), 400)
    assert error["param"] == "priority", error
    assert "must be an integer from -10 to 10" in error["message"] and f"got {shown}" in error["message"], error


def test_a_priority_reaches_the_engine_with_the_request_and_stays_in_the_job_record(server):
    """A video posted as a form (priority as text) and an image as JSON, both held in the engine while the
    replica's diagnostics are read: each ticket carries the priority its request gave; the job's record keeps it."""
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
    long_video = {"prompt": "a slow pan", "seconds": "14", "num_inference_steps": "50", "priority": "-7"}
    image = {"prompt": "a bell", "size": "64x64", "num_inference_steps": 50, "priority": 10, "seed": 3}
    with client(server.url) as http, ThreadPoolExecutor(1) as pool:
        video = http.post("/v1/videos", data=long_video, headers={"X-Request-Id": "prio-video"})
        assert video.status_code == 200, video.text
        still = pool.submit(http.post, "/v1/images/generations", json=image, headers={"X-Request-Id": "prio-image"})

        def both_in_the_engine():
            requests = handle.diagnostics.remote().result()["requests"]
            return requests if {"prio-video", "prio-image-0"} <= set(requests) else None

        requests = wait_for(both_in_the_engine, timeout=120, interval=0.05, what="both requests in the engine")
        assert requests["prio-video"]["priority"] == -7 and requests["prio-image-0"]["priority"] == 10, requests
        assert still.result().status_code == 200
        record = json.loads((server.store / f"{video.json()['id']}.json").read_text())
        assert (record["request_id"], record["priority"], record["submissions"]) == ("prio-video", -7, 1)
        assert "priority" not in video.json()  # the OpenAI video object is unchanged
        assert http.delete(f"/v1/videos/{video.json()['id']}").status_code == 200
        # the edges of the range are accepted
        assert http.post("/v1/images/generations", json={**image, "num_inference_steps": 2, "priority": -10}).is_success


def test_a_cache_tier_is_listed_validated_and_served(server):
    """The deployment's step-cache tiers: listed by /v1/models and the OpenAPI document, a name outside them is a 400
    naming the field and the allowed values, and a request on a tier is generated."""
    allowed = ["off", "high", "low", "medium"]  # the built-in tiers; the deployment's default is off
    with client(server.url) as http:
        (model,) = http.get("/v1/models").json()["data"]
        assert (model["cache_tiers"], model["cache_default"]) == (allowed, "off")
        doc = http.get("/openapi.json").json()
        for path in ("/v1/images/generations", "/v1/videos"):
            cache = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
            assert (cache["cache"]["enum"], cache["cache"]["default"]) == (allowed, "off")
        for path, kwargs in (
            ("/v1/images/generations", {"json": {"prompt": "x", "cache": "ultra"}}),
            ("/v1/videos", {"data": {"prompt": "x", "cache": "ultra"}}),
        ):
            error = error_of(http.post(path, **kwargs), 400)
            assert error["param"] == "cache", error
            assert "must be one of off, high, low, medium, got 'ultra'" in error["message"], error
        still = {"prompt": "a bell", "size": "64x64", "num_inference_steps": 6, "cache": "low"}
        response = http.post("/v1/images/generations", json=still)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["b64_json"]


def test_a_bomb_or_a_truncated_keyframe_is_a_400_at_submit_and_never_a_job(server):
    """A 32000x32000 PNG of ~125 kB and a truncated PNG in every image field of POST /v1/videos, as JSON (base64)
    and as the openai client's multipart: a 400 naming the API's field, before anything is queued (the only route
    that takes images; /v1/images/generations takes none)."""
    import base64

    bomb, truncated = bomb_png(), truncated_png()
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 10)).save(buf, format="PNG")
    valid = buf.getvalue()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    def jobs(http) -> list[str]:
        return [v["id"] for v in http.get("/v1/videos", params={"limit": 100}).json()["data"]]

    with client(server.url) as http:
        before, records = jobs(http), sorted(server.store.glob("*.json"))
        for field, data, words in (
            ("input_reference", bomb, "is too large to decode"),
            ("last_reference", truncated, "is not a decodable image"),
        ):
            for kwargs in (
                {"json": {"prompt": "a fox", field: b64(data)}},
                {"data": {"prompt": "a fox"}, "files": {field: ("keyframe.png", data, "image/png")}},
            ):
                error = error_of(http.post("/v1/videos", **kwargs), 400)
                assert error["param"] == field and error["message"].startswith(f"{field}: {words}"), error
        for data in (bomb, truncated):
            as_json = {
                "json": {"prompt": "a fox", "references": [{"kind": "image", "data": b64(x)} for x in (valid, data)]}
            }
            uploads = [("references", (f"ref{i}.png", x, "image/png")) for i, x in enumerate((valid, data))]
            for kwargs in (as_json, {"data": {"prompt": "a fox"}, "files": uploads}):
                error = error_of(http.post("/v1/videos", **kwargs), 400)
                assert error["param"] == "references[1]", error
        assert jobs(http) == before and sorted(server.store.glob("*.json")) == records  # no job was ever made


def embedded_document(page: str) -> tuple[dict, str]:
    """The OpenAPI document a docs page carries inline, and the page around it."""
    opening = '<script id="openapi-document" type="application/json">'
    start = page.index(opening) + len(opening)
    end = page.index("</script>", start)
    return json.loads(page[start:end]), page[:start] + page[end:]


def test_the_docs_pages_carry_the_document_so_they_work_with_auth_on(server):
    """A browser does not send the token when Swagger or Redoc fetch a URL: the pages hold the document."""
    with client(server.url) as http:
        locked = http.get("/locked/openapi.json", headers=AUTH).json()
        for page in ("/locked/docs", "/locked/redoc"):
            response = http.get(page, headers=AUTH)
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
            inline, rest = embedded_document(response.text)
            assert inline == locked
            assert "openapi.json" not in rest and "spec-url" not in rest and "url:" not in rest, rest
        assert embedded_document(http.get("/docs").text)[0] == http.get("/openapi.json").json()
        open_doc = http.get("/openapi.json").json()
    # with a token the document declares it, so Swagger's Authorize button sends it; /health needs none
    assert locked["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    operations = {(method, path): op for path, methods in locked["paths"].items() for method, op in methods.items()}
    unsecured = {key for key, op in operations.items() if op.get("security") != [{"bearer": []}]}
    assert unsecured == {("get", "/health"), ("get", "/")}
    assert "securitySchemes" not in open_doc["components"]
    assert all("security" not in op for methods in open_doc["paths"].values() for op in methods.values())
    # every operation takes an X-Request-Id; the POSTs take timeout_s up to max_timeout_s
    without = [key for key, op in operations.items() if "X-Request-Id" not in {p["name"] for p in op["parameters"]}]
    assert not without
    # the generating POSTs take an Idempotency-Key header (Stripe's), nothing else does
    keyed = {key for key, op in operations.items() if "Idempotency-Key" in {p["name"] for p in op["parameters"]}}
    derived = {("post", f"/v1/videos/{{video_id}}/{action}") for action in ("remix", "extend")}
    assert keyed == {("post", "/v1/videos"), ("post", "/v1/images/generations"), *derived}, keyed
    key = next(p for p in operations["post", "/v1/videos"]["parameters"] if p["name"] == "Idempotency-Key")
    assert key["in"] == "header" and not key["required"] and key["schema"]["type"] == "string"
    body = locked["paths"]["/v1/videos"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["timeout_s"]["maximum"] == 3600


def test_the_bearer_scheme_is_case_insensitive(server):
    with client(server.url) as http:
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            response = http.get("/locked/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
            assert response.status_code == 200, (scheme, response.text)
        for wrong in (f"Basic {KEY}", f"Bearer {KEY}x", f"Bearer{KEY}", "bearer", f"Token {KEY}", f"{KEY} bearer"):
            error_of(http.get("/locked/v1/models", headers={"Authorization": wrong}), 401)


def test_a_request_id_is_echoed_or_made_and_a_malformed_one_refused(server):
    with client(server.url) as http:
        for sent in ("client-42:a.b_c", "x" * 64):
            response = http.get("/v1/models", headers={"X-Request-Id": sent})
            assert response.status_code == 200 and response.headers.get_list("x-request-id") == [sent]
        made = [http.get("/v1/models").headers.get_list("x-request-id") for _ in range(2)]
        assert all(len(ids) == 1 and REQUEST_ID.fullmatch(ids[0]) for ids in made) and made[0] != made[1], made
        for bad in ("x" * 65, "", "a b", "id/1", "ü".encode(), "<script>"):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/images/generations")):
                response = http.request(method, path, headers={"X-Request-Id": bad}, json={"prompt": "x"})
                error = error_of(response, 400)
                assert error["param"] == "X-Request-Id" and "1 to 64 characters" in error["message"], error
        # a locked app checks the id before the token: the 400 says what is wrong with it either way
        error_of(http.get("/locked/v1/models", headers={"X-Request-Id": "a b"}), 400)


def schemathesis(url: str, cwd, *args: str, overload: bool = False) -> subprocess.CompletedProcess:
    """The schemathesis command, in ``cwd`` (it keeps a .schemathesis/ cache where it runs). A 504 is no
    server error here: it is the answer to a timeout_s the fuzzer picks too short (5e-324 s, say). With
    ``overload``, neither is a 503: the documented answer when every engine queue is full (the fuzzer's
    video jobs fill them; tests/test_api_backpressure.py checks that answer's shape)."""
    config = cwd / "schemathesis.toml"
    statuses = ["2xx", "3xx", "4xx", "504"] + (["503"] if overload else [])
    config.write_text(f"[checks.not_a_server_error]\nexpected-statuses = {statuses!r}\n".replace("'", '"'))
    command = [
        *SCHEMATHESIS,
        "--config-file",
        str(config),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--seed",
        "7",
        "--workers",
        "1",
        "--phases",
        "examples,coverage,fuzzing",
        "--request-timeout",
        "60",
        "--max-examples",
        "15",
        "--suppress-health-check",
        "all",
        "--output-truncate",
        "true",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd)


def test_schema_fuzz_finds_no_5xx(server, tmp_path):
    # POST /v1/videos last and alone: the jobs it starts keep the engine busy, and an image request
    # meeting a full engine queue would rightly get a 503
    create = "create_video_v1_videos_post"
    runs = ((["--exclude-operation-id", create], False), (["--include-operation-id", create], True))
    for selection, overload in runs:  # the video jobs may fill every queue: a 503 is then the right answer
        result = schemathesis(server.url, tmp_path, *selection, overload=overload)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert " passed" in result.stdout and "Tested: 0" not in result.stdout, result.stdout[-3000:]
    with client(server.url) as http:  # and the server is still fine
        assert http.get("/health").status_code == 200


def test_the_playground_page_of_a_locked_server_asks_for_the_key_and_sends_it_as_a_bearer_token(server):
    """The locked application's page in a real browser (test_events_http drives the rest of the page; this one is
    here so that no application is started for it alone): it asks for the key, asks nothing without it, says so
    when a wrong key is refused, then loads the models with the right one, never putting the key in its URL."""
    from selenium.webdriver.common.by import By

    browser = browser_or_skip()
    try:
        browser.get(server.root + "/locked/")
        state = browser.find_element(By.ID, "auth-state")
        wait(browser, lambda d: state.text == "this server needs an API key", 30, "the page to ask for the key")
        assert not browser.find_elements(By.CSS_SELECTOR, "#model option")  # nothing was asked without it
        browser.find_element(By.ID, "key").send_keys("wrong")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait(browser, lambda d: "refused" in d.find_element(By.ID, "form-error").text, 30, "a wrong key refused")
        browser.find_element(By.ID, "key").send_keys(KEY)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"), 30, "the models")
        assert state.text == "key set" and KEY not in browser.current_url
        # api_key_env's key is tenant admin's: the page says whose key it is
        assert browser.find_element(By.ID, "tenant").text == "tenant admin (admin: every job)"
    finally:
        browser.quit()
