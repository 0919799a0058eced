"""Starting, crashing and restarting h3serve: no start without the configured token, no video job left
'in_progress' by a dead ingress, and finished videos that outlive the server and the cluster."""

import asyncio
import concurrent.futures
import copy
import json
import os
import signal
import time
import uuid

import httpx
import pytest
import ray
import yaml
from ray import serve
from ray.serve import context
from ray.serve.schema import ServeDeploySchema
from ray.util.state import list_actors

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from h3serve.deploy.jobs.video_jobs import VideoJobs
from tests.harness import (
    ServeProcess,
    client,
    default_config,
    error_of,
    event_stream,
    free_port,
    gone,
    h3serve_inline,
    start_cluster,
    wait_for,
    wait_video,
    write_config,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e, pytest.mark.own_cluster]  # restarts its cluster
LEASE_S = 6
TERMINAL = ("completed", "failed", "cancelled")
LONG = {"prompt": "a long one", "seconds": 14, "num_inference_steps": 100}  # ~20 s on the tiny model
# kill -9 of the H3Replica to both jobs completed: Serve's replacement loading the tiny model, then the two runs
# (max_active 1) one after the other, on a 2-core machine shared with other suites
RECOVERED_S = 240
MAX_UNFINISHED = 3  # more than any other test here holds at once


class Server:
    """One cluster for the module, and at most one `h3serve serve` on it; both can be restarted."""

    def __init__(self, tmp):
        self.tmp, self.process = tmp, None
        self.address = start_cluster()
        config = default_config()
        args = config["applications"][0]["args"]
        args["jobs"] = {"store": str(tmp / "videos"), "lease_s": LEASE_S, "max_unfinished": MAX_UNFINISHED}
        args["limits"]["max_steps"] = LONG["num_inference_steps"]
        self.port = free_port()
        self.config = write_config(tmp, config, self.port)
        self.store = tmp / "videos" / config["applications"][0]["name"]
        self.starts = 0

    def start(self) -> ServeProcess:
        if self.process is None:
            self.starts += 1
            self.process = ServeProcess(self.config, self.address, self.port, log_name=f"serve-{self.starts}.log")
            self.process.wait_serving()
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None
        serve.shutdown()

    def restart_cluster(self) -> None:
        self.stop()
        ray.shutdown()
        self.address = start_cluster()

    def close(self) -> None:
        self.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("lifecycle"))
    try:
        yield server
    finally:
        server.close()


def keyed_config(tmp_path, env_var: str | None) -> os.PathLike:
    config = copy.deepcopy(default_config())
    args = config["applications"][0]["args"]
    if env_var is None:
        del args["api_key_env"]  # not open mode: the default names H3SERVE_API_KEY
    else:
        args["api_key_env"] = env_var
    return write_config(tmp_path, config, free_port(), "keyed.yaml")


def test_h3serve_serve_refuses_an_unset_or_empty_token_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.delenv("H3SERVE_API_KEY", raising=False)
    monkeypatch.setenv("H3_TEST_EMPTY_KEY", "")
    for config in (keyed_config(tmp_path, None), keyed_config(tmp_path, "H3_TEST_EMPTY_KEY")):
        result = h3serve_inline("serve", str(config))  # the command's own process is checked by every ServeProcess
        assert result.returncode == 2, result.stderr[-3000:]
        assert "environment variable is empty or unset" in result.stderr
        assert "api_key_env: null" in result.stderr  # says how to run open, explicitly
        assert not ray.is_initialized()  # refused before any Ray instance was started
    # with --address the replicas' environment decides: a plain `serve run` on a cluster without the token reaches
    # DEPLOY_FAILED, shown in test_deploy_admission's shared `serve run` (it needs no cluster of this module's)


def ingress_actors(address: str) -> list:
    return [
        a
        for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        if "H3Ingress" in (a.class_name or "")
    ]


def read_events(url: str, video_id: str, headers: dict | None = None) -> tuple[int, list[dict]]:
    """One connection to the job's event stream, read until it ends or breaks: (status, events read)."""
    text = ""
    try:
        with (
            client(url) as http,
            http.stream("GET", f"/v1/videos/{video_id}/events", headers=headers, timeout=LEASE_S + 90) as response,
        ):
            if response.status_code != 200:
                return response.status_code, []
            for chunk in response.iter_text():
                text += chunk
    except httpx.HTTPError:  # the ingress serving it died: what was read still counts
        pass
    return 200, event_stream(text)


