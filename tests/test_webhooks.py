"""Webhooks on their own (no Ray): which targets the allow-list refuses, the signature's round trip through the
client's verify_webhook, and the sender against a real HTTP receiver on 127.0.0.1 (retries, then delivered, once
across two 'ingresses' sharing one job store). Over the served API: tests/test_webhooks_http.py."""

import asyncio
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from h3serve.client import WebhookVerificationError, verify_webhook
from h3serve.client.webhooks import sign
from h3serve.deploy.common.args import WebhookArgs
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from h3serve.deploy.jobs.webhooks import Delivery, WebhookRefused, WebhookSender, check_target

SECRET = "whsec_c2VjcmV0LWZvci10ZXN0cw=="


@pytest.mark.parametrize(
    "url",
    [
        "https://169.254.169.254/latest/meta-data/",
        "https://127.0.0.1/hook",
        "https://[::1]/hook",
        "https://[::ffff:127.0.0.1]/hook",  # IPv4-mapped loopback
        "https://10.0.0.1/hook",
        "https://172.16.5.4/hook",
        "https://192.168.1.1/hook",
        "https://100.64.0.1/hook",  # shared address space (carrier NAT)
        "https://0.0.0.0/hook",
        "https://[fd00:ec2::254]/hook",  # AWS's IPv6 metadata address (unique local)
        "https://224.0.0.1/hook",
        "https://localhost/hook",
        "http://93.184.216.34/hook",  # public, but http without allow_http
        "https://user:pw@93.184.216.34/hook",
        "file:///etc/passwd",
        "https:///no-host",
    ],
)
def test_refused_targets(url):
    with pytest.raises(WebhookRefused):
        check_target(url, WebhookArgs())


def test_public_and_allowed_targets_pass():
    check_target("https://93.184.216.34/hook", WebhookArgs())  # a literal public address: no DNS needed
    allowed = WebhookArgs(allow=["127.0.0.1/32", "10.0.0.0/8"], allow_http=True)
    check_target("http://127.0.0.1:9/hook", allowed)
    check_target("https://10.20.30.40/hook", allowed)
    with pytest.raises(WebhookRefused):
        check_target("https://169.254.169.254/", allowed)  # allowing one network allows no other


def test_config_refuses_a_bad_network_and_an_unsigned_default():
    with pytest.raises(ValueError, match="not a network"):
        WebhookArgs(allow=["10.0.0.0/33"])
    with pytest.raises(ValueError, match="secret_env"):
        WebhookArgs(url="https://93.184.216.34/hook")


def test_the_signature_round_trip():
    body, now = json.dumps({"id": "video_x", "status": "completed"}).encode(), int(time.time())
    headers = {
        "Webhook-Id": "msg_1",
        "Webhook-Timestamp": str(now),
        "Webhook-Signature": sign(SECRET, "msg_1", now, body),
    }
    assert verify_webhook(SECRET, headers, body) == {"id": "video_x", "status": "completed"}
    rotated = {**headers, "Webhook-Signature": "v1,b2xk " + headers["Webhook-Signature"]}  # an old key's first
    assert verify_webhook(SECRET, rotated, body)["status"] == "completed"
    for bad in (
        {**headers, "Webhook-Id": "msg_2"},  # the id is signed too
        {**headers, "Webhook-Timestamp": str(now - 301)},
        {k: v for k, v in headers.items() if k != "Webhook-Signature"},
    ):
        with pytest.raises(WebhookVerificationError):
            verify_webhook(SECRET, bad, body)
    with pytest.raises(WebhookVerificationError):
        verify_webhook("another secret", headers, body)
    old = {
        **headers,
        "Webhook-Timestamp": str(now - 1000),
        "Webhook-Signature": sign(SECRET, "msg_1", now - 1000, body),
    }
    assert verify_webhook(SECRET, old, body, tolerance_s=2000)["id"] == "video_x"


