"""Webhooks over real HTTP on the session's server (its "webhooks" application: jobs.webhooks signed with
served_apps.WEBHOOK_SECRET, allowed to 127.0.0.1 only): a receiver on 127.0.0.1 that answers 500 twice sees a third
attempt, signed so that the client's verify_webhook accepts it, carrying the final job object; the attempts are
counted by outcome; targets outside the allow-list are a 400 naming ``webhook``; a job whose runner ingress is killed
with kill -9 and is then cancelled through the proxy sends its cancelled object once, from another ingress (the app
runs two). The parts alone: tests/test_webhooks.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from h3serve.client import H3Client, WebhookVerificationError, verify_webhook
from tests.harness import H3SERVE, client, gone, scrape, wait_for
from tests.served_apps import WEBHOOK_SECRET, WEBHOOKS_LEASE_S

pytestmark = [pytest.mark.ray, pytest.mark.e2e]


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


class Receiver:
    """A webhook receiver on 127.0.0.1: answers ``fail_first`` deliveries with 500, then 204; keeps every one."""

    def __init__(self, fail_first: int):
        self.fail_first, self.received = fail_first, []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                receiver.received.append((dict(self.headers), body))
                self.send_response(500 if len(receiver.received) <= receiver.fail_first else 204)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/hooks/h3"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


def attempts(server) -> dict[str, float]:
    counted: dict[str, float] = {}
    for sample in scrape(server.metrics_port).get("ray_h3serve_webhook_attempts_total", []):
        if sample.labels.get("application") == server.name:
            counted[sample.labels["outcome"]] = counted.get(sample.labels["outcome"], 0.0) + sample.value
    return counted


def test_a_webhook_is_retried_signed_and_carries_the_final_job(server):
    receiver = Receiver(fail_first=2)
    before = attempts(server)
    try:
        created = subprocess.run(  # `h3serve video create --webhook`, as a user runs it
            [*H3SERVE, "video", "create", "--prompt", "a bell", "--steps", "2", "--webhook", receiver.url],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "H3SERVE_SERVER": server.url},
            check=False,
        )
        assert created.returncode == 0, created.stderr[-2000:]
        job = {"id": created.stdout.strip()}
        with H3Client(server.url) as api:
            final = api.wait_video(job["id"])
            assert final["status"] == "completed", final
            wait_for(lambda: len(receiver.received) >= 3, timeout=60, interval=0.2, what="three webhook attempts")
            wait_for(lambda: attempts(server).get("delivered", 0) > before.get("delivered", 0), 30, what="counted")
            assert len(receiver.received) == 3  # two 500s, then delivered: no fourth
            ids = {headers["webhook-id"] for headers, _ in receiver.received}
            assert len(ids) == 1  # one message, retried: a receiver dedupes on it
            for headers, body in receiver.received:
                assert verify_webhook(WEBHOOK_SECRET, headers, body) == final
            headers, body = receiver.received[-1]
            with pytest.raises(WebhookVerificationError):
                verify_webhook(WEBHOOK_SECRET, headers, body.replace(b"completed", b"cancelled"))
            with pytest.raises(WebhookVerificationError):
                verify_webhook("whsec_" + "b3RoZXI=", headers, body)
            after = attempts(server)
            assert after.get("rejected", 0) - before.get("rejected", 0) >= 2, after
            api.delete(job["id"])
    finally:
        receiver.close()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data/",  # the cloud metadata address (link-local)
        "http://10.1.2.3/hook",  # private
        "http://192.168.0.7:8080/hook",
        "http://[::1]/hook",  # loopback, IPv6
        "ftp://127.0.0.1/hook",
        "not a url",
    ],
)
def test_a_target_outside_the_allow_list_is_a_400_naming_webhook(server, url):
    with H3Client(server.url) as api:
        answer = api.http.post("/v1/videos", json={"prompt": "a bell", "num_inference_steps": 2, "webhook": url})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "webhook", answer.json()


def test_a_cancelled_job_sends_its_final_object_once(server):
    """Cancelled at once (a 50-step job), or completed first when the cancel lost the race: either way the one
    webhook carries the final object the API reads."""
    receiver = Receiver(fail_first=0)
    try:
        with H3Client(server.url) as api:
            job = api.create_video({"prompt": "a bell", "num_inference_steps": 50, "webhook": receiver.url})
            api.http.post(f"/v1/videos/{job['id']}/cancel")  # 200 cancelled, or 409 when it completed first
            final = api.wait_video(job["id"])
            assert final["status"] in ("cancelled", "completed"), final
            wait_for(lambda: receiver.received, timeout=60, interval=0.2, what="the webhook")
            time.sleep(1.0)  # no second delivery follows
            assert len(receiver.received) == 1
            headers, body = receiver.received[0]
            assert verify_webhook(WEBHOOK_SECRET, headers, body) == final
            api.delete(job["id"])
    finally:
        receiver.close()


def test_a_job_whose_runner_ingress_is_killed_sends_its_cancelled_webhook_from_another(server):
    """kill -9 of the ingress running a job, then a cancel through the proxy: the job ends cancelled by an ingress
    that never ran it (the cancel found when its lease lapsed), which sends its webhook, once."""
    receiver = Receiver(fail_first=0)
    try:
        with client(server.url) as http:
            body = {"prompt": "a lost bell", "num_inference_steps": 50, "webhook": receiver.url}
            created = http.post("/v1/videos", json=body)
            assert created.status_code == 200, created.text
            job_id = created.json()["id"]
            runner = json.loads((server.store / f"{job_id}.json").read_text())["runner"]
            assert b"H3Ingress" in Path(f"/proc/{runner['pid']}/cmdline").read_bytes(), runner
            os.kill(runner["pid"], signal.SIGKILL)
            killed = time.monotonic()
            assert gone(runner["pid"], 10)

            def cancelled():  # sent again while the proxy still routes to the dead replica
                try:
                    answer = http.post(f"/v1/videos/{job_id}/cancel")
                except httpx.HTTPError:
                    return None
                return answer if answer.status_code < 500 else None

            answer = wait_for(cancelled, timeout=60, interval=0.25, what="the cancel answered")
            assert answer.status_code == 200 and answer.json()["status"] == "cancelled", answer.text
            wait_for(lambda: receiver.received, timeout=60, interval=0.2, what="the webhook")
            print(f"kill -9 of the runner ingress to its job's cancelled webhook: {time.monotonic() - killed:.1f} s")
            time.sleep(WEBHOOKS_LEASE_S / 2)  # no second delivery follows (a sweep on every ingress ran meanwhile)
            assert len(receiver.received) == 1, receiver.received
            headers, sent = receiver.received[0]
            final = http.get(f"/v1/videos/{job_id}").json()
            assert verify_webhook(WEBHOOK_SECRET, headers, sent) == final and final["status"] == "cancelled"
            delivery = json.loads((server.store / f"{job_id}.webhook1").read_text())
            assert delivery["delivered"] and delivery["runner"]["pid"] != runner["pid"], delivery
            http.delete(f"/v1/videos/{job_id}")
    finally:
        receiver.close()
