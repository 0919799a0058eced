"""Tenants over real HTTP against the session's `h3serve serve` (``served_apps._tenant_apps``): keys from a file re-read
every second; alpha and beta are users, ops an admin, rpm and steps carry one quota each. Every route's ownership,
the list's pagination, each quota's 429, the priority cap, key rotation and revocation while jobs run, and a schema
fuzz with a tenant's key."""

import os
import re

import pytest
import yaml

from tests.harness import client, error_of, scrape, wait_for, wait_video
from tests.served_apps import TENANT_KEYS, tenant_entries
from tests.test_api_http import schemathesis

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
P = "/tenants"


def auth(tenant: str, keys: dict[str, str] = TENANT_KEYS) -> dict:
    return {"Authorization": f"Bearer {keys[tenant]}"}


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def keys_file(server):
    return server.store.parent.parent / "tenants" / "keys.yaml"


def rewrite_keys(server, keys: dict[str, str], steps_limit: int = 1) -> None:
    """As a Secret update does: a new file renamed over the old one."""
    path = keys_file(server)
    tmp = path.with_suffix(".new")
    tmp.write_text(yaml.safe_dump({"keys": tenant_entries(keys, steps_limit)}))
    os.replace(tmp, path)


def create(http, tenant: str, steps: int = 2, keys=TENANT_KEYS, **fields):
    body = {"prompt": f"a bell for {tenant}", "num_inference_steps": steps, **fields}
    return http.post(f"{P}/v1/videos", json=body, headers=auth(tenant, keys))


def created(http, tenant: str, steps: int = 2, keys=TENANT_KEYS, **fields) -> str:
    response = create(http, tenant, steps, keys, **fields)
    assert response.status_code == 200, response.text
    return response.json()["id"]


def cancel_all(http, ids) -> None:
    for video_id in ids:
        http.post(f"{P}/v1/videos/{video_id}/cancel", headers=auth("ops"))


def test_me_names_the_tenant_and_no_key_is_a_401_but_on_health_and_the_page(server):
    with client(server.root) as http:
        me = http.get(f"{P}/v1/me", headers=auth("alpha")).json()
        assert me["name"] == "alpha" and me["role"] == "user" and me["max_priority"] == 1 and me["max_jobs"] == 2
        assert http.get(f"{P}/v1/me", headers=auth("ops")).json()["role"] == "admin"
        for headers in ({}, {"Authorization": "Bearer nope-0123456789abcdef"}):
            for path in ("/v1/me", "/v1/videos", "/v1/models", "/openapi.json", "/docs"):
                error_of(http.get(P + path, headers=headers), 401)
            assert http.get(f"{P}/health", headers=headers).status_code == 200
            assert http.get(f"{P}/", headers=headers).status_code == 200
        # a browser opening /docs without the header: a page asking for the key (the 401 still), holding no data
        page = http.get(f"{P}/docs", headers={"Accept": "text/html,application/xhtml+xml"})
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert 'id="key-form"' in page.text and "openapi-document" not in page.text and "/v1/videos" not in page.text
        assert "persistAuthorization: false" in page.text and "localStorage" not in page.text
        page = http.get(f"{P}/docs", headers=auth("beta"))
        assert page.status_code == 200 and "persistAuthorization: false" in page.text


def test_another_tenants_job_is_a_404_on_every_route_and_the_admin_sees_all(server):
    with client(server.root) as http:
        alpha_job = created(http, "alpha")
        assert wait_video(http, alpha_job, headers=auth("alpha"), prefix=P)["status"] == "completed"
        routes = [
            ("GET", f"/v1/videos/{alpha_job}"),
            ("GET", f"/v1/videos/{alpha_job}/content"),
            ("GET", f"/v1/videos/{alpha_job}/events"),
            ("POST", f"/v1/videos/{alpha_job}/cancel"),
            ("DELETE", f"/v1/videos/{alpha_job}"),
        ]
        for method, path in routes:
            error = error_of(http.request(method, P + path, headers=auth("beta")), 404)
            assert error["param"] == "video_id" and "no video job" in error["message"], (method, path, error)
        # the same answer as for a job that never existed: existence is not told
        never = "video_" + "0" * 32
        assert error_of(http.get(f"{P}/v1/videos/{never}", headers=auth("beta")), 404)["message"] == (
            f"no video job {never!r}"
        )
        assert alpha_job not in [v["id"] for v in http.get(f"{P}/v1/videos", headers=auth("beta")).json()["data"]]
        error_of(http.get(f"{P}/v1/videos", params={"after": alpha_job}, headers=auth("beta")), 400)
        # its owner and the admin get it on every route
        assert alpha_job in [v["id"] for v in http.get(f"{P}/v1/videos", headers=auth("alpha")).json()["data"]]
        assert alpha_job in [v["id"] for v in http.get(f"{P}/v1/videos", headers=auth("ops")).json()["data"]]
        for tenant in ("alpha", "ops"):
            assert http.get(f"{P}/v1/videos/{alpha_job}", headers=auth(tenant)).status_code == 200
            content = http.get(f"{P}/v1/videos/{alpha_job}/content", headers=auth(tenant))
            assert content.status_code == 200 and content.content[4:8] == b"ftyp"
            assert http.get(f"{P}/v1/videos/{alpha_job}/events", headers=auth(tenant)).status_code == 200
            error_of(http.post(f"{P}/v1/videos/{alpha_job}/cancel", headers=auth(tenant)), 409)  # finished
        assert http.delete(f"{P}/v1/videos/{alpha_job}", headers=auth("ops")).status_code == 200
        error_of(http.get(f"{P}/v1/videos/{alpha_job}", headers=auth("alpha")), 404)
        # an Idempotency-Key is the tenant's own: beta's same key is another request, another job
        same = {"Idempotency-Key": "shared-key-1"}
        body = {"prompt": "same", "num_inference_steps": 2}
        first = http.post(f"{P}/v1/videos", json=body, headers={**auth("alpha"), **same}).json()["id"]
        other = http.post(f"{P}/v1/videos", json=body, headers={**auth("beta"), **same}).json()["id"]
        again = http.post(f"{P}/v1/videos", json=body, headers={**auth("alpha"), **same}).json()["id"]
        assert first == again != other
        for video_id, tenant in ((first, "alpha"), (other, "beta")):
            wait_video(http, video_id, headers=auth(tenant), prefix=P)


