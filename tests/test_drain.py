"""Drain: an H3 replica that Serve stops (here a scale-down from 2 to 1) finishes the video it is generating and
hands back, at once, the one it never started; the ingress runs that one on the other replica. Real Ray Serve,
two H3Replica replicas of the tiny model, real HTTP, the job store read as the operator would."""

import json
import time

import pytest
from ray import serve
from ray.serve import context
from ray.serve.schema import ServeDeploySchema

from h3serve.deploy.common.metrics import STAGES
from tests.harness import (
    ServeProcess,
    client,
    default_config,
    free_port,
    scrape,
    serve_status,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
# Each replica runs one video (max_active 1) and queues one more (max_queue 1), and answers a third with 503 at
# POST time: four accepted jobs are one running and one queued on each replica. A video takes long enough (tens
# of seconds on the tiny model) that the scale-down lands while the first still runs.
JOB = {"prompt": "a slow pan over a city", "seconds": 14, "num_inference_steps": 60, "priority": 3}


def drain_config(store, port: int, h3_replicas: int) -> dict:
    config = default_config()
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"]["rank_resources"] = {"CPU": 0.25}
    app["args"]["engine"] = {"max_queue": 1, "max_active": 1, "drain_timeout_s": 300}
    app["args"]["limits"]["max_steps"] = JOB["num_inference_steps"]
    app["args"]["jobs"] = {"store": str(store), "lease_s": 30}
    app["args"]["ingress"] = {"h3_replicas": 2}  # the most H3 replicas it runs: only num_replicas scales down
    app["deployments"] = [
        {"name": "H3Ingress", "num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}},
        {"name": "H3Replica", "num_replicas": h3_replicas},
    ]
    return config


def replica_views(handle, want: int = 2, tries: int = 60) -> dict[str, dict]:
    """diagnostics() of each H3 replica the handle reaches, by replica id (the router picks one per call)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        info = handle.diagnostics.remote().result()
        seen[info["replica"]] = info
        if len(seen) == want:
            break
    return seen


def record(store, video_id: str) -> dict:
    """The job's record as the store holds it: the video object, its request id, how often it was submitted."""
    return json.loads((store / "h3serve" / f"{video_id}.json").read_text())


def counted(metrics_port: int, series: str, **labels: str) -> float:
    return sum(
        s.value for s in scrape(metrics_port).get(series, []) if all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_scale_down_finishes_the_active_video_and_runs_the_queued_one_elsewhere(ray_cluster, tmp_path):
    store, port = tmp_path / "videos", free_port()
    config = drain_config(store, port, h3_replicas=2)
    process = ServeProcess(write_config(tmp_path, config, port), ray_cluster.address, port)
    # the session's cluster counts earlier modules' requests too: what this test adds is what it checks
    metrics = ray_cluster.metrics_port
    handed_back_before = counted(metrics, "ray_h3serve_failed_requests_total", reason="draining")
    stages_before = {stage: counted(metrics, "ray_h3serve_stage_seconds_count", stage=stage) for stage in STAGES}
    try:
        process.wait_serving()
        handle = serve.get_deployment_handle("H3Replica", app_name="h3serve")
        jobs: dict[str, str] = {}  # request id -> video id
        with client(process.url) as http:
            for i in range(4):
                request_id = f"drain-{i}"

                def accepted(rid=request_id):
                    response = http.post("/v1/videos", json=JOB, headers={"X-Request-Id": rid})
                    if response.status_code == 503:  # Serve routed it to a full replica: the client retries
                        assert response.headers["retry-after"], response.headers
                        return None
                    assert response.status_code == 200, response.text
                    return response

                response = wait_for(accepted, timeout=120, interval=0.5, what=f"a replica to accept {request_id}")
                assert response.headers["x-request-id"] == request_id
                jobs[request_id] = response.json()["id"]

            def one_running_one_waiting_on_each():
                views = replica_views(handle)
                placed = {
                    replica: {rid: r["forwards"] for rid, r in view["requests"].items()}
                    for replica, view in views.items()
                }
                ok = len(placed) == 2 and all(
                    sorted(f > 0 for f in reqs.values()) == [False, True] for reqs in placed.values()
                )
                return placed if ok else None

            placed = wait_for(one_running_one_waiting_on_each, timeout=120, interval=0.5, what="2 + 2 placement")

            # scale 2 -> 1 the way an operator does: the same config with num_replicas 1 (no rebuild, no admission)
            context._check_cached_client_alive()
            context._get_global_client().deploy_apps(
                ServeDeploySchema.model_validate(drain_config(store, port, h3_replicas=1)), _blocking=False
            )

            def stopped_replica():
                states = serve_status().applications["h3serve"].deployments["H3Replica"].replica_states
                if states.get("STOPPING", 0) != 1:
                    return None
                reached = replica_views(handle, want=1, tries=5)
                return next(r for r in placed if r not in reached) if len(reached) == 1 else None

            removed = wait_for(stopped_replica, timeout=60, interval=0.2, what="Serve to stop one H3 replica")
            running_id = next(rid for rid, forwards in placed[removed].items() if forwards > 0)
            queued_id = next(rid for rid, forwards in placed[removed].items() if forwards == 0)

            # the queued one is handed back at once, not after the drain: counted (under its own reason, not
            # an error a client saw) while the replica that had it still runs its video
            wait_for(
                lambda: counted(metrics, "ray_h3serve_failed_requests_total", reason="draining") > handed_back_before,
                timeout=30,
                interval=0.5,
                what="the hand-back to be counted",
            )
            assert record(store, jobs[running_id])["video"]["status"] == "in_progress"
            states = serve_status().applications["h3serve"].deployments["H3Replica"].replica_states
            assert states.get("STOPPING") == 1, states

            # its ingress queues it on the remaining replica as soon as that has room; it never fails meanwhile
            def resubmitted():
                kept = record(store, jobs[queued_id])
                assert kept["video"]["status"] == "queued", kept
                return kept["submissions"] == 2

            wait_for(resubmitted, timeout=300, interval=0.5, what=f"{queued_id} to be queued again")
            # re-submitted with the priority its client asked for
            (kept_view,) = [v for v in replica_views(handle, want=1, tries=5).values() if queued_id in v["requests"]]
            assert kept_view["requests"][queued_id]["priority"] == 3, kept_view
            # the kept replica's own second video (queued there at the scale-down, running or next now) plays no
            # part in the drain: cancelled, so the handed-back one runs next instead of a whole 60-step video later
            (kept,) = set(placed) - {removed}
            own_second = next(rid for rid, forwards in placed[kept].items() if forwards == 0)
            assert http.post(f"/v1/videos/{jobs[own_second]}/cancel").status_code == 200

            finished = {}
            for request_id, video_id in jobs.items():
                deadline = time.time() + 600
                while time.time() < deadline:
                    video = http.get(f"/v1/videos/{video_id}").json()
                    if video["status"] in ("completed", "failed", "cancelled"):
                        break
                    time.sleep(0.5)
                finished[request_id] = video
            expected = {rid: "cancelled" if rid == own_second else "completed" for rid in jobs}
            assert {rid: v["status"] for rid, v in finished.items()} == expected, finished
            for request_id, video_id in jobs.items():
                kept_record = record(store, video_id)
                assert kept_record["request_id"] == request_id
                assert kept_record["submissions"] == (2 if request_id == queued_id else 1), (request_id, kept_record)
                assert kept_record["priority"] == 3, kept_record
                if request_id != own_second:
                    mp4 = http.get(f"/v1/videos/{video_id}/content")
                    assert mp4.status_code == 200 and mp4.content[4:8] == b"ftyp"

        # the removed replica left once its last stream ended, long before drain_timeout_s + margin
        def settled():
            states = serve_status().applications["h3serve"].deployments["H3Replica"].replica_states
            return states == {"RUNNING": 1}

        wait_for(settled, timeout=60, interval=0.5, what="the stopped replica to exit")

        # every stage of a request is observed, MP4 encoding included
        def stages_observed():
            return all(
                counted(metrics, "ray_h3serve_stage_seconds_count", stage=stage) > stages_before[stage]
                for stage in STAGES
            )

        wait_for(stages_observed, timeout=30, interval=0.5, what=f"observations of every stage {STAGES}")
        assert set(replica_views(handle, want=1, tries=5)) == set(placed) - {removed}
    finally:
        process.stop()