def test_a_job_whose_ingress_crashed_is_taken_over_and_completes(server):
    """kill -9 of the ingress running a job: Serve starts another, whose sweeper finds the job's lease lapsed and
    takes it over from its stored request (requeued, reason ingress_lost); polled, the job completes; an event
    stream broken by the crash, resumed with Last-Event-ID as an EventSource does, reads on to completed."""
    process = server.start()
    with client(process.url) as http:
        job = http.post("/v1/videos", json=LONG).json()
        wait_for(
            lambda: http.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress",
            timeout=60,
            interval=0.2,
            what="the job to run",
        )
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            before = pool.submit(read_events, process.url, job["id"])
            wait_for(
                lambda: http.get("/v1/stats").json()["event_streams_open"] == 1,
                timeout=30,
                interval=0.2,
                what="the stream open",
            )
            (ingress,) = ingress_actors(server.address)
            ray.kill(ray.get_actor(ingress.name, namespace=ingress.ray_namespace), no_restart=True)  # no __del__
            status, read = before.result(timeout=60)
        assert status == 200 and read and read[-1]["event"] not in ("completed", "failed", "cancelled"), read
        seen = [e["id"] for e in read if e["id"] is not None]

        killed = time.monotonic()

        def resumed():  # reconnect until the new ingress answers, as an EventSource does every `retry` ms
            status, events = read_events(process.url, job["id"], headers={"Last-Event-ID": seen[-1]})
            return events if status == 200 and events and events[-1]["event"] in TERMINAL else None

        events = wait_for(resumed, timeout=LEASE_S + 180, interval=1, what="the resumed stream's final event")
        assert events[-1]["event"] == "completed", events[-3:]
        ids = [int(e["id"]) for e in events]
        assert all(i > int(seen[-1]) for i in ids) and ids == sorted(ids), (seen[-1], ids)  # read on, in order
        # the new runner's log (read from the store by a reader that came before the take-over), ids past the old one's
        assert any(e["event"] == "requeued" and e["data"]["reason"] == "ingress_lost" for e in events), events
        video = http.get(f"/v1/videos/{job['id']}").json()
        print(f"kill -9 of the ingress to its job completed: {time.monotonic() - killed:.1f} s")
        assert video["status"] == "completed" and http.get(f"/v1/videos/{job['id']}/content").status_code == 200
        record = json.loads((server.store / f"{job['id']}.json").read_text())
        assert (record["attempts"], record["epoch"]) == (2, 2), record


def test_an_in_place_update_of_the_ingress_args_mid_job_completes_the_job(server):
    """`serve deploy` of the same config with the ingress's args changed while a job steps: Serve rebuilds the
    application and rolls every replica (its code version hashes the args); the stopping ingress hands the job over
    (an open event stream would hold the old ingress for its graceful shutdown, and the job finish there), the new
    one takes it over and runs it on the new H3 replica: it completes, once, and its whole event stream, read from the
    new ingress (the store's log), says so and ends with it."""
    process = server.start()
    config = yaml.safe_load(server.config.read_text())
    limits = config["applications"][0]["args"]["limits"]
    limits["max_prompt_chars"] = limits.get("max_prompt_chars", 4000) + 1  # a change only the ingress reads
    with client(process.url) as http:
        job = http.post("/v1/videos", json=LONG).json()
        wait_for(
            lambda: http.get(f"/v1/videos/{job['id']}").json()["progress"] >= 5,
            timeout=120,
            interval=0.2,
            what="the job to step",
        )
        context._check_cached_client_alive()
        context._get_global_client().deploy_apps(ServeDeploySchema.model_validate(config), _blocking=False)
        updated = time.monotonic()

        def final():
            try:
                video = http.get(f"/v1/videos/{job['id']}")
            except httpx.HTTPError:  # between the old ingress and the new one
                return None
            return video.json() if video.status_code == 200 and video.json()["status"] in TERMINAL else None

        video = wait_for(final, timeout=RECOVERED_S, interval=0.5, what="the job to end after the update")
        took_s = time.monotonic() - updated
        status, events = read_events(process.url, job["id"])  # the whole stream, from the new ingress
    record = json.loads((server.store / f"{job['id']}.json").read_text())
    print(f"in-place update of the ingress args mid-job to the job {video['status']}: {took_s:.1f} s")
    print(f"the job's record: attempts {record['attempts']}, epoch {record['epoch']}")
    assert video["status"] == "completed", video
    assert status == 200 and events[-1]["event"] == "completed", events[-3:]
    assert events[-1]["data"]["video"]["status"] == "completed"
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(set(ids)), ids
    # handed over by the stopping ingress and run once more by the new one (or, had it finished before the old one
    # stopped, run once): never failed, never a second job
    assert (record["attempts"], record["epoch"]) in ((1, 1), (2, 2)), record
    if record["attempts"] == 2:
        assert any(e["event"] == "requeued" and e["data"]["reason"] == "ingress_lost" for e in events), events


