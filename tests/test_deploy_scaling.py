"""Several replicas: admission once per app, never in a replica; overload is 503; autoscaling; auth."""

import asyncio
import copy

import httpx
import pytest
import ray
from ray import serve

from h3serve.deploy.common.metrics import admission_recorder
from tests.harness import ServeProcess, client, default_config, free_port, serve_status, wait_for, write_config

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
KEY = "test-secret"


def multi_app_config() -> dict:
    base = default_config()
    template = base["applications"][0]
    template["args"]["rank_resources"] = {"CPU": 0.25}

    def app(name: str, route: str, args: dict, replica: dict, **extra) -> dict:
        new = copy.deepcopy(template)
        new.update(name=name, route_prefix=route, **extra)
        new["args"].update(args)
        # the ingress is sized for the most H3 replicas the app runs; `h3serve serve` checks they agree
        most = replica.get("num_replicas") or replica["autoscaling_config"]["max_replicas"]
        new["args"]["ingress"] = {"h3_replicas": most}
        new["deployments"] = [
            {"name": "H3Ingress", "ray_actor_options": {"num_cpus": 0.05}},
            {"name": "H3Replica", **replica},
        ]
        return new

    base["applications"] = [
        app("h3serve", "/", {}, {"num_replicas": 2}),
        app(
            "busy",
            "/busy",
            {"engine": {"max_queue": 1, "max_active": 1}, "api_key_env": "H3_TEST_KEY"},
            {"num_replicas": 1},
            runtime_env={"env_vars": {"H3_TEST_KEY": KEY}},
        ),
        app(
            "elastic",
            "/elastic",
            {"engine": {"max_queue": 8, "max_active": 2}},
            {
                "autoscaling_config": {
                    "min_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 1,
                    "upscale_delay_s": 0.5,
                    "downscale_delay_s": 600,
                    "metrics_interval_s": 0.5,
                    "look_back_period_s": 2,
                }
            },
        ),
    ]
    return base


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    port = free_port()
    config = write_config(tmp_path_factory.mktemp("multi"), multi_app_config(), port)
    # the session's cluster holds one admission recorder for every module: this server's decisions come after these
    decided_before = len(ray.get(admission_recorder().decisions_log.remote()))
    process = ServeProcess(config, ray_cluster.address, port)
    process.decided_before = decided_before
    try:
        process.wait_serving(apps=3)
        yield process
    finally:
        process.stop()


def test_admission_ran_once_per_app_in_the_driver_and_never_in_a_replica(server):
    recorder = ray.get_actor("h3serve-admission-metrics", namespace="h3serve")
    log = ray.get(recorder.decisions_log.remote())[server.decided_before :]
    # one pre-flight (h3serve serve) and one build per application, however many replicas
    assert sorted(entry["stage"] for entry in log) == ["build"] * 3 + ["preflight"] * 3
    assert all(entry["outcome"] == "admitted" and entry["backend"] == "torch_sdpa" for entry in log)

    handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
    seen = {}
    for _ in range(40):
        info = handle.diagnostics.remote().result()
        seen[info["replica"]] = info
        if len(seen) == 2:
            break
    assert len(seen) == 2, "expected two H3 replicas"
    assert all(info["selector_calls"] == 0 for info in seen.values()), seen
    assert {info["backend"] for info in seen.values()} == {"torch_sdpa"}


def test_bearer_token_is_required_when_configured(server):
    with client(server.url) as http:
        body = {"prompt": "x", "size": "64x64", "num_inference_steps": 2}
        assert http.post("/busy/v1/images/generations", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert http.post("/busy/v1/images/generations", json=body, headers=wrong).status_code == 401
        ok = http.post("/busy/v1/images/generations", json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200
        assert http.get("/busy/health").status_code == 200  # probes need no token


async def burst(url: str, n: int, prefix: str, headers: dict | None = None, steps: int = 30):
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as http:
        body = {"prompt": "load", "size": "64x64", "num_inference_steps": steps}
        return await asyncio.gather(*(http.post(f"{prefix}/v1/images/generations", json=body) for _ in range(n)))


def test_overload_gets_503s_with_retry_after_not_hangs_or_500s(server):
    responses = asyncio.run(burst(server.url, 10, "/busy", {"Authorization": f"Bearer {KEY}"}))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 5 and codes.count(200) >= 2, codes
    rejected = next(r for r in responses if r.status_code == 503)
    assert rejected.headers["retry-after"] == "2"
    assert "queue is full" in rejected.json()["error"]["message"]


def test_load_scales_the_h3_deployment_from_one_to_two_replicas(server):
    def running() -> int:
        deployment = serve_status().applications["elastic"].deployments["H3Replica"]
        return deployment.replica_states.get("RUNNING", 0)

    assert running() == 1

    async def load_until_scaled():
        task = asyncio.ensure_future(burst(server.url, 8, "/elastic", steps=40))
        try:
            return await asyncio.to_thread(wait_for, lambda: running() >= 2, 120, 1.0, "a second replica")
        finally:
            responses = await task
            assert all(r.status_code == 200 for r in responses), [r.status_code for r in responses]

    asyncio.run(load_until_scaled())
    assert running() == 2
