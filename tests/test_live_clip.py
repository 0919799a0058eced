"""A decoding job's live clip (``h3serve.deploy.jobs.live``): every reader gets every byte from the first, in order,
as it comes; a reader that goes away takes nothing from the others; one that comes later starts over; a stream cut
short ends its readers with StreamBroken, never a clean end; a new attempt cuts the old one off. The same through the
job store (``StoredClip``, ``follow_stored``): what an ingress replica that does not run the job streams."""

import asyncio
import json
import uuid

import pytest

from h3serve.deploy.jobs.live import (
    LiveClip,
    LiveClips,
    StoredClip,
    StreamBroken,
    follow_stored,
    part_name,
    stored_marker,
)
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore


async def read_all(clip: LiveClip, got: list[bytes]) -> None:
    async for part in clip.read():
        got.append(part)


def test_readers_get_every_byte_in_order_and_a_leaving_reader_takes_nothing():
    async def run():
        clip = LiveClip()
        clip.append(b"head", 0)
        first, second = [], []
        readers = [asyncio.ensure_future(read_all(clip, got)) for got in (first, second)]
        leaving = clip.read()
        assert await anext(leaving) == b"head"
        await leaving.aclose()  # a reader that disconnects
        await asyncio.sleep(0)
        assert first == second == [b"head"]  # waiting for the next bytes, not polling
        clip.append(b"one", 17)
        clip.append(b"", 17)  # no bytes: only the count moves
        clip.append(b"two", 34)
        await asyncio.sleep(0)
        clip.end()
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert first == second == [b"head", b"one", b"two"] and clip.size == 10 and clip.frames == 34
        late = []
        await read_all(clip, late)  # one that comes after the end reads it all
        assert late == first
        with pytest.raises(RuntimeError, match="ended"):
            clip.append(b"more", 40)

    asyncio.run(run())


def test_a_stream_cut_short_breaks_its_readers_and_a_new_attempt_replaces_it():
    async def run():
        clips = LiveClips()
        clip = clips.start("video_1")
        clip.append(b"head", 0)
        got: list[bytes] = []
        reader = asyncio.ensure_future(read_all(clip, got))
        await asyncio.sleep(0)
        again = clips.start("video_1")  # the decode started over on another replica
        assert again is not clip and clips.get("video_1") is again
        with pytest.raises(StreamBroken, match="started again"):
            await asyncio.wait_for(reader, 5)
        assert got == [b"head"]
        clips.end("video_1", "the job ended before its video did (HTTP 499)")
        assert clips.get("video_1") is None
        with pytest.raises(StreamBroken, match="HTTP 499"):
            await read_all(again, [])
        clips.end("video_1")  # nothing left: a no-op

    asyncio.run(run())


# -- the stored clip: what an ingress replica that does not run the job reads (a real store: a directory) ----------


def stored_reader(store: MediaStore, jobs: JobStore, job_id: str, poll_s: float = 0.01):
    marker = stored_marker(store, job_id)
    assert marker is not None and "parts" not in marker

    async def state():
        return await asyncio.to_thread(jobs.get, job_id), await asyncio.to_thread(stored_marker, store, job_id)

    return follow_stored(
        marker["stream"], lambda n: asyncio.to_thread(store.get, part_name(job_id, n)), state, poll_s=poll_s
    )


def running_job(tmp_path) -> tuple[MediaStore, JobStore, str]:
    store = MediaStore(str(tmp_path / "videos"))
    jobs = JobStore(store, JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=10))
    job_id = f"video_{uuid.uuid4().hex}"
    video = {"id": job_id, "object": "video", "status": "queued", "progress": 0, "created_at": 0}
    jobs.create({**video, "completed_at": None, "error": None}).update(status="in_progress")
    return store, jobs, job_id


def test_another_replica_reads_the_stored_stream_from_its_first_byte_to_its_whole_end(tmp_path):
    async def run():
        store, jobs, job_id = running_job(tmp_path)
        clip = StoredClip(store, job_id, {"attempts": 1, "epoch": 1})
        clip.start()
        clip.append(b"head")
        early = stored_reader(store, jobs, job_id)
        assert await anext(early) == b"head"
        late: list[bytes] = []
        rest = asyncio.ensure_future(read_stored(early, late))
        for data in (b"one", b"", b"two"):  # no bytes: no part
            clip.append(data)
        for _ in range(500):  # each part as it is there (a loaded machine's thread hops: up to 5 s)
            if len(late) == 2:
                break
            await asyncio.sleep(0.01)
        assert late == [b"one", b"two"] and not rest.done()  # polling for the next: not ended yet
        clip.end()
        await asyncio.wait_for(rest, 5)
        again: list[bytes] = []
        await read_stored(stored_reader_of_ended(store, jobs, job_id), again)
        assert again == [b"head", b"one", b"two"] and clip.parts == 3

    asyncio.run(run())


def test_a_stored_stream_breaks_on_a_new_attempt_a_broken_end_and_a_job_that_left_decoding(tmp_path):
    async def run():
        store, jobs, job_id = running_job(tmp_path)
        first = StoredClip(store, job_id, {"attempts": 1, "epoch": 1})
        first.start()
        first.append(b"old head")
        reader = stored_reader(store, jobs, job_id)
        assert await anext(reader) == b"old head"
        second = StoredClip(store, job_id, {"attempts": 2, "epoch": 2})
        second.start()
        second.append(b"new head")  # the same part number: not the old stream's
        with pytest.raises(StreamBroken, match="started again"):
            await anext(reader)
        new = stored_reader(store, jobs, job_id)
        assert await anext(new) == b"new head"
        second.end("the job ended before its video did (HTTP 499)")
        with pytest.raises(StreamBroken, match="HTTP 499"):
            await anext(new)
        third = StoredClip(store, job_id, {"attempts": 3, "epoch": 3})
        third.start()
        orphaned = stored_reader(store, jobs, job_id)
        # its runner died before it could end the stream; the record is failed (as a lapsed lease fails it)
        record = json.loads(store.get(f"{job_id}.json"))
        record["video"]["status"] = "failed"
        store.put(f"{job_id}.json", json.dumps(record).encode())
        with pytest.raises(StreamBroken, match="failed"):
            await asyncio.wait_for(anext(orphaned), 5)

    asyncio.run(run())


def stored_reader_of_ended(store: MediaStore, jobs: JobStore, job_id: str):
    marker = stored_marker(store, job_id)
    assert marker is not None and marker["parts"] == 3 and marker["broken"] is None

    async def state():
        return jobs.get(job_id), stored_marker(store, job_id)

    return follow_stored(marker["stream"], lambda n: asyncio.to_thread(store.get, part_name(job_id, n)), state)


async def read_stored(reader, got: list[bytes]) -> None:
    async for part in reader:
        got.append(part)