def replica_pid(address: str) -> int:
    (replica,) = [
        a
        for a in list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        if "H3Replica" in (a.class_name or "")
    ]
    return replica.pid


def test_a_lost_replica_requeues_the_job_it_ran_and_the_one_waiting_and_both_complete(server):
    """kill -9 of the H3Replica process (an OOM kill, a lost node) while one job steps and another waits behind it
    (the served default: max_active 1): both are queued again (a ``requeued`` event naming why, the attempt counted
    in the record) on the replica Serve starts in its place, and both end completed, their streams with them."""
    process = server.start()
    with client(process.url) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = http.post("/v1/videos", json=LONG).json()
        waiting = http.post("/v1/videos", json={**LONG, "prompt": "the one behind it"}).json()
        streams = [pool.submit(read_events, process.url, job["id"]) for job in (running, waiting)]
        wait_for(
            lambda: http.get(f"/v1/videos/{running['id']}").json()["progress"] >= 5,
            timeout=120,
            interval=0.2,
            what="the first job to step",
        )
        assert http.get(f"/v1/videos/{waiting['id']}").json()["status"] == "queued"
        pid = replica_pid(server.address)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        assert gone(pid, 10)
        videos = [wait_video(http, job["id"], timeout=RECOVERED_S) for job in (running, waiting)]
        recovered_s = time.monotonic() - killed
        print(f"kill -9 of the H3Replica to both jobs completed: {recovered_s:.1f} s")
        for video in videos:
            assert video["status"] == "completed", video
            assert http.get(f"/v1/videos/{video['id']}/content").status_code == 200
            record = json.loads((server.store / f"{video['id']}.json").read_text())
            assert (record["attempts"], record["max_attempts"]) == (2, 3), record
        for stream in streams:
            status, events = stream.result(timeout=60)
            kinds = [e["event"] for e in events]
            assert status == 200 and kinds[-1] == "completed", kinds
            (requeued,) = [e["data"] for e in events if e["event"] == "requeued"]
            assert requeued["attempt"] == 2 and requeued["max_attempts"] == 3, requeued
            assert "Actor" in requeued["reason"] or "Engine" in requeued["reason"], requeued  # RayActorError's kin
            assert kinds.index("requeued") < len(kinds) - 1 and "queued" in kinds[kinds.index("requeued") :], kinds


def other_ingress(server) -> VideoJobs:
    """A second ingress replica of the application, in this process: the code an H3Ingress replica runs for its
    jobs (``VideoJobs``) over the same store, not running the jobs the served ingress runs."""
    policy = JobPolicy(ttl_s=3600, max_bytes=2**30, lease_s=LEASE_S, max_unfinished=256)
    return VideoJobs(JobStore(MediaStore(str(server.store)), policy), None, None)  # type: ignore[arg-type]


def test_a_cancel_asked_on_the_other_ingress_stops_the_job_and_every_answer_agrees(server):
    """The job runs on the served ingress; the cancel is asked on another replica (it writes the request into the
    store): the runner sees it at its next write or heartbeat, stops the job at a step boundary and records it
    cancelled; the other replica answers cancelled, the record and the runner's event stream say the same."""
    process = server.start()
    other = other_ingress(server)
    with client(process.url) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        job = http.post("/v1/videos", json=LONG).json()
        stream = pool.submit(read_events, process.url, job["id"])
        there = pool.submit(other_events, other_ingress(server), job["id"])  # its stream on the other replica
        wait_for(
            lambda: http.get(f"/v1/videos/{job['id']}").json()["progress"] >= 5,
            timeout=120,
            interval=0.2,
            what="the job to step",
        )
        asked = time.monotonic()
        answer = asyncio.run(other.cancel(job["id"]))
        took_s = time.monotonic() - asked
        assert answer is not None and answer["status"] == "cancelled", answer
        assert took_s < LEASE_S / 4 + 3, took_s  # the runner's next progress write or heartbeat, not its lease
        assert http.get(f"/v1/videos/{job['id']}").json()["status"] == "cancelled"
        status, events = stream.result(timeout=60)
        assert status == 200 and events[-1]["event"] == "cancelled", events[-3:]
        assert events[-1]["data"]["video"]["status"] == "cancelled"
        elsewhere = there.result(timeout=60)
        assert [(e["id"], e["event"]) for e in elsewhere][-1] == (events[-1]["id"], "cancelled"), elsewhere[-3:]
        assert error_of(http.post(f"/v1/videos/{job['id']}/cancel"), 409)["param"] == "video_id"


