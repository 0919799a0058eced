"""The event log a job's readers follow, and the record-following fallback, without Ray: ``h3serve.deploy.jobs.events``
on real
asyncio and a real job store (a directory), as an ingress replica uses them."""

import asyncio
import json
import uuid

import pytest

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.jobs.events import EventLog, follow_store, last_event_id
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from h3serve.deploy.jobs.video_jobs import VideoJobs


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def parse(chunks: list[bytes]) -> list[dict]:
    events = []
    for block in b"".join(chunks).decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line and not line.startswith(":"))
        if "event" in fields:
            events.append({"id": fields.get("id"), "event": fields["event"], "data": json.loads(fields["data"])})
    return events


async def read(stream, until: str | None = None) -> list[bytes]:
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if until is not None and until.encode() in chunk:
            break
    return chunks


def test_last_event_id_is_a_decimal_id_or_a_400_naming_the_header():
    assert last_event_id(None) == 0 and last_event_id("") == 0 and last_event_id(" 17 ") == 17
    for bad in ("x", "-1", "1e3", "9" * 10, "1 2"):
        with pytest.raises(APIError) as refused:
            last_event_id(bad)
        assert refused.value.status == 400 and refused.value.param == "Last-Event-ID"


def test_readers_get_what_follows_their_id_live_and_the_stream_ends_at_the_final_event():
    async def scenario():
        log = EventLog()
        log.publish("queued", {"position": 2})
        live = asyncio.create_task(read(log.follow(0)))
        await asyncio.sleep(0.01)  # the reader waits: nothing new yet
        assert not live.done()
        log.publish("started", {})
        for step in (1, 2, 3):  # a reader that keeps up sees every event (one that lags, only the newest preview)
            await asyncio.sleep(0.01)
            log.publish("step", {"step": step, "steps": 3})
            await asyncio.sleep(0.01)
            log.publish("preview", {"step": step, "image": f"png{step}"})
        log.publish("completed", {"video": {"status": "completed"}})
        everything = parse(await asyncio.wait_for(live, 5))
        resumed = parse(await read(log.follow(3)))  # after the first step event
        with pytest.raises(RuntimeError, match="after the job's final event"):
            log.publish("step", {})
        return everything, resumed

    everything, resumed = asyncio.run(scenario())
    assert [e["event"] for e in everything][:3] == ["queued", "started", "step"]
    assert everything[-1]["event"] == "completed"
    assert [int(e["id"]) for e in everything] == list(range(1, 10))
    # a resumed reader gets what followed id 3, less the previews a newer one superseded
    assert [(e["id"], e["event"]) for e in resumed] == [
        ("5", "step"),
        ("7", "step"),
        ("8", "preview"),
        ("9", "completed"),
    ]
    assert resumed[2]["data"]["image"] == "png3"


def test_an_idle_reader_gets_keepalive_comments():
    async def scenario():
        log = EventLog()
        log.publish("queued", {"position": 1})
        stream = log.follow(1, keepalive_s=0.05)
        chunks = [await stream.__anext__() for _ in range(3)]  # retry, then two keep-alives
        await stream.aclose()
        return chunks

    retry, *keepalives = asyncio.run(scenario())
    assert retry.startswith(b"retry: ") and keepalives == [b": keep-alive\n\n"] * 2


