"""A video job's events reach the client while it denoises, on steps that take seconds, not in one burst at the end.

Through the real path: the session's `h3serve serve` (its "liveevents" application: a synthetic checkpoint whose
transformer is wide enough that one step of the default clip takes ~0.5-2 s on this 2-core machine,
``served_apps.LIVE_TRANSFORMER``), the replica's stream to the ingress, the ingress's event log and Serve's proxy,
read with the product's client (``H3Client.follow``, the SSE stream). Each event's arrival is set beside the
engine's own marks for the request (``H3Replica.timelines``: ``time.monotonic()`` on the replica's node, which is
this one, so the clocks agree): an event held back while the model thread runs a forward, or by any stage of the
stream, arrives late against them. (Section 21 of docs/BENCHMARKS.md read such a burst once; it was a one-step job,
whose ``started``, ``step`` and ``decoding`` come at the same instant by design.)
"""

import time
import uuid

import pytest
from ray import serve

from h3serve.client import H3Client

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
PROMPT = "a red circle moving left with a high beep"
STEPS = 6  # sigma grid points: 5 forwards
LATE_S = 1.0  # an event may arrive this long after the engine's mark (the replica's, the ingress' and the proxy's hops)
SPAN_S = 1.5  # the forwards must span at least this, or a burst at their end would not be told from live events


@pytest.fixture(scope="module")
def server(served):
    with served.module(__name__) as app:
        yield app


def test_step_events_arrive_as_the_steps_end(server):
    request_id = f"live-{uuid.uuid4().hex[:12]}"
    arrived: list[tuple[str, dict, float]] = []  # (kind, data, time.monotonic() of its arrival here)
    with H3Client(server.url, timeout=120) as client:
        body = {"prompt": PROMPT, "num_inference_steps": STEPS}
        video_id = client.create_video(body, headers={"X-Request-Id": request_id})["id"]
        for event in client.follow(video_id):
            arrived.append((event["event"], event["data"], time.monotonic()))
    kinds = [kind for kind, _, _ in arrived]
    assert kinds[-1] == "completed", kinds
    handle = serve.get_deployment_handle("H3Replica", app_name="liveevents")
    marks = handle.timelines.remote([request_id]).result(timeout_s=30)[request_id]
    span = marks["last_step"] - marks["first_step"]
    assert span >= SPAN_S, f"the forwards after the first took {span:.2f} s: too fast to tell live events from a burst"

    def at(kind: str, step: int | None = None) -> float:
        (t,) = [t for k, data, t in arrived if k == kind and (step is None or data.get("step") == step)]
        return t

    steps = [(data["step"], t) for kind, data, t in arrived if kind == "step"]
    assert [s for s, _ in steps] == list(range(1, STEPS)), kinds  # every step's event, in order (none throttled)
    # each edge the engine marks reaches the client within LATE_S of it: the first step's end (started, step 1),
    # the last step's end, the decode's start
    for kind, step, mark in (
        ("started", None, "first_step"),
        ("step", 1, "first_step"),
        ("step", STEPS - 1, "last_step"),
        ("decoding", None, "decode"),
    ):
        late = at(kind, step) - marks[mark]
        assert -0.05 <= late <= LATE_S, f"{kind} {step or ''} arrived {late:+.2f} s from the engine's {mark}: {arrived}"
    # and the step events in between come as the steps do: spread over the forwards, not bunched at their end
    assert steps[-1][1] - steps[0][1] >= span - LATE_S, (span, steps)
    # (one event held up by a hiccup of this loaded machine may arrive with the next; a burst brings them all)
    gaps = [b - a for (_, a), (_, b) in zip(steps, steps[1:], strict=False)]
    bunched = [gap for gap in gaps if gap < 0.1 * span / len(gaps)]
    assert len(bunched) <= len(gaps) // 2, (gaps, span)