def tenant_counter(server, name: str) -> dict[str, float]:
    """A tenant counter (``ray_h3serve_tenant_*_total``) by tenant, summed over this application's replicas."""
    counted: dict[str, float] = {}
    for sample in scrape(server.metrics_port).get(f"ray_h3serve_tenant_{name}_total", []):
        if sample.labels.get("application") == server.name:
            counted[sample.labels["tenant"]] = counted.get(sample.labels["tenant"], 0.0) + sample.value
    return counted


def test_seconds_of_gpu_and_row_steps_are_counted_by_tenant(server):
    """The replica splits each forward's seconds among the tenants of its requests (rows' share) and exports them by
    tenant, the ingress the row-steps it admitted: both grow with a tenant's job, labelled by key-file names only."""
    before = tenant_counter(server, "gpu_seconds")
    with client(server.root) as http:
        jobs = {tenant: created(http, tenant, steps=3) for tenant in ("alpha", "beta")}
        for tenant, job in jobs.items():
            assert wait_video(http, job, headers=auth(tenant), prefix=P)["status"] == "completed"

    def grown():
        gpu_s, row_steps = tenant_counter(server, "gpu_seconds"), tenant_counter(server, "row_steps")
        ran = all(gpu_s.get(t, 0.0) > before.get(t, 0.0) for t in jobs) and all(row_steps.get(t) for t in jobs)
        return ran and (gpu_s, row_steps)

    gpu_s, row_steps = wait_for(grown, timeout=60, what="the tenants' counters exported")
    assert set(gpu_s) | set(row_steps) <= set(TENANT_KEYS)  # bounded: names from the key file, never a key