SHORT = {"prompt": "a short one", "num_inference_steps": 4}


def other_events(other: VideoJobs, video_id: str, after: int = 0) -> list[dict]:
    """The job's event stream as the other ingress replica serves it (its route's own call), read to its end."""

    async def read() -> str:
        video = await other.get(video_id)
        assert video is not None
        chunks = [chunk async for chunk in await other.event_stream(video_id, video, after)]
        return b"".join(chunks).decode()

    return event_stream(asyncio.run(read()))


def test_the_other_ingress_streams_the_same_events_with_the_same_ids_and_resumes(server):
    """A job runs on the served ingress; its stream read over HTTP there and from the other replica (which reads the
    log the runner keeps in the store) has the same events with the same ids (previews: the newest stored when read),
    both end with the record's final status, and the other one resumes after a Last-Event-ID."""
    process = server.start()
    other = other_ingress(server)
    body = {"prompt": "streamed twice", "num_inference_steps": 12}
    with client(process.url) as http, concurrent.futures.ThreadPoolExecutor(2) as pool:
        job = http.post("/v1/videos", json=body).json()
        here = pool.submit(read_events, process.url, job["id"])
        there = pool.submit(other_events, other, job["id"])
        status, events = here.result(timeout=180)
        elsewhere = there.result(timeout=60)
        record = http.get(f"/v1/videos/{job['id']}").json()
    assert status == 200 and record["status"] == "completed", record
    kinds = [e["event"] for e in events]
    assert {"queued", "started", "step", "decoding"} <= set(kinds) and kinds[-1] == "completed", kinds

    def not_previews(stream):
        return [(e["id"], e["event"], e["data"]) for e in stream if e["event"] != "preview"]

    assert not_previews(elsewhere) == not_previews(events), (elsewhere, events)
    assert {e["id"] for e in elsewhere if e["event"] == "preview"} <= {e["id"] for e in events}
    assert elsewhere[-1]["data"]["video"] == events[-1]["data"]["video"] and record["status"] == kinds[-1]
    middle = next(int(e["id"]) for e in events if e["event"] == "step")
    resumed = other_events(other, job["id"], middle)
    assert not_previews(resumed) == [x for x in not_previews(events) if int(x[0]) > middle]


def test_a_cancel_racing_completion_gives_one_answer(server):
    """Cancels sent as a short job finishes, over many tries, here and on the other ingress: whichever status the
    record took first is the answer (200 cancelled, or 409 when it had completed), the record's and the stream's."""
    process = server.start()
    other = other_ingress(server)
    outcomes: dict[str, int] = {}
    with client(process.url) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        took = http.post("/v1/videos", json=SHORT).json()
        whole_s = wait_video(http, took["id"], timeout=120)["completed_at"] - took["created_at"] + 1
        for attempt in range(16):
            job = http.post("/v1/videos", json=SHORT).json()
            stream = pool.submit(read_events, process.url, job["id"])
            time.sleep(whole_s * (attempt % 8) / 8)
            if attempt % 2:  # the other ingress: through the store
                try:
                    answer = asyncio.run(other.cancel(job["id"]))
                    status, video = 200, answer
                except APIError as e:
                    status, video = e.status, None
            else:
                response = http.post(f"/v1/videos/{job['id']}/cancel")
                status, video = response.status_code, response.json()
            final = wait_video(http, job["id"], timeout=120) if status == 409 else http.get(f"/v1/videos/{job['id']}")
            record = final if status == 409 else final.json()
            read_status, events = stream.result(timeout=60)
            assert read_status == 200 and events[-1]["data"]["video"]["status"] == record["status"], (events, record)
            if status == 200:
                assert video["status"] == record["status"] == events[-1]["event"] == "cancelled", (video, record)
            else:
                assert status == 409 and record["status"] == events[-1]["event"] == "completed", (status, record)
            outcomes[record["status"]] = outcomes.get(record["status"], 0) + 1
    print(f"cancel racing completion, 16 tries: {outcomes}")
    assert sum(outcomes.values()) == 16


