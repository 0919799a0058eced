"""The video job store on its own: a real directory (and fsspec's memory://), several 'replicas', real processes."""

import json
import multiprocessing
import time
import uuid

import pytest

from h3serve.deploy.jobs.live import LIVE_KEEP_S, StoredClip
from h3serve.deploy.jobs.media_store import MediaStore, StoreError
from h3serve.deploy.jobs.records import RUNNER_LOST
from h3serve.deploy.jobs.store import JobGone, JobPolicy, JobStore, LeaseLost

POLICY = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=100)


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["dir", "memory"])
def url(request, tmp_path) -> str:
    return str(tmp_path / "videos") if request.param == "dir" else f"memory://h3serve-test-{uuid.uuid4().hex}"


def video(created_at: int = 0) -> dict:
    return {
        "id": f"video_{uuid.uuid4().hex}",
        "object": "video",
        "status": "queued",
        "progress": 0,
        "created_at": created_at,
        "completed_at": None,
        "error": None,
    }


def replicas(url: str, policy: JobPolicy = POLICY, n: int = 2) -> tuple[Clock, list[JobStore]]:
    """``n`` job stores on one store URL, like the ingress replicas of one app, sharing a clock."""
    clock = Clock()
    return clock, [JobStore(MediaStore(url), policy, clock=clock) for _ in range(n)]


def test_put_get_delete_and_names(url):
    store = MediaStore(url)
    store.check()
    assert store.names() == [] and store.get("a.json") is None
    store.put("a.json", b"1")
    store.put("a.json", b"22")
    store.put("b.mp4", b"x")
    assert store.get("a.json") == b"22" and store.names() == ["a.json", "b.mp4"]
    store.delete("a.json", "missing.mp4")
    assert store.names() == ["b.mp4"] and not store.exists("a.json")
    with pytest.raises(ValueError):
        store.get("../escape.json")