def test_the_list_is_ones_own_newest_first_with_cursor_pagination(server):
    with client(server.root) as http:
        ids = [created(http, "beta") for _ in range(3)]
        created(http, "alpha")  # not beta's
        for video_id in ids:
            wait_video(http, video_id, headers=auth("beta"), prefix=P)
        seen, after = [], None
        while True:
            params = {"limit": 2, **({"after": after} if after else {})}
            page = http.get(f"{P}/v1/videos", params=params, headers=auth("beta")).json()
            assert page["object"] == "list" and len(page["data"]) <= 2
            assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
            seen += [v["id"] for v in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        # beta's only, newest first (created_at is whole seconds: jobs of one second go by id), no job twice
        assert set(ids) <= set(seen) and len(seen) == len(set(seen))
        jobs = {
            v["id"]: v for v in http.get(f"{P}/v1/videos", params={"limit": 100}, headers=auth("beta")).json()["data"]
        }
        order = [(jobs[i]["created_at"], i) for i in seen]
        assert order == sorted(order, reverse=True) and list(jobs) == seen
        everyone = http.get(f"{P}/v1/videos", params={"limit": 100}, headers=auth("ops")).json()["data"]
        assert set(seen) < {v["id"] for v in everyone}


def test_a_priority_over_the_tenants_cap_is_a_400_naming_the_range(server):
    with client(server.root) as http:
        error = error_of(create(http, "alpha", priority=2), 400)
        assert error["param"] == "priority" and "-10 to 1" in error["message"], error
        error = error_of(
            http.post(f"{P}/v1/images/generations", json={"prompt": "x", "priority": 5}, headers=auth("alpha")), 400
        )
        assert error["param"] == "priority"
        capped = created(http, "alpha", priority=1)
        created_by_ops = created(http, "ops", priority=10)  # no cap
        for video_id, tenant in ((capped, "alpha"), (created_by_ops, "ops")):
            wait_video(http, video_id, headers=auth(tenant), prefix=P)


def quota_error(response, limit: str) -> dict:
    error = error_of(response, 429)
    assert error["param"] == limit and limit in error["message"], error
    assert int(response.headers["retry-after"]) >= 1
    return error


def test_each_quota_is_a_429_with_retry_after_naming_it(server):
    with client(server.root) as http:
        # max_jobs 2: a long job holds the one pack slot, a second waits, a third is refused
        long_jobs = [created(http, "alpha", steps=40), created(http, "alpha", steps=40)]
        quota_error(create(http, "alpha"), "max_jobs")
        assert created(http, "beta")  # another tenant is not held by alpha's quota
        cancel_all(http, long_jobs)
        assert created(http, "alpha")  # its jobs ended: room again
        # requests_per_minute 2 (a bucket of 2): the third generation request within the minute
        rpm = [created(http, "rpm"), created(http, "rpm")]
        error = quota_error(create(http, "rpm"), "requests_per_minute")
        assert "2 generation requests a minute" in error["message"]
        quota_error(
            http.post(f"{P}/v1/images/generations", json={"prompt": "x"}, headers=auth("rpm")), "requests_per_minute"
        )
        assert http.get(f"{P}/v1/videos", headers=auth("rpm")).status_code == 200  # polls are not counted
        # max_row_steps: first learn a request's size from the 400 of a limit it can never fit under
        error = error_of(create(http, "steps"), 400)
        assert error["param"] == "max_row_steps"
        size = int(re.search(r"this request is (\d+) row-steps", error["message"]).group(1))
        rewrite_keys(server, TENANT_KEYS, steps_limit=size)  # room for one such request at a time
        wait_for(
            lambda: http.get(f"{P}/v1/me", headers=auth("steps")).json()["max_row_steps"] == size,
            15,
            0.3,
            "the key file re-read",
        )
        blocker = created(http, "ops", steps=40)  # holds the engine: steps' first job stays unfinished
        first = created(http, "steps")
        error = quota_error(create(http, "steps"), "max_row_steps")
        assert f"adds {size}" in error["message"]
        cancel_all(http, [blocker, first, *rpm])
        rewrite_keys(server, TENANT_KEYS)


def test_a_rotated_key_works_and_a_revoked_one_stops_within_seconds_while_jobs_run_none_lost(server):
    with client(server.root) as http:
        beta_job = created(http, "beta", steps=30)
        alpha_job = created(http, "alpha", steps=4)
        rotated = {**TENANT_KEYS, "beta": "beta-rotated-0123456789abcdef"}
        del rotated["alpha"]  # alpha revoked
        rewrite_keys(server, rotated)
        wait_for(
            lambda: http.get(f"{P}/v1/me", headers=auth("beta", rotated)).status_code == 200, 15, 0.3, "the rotated key"
        )
        error_of(http.get(f"{P}/v1/me", headers=auth("beta")), 401)  # the old key stopped
        error_of(http.get(f"{P}/v1/videos/{alpha_job}", headers=auth("alpha")), 401)
        # the jobs run on: beta follows its job with its new key, the admin sees alpha's end
        assert wait_video(http, beta_job, headers=auth("beta", rotated), prefix=P)["status"] == "completed"
        assert wait_video(http, alpha_job, headers=auth("ops"), prefix=P)["status"] == "completed"
        # a broken file fails closed (no key of it), the fixed one is taken again
        keys_file(server).write_text("keys: [{tenant: beta}]")
        wait_for(lambda: http.get(f"{P}/v1/me", headers=auth("ops")).status_code == 401, 15, 0.3, "a broken file")
        rewrite_keys(server, TENANT_KEYS)
        wait_for(lambda: http.get(f"{P}/v1/me", headers=auth("alpha")).status_code == 200, 15, 0.3, "the fixed file")
        assert http.get(f"{P}/v1/videos/{alpha_job}", headers=auth("alpha")).json()["status"] == "completed"


def test_schema_fuzz_with_a_tenants_key_finds_no_5xx(server, tmp_path):
    header = f"Authorization: Bearer {TENANT_KEYS['beta']}"
    create_op = "create_video_v1_videos_post"
    for selection, overload in (
        (["--exclude-operation-id", create_op], False),
        (["--include-operation-id", create_op], True),
    ):
        result = schemathesis(server.url, tmp_path, "--header", header, *selection, overload=overload)
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert " passed" in result.stdout and "Tested: 0" not in result.stdout, result.stdout[-3000:]
    with client(server.root) as http:
        assert http.get(f"{P}/health").status_code == 200