@pytest.fixture
def receiver():
    """127.0.0.1, answering 500 to its first two POSTs and 200 after."""
    received: list[tuple[dict, bytes]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append((dict(self.headers), self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(500 if len(received) <= 2 else 200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{http.server_address[1]}/hook", received
    http.shutdown()
    http.server_close()


def test_the_sender_retries_and_delivers_once_across_ingresses(tmp_path, receiver):
    url, received = receiver
    config = WebhookArgs(allow=["127.0.0.1/32"], allow_http=True, first_retry_s=0.05, max_retry_s=0.1, retry_for_s=10)
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=9)
    stores = [JobStore(MediaStore(str(tmp_path)), policy) for _ in range(2)]  # two ingresses, one store
    job_id = f"video_{uuid.uuid4().hex}"
    runner = stores[0].create({"id": job_id, "object": "video", "status": "queued", "progress": 0, "created_at": 0})
    assert runner is not None
    runner.complete(b"mp4")
    video = runner.record["video"]

    async def both():
        senders = [WebhookSender(config, SECRET) for _ in stores]
        for sender, store in zip(senders, stores, strict=True):

            async def io(fn, *args):
                return await asyncio.to_thread(fn, *args)

            markers = store.webhook_markers
            sender.start(
                Delivery(
                    url,
                    video,
                    lambda m=markers: m.claim(job_id),
                    lambda marker, m=markers: m.beat(job_id, marker),
                    lambda marker, o, m=markers: m.record(job_id, marker, o),
                    io,
                    1.0,
                )
            )
        for sender in senders:
            await asyncio.gather(*sender.tasks)

    asyncio.run(both())
    assert len(received) == 3  # one sender: 500, 500, 200
    assert all(verify_webhook(SECRET, headers, body) == video for headers, body in received)
    outcome = stores[1].webhook_markers.get(job_id)
    assert outcome["delivered"] and outcome["attempts"] == 3 and outcome["status"] == 200
    assert stores[0].delete(job_id) and not list(tmp_path.glob(f"{job_id}*"))


def test_a_target_that_never_answers_2xx_gives_up_within_retry_for_s(tmp_path):
    config = WebhookArgs(allow=["127.0.0.1/32"], allow_http=True, first_retry_s=0.05, max_retry_s=0.1, retry_for_s=1.5)
    store = JobStore(MediaStore(str(tmp_path)), JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=9))
    job_id = f"video_{uuid.uuid4().hex}"
    runner = store.create({"id": job_id, "object": "video", "status": "queued", "progress": 0, "created_at": 0})
    runner.fail("500", "boom")

    async def deliver():
        sender = WebhookSender(config, SECRET)

        async def io(fn, *args):
            return await asyncio.to_thread(fn, *args)

        started = time.monotonic()
        # port 9 (discard) on loopback: nothing listens, the connection is refused at once
        markers = store.webhook_markers
        sender.start(
            Delivery(
                "http://127.0.0.1:9/hook",
                runner.record["video"],
                lambda: markers.claim(job_id),
                lambda m: markers.beat(job_id, m),
                lambda m, o: markers.record(job_id, m, o),
                io,
                1.0,
            )
        )
        await asyncio.gather(*sender.tasks)
        return time.monotonic() - started

    assert asyncio.run(deliver()) < 5
    outcome = store.webhook_markers.get(job_id)
    assert not outcome["delivered"] and outcome["attempts"] >= 3 and "no answer" in outcome["error"]


def test_a_requests_webhook_needs_a_secret_and_the_default_is_the_configs():
    from h3serve.deploy.common.errors import APIError
    from h3serve.deploy.jobs.webhooks import job_webhook

    config = WebhookArgs(secret_env="H3_SECRET", url="https://93.184.216.34/default")
    assert asyncio.run(job_webhook(None, config, True)) == "https://93.184.216.34/default"
    assert asyncio.run(job_webhook(None, WebhookArgs(), False)) is None
    with pytest.raises(APIError) as refused:
        asyncio.run(job_webhook("https://93.184.216.34/hook", WebhookArgs(), False))  # never sent unsigned
    assert refused.value.status == 400 and refused.value.param == "webhook"
    with pytest.raises(APIError) as refused:
        asyncio.run(job_webhook("https://169.254.169.254/", config, True))
    assert (
        refused.value.status == 400 and refused.value.param == "webhook" and "169.254.169.254" in refused.value.message
    )


# -- a job that ends without its runner; a delivery whose ingress dies; the address pinned -------------------------
FAST = WebhookArgs(allow=["127.0.0.1/32"], allow_http=True, first_retry_s=0.05, max_retry_s=0.1, retry_for_s=30)


class Receiver:
    """A webhook receiver on 127.0.0.1: answers 500 while ``failing``, else 204; keeps (headers, body) of each POST."""

    def __init__(self, failing: bool = False):
        self.failing, self.received = failing, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.received.append((dict(self.headers), self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(500 if receiver.failing else 204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.http.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hook"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def new_video() -> dict:
    return {"id": f"video_{uuid.uuid4().hex}", "object": "video", "status": "queued", "progress": 0, "created_at": 0}


@pytest.mark.parametrize("how", ["runner_lost", "cancel_pending", "cancel_on_another_ingress"])
def test_a_job_that_ends_without_its_runner_sends_its_webhook_from_one_ingress(tmp_path, how):
    """Its runner died (it never writes again): the job's lease lapses and two other ingresses read it at once (or one
    is asked to cancel it): exactly one writes its final record (the next epoch's lease file) and sends its webhook."""
    from h3serve.deploy.jobs.video_jobs import VideoJobs

    receiver = Receiver()
    now = [1000.0]
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=2, max_unfinished=9)
    stores = [JobStore(MediaStore(str(tmp_path)), policy, clock=lambda: now[0]) for _ in range(3)]
    video = new_video()
    job_id = video["id"]
    # the dead runner's job: its request stored (takeable, with attempts left) only where a cancel ends it
    stored = b"{}" if how == "cancel_on_another_ingress" else None
    assert stores[0].create(video, job=stored, webhook=receiver.url) is not None
    if how == "cancel_pending":
        stores[0].request_cancel(job_id)
    now[0] += policy.lease_s + 1  # its runner stopped writing: the lease lapsed

    async def two_ingresses():
        ingresses = [VideoJobs(store, None, None, WebhookSender(FAST, SECRET)) for store in stores[1:]]  # type: ignore[arg-type]
        if how == "cancel_on_another_ingress":
            answers = await asyncio.gather(ingresses[0].cancel(job_id), ingresses[1].cancel(job_id))
        else:
            answers = await asyncio.gather(*(i.get(job_id) for i in ingresses), *(i.list() for i in ingresses))
            answers = answers[:2]
        for _ in range(100):  # the winner's delivery starts on its loop
            await asyncio.sleep(0.05)
            if receiver.received and not any(i.webhooks.tasks for i in ingresses):  # type: ignore[union-attr]
                break
        await asyncio.sleep(0.5)  # no second delivery follows
        for ingress in ingresses:
            await ingress.close()
        return answers

    try:
        answers = asyncio.run(two_ingresses())
    finally:
        receiver.close()
    final = stores[0].get(job_id)
    assert final is not None
    expected = "failed" if how == "runner_lost" else "cancelled"
    assert final["status"] == expected and all(a["status"] == expected for a in answers), (final, answers)
    if how == "runner_lost":
        assert final["error"]["code"] == "runner_lost"
    assert len(receiver.received) == 1, receiver.received  # one ingress sent it, once
    headers, body = receiver.received[0]
    assert verify_webhook(SECRET, headers, body) == final
    assert stores[0].webhook_markers.get(job_id)["delivered"]
    assert json.loads((tmp_path / f"{job_id}.json").read_text())["epoch"] == 2  # the fenced writer's epoch
    assert stores[1].webhook_markers.pending() == [] and stores[2].webhook_markers.pending() == []


DELIVERING = """
import asyncio, sys, time
from h3serve.deploy.common.args import WebhookArgs
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from h3serve.deploy.jobs.video_jobs import VideoJobs
from h3serve.deploy.jobs.webhooks import WebhookSender

root, job_id, secret = sys.argv[1:]
config = WebhookArgs(allow=["127.0.0.1/32"], allow_http=True, first_retry_s=0.2, max_retry_s=0.2, retry_for_s=600)
store = JobStore(MediaStore(root), JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=1, max_unfinished=9))

async def main():
    ingress = VideoJobs(store, None, None, WebhookSender(config, secret))
    ingress._notify(await ingress._io(store._read, job_id))
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_delivery_whose_ingress_is_killed_is_resumed_by_another_with_the_same_id(tmp_path):
    """At least once: the ingress delivering a webhook (a real process, retrying a receiver that answers 500) is
    killed with kill -9; while it lived its beats kept the delivery its own; once they are lease_s old another
    ingress's sweep delivers it, as the next owner, under the same webhook-id."""
    import os
    import signal
    import subprocess
    import sys

    from h3serve.deploy.jobs.video_jobs import VideoJobs

    receiver = Receiver(failing=True)
    policy = JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=1, max_unfinished=9)
    store = JobStore(MediaStore(str(tmp_path)), policy)
    runner = store.create(new_video(), webhook=receiver.url)
    assert runner is not None
    runner.fail("500", "boom")
    job_id = runner.job_id
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", DELIVERING, str(tmp_path), job_id, SECRET], env=env)
    try:
        deadline = time.monotonic() + 60
        while len(receiver.received) < 3 and time.monotonic() < deadline and child.poll() is None:
            time.sleep(0.1)
        assert len(receiver.received) >= 3, "the first ingress never retried"
        time.sleep(policy.lease_s * 1.5)
        assert store.webhook_markers.pending() == []  # alive and beating: nobody else takes it
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    first = store.webhook_markers.get(job_id)
    assert first is not None and first["owner"] == 1 and "delivered" not in first
    killed_after = len(receiver.received)
    time.sleep(policy.lease_s * 1.5)  # its last beat is now older than the lease
    receiver.failing = False

    async def another_ingress():
        ingress = VideoJobs(store, None, None, WebhookSender(FAST, SECRET))  # type: ignore[arg-type]
        await ingress.sweep_once()
        await asyncio.gather(*ingress.webhooks.tasks)  # type: ignore[union-attr]
        await ingress.close()

    try:
        asyncio.run(another_ingress())
    finally:
        receiver.close()
    assert len(receiver.received) == killed_after + 1  # the resumed delivery, answered 204 at once
    assert {h["webhook-id"] for h, _ in receiver.received} == {first["id"]}  # one message: a receiver dedupes on it
    assert verify_webhook(SECRET, *receiver.received[-1]) == store.get(job_id)
    outcome = store.webhook_markers.get(job_id)
    assert outcome["owner"] == 2 and outcome["delivered"] and outcome["id"] == first["id"]
    assert store.webhook_markers.pending() == []
    assert store.delete(job_id) and not list(tmp_path.glob(f"{job_id}*"))


def resolver(*answers: str, calls: list | None = None):
    """A resolver (socket.getaddrinfo's shape) answering ``answers`` for any host, counting its calls in ``calls``."""
    import socket

    def resolve(host, port, type=0, **_):
        if calls is not None:
            calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)) for address in answers]

    return resolve