def test_a_store_that_cannot_be_used_says_which_and_what_to_set(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("in the way")
    with pytest.raises(StoreError, match=r"a-file/videos.*not usable.*jobs\.store"):
        MediaStore(str(blocker / "videos"))
    with pytest.raises(StoreError, match="nosuchproto"):
        MediaStore("nosuchproto://bucket/videos")


def test_a_job_written_by_one_replica_is_read_and_downloaded_by_another(url):
    _, (a, b) = replicas(url)
    job = video()
    runner = a.create(job)
    assert b.get(job["id"])["status"] == "queued"
    runner.update(status="in_progress", progress=40)
    assert b.get(job["id"])["progress"] == 40
    runner.complete(b"mp4 bytes")
    assert b.get(job["id"])["status"] == "completed" and b.content(job["id"]) == b"mp4 bytes"
    assert [v["id"] for v in b.list()] == [job["id"]]


def test_ids_that_are_not_ours_are_not_paths(url):
    _, (jobs,) = replicas(url, n=1)
    for bad in ("..", "../../etc/passwd", "video_x", "video_" + "0" * 31 + "/", ""):
        assert jobs.get(bad) is None and jobs.content(bad) is None and not jobs.delete(bad)


def test_a_job_whose_runner_stopped_heartbeating_reads_as_failed_on_every_replica(url):
    clock, (a, b) = replicas(url)
    job = video()
    a.create(job).update(status="in_progress", progress=10)
    clock.now += POLICY.lease_s - 1
    assert b.get(job["id"])["status"] == "in_progress"  # within the lease
    clock.now += 2
    failed = b.get(job["id"])
    assert failed["status"] == "failed" and failed["error"]["code"] == RUNNER_LOST
    assert "crashed or was restarted" in failed["error"]["message"]
    # saved as failed: a third replica (a fresh process after a restart) reads the same verdict
    fresh = JobStore(MediaStore(url), POLICY, clock=clock)
    assert fresh.get(job["id"])["status"] == "failed"


def test_the_sweeper_fails_lost_jobs_without_a_reader(url):
    clock, (a, b) = replicas(url)
    job = video()
    a.create(job)
    clock.now += POLICY.lease_s + 1
    b.sweep()
    record = json.loads(MediaStore(url).get(f"{job['id']}.json"))
    assert record["video"]["status"] == "failed" and record["video"]["error"]["code"] == RUNNER_LOST


def test_a_runner_that_could_not_write_for_half_its_lease_stops():
    policy = JobPolicy(ttl_s=60, max_bytes=10**6, lease_s=1.0, max_unfinished=10)
    _, (jobs,) = replicas(f"memory://h3serve-test-{uuid.uuid4().hex}", policy, n=1)
    runner = jobs.create(video())
    runner.update(progress=1)
    time.sleep(0.6)  # > lease_s / 2 since the last write
    with pytest.raises(LeaseLost):
        runner.update(progress=2)


def test_deleting_a_running_job_stops_its_runner_on_another_replica(url):
    clock, (a, b) = replicas(url)
    job = video()
    runner = a.create(job)
    assert b.delete(job["id"])
    assert a.get(job["id"]) is None and b.get(job["id"]) is None and not b.delete(job["id"])
    with pytest.raises(JobGone):
        runner.update(progress=50)
    with pytest.raises(JobGone):  # and it stays gone, even if a write was in flight
        runner.complete(b"late")
    assert a.get(job["id"]) is None and a.list() == []
    clock.now += POLICY.lease_s + 1  # no runner can write any more: the tombstone goes too
    b.sweep()
    assert MediaStore(url).names() == []


def test_deleting_a_finished_job_removes_it_at_once_for_every_replica(url):
    _, (a, b) = replicas(url)
    job = video()
    runner = a.create(job)
    runner.complete(b"mp4")
    assert [v["status"] for v in a.list()] == ["completed"]  # a has read (and cached) the finished record
    assert b.delete(job["id"])
    runner.update()  # a heartbeat that raced the result writes nothing
    assert MediaStore(url).names() == []
    assert a.get(job["id"]) is None and a.list() == [] and a.content(job["id"]) is None


def test_ttl_removes_finished_jobs_and_their_mp4s(url):
    clock, (a, b) = replicas(url)
    done, running = video(), video()
    a.create(done).complete(b"old")
    runner = a.create(running)
    clock.now += POLICY.ttl_s - 10
    runner.update(progress=5)
    b.sweep()
    assert b.get(done["id"])["expires_at"] == b.get(done["id"])["completed_at"] + POLICY.ttl_s
    clock.now += 20
    runner.update(progress=6)
    b.sweep()
    assert b.get(done["id"]) is None and b.content(done["id"]) is None
    assert b.get(running["id"])["progress"] == 6  # unfinished jobs are the lease's business, not the TTL's


def test_the_byte_cap_evicts_the_oldest_finished_jobs_first(url):
    policy = JobPolicy(ttl_s=3600, max_bytes=250, lease_s=60, max_unfinished=100)
    clock, (a, b) = replicas(url, policy)
    jobs = [video() for _ in range(4)]
    for job in jobs:
        a.create(job).complete(b"x" * 100)
        clock.now += 1
    a.create(running := video())  # unfinished: never evicted
    b.sweep()
    kept = {v["id"] for v in b.list()}
    assert kept == {jobs[2]["id"], jobs[3]["id"], running["id"]}
    assert b.content(jobs[0]["id"]) is None and b.content(jobs[3]["id"]) == b"x" * 100


def test_unfinished_jobs_have_their_own_cap_and_finished_ones_go_by_ttl_and_bytes_only(url):
    """At max_unfinished queued or running jobs a new one is refused (HTTP 429); finished jobs do not count and no
    count removes them: each stays until its expires_at (or the byte cap needs its room)."""
    policy = JobPolicy(ttl_s=3600, max_bytes=10**6, lease_s=60, max_unfinished=2)
    clock, (a, b) = replicas(url, policy)
    finished = []
    for _ in range(5):  # more finished jobs than the cap: all kept
        job = video()
        a.create(job).complete(b"x")
        finished.append(job["id"])
        clock.now += 1
    running = b.create(video())
    queued = a.create(second := video())
    assert running is not None and queued is not None
    assert a.create(video()) is None and b.create(video()) is None  # two unfinished: refused, on every replica
    a.sweep()
    assert all(b.get(job_id) is not None for job_id in finished)
    running.complete(b"2")  # one fewer unfinished: room again
    assert b.create(video()) is not None
    b.delete(second["id"])  # a deleted (tombstoned) running job no longer counts
    assert a.create(video()) is not None
    clock.now += 3601 - 5  # the first finished ones pass their expires_at, the later ones not yet
    a.sweep()
    assert b.get(finished[0]) is None and b.get(finished[-1]) is not None


def test_an_orphan_mp4_goes_after_two_sweeps_and_temporaries_after_the_lease(tmp_path):
    url = str(tmp_path / "videos")
    clock, (jobs,) = replicas(url, n=1)
    store = MediaStore(url)
    store.put("video_" + "a" * 32 + ".mp4", b"orphan")  # a runner died between the MP4 and its record
    (tmp_path / "videos" / ".half-written.tmp").write_bytes(b"")
    jobs.sweep()
    assert store.names() == ["video_" + "a" * 32 + ".mp4"]
    jobs.sweep()
    assert store.names() == []
    import os

    os.utime(tmp_path / "videos" / ".half-written.tmp", (0, 0))
    jobs.sweep()
    assert not (tmp_path / "videos" / ".half-written.tmp").exists()


def _writer(url: str, job_id: str, seconds: float) -> None:
    store = MediaStore(url)
    end, i = time.time() + seconds, 0
    while time.time() < end:
        i += 1
        store.put(f"{job_id}.json", json.dumps({"n": i, "pad": "x" * (i % 5000)}).encode())


@pytest.mark.slow  # two spawned writer processes for 2 s (`make test-fast`, no subprocesses, leaves it out)
def test_concurrent_writers_in_other_processes_never_show_a_partial_record(tmp_path):
    url, job_id = str(tmp_path / "videos"), f"video_{uuid.uuid4().hex}"
    MediaStore(url).put(f"{job_id}.json", b'{"n": 0}')
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(url, job_id, 2.0)) for _ in range(2)]
    for w in writers:
        w.start()
    store, reads = MediaStore(url), 0
    while any(w.is_alive() for w in writers):
        json.loads(store.get(f"{job_id}.json"))  # raises on a torn write
        reads += 1
    assert all(w.exitcode == 0 for w in writers) and reads > 100
    assert store.names() == [f"{job_id}.json"]  # no temporaries left behind


