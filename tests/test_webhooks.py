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
from h3serve.deploy.jobs.webhooks import WebhookRefused, WebhookSender, check_target

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

            sender.start(
                url, video, lambda s=store: s.claim_webhook(job_id), lambda o, s=store: s.record_webhook(job_id, o), io
            )
        for sender in senders:
            await asyncio.gather(*sender.tasks)

    asyncio.run(both())
    assert len(received) == 3  # one sender: 500, 500, 200
    assert all(verify_webhook(SECRET, headers, body) == video for headers, body in received)
    outcome = stores[1].webhook(job_id)
    assert outcome["delivered"] and outcome["attempts"] == 3 and outcome["status"] == 200
    assert stores[0].delete(job_id) and not list(tmp_path.glob(f"{job_id}*"))


def test_a_target_that_never_answers_2xx_gives_up_within_retry_for_s(tmp_path):
    config = WebhookArgs(allow=["127.0.0.1/32"], allow_http=True, first_retry_s=0.05, max_retry_s=0.1, retry_for_s=0.5)
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
        sender.start(
            "http://127.0.0.1:9/hook",
            runner.record["video"],
            lambda: store.claim_webhook(job_id),
            lambda o: store.record_webhook(job_id, o),
            io,
        )
        await asyncio.gather(*sender.tasks)
        return time.monotonic() - started

    assert asyncio.run(deliver()) < 5
    outcome = store.webhook(job_id)
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
