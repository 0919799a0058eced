"""Event streams, queue position and ETA, cancel, and the playground page in a real browser, against the session's
`h3serve serve` (the "events" application: one request in the pack at a time, a preview every 2 steps;
``served_apps.EVENTS_ENGINE``). The page's test shares this module's application rather than starting one of its
own (each costs the suite's server start ~18 s on CI); `make screenshots` runs it alone."""

import asyncio
import base64
import io
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image
from ray import serve

from tests.harness import REPO, browser_or_skip, client, error_of, event_stream, scrape, wait, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PROMPT = "a red circle moving left with a high beep"  # the README's


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def diagnostics() -> dict:
    return serve.get_deployment_handle("H3Replica", app_name="events").diagnostics.remote().result()


def stream(http: httpx.Client, video_id: str, headers: dict | None = None) -> list[dict]:
    with http.stream("GET", f"/v1/videos/{video_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return event_stream(response.read().decode())


def video(http: httpx.Client, steps: int, prompt: str = PROMPT, **fields) -> dict:
    response = http.post("/v1/videos", json={"prompt": prompt, "num_inference_steps": steps, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def cancelled_counted(metrics_port: int, stage: str) -> float:
    samples = scrape(metrics_port).get("ray_h3serve_cancelled_requests_total", [])
    return sum(s.value for s in samples if s.labels.get("stage") == stage and s.labels.get("application") == "events")


def submit(driver, prompt: str, steps: int, seconds: str = "") -> str:
    """Fill the form and submit; the new card's video id."""
    from selenium.webdriver.common.by import By

    before = {e.get_attribute("id") for e in driver.find_elements(By.CSS_SELECTOR, "#jobs .card")}
    for field, value in (("prompt", prompt), ("steps", str(steps)), ("seconds", seconds)):
        element = driver.find_element(By.ID, field)
        element.clear()
        if value:
            element.send_keys(value)
    driver.find_element(By.ID, "submit").click()

    def new_card(d):
        ids = {e.get_attribute("id") for e in d.find_elements(By.CSS_SELECTOR, "#jobs .card")} - before
        return next(iter(ids), None)

    return wait(driver, new_card, 60, "a card for the new job").removeprefix("job-")


def test_the_playground_page_generates_shows_previews_plays_the_clip_and_cancels(server):
    """The page at / in a real browser (Debian's chromium, headless, selenium through chromium-driver), first in this
    module so that it finds the application idle: the README's prompt's previews change, its clip loads with the
    right duration and plays; a second job shows its queue position, then is cancelled from its card while it
    runs; the live panel reads the server's figures. Its screenshot is the README's picture under `make screenshots`
    (H3SERVE_SCREENSHOTS=docs/images). A locked server's page: test_api_http, on its "locked" application."""
    browser = browser_or_skip()
    try:
        page_flow(server, browser)
    finally:
        browser.quit()


def page_flow(server, browser) -> None:
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/")
    assert browser.title == "h3serve playground"
    wait(browser, lambda d: d.find_element(By.ID, "auth-state").text == "open server: no key needed", 30, "auth state")
    wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"), 30, "models and jobs")
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#cache option")][0].startswith("off")

    first = submit(browser, PROMPT, 16)
    second = submit(browser, "a blue square moving up", 50, "14")  # waits behind the first, then runs long
    el = browser.find_element(By.ID, f"job-{second}")
    wait(browser, lambda d: "position" in el.find_element(By.CLASS_NAME, "detail").text, 60, "a queue position")
    mine = browser.find_element(By.ID, f"job-{first}")
    wait(browser, lambda d: int(mine.get_attribute("data-previews")) >= 3, 120, "three distinct previews")
    video = mine.find_element(By.CSS_SELECTOR, "video.clip")
    # issue 58: from its decoding event the card played its content as a stream (a fragmented MP4 through
    # MediaSource); paused, the finished MP4 takes the stream's place
    wait(browser, lambda d: mine.get_attribute("data-streamed") == "1", 120, "the stream to end")
    assert int(mine.get_attribute("data-stream-bytes")) > 0 and mine.get_attribute("data-stream-error") is None
    wait(browser, lambda d: mine.get_attribute("data-stream-played") == "1", 30, "the stream to play")
    browser.execute_script("arguments[0].pause()", video)
    wait(browser, lambda d: mine.get_attribute("data-clip") == "finished", 30, "the finished clip, after the stream")
    wait(browser, lambda d: d.execute_script("return arguments[0].readyState >= 1", video), 120, "the clip to load")
    duration = browser.execute_script("return arguments[0].duration", video)
    assert abs(duration - 124 / 24) < 0.1, duration  # the shortest clip: 124 frames at 24 fps
    browser.execute_script("arguments[0].play()", video)
    wait(browser, lambda d: d.execute_script("return arguments[0].currentTime", video) > 0.2, 30, "the clip to play")
    link = mine.find_element(By.CLASS_NAME, "download")
    assert link.get_attribute("download") == f"{first}.mp4" and link.get_attribute("href").startswith("blob:")
    # the second one, running now: cancel it from its card
    wait(browser, lambda d: "step" in el.find_element(By.CLASS_NAME, "detail").text, 120, "the second job to run")
    el.find_element(By.CLASS_NAME, "cancel").click()
    wait(browser, lambda d: el.get_attribute("data-status") == "cancelled", 60, "the second job cancelled")
    assert el.find_element(By.CLASS_NAME, "status").text == "cancelled"
    # the live panel (every 2 s): the engine let the cancelled job go, and counted it
    panel = ("stat-queue", "stat-cancelled")
    wait(browser, lambda d: [d.find_element(By.ID, i).text for i in panel] == ["0 waiting, 0 active", "1"], 30, "panel")
    # admission failures as the server reports them (the session's cluster also counts other modules' refusals)
    with client(server.url) as http:
        reported = http.get("/v1/stats").json()["admission_failures"]
    assert isinstance(reported, int) and browser.find_element(By.ID, "stat-admission").text == str(reported)
    screenshots = Path(os.environ.get("H3SERVE_SCREENSHOTS", REPO / "tests" / ".screenshots"))
    screenshots.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(screenshots / "playground.png"))


def test_a_job_streams_its_queue_position_steps_previews_decoding_and_its_record(server):
    """Two jobs, one pack slot: the second reports position 1 behind the first, then every step with an ETA,
    previews (PNG strips), decoding and the completed record; GET shows the position while it waits. Both streams
    are read live, at once: the first's previews change as it denoises. A reader that resumes with Last-Event-ID
    gets only what followed."""
    with client(server.url) as http, ThreadPoolExecutor(1) as pool:
        first = video(http, 12, seed=1)
        second = video(http, 8, seed=2)
        waiting = http.get(f"/v1/videos/{second['id']}").json()

        def first_stream() -> list[dict]:
            with client(server.url) as own:
                return stream(own, first["id"])

        reading = pool.submit(first_stream)
        events = stream(http, second["id"])
        first_events = reading.result()
        finished = http.get(f"/v1/videos/{second['id']}").json()
    if waiting["status"] == "queued":  # the first may have finished already on a fast machine
        assert waiting["queue_position"] >= 1 and waiting["eta_seconds"] > 0, waiting
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[-1] == "completed" and "started" in kinds and "decoding" in kinds, kinds
    ids = [int(e["id"]) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids
    steps = [e["data"] for e in events if e["event"] == "step"]
    assert [s["step"] for s in steps] == list(range(1, 8)) and all(s["steps"] == 7 for s in steps)
    assert all(s["eta_s"] is not None and s["eta_s"] >= 0 for s in steps)
    # the first runs alone: its previews change; the second's may coalesce behind the first's decode on the stage
    # worker (a capture waiting there is replaced by a newer one), so it is only sure to show one
    changing = [e["data"]["image"] for e in first_events if e["event"] == "preview"]
    assert len(set(changing)) >= 2, len(changing)
    previews = [e["data"]["image"] for e in events if e["event"] == "preview"]
    assert previews, [e["event"] for e in events]
    strip = Image.open(io.BytesIO(base64.b64decode(previews[-1].removeprefix("data:image/png;base64,"))))
    assert strip.format == "PNG" and strip.height == 4 and strip.width == 4 * 8 + 3  # four 8x4 latent frames
    record = events[-1]["data"]["video"]
    assert record["id"] == second["id"] and record["status"] == "completed"
    assert finished["status"] == "completed" and finished["queue_position"] is None and finished["eta_seconds"] is None
    assert first_events[-1]["event"] == "completed"
    # resume after the third event: exactly what followed it
    with client(server.url) as http:
        resumed = stream(http, second["id"], headers={"Last-Event-ID": events[2]["id"]})
    # only the newest preview is kept for replay: the resumed stream is the rest less superseded previews
    rest = [e for e in events[3:] if e["event"] != "preview" or e["data"]["image"] == previews[-1]]
    assert [e["id"] for e in resumed] == [e["id"] for e in rest]


def test_cancel_a_running_and_a_queued_job(server):
    """A running job leaves its pack at the next step boundary, a queued one the queue at once: both read cancelled,
    their streams end with cancelled, the engine holds neither, and the metric counts each where it was."""
    before = {stage: cancelled_counted(server.metrics_port, stage) for stage in ("running", "waiting")}
    with client(server.url) as http:
        running = video(http, 50, prompt="a slow blue square", seed=3)
        queued = video(http, 50, prompt="a green triangle", seed=4)

        def stepping():
            requests = diagnostics()["requests"]
            return any(r["forwards"] >= 2 for r in requests.values())

        wait_for(stepping, timeout=120, interval=0.1, what="the first job to step")
        response = http.post(f"/v1/videos/{queued['id']}/cancel")
        assert response.status_code == 200 and response.json()["status"] == "cancelled", response.text
        response = http.post(f"/v1/videos/{running['id']}/cancel")
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "cancelled" and response.json()["queue_position"] is None
        for job in (running, queued):
            assert http.get(f"/v1/videos/{job['id']}").json()["status"] == "cancelled"
            assert stream(http, job["id"])[-1]["event"] == "cancelled"
            error = error_of(http.post(f"/v1/videos/{job['id']}/cancel"), 409)  # once finished, nothing to cancel
            assert error["param"] == "video_id" and "cancelled" in error["message"], error
        assert wait_for(lambda: not diagnostics()["requests"], timeout=30, interval=0.1, what="the engine to let go")
        listed = {v["id"]: v["status"] for v in http.get("/v1/videos").json()["data"]}
        assert listed[running["id"]] == listed[queued["id"]] == "cancelled"

    def counted():
        now = {stage: cancelled_counted(server.metrics_port, stage) for stage in before}
        return now if all(now[s] - before[s] >= 1 for s in before) else None

    wait_for(counted, timeout=60, what="ray_h3serve_cancelled_requests_total by stage")


def test_bad_input_on_the_new_routes_is_a_4xx_naming_the_problem(server):
    unknown = "video_" + "0" * 32
    with client(server.url) as http:
        for method, path in (("GET", f"/v1/videos/{unknown}/events"), ("POST", f"/v1/videos/{unknown}/cancel")):
            error = error_of(http.request(method, path), 404)
            assert error["param"] == "video_id" and unknown in error["message"], error
        job = video(http, 2)
        for bad in ("abc", "-1", "1.5", "9" * 12):
            error = error_of(http.get(f"/v1/videos/{job['id']}/events", headers={"Last-Event-ID": bad}), 400)
            assert error["param"] == "Last-Event-ID" and "decimal integer" in error["message"], (bad, error)
        error = error_of(http.get(f"/v1/videos/{job['id']}/events", headers={"Last-Event-ID": "999999"}), 400)
        assert error["param"] == "Last-Event-ID" and "past this job's last event" in error["message"], error
        assert stream(http, job["id"])[-1]["event"] == "completed"


def test_an_image_client_that_goes_away_cancels_its_request_at_the_next_step_boundary(server):
    """A raw connection posts an image request of 50 steps and closes once it runs: Serve cancels the ingress's
    call, the replica's generate_image leaves the engine, and the request stops at the next step boundary."""
    import socket
    from urllib.parse import urlsplit

    before = cancelled_counted(server.metrics_port, "running")
    body = json.dumps({"prompt": "a bell", "size": "64x64", "num_inference_steps": 50}).encode()
    url = urlsplit(server.url)
    head = (
        f"POST {url.path or ''}/v1/images/generations HTTP/1.1\r\nHost: {url.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nX-Request-Id: gone-image\r\n\r\n"
    )
    with socket.create_connection((url.hostname, url.port), timeout=30) as connection:
        connection.sendall(head.encode() + body)

        def stepping():
            request = diagnostics()["requests"].get("gone-image-0")
            return request is not None and request["forwards"] >= 2

        wait_for(stepping, timeout=120, interval=0.1, what="the image request to step")
        forwards = diagnostics()["forwards"]
    # the connection closed with no answer read
    wait_for(lambda: "gone-image-0" not in diagnostics()["requests"], timeout=30, interval=0.1, what="it to leave")
    assert diagnostics()["forwards"] - forwards < 45  # it never ran its remaining steps
    wait_for(lambda: cancelled_counted(server.metrics_port, "running") > before, timeout=60, what="the cancel counted")


def test_a_hundred_idle_event_streams_do_not_slow_the_engine(server):
    """100 readers of a job that waits behind another: each stream is open (it got its first event) and idle; the
    running job's steps take as long as without them (the engine never sees a reader)."""

    def step_seconds(job_id: str) -> float:
        """Mean seconds per step of the running job, from two step events 6 steps apart."""
        with client(server.url) as http:
            with http.stream("GET", f"/v1/videos/{job_id}/events") as response:
                marks = []
                buffer = ""
                for chunk in response.iter_text():
                    buffer += chunk
                    while "\n\n" in buffer:
                        block, buffer = buffer.split("\n\n", 1)
                        if "event: step" in block:
                            marks.append(time.monotonic())
                    if len(marks) >= 8:
                        return (marks[-1] - marks[1]) / 6
        raise AssertionError("the job ended before 8 steps")

    with client(server.url) as http:
        alone = video(http, 24, prompt="a magenta circle", seed=5)
        baseline = step_seconds(alone["id"])
        running = video(http, 40, prompt="a cyan square", seed=6)
        idle = video(http, 4, prompt="a yellow triangle", seed=7)  # waits behind it: its streams stay quiet
        wait_for(lambda: http.get(f"/v1/videos/{running['id']}").json()["status"] == "in_progress", timeout=120)

    async def hundred_readers():
        opened = 0
        limits = httpx.Limits(max_connections=120, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(60, read=None), limits=limits) as h:

            async def reader():
                nonlocal opened
                async with h.stream("GET", f"/v1/videos/{idle['id']}/events") as response:
                    assert response.status_code == 200
                    seen = False
                    async for chunk in response.aiter_text():  # read on (and hold the stream) until cancelled
                        if "event: queued" in chunk and not seen:
                            seen, opened = True, opened + 1

            # in waves of 20: a burst of 100 at once would outrun the proxy's queue (ingress.headroom, 32), which
            # answers 503 by design; what is measured is 100 streams held open
            tasks: list[asyncio.Task] = []
            for wave in range(5):
                tasks += [asyncio.create_task(reader()) for _ in range(20)]
                deadline = time.monotonic() + 60
                while opened < 20 * (wave + 1):
                    assert time.monotonic() < deadline, f"{opened} streams open"
                    await asyncio.sleep(0.05)
            loaded = await asyncio.to_thread(step_seconds, running["id"])
            stats = (await h.get("/v1/stats")).json()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return loaded, stats

    loaded, stats = asyncio.run(hundred_readers())
    assert stats["event_streams_open"] >= 100, stats
    # on 2 shared cores a step varies; a reader that cost the engine anything per step would show as a multiple
    assert loaded < 1.5 * baseline + 0.02, (loaded, baseline)