def test_stray_files_in_the_store_are_skipped_and_logged_once(url, caplog):
    """Not every file in a shared directory or bucket is ours: listing, creating and sweeping skip them."""
    policy = JobPolicy(ttl_s=3600, max_bytes=10**6, lease_s=60, max_unfinished=2)
    clock, (jobs,) = replicas(url, policy, n=1)
    store = MediaStore(url)
    job = video()
    jobs.create(job, request_id="req-1")
    stray = {
        "notes.json": b'{"hello": "world"}',  # not named like a record
        "video_" + "b" * 32 + ".json": b'{"video": {"id": 1}}',  # named like one, not shaped like one
        "video_" + "c" * 32 + ".json": b"[1, 2, 3]",
        "video_" + "d" * 32 + ".json": b"not json",
        "video_" + "e" * 32 + ".deleted": b"garbage",  # a tombstone this store never wrote
        "readme.mp4": b"not a job's",
    }
    for name, data in stray.items():
        store.put(name, data)
    with caplog.at_level("ERROR", logger="h3serve.deploy.jobs.store"):
        assert [v["id"] for v in jobs.list()] == [job["id"]]
        assert [v["id"] for v in jobs.list()] == [job["id"]]
        clock.now += policy.lease_s + 1
        jobs.sweep()
        jobs.sweep()
    for name in ("notes.json", *(f"video_{c * 32}.json" for c in "bcd"), f"video_{'e' * 32}.deleted"):
        assert sum(name in r.getMessage() for r in caplog.records) == 1, (name, caplog.text)
    assert jobs.get("video_" + "b" * 32) is None and jobs.get("video_" + "d" * 32) is None
    assert jobs.get(job["id"])["status"] == "failed"  # the sweep still did its work (the lease ran out)
    assert jobs.create(video()) is not None  # strays do not count against max_jobs (2)
    assert set(stray) <= set(store.names())  # and nothing of someone else's was deleted