@pytest.fixture(params=["dir", "memory"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "videos") if request.param == "dir" else f"memory://h3serve-events-{uuid.uuid4().hex}"


def video_object() -> dict:
    return {
        "id": f"video_{uuid.uuid4().hex}",
        "object": "video",
        "status": "queued",
        "progress": 0,
        "created_at": 0,
        "completed_at": None,
        "error": None,
    }


def test_another_ingress_serves_the_same_stream_from_the_store_and_resumes_it(url):
    """Two ingress replicas' job code over one store (a directory, or fsspec's memory://): the job runs on A; B, which
    does not run it, streams the same events with the same ids from the stored log (previews: the newest the log held
    when read), resumes after a Last-Event-ID, and ends with the record's final status. A's log in the store stays
    bounded: one preview."""
    policy = JobPolicy(ttl_s=600, max_bytes=10**6, lease_s=60, max_unfinished=9)
    a, b = (VideoJobs(JobStore(MediaStore(url), policy), None, None) for _ in range(2))  # type: ignore[arg-type]
    video = video_object()
    job_id = video["id"]

    async def scenario():
        runner = await asyncio.to_thread(a.store.create, video)
        log = a._follow_here(runner)
        log.publish("queued", {"position": 1, "eta_s": 2.0})
        here = asyncio.create_task(read(await a.event_stream(job_id, video, 0)))
        there = asyncio.create_task(read(await b.event_stream(job_id, video, 0)))
        log.publish("started", {})
        for step in (1, 2, 3, 4):
            log.publish("step", {"step": step, "steps": 4, "eta_s": 4 - step})
            log.publish("preview", {"step": step, "image": f"png{step}"})
            await asyncio.sleep(0.3)  # steps a little slower than the store is read (every 0.5 s)
        log.publish("decoding", {})
        await asyncio.to_thread(runner.complete, b"mp4")
        a._finished(runner)
        await a._save_log(runner)
        everything, elsewhere = parse(await asyncio.wait_for(here, 10)), parse(await asyncio.wait_for(there, 10))
        step2 = next(int(e["id"]) for e in everything if e["event"] == "step" and e["data"]["step"] == 2)
        resumed = parse(await asyncio.wait_for(read(await b.event_stream(job_id, video, step2)), 10))
        with pytest.raises(APIError) as past:  # the route passes the job as it reads now
            await b.event_stream(job_id, await asyncio.to_thread(b.store.get, job_id), 99)
        stored = json.loads(await asyncio.to_thread(a.store.events, job_id))
        return everything, elsewhere, resumed, step2, past.value, stored

    everything, elsewhere, resumed, step2, past, stored = asyncio.run(scenario())
    kinds = [e["event"] for e in everything]
    assert kinds[:3] == ["queued", "started", "step"] and kinds[-2:] == ["decoding", "completed"], kinds
    assert [int(e["id"]) for e in everything] == list(range(1, len(everything) + 1))

    def not_previews(events):
        return [(e["id"], e["event"], e["data"]) for e in events if e["event"] != "preview"]

    assert not_previews(elsewhere) == not_previews(everything)  # the same ids, kinds and data
    assert {e["id"] for e in elsewhere if e["event"] == "preview"} <= {e["id"] for e in everything}
    assert any(e["event"] == "preview" for e in elsewhere)
    assert elsewhere[-1]["data"]["video"]["status"] == "completed"
    assert not_previews(resumed) == [x for x in not_previews(everything) if int(x[0]) > step2]
    assert past.status == 400 and past.param == "Last-Event-ID"
    assert [e["kind"] for e in stored["events"]].count("preview") == 1 and stored["events"][-1]["kind"] == "completed"


def test_a_stored_log_without_its_final_event_ends_with_the_records_status(url):
    """The runner died after its last log write: once its record reads failed (the lease ran out), a reader on
    another replica ends the stream with that status, numbered after the last stored event. A deleted job's stream
    ends cancelled, as its runner's does."""
    clock = Clock()
    policy = JobPolicy(ttl_s=600, max_bytes=10**6, lease_s=60, max_unfinished=9)
    a, b = (JobStore(MediaStore(url), policy, clock=clock) for _ in range(2))
    runner = a.create(video_object())
    log = EventLog()
    log.publish("queued", {"position": 1})
    log.publish("started", {})
    runner.save_events(log.dump())

    async def stream(job_id: str, after: int = 0):
        events = follow_store(lambda: asyncio.to_thread(b.video_and_events, job_id), after, poll_s=0.02, grace_s=0.1)
        return parse(await read(events))

    async def scenario():
        reader = asyncio.create_task(stream(runner.job_id))
        await asyncio.sleep(0.2)
        assert not reader.done()  # a running job: the reader waits
        clock.now += 61  # its runner is silent past its lease
        failed = await asyncio.wait_for(reader, 5)
        deleted_runner = a.create(video_object())
        deleted_runner.save_events(log.dump())
        reader = asyncio.create_task(stream(deleted_runner.job_id, 1))
        await asyncio.sleep(0.1)
        b.delete(deleted_runner.job_id)
        return failed, await asyncio.wait_for(reader, 5)

    failed, deleted = asyncio.run(scenario())
    assert [(e["id"], e["event"]) for e in failed] == [("1", "queued"), ("2", "started"), ("3", "failed")]
    assert failed[-1]["data"]["video"]["error"]["code"] == "runner_lost"
    assert [(e["id"], e["event"]) for e in deleted] == [("2", "started"), ("3", "cancelled")]
