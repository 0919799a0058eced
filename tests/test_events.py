"""The event log a job's readers follow, and the record-following fallback, without Ray: ``h3serve.deploy.jobs.events``
on real
asyncio and a real job store (a directory), as an ingress replica uses them."""

import asyncio
import json

import pytest

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.jobs.events import EventLog, follow_record, last_event_id
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore


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


def test_another_replica_follows_the_jobs_record_to_its_final_event(tmp_path):
    """Where the runner's log is not (another ingress replica), the stream follows what the runner writes."""
    store = JobStore(MediaStore(str(tmp_path / "videos")), JobPolicy(ttl_s=60, max_bytes=10**6, lease_s=60, max_jobs=9))
    video = {"id": "video_" + "a" * 32, "object": "video", "status": "queued", "progress": 0, "created_at": 0}
    runner = store.create({**video, "queue_position": 2, "eta_seconds": 3.0, "completed_at": None})
    job_id = runner.job_id

    async def scenario():
        async def get():
            return await asyncio.to_thread(store.get, job_id)

        stream = follow_record(get, await get(), poll_s=0.02)
        first = await read(stream, until="event: queued")
        runner.update(status="in_progress", progress=50, queue_position=None, eta_seconds=1.5)
        middle = await read(stream, until="event: progress")
        runner.cancel()
        rest = await read(stream)
        return parse(first), parse(middle), parse(rest)

    first, middle, rest = asyncio.run(scenario())
    assert first == [{"id": None, "event": "queued", "data": {"position": 2, "eta_s": 3.0}}]
    assert middle == [{"id": None, "event": "progress", "data": {"progress": 50, "eta_s": 1.5}}]
    assert [e["event"] for e in rest] == ["cancelled"] and rest[0]["data"]["video"]["status"] == "cancelled"