def test_a_record_keeps_its_request_id_and_counts_its_submissions(url):
    clock, (a, b) = replicas(url)
    done, lost = video(), video()

    def record(job_id: str) -> dict:
        return json.loads(MediaStore(url).get(f"{job_id}.json"))

    runner = a.create(done, request_id="client-id:1")
    assert (record(done["id"])["request_id"], record(done["id"])["submissions"]) == ("client-id:1", 1)
    runner.update(status="in_progress", progress=10)
    runner.resubmitted()  # a draining replica handed it back; the runner queued it elsewhere
    runner.complete(b"mp4")
    assert record(done["id"])["request_id"] == "client-id:1" and record(done["id"])["submissions"] == 2
    assert record(done["id"])["video"]["status"] == "completed"
    a.create(lost, request_id="client-id:2")
    clock.now += POLICY.lease_s + 1
    assert b.get(lost["id"])["status"] == "failed"  # expired by another replica: the id stays with it
    assert record(lost["id"])["request_id"] == "client-id:2"


def test_a_cancel_asked_on_another_replica_reaches_the_runner_at_its_next_write(url):
    """Ingress A runs the job; B is asked to cancel it: B writes the request, A's next write raises JobCancelled, A
    records it cancelled (finished: its record never changes again, the request file is gone) and B reads that."""
    from h3serve.deploy.jobs.records import FINISHED
    from h3serve.deploy.jobs.store import JobCancelled

    clock, (a, b) = replicas(url)
    runner = a.create(video(), "req-1")
    job_id = runner.job_id
    runner.update(status="in_progress", progress=10)
    b.request_cancel(job_id)
    with pytest.raises(JobCancelled):
        runner.update(progress=20)
    assert b.get(job_id)["progress"] == 10  # nothing was written past the request
    runner.cancel()
    for store in (a, b):
        record = store.get(job_id)
        assert record["status"] == "cancelled" and "cancelled" in FINISHED
        assert record["queue_position"] is None and record["completed_at"] == int(clock.now)
    assert not a.store.exists(f"{job_id}.cancel")
    runner.update(progress=99)  # a late heartbeat changes nothing: the record is final
    assert b.get(job_id)["progress"] == 10
    assert b.delete(job_id) and b.get(job_id) is None  # a finished job: removed at once


def test_a_job_whose_replica_is_lost_is_queued_again_until_its_attempts_run_out(url):
    """Each lost replica counts an attempt in the record (read by every replica) and queues the job again; at
    max_attempts requeue says no and the runner fails it (video_jobs: code replica_lost)."""
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=100, max_attempts=3)
    _, (a, b) = replicas(url, policy)
    runner = a.create(video(), "req-lost")
    job_id = runner.job_id
    record = json.loads(MediaStore(url).get(f"{job_id}.json"))
    assert (record["attempts"], record["max_attempts"], record["submissions"]) == (1, 3, 1)
    for attempt in (2, 3):
        runner.update(status="in_progress", progress=40)
        assert runner.requeue()
        seen = b.get(job_id)
        assert (seen["status"], seen["progress"]) == ("queued", 0)  # the truth: it waits for a replica again
        record = json.loads(MediaStore(url).get(f"{job_id}.json"))
        assert (record["attempts"], record["submissions"]) == (attempt, attempt)
    assert not runner.requeue()  # the third replica lost under it: no fourth run
    assert json.loads(MediaStore(url).get(f"{job_id}.json"))["attempts"] == 3
    runner.fail("replica_lost", "lost on each of its 3 attempts")
    assert b.get(job_id)["status"] == "failed" and b.get(job_id)["error"]["code"] == "replica_lost"


