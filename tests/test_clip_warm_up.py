"""The warm-up clip (``WarmUps.clip``, ``h3serve/replicas/warm_up.py``): one whole request at the served size through
the engine's own stages and ranks before the replica is ready, invisible to the request table, its events and
metrics; on a real engine over a real sp=1 worker group of the tiny checkpoint, and in a real Serve replica (sp=2,
its decode's tiles over the ranks)."""

import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.replicas import Engine, EngineLimits, WorkerGroup
from h3serve.replicas.warm_up import ClipWarmUpRefused
from tests.test_engine_faults import Recorder
from tests.test_replicas import spec

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

CLIP = {"enabled": True}


class Seen(Recorder):
    """A Recorder that also keeps every request event."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str]] = []

    def on_request_event(self, ticket, kind, fields):
        self.events.append((ticket.id, kind))


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


def served(group, limits: EngineLimits, request: GenerationRequest, clip: bool):
    """The engine's warm-up (and its clip), then ``request`` as a user's: (clip report, media, observer, engine)."""

    async def scenario():
        observer = Seen()
        engine = Engine(group, limits, observer)
        try:
            engine.warm_up()
            warm = await engine.warm_up_clip() if clip else None
            seen_before = (list(observer.events), observer.steps, dict(observer.stages), engine.stats.forwards)
            media = await engine.generate(request, "user")
            return warm, seen_before, media, observer, engine
        finally:
            await engine.close()

    return asyncio.run(scenario())


def test_the_clip_runs_the_served_size_through_every_stage_and_leaves_no_trace(solo):
    """At the served size (the model's canvas, shortest clip): prepared, every step, decoded as a stream, encoded;
    nothing the engine reports counts it, and the first user's clip equals the one made without it."""
    user = GenerationRequest(prompt="a red circle moving left", num_inference_steps=3, seed=7)
    limits = EngineLimits(warmup_clip=CLIP)
    warm, before, media, observer, engine = served(solo, limits, user, clip=True)
    assert warm is not None and engine.last_clip_warm_up == warm
    assert warm.frames == media.frames.shape[:3]  # the default request's size: the served one
    assert warm.forwards == limits.warmup_clip.steps - 1 and warm.rows > 0
    assert warm.streamed and warm.mp4_bytes > 0  # the followed video's path: its MP4 made while it decoded
    assert all(s >= 0 for s in (warm.prepare_s, warm.steps_s, warm.decode_s, warm.encode_s))
    events, steps, stages, forwards = before
    assert events == [] and steps == 0 and stages == {} and forwards == 0  # no event, no metric, no count
    assert {rid for rid, _ in observer.events} == {"user"} and engine.stats.forwards == 2

    _, _, alone, _, _ = served(solo, EngineLimits(), user, clip=False)
    assert np.array_equal(media.frames, alone.frames) and np.array_equal(media.audio, alone.audio)


def test_a_size_the_model_refuses_fails_the_start_naming_the_field(solo):
    async def scenario():
        engine = Engine(solo, EngineLimits(warmup_clip={"enabled": True, "num_frames": 6}))
        try:
            engine.warm_up()
            with pytest.raises(ClipWarmUpRefused, match="engine.warmup_clip.*num_frames must be 17n\\+5"):
                await engine.warm_up_clip()
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_it_is_off_unless_enabled_and_needs_the_warm_up(solo):
    assert not Engine(solo, EngineLimits()).clip_warm_up_due  # its start cost is every start's: opt-in
    assert Engine(solo, EngineLimits(warmup_clip=CLIP)).clip_warm_up_due
    assert not Engine(solo, EngineLimits(warmup=False)).clip_warm_up_due
    with pytest.raises(ValidationError, match="warmup_clip.enabled: true needs warmup: true"):
        EngineLimits(warmup=False, warmup_clip=CLIP)
    with pytest.raises(ValidationError, match="steps"):
        EngineLimits(warmup_clip={"enabled": True, "steps": 1})