def test_a_delivery_connects_to_the_address_it_checked():
    """DNS rebinding: the sender resolves a host once per attempt, checks the addresses, and connects to the one it
    checked with the host kept in the Host header: a name nothing else can resolve (.invalid) reaches the receiver
    on 127.0.0.1; a name resolving to a private address, or to an allowed one beside a private one, is refused."""
    receiver = Receiver()
    calls: list[str] = []
    url = f"http://hooks.invalid:{receiver.port}/hook"

    async def deliver(resolve) -> int:
        return await WebhookSender(FAST, SECRET, resolve=resolve)._attempt(url, "msg_pinned", b"{}")

    try:
        assert asyncio.run(deliver(resolver("127.0.0.1", calls=calls))) == 204
        assert calls == ["hooks.invalid"]  # resolved once: httpx did not resolve it again (it could not)
        headers, _ = receiver.received[0]
        assert {k.lower(): v for k, v in headers.items()}["host"] == f"hooks.invalid:{receiver.port}"
        for answers in (("10.0.0.1",), ("127.0.0.1", "10.0.0.1"), ("169.254.169.254",)):
            with pytest.raises(WebhookRefused, match="jobs.webhooks.allow"):
                asyncio.run(deliver(resolver(*answers)))
        assert len(receiver.received) == 1
    finally:
        receiver.close()
    with pytest.raises(WebhookRefused, match="10.0.0.1"):
        check_target("https://hooks.invalid/hook", WebhookArgs(), resolver("10.0.0.1"))
    assert check_target("https://hooks.invalid/hook", WebhookArgs(), resolver("93.184.216.34")) == "93.184.216.34"


def test_a_pinned_url_keeps_its_host_for_tls():
    from h3serve.deploy.jobs.webhooks import pinned

    target, host, extensions = pinned("https://hooks.example.com/h3?x=1", "93.184.216.34")
    assert str(target) == "https://93.184.216.34/h3?x=1"
    assert host == {"host": "hooks.example.com"} and extensions == {"sni_hostname": "hooks.example.com"}
    target, host, extensions = pinned("http://hooks.example.com:8080/h3", "2001:db8::1")
    assert str(target) == "http://[2001:db8::1]:8080/h3" and host == {"host": "hooks.example.com:8080"}
    assert extensions == {}