def test_the_first_final_status_wins_a_cancel_racing_completion(url):
    """A cancel asked elsewhere does not stop a completion already on its way (the record takes the first final
    status); a cancel after it finds the job completed and changes nothing, and one that won keeps the MP4 out."""
    _, (a, b) = replicas(url)
    done = a.create(video(), "req-done")
    done.update(status="in_progress", progress=90)
    b.request_cancel(done.job_id)
    done.complete(b"mp4")  # final: written although a cancel is pending
    done.cancel()  # the runner answering the cancel afterwards: the record is final
    assert b.get(done.job_id)["status"] == "completed" and b.content(done.job_id) == b"mp4"
    cancelled = a.create(video(), "req-cancelled")
    cancelled.cancel()
    cancelled.complete(b"late")  # the MP4 of a cancelled job is never stored, its record never changes
    assert b.get(cancelled.job_id)["status"] == "cancelled" and b.content(cancelled.job_id) is None
    failed = a.create(video(), "req-failed")
    b.request_cancel(failed.job_id)
    failed.fail("500", "internal error")
    assert b.get(failed.job_id)["status"] == "failed"


def test_a_lapsed_job_with_its_request_is_taken_over_once_and_its_old_runner_is_fenced(url):
    """Ingress A dies mid-job: its record lapses but does not read failed while the request is stored; B and C sweep
    at once and exactly one takes it over (epoch 2, one more attempt, queued again, the stored request handed back);
    A's late write is refused (LeaseLost), never overwriting B's record."""
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=100, max_attempts=3)
    clock, (a, b, c) = replicas(url, policy, n=3)
    old = a.create(video(), "req-taken", job=b'{"request": "as stored"}')
    old.update(status="in_progress", progress=40)
    clock.now += policy.lease_s + 1
    assert b.get(old.job_id)["status"] == "in_progress"  # waiting for a taker, not failed
    assert b.takeable() == [old.job_id] == c.takeable()
    taken = [s.take_over(old.job_id) for s in (b, c)]
    assert taken[1] is None  # C came second
    runner, job = taken[0]
    assert job == b'{"request": "as stored"}'
    record = json.loads(MediaStore(url).get(f"{old.job_id}.json"))
    assert (record["epoch"], record["attempts"], record["video"]["status"]) == (2, 2, "queued")
    old.last_write = time.monotonic()  # A comes back within what it thinks is its lease
    with pytest.raises(LeaseLost):
        old.update(progress=50)
    runner.complete(b"mp4")
    assert c.get(old.job_id)["status"] == "completed" and not MediaStore(url).exists(f"{old.job_id}.request")
    assert b.takeable() == []


def test_a_clean_stop_hands_its_job_over_and_the_attempts_bound_take_overs(url):
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=100, max_attempts=2)
    clock, (a, b) = replicas(url, policy)
    runner = a.create(video(), "req-handed", job=b"{}")
    runner.hand_over()  # Serve stops ingress A: dated back past its lease
    assert b.takeable() == [runner.job_id]  # at once, not after the lease
    with pytest.raises(LeaseLost):
        runner.update(progress=1)  # A writes nothing more
    second, _ = b.take_over(runner.job_id)
    clock.now += policy.lease_s + 1  # B dies too: its second attempt was the last
    assert b.takeable() == [] and b.get(runner.job_id)["status"] == "failed"
    assert b.get(runner.job_id)["error"]["code"] == RUNNER_LOST
    unstored = a.create(video(), "req-no-request")  # without a stored request it cannot be handed over
    with pytest.raises(LeaseLost):
        unstored.hand_over()