def test_unfinished_jobs_over_their_cap_get_429_and_finished_ones_are_not_counted(server):
    """jobs.max_unfinished jobs queued or running: one more is a 429 with Retry-After in the API's error shape, and
    leaves no job; once they end (cancelled here) new jobs are accepted again, however many finished jobs there are."""
    process = server.start()
    with client(process.url) as http:
        before = len(http.get("/v1/videos", params={"limit": 100}).json()["data"])
        held = [http.post("/v1/videos", json=LONG).json()["id"] for _ in range(MAX_UNFINISHED)]
        refused = http.post("/v1/videos", json=LONG)
        error = error_of(refused, 429)
        assert "unfinished" in error["message"], error
        assert refused.headers["retry-after"] == "2"
        assert len(http.get("/v1/videos", params={"limit": 100}).json()["data"]) == before + MAX_UNFINISHED
        for video_id in held:
            assert http.post(f"/v1/videos/{video_id}/cancel").json()["status"] == "cancelled"
        again = http.post("/v1/videos", json=SHORT)
        assert again.status_code == 200, again.text
        assert wait_video(http, again.json()["id"], timeout=120)["status"] == "completed"


def test_a_post_retried_with_its_idempotency_key_is_the_same_job(server):
    """A client that retries POST /v1/videos (a proxy timed out) with the same Idempotency-Key gets the same job, as
    it reads now, and no second job; the same key with another body is a 422 naming the header. Images alike."""
    process = server.start()
    key = {"Idempotency-Key": f"retry-{uuid.uuid4().hex}"}
    body = {**SHORT, "prompt": f"the retried one {key['Idempotency-Key']}"}
    with client(process.url) as http:
        first = http.post("/v1/videos", json=body, headers=key)
        again = http.post("/v1/videos", data={k: str(v) for k, v in body.items()}, headers=key)  # as a form this time
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert again.json()["id"] == first.json()["id"]
        assert (
            error_of(http.post("/v1/videos", json={**body, "seed": 7}, headers=key), 422)["param"] == "Idempotency-Key"
        )
        assert wait_video(http, first.json()["id"], timeout=120)["status"] == "completed"
        late = http.post("/v1/videos", json=body, headers=key).json()
        assert late["id"] == first.json()["id"] and late["status"] == "completed"  # the job as it reads now
        listed = http.get("/v1/videos", params={"limit": 100}).json()["data"]
        assert [v["id"] for v in listed if v["prompt"] == body["prompt"]] == [first.json()["id"]]
        assert error_of(http.post("/v1/videos", json=body, headers={"Idempotency-Key": "a b"}), 400)["param"] == (
            "Idempotency-Key"
        )
        image = {"prompt": "a bell", "size": "64x64", "num_inference_steps": 2}
        shots = [http.post("/v1/images/generations", json=image, headers=key) for _ in range(2)]
        assert [s.status_code for s in shots] == [200, 200] and shots[0].json() == shots[1].json()
        other = http.post("/v1/images/generations", json={**image, "seed": 1}, headers=key)
        assert error_of(other, 422)["param"] == "Idempotency-Key"


def test_a_finished_video_outlives_the_server_and_the_cluster(server):
    process = server.start()
    with client(process.url) as http:
        done = http.post("/v1/videos", json={"prompt": "a short one", "num_inference_steps": 2}).json()
        assert wait_video(http, done["id"])["status"] == "completed"
        mp4 = http.get(f"/v1/videos/{done['id']}/content").content
        running = http.post("/v1/videos", json=LONG).json()
        wait_for(
            lambda: http.get(f"/v1/videos/{running['id']}").json()["progress"] > 0,
            timeout=60,
            interval=0.2,
            what="the long job to make progress",
        )

    server.restart_cluster()  # Ctrl-C on `h3serve serve`, and a new Ray cluster: nothing in memory survives
    process = server.start()
    with client(process.url) as http:
        video = http.get(f"/v1/videos/{done['id']}").json()
        assert video["status"] == "completed" and video["expires_at"] > video["completed_at"]
        content = http.get(f"/v1/videos/{done['id']}/content")
        assert content.status_code == 200 and content.content == mp4
        # the job that was running when the server stopped was handed over (or its lease lapsed): the new server
        # takes it over from its stored request and runs it to the end, never leaving it 'in_progress' forever
        resumed = wait_video(http, running["id"], timeout=LEASE_S + 180)
        assert resumed["status"] == "completed", resumed
        assert json.loads((server.store / f"{running['id']}.json").read_text())["attempts"] >= 2
        listed = http.get("/v1/videos").json()
        assert {done["id"], running["id"]} <= {v["id"] for v in listed["data"]}
        assert http.delete(f"/v1/videos/{done['id']}").status_code == 200
        assert http.get(f"/v1/videos/{done['id']}/content").status_code == 404