def test_a_stored_request_round_trips_with_its_uploads():
    from h3serve.deploy.jobs.video_jobs import dump_job, load_job
    from h3serve.pipelines.h3 import GenerationRequest, Reference

    request = GenerationRequest(
        prompt="p", first_frame=b"\x89PNG\x00\xff", references=(Reference(kind="audio", data=b"RIFF\x00"),)
    )
    job = load_job(dump_job(request, request_id="r", deadline=None, priority=3, adapter=None, model="m"))
    assert job["request"] == request and (job["request_id"], job["priority"], job["model"]) == ("r", 3, "m")
    assert b"\x89PNG" not in dump_job(request)  # JSON with base64, never pickle, in a shared store


def test_a_cancel_asked_while_a_job_had_no_runner_ends_it_at_the_take_over(url):
    clock, (a, b) = replicas(url)
    runner = a.create(video(), "req-orphan", job=b"{}")
    clock.now += POLICY.lease_s + 1  # its ingress died
    b.request_cancel(runner.job_id)
    assert b.take_over(runner.job_id) is None  # not run again: recorded cancelled
    assert b.get(runner.job_id)["status"] == "cancelled" and b.takeable() == []


def test_a_completed_job_keeps_its_request_as_settings_until_it_goes(url):
    """What remix and extend start from: a completed job's stored request, readable on every replica, removed with
    the job; a failed or cancelled job keeps none."""
    _, (a, b) = replicas(url)
    done = a.create(video(), "req-done", job=b'{"request": "as it ran"}')
    assert b.settings(done.job_id) is None  # not before it completes
    done.complete(b"mp4")
    assert b.settings(done.job_id) == b'{"request": "as it ran"}'
    assert not MediaStore(url).exists(f"{done.job_id}.request")  # never taken over again
    failed = a.create(video(), "req-failed", job=b"{}")
    failed.fail("500", "internal error")
    assert b.settings(failed.job_id) is None and b.settings("../etc/passwd") is None
    assert b.delete(done.job_id) and b.settings(done.job_id) is None


def test_an_extensions_joined_clip_is_stored_before_its_record_counted_in_its_bytes_and_removed_with_it(url):
    """``complete(mp4, joined)``: the joined MP4 is there once the record says completed, on every replica; its bytes
    count toward the byte cap (the oldest job goes for it); it goes with its job. A job without one reads None."""
    clock, (a, b) = replicas(url, JobPolicy(ttl_s=3600, max_bytes=250, lease_s=60, max_unfinished=100))
    plain = a.create(video(created_at=1))
    plain.complete(b"p" * 100)
    assert b.media(plain.job_id, "joined") is None
    clock.now += 1
    extension = a.create(video(created_at=2))
    extension.complete(b"e" * 100, joined=b"j" * 120)
    assert b.media(extension.job_id, "joined")[0] == b"j" * 120
    assert b.media(extension.job_id)[0] == b"e" * 100
    b.sweep()  # 100 + 220 bytes > 250: the older job goes, the extension with its joined clip stays
    assert b.get(plain.job_id) is None and b.get(extension.job_id)["status"] == "completed"
    assert b.delete(extension.job_id)
    assert not MediaStore(url).exists(f"{extension.job_id}.joined.mp4")


def test_a_record_names_its_runner_and_a_take_over_names_the_new_one(url):
    """``runner`` (the ingress replica's id, node and pid) is written with the job, and replaced by the one that took
    it over: an operator can tell which process runs a job, and a chaos test which process to kill."""
    clock = Clock()
    a, b = (JobStore(MediaStore(url), POLICY, clock=clock, runner={"replica": name, "pid": 1}) for name in "ab")
    runner = a.create(video(), "req-runner", job=b"{}")
    assert json.loads(MediaStore(url).get(f"{runner.job_id}.json"))["runner"] == {"replica": "a", "pid": 1}
    clock.now += POLICY.lease_s + 1
    b.take_over(runner.job_id)
    assert json.loads(MediaStore(url).get(f"{runner.job_id}.json"))["runner"] == {"replica": "b", "pid": 1}


def test_a_cancelled_job_whose_runner_died_with_no_attempts_left_reads_cancelled_not_failed(url):
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=100, max_attempts=1)
    clock, (a, b) = replicas(url, policy)
    runner = a.create(video(), "req-last", job=b"{}")
    runner.update(status="in_progress", progress=30)
    b.request_cancel(runner.job_id)  # asked elsewhere; the runner dies before its next write
    clock.now += policy.lease_s + 1
    ended = b.get(runner.job_id)
    assert ended["status"] == "cancelled" and ended["error"] is None, ended
    store = MediaStore(url)
    assert not store.exists(f"{runner.job_id}.cancel") and not store.exists(f"{runner.job_id}.request")
    assert a.get(runner.job_id)["status"] == "cancelled"  # saved so: every replica reads it


def test_a_cancel_asked_of_another_ingress_ends_a_job_whose_runner_died_within_its_lease():
    """The cancel route on an ingress that does not run the job, whose runner died (kill -9: no heartbeat, no write):
    it answers cancelled once the record lapses (taken over with the cancel pending), within 1.5 x lease_s of the ask,
    not a record still in progress or failed runner_lost."""
    import asyncio

    from h3serve.deploy.jobs.video_jobs import VideoJobs

    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=1.0, max_unfinished=100)
    url = f"memory://h3serve-test-{uuid.uuid4().hex}"
    dead = JobStore(MediaStore(url), policy).create(video(), "req-dead", job=b"{}")
    dead.update(status="in_progress", progress=20)
    other = VideoJobs(JobStore(MediaStore(url), policy), None, None)  # type: ignore[arg-type]
    asked = time.monotonic()
    answer = asyncio.run(other.cancel(dead.job_id))
    took_s = time.monotonic() - asked
    assert answer is not None and answer["status"] == "cancelled", answer
    assert policy.lease_s * 0.5 < took_s < policy.lease_s * 1.5, took_s  # waited for the lapse, not past the bound
    assert json.loads(MediaStore(url).get(f"{dead.job_id}.json"))["epoch"] == 2  # ended by the one take-over


def test_a_live_streams_parts_go_with_the_job_after_it_completes_and_as_leftovers(url):
    """``<id>.live*`` (``live.StoredClip``): a DELETE removes them with the job; the sweeper removes a completed job's
    once its late readers had LIVE_KEEP_S, and a job's without a record after two sweeps, like its other leftovers."""
    clock, (a, b) = replicas(url)
    store = MediaStore(url)
    deleted, completed, orphan = video(), video(), video()
    clips = {}
    for job in (deleted, completed, orphan):
        runner = a.create(job)
        clip = clips[job["id"]] = StoredClip(store, job["id"], {"attempts": 1, "epoch": 1})
        clip.start()
        clip.append(b"head")
        clip.append(b"chunk")
        if job is not orphan:
            clip.end()
            runner.complete(b"mp4")

    def live(job: dict) -> list[str]:
        return sorted(n for n in store.names() if n.startswith(f"{job['id']}.live"))

    assert live(deleted) == [f"{deleted['id']}.live", f"{deleted['id']}.live0", f"{deleted['id']}.live1"]
    assert b.delete(deleted["id"]) and live(deleted) == []
    store.delete(f"{orphan['id']}.json", f"{orphan['id']}.request")  # its writer died before the record was kept
    b.sweep()
    assert live(completed) and live(orphan)  # a late reader of the completed one still reads its parts
    clock.now += LIVE_KEEP_S + 1
    b.sweep()
    assert live(completed) == [] and live(orphan) == []
    assert b.content(completed["id"]) == b"mp4"  # the finished MP4 stays
