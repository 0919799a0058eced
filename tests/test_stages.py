"""Conditioner and decoder stages of their own (issue 27, first piece), on a real local Ray cluster.

Two applications from one `h3serve serve` config: "solo" (today's one-deployment app) and "staged" (two
H3Replica denoisers sharing one H3Conditioner and one H3Decoder, args.stages). Outputs are compared
bit for bit: the stages run the same diffusers blocks on the same weights, in float32 on the CPU, and
the hand-off moves host tensors through the object store unchanged (pickling a tensor is exact).
"""

import asyncio
import copy
import importlib.util
import io

import av
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from deploy.args import DeployArgs
from deploy.errors import root_cause
from deploy.replica import SERVE_CONTROLLER, ServeStages
from pipelines.h3 import GenerationRequest, PreparedState, RequestError
from replicas import Engine, EngineLimits, WorkerGroup
from tests.harness import ServeProcess, default_config, free_port, write_config
from tests.test_engine_faults import assert_same_media
from tests.test_replicas import spec

pytestmark = [pytest.mark.ray]
SOLO, STAGED = "solo", "staged"
SMALL = {"num_cpus": 0.2}
NEEDS_TORCHVISION = "FL2VA/Ref2VA keyframes and references go through Qwen3-VL's vision processor, which needs "
NEEDS_TORCHVISION += "torchvision (not installed here)"


def two_apps_config() -> dict:
    base = default_config()
    template = base["applications"][0]
    template["args"].update(rank_resources={"CPU": 0.2}, limits={"default_steps": 4})

    def app(name: str, args: dict, replicas: int) -> dict:
        new = copy.deepcopy(template)
        new.update(name=name, route_prefix=f"/{name}")
        new["args"].update(args, ingress={"h3_replicas": replicas})
        new["deployments"] = [
            {"name": "H3Ingress", "ray_actor_options": {"num_cpus": 0.05}},
            {"name": "H3Replica", "num_replicas": replicas},
        ]
        return new

    stages = {"conditioner": {"ray_actor_options": SMALL}, "decoder": {"ray_actor_options": SMALL}}
    base["applications"] = [app(SOLO, {}, 1), app(STAGED, {"stages": stages}, 2)]
    return base


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    port = free_port()
    process = ServeProcess(
        write_config(tmp_path_factory.mktemp("stages"), two_apps_config(), port), ray_cluster.address, port
    )
    try:
        process.wait_serving(apps=2, timeout=300)
        yield process
    finally:
        process.stop()


def replica(app: str):
    return serve.get_deployment_handle("H3Replica", app_name=app)


def stage_report(role: str) -> dict:
    name = {"conditioner": "H3Conditioner", "decoder": "H3Decoder"}[role]
    return serve.get_deployment_handle(name, app_name=STAGED).report.remote().result(timeout_s=60)


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def mp4_frames_and_audio(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(io.BytesIO(data)) as container:
        audio = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=-1)
    return frames, audio


def video_of(app: str, request: GenerationRequest, request_id: str) -> bytes:
    stream = replica(app).options(stream=True).generate_video.remote(request, request_id)
    chunks = [chunk for chunk in stream if "mp4" in chunk]
    return chunks[-1]["mp4"]


def keyframe_png() -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.tile(np.arange(64, dtype=np.uint8)[:, None, None], (1, 64, 3))).save(buffer, "PNG")
    return buffer.getvalue()


REQUESTS = {
    "t2va": GenerationRequest(prompt="a red circle moving left", num_inference_steps=4, seed=5),
    "fl2va": GenerationRequest(prompt="a sunrise", num_inference_steps=4, seed=6, first_frame=keyframe_png()),
}


def test_builder_binds_no_stage_without_a_stages_section():
    assert DeployArgs().stage_deployments() == {}
    staged = DeployArgs.model_validate({"stages": {"decoder": {"num_replicas": 2}}})
    assert staged.stage_deployments()["conditioner"].ray_actor_options == {"num_cpus": 1.0}
    assert staged.stage_deployments()["decoder"].num_replicas == 2
    with pytest.raises(ValueError, match="stages.conditioner.ray_actor_options must reserve num_gpus >= 1"):
        DeployArgs.model_validate({"device": "cuda", "stages": {"conditioner": {"ray_actor_options": {"num_gpus": 0}}}})


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_the_staged_app_makes_exactly_what_the_one_replica_app_makes(server, task):
    if task != "t2va" and importlib.util.find_spec("torchvision") is None:
        pytest.skip(NEEDS_TORCHVISION)
    request = REQUESTS[task]
    images = [
        replica(app).generate_image.remote(request, f"{task}-still").result(timeout_s=300) for app in (SOLO, STAGED)
    ]
    solo_still, staged_still = (png_pixels(png) for png in images)
    assert solo_still.shape == (64, 128, 3)
    np.testing.assert_array_equal(staged_still, solo_still)  # bit-identical: same blocks, same weights, fp32 CPU
    solo_clip, staged_clip = (mp4_frames_and_audio(video_of(app, request, f"{task}-clip")) for app in (SOLO, STAGED))
    np.testing.assert_array_equal(staged_clip[0], solo_clip[0])
    np.testing.assert_array_equal(staged_clip[1], solo_clip[1])


def test_two_denoiser_replicas_share_one_conditioner_and_one_decoder(server):
    controller = ray.get_actor(*SERVE_CONTROLLER)
    details = ray.get(controller.get_deployment_details.remote(STAGED, "H3Replica"))
    denoisers = {r.replica_id for r in details.replicas if r.state == "RUNNING"}
    assert len(denoisers) == 2
    before = {role: stage_report(role) for role in ("conditioner", "decoder")}

    async def burst(n: int) -> list[bytes]:
        handle = replica(STAGED)
        request = GenerationRequest(prompt="a drum", num_inference_steps=3, width=64, height=64)
        return await asyncio.gather(*(handle.generate_image.remote(request, f"burst-{i}") for i in range(n)))

    sent = 0
    for _ in range(4):  # concurrent requests spread over both denoisers (Serve routes to the shorter queue)
        sent += len(asyncio.run(burst(4)))
        if set(stage_report("conditioner")["calls"]) >= denoisers:
            break
    for role in ("conditioner", "decoder"):
        after = stage_report(role)
        assert after["replica_id"] == before[role]["replica_id"]  # one replica of each stage served it all
        assert set(after["calls"]) == denoisers, (role, after)  # called by both denoisers, nobody else
        served = sum(after["calls"].values()) - sum(before[role]["calls"].values())
        assert served == sent, (role, after, before[role])


class CorruptingStages(ServeStages):
    """The real stage deployments, with one request's latents cut one row short on their way to the decoder
    (real bad data: diffusers' after-denoise block cannot lay them out)."""

    def __init__(self, *args, poisoned_rows: int):
        super().__init__(*args)
        self.poisoned_rows = poisoned_rows

    async def decode(self, handoff, output):
        if handoff.video_rows.shape[0] == self.poisoned_rows:
            handoff.video_rows = handoff.video_rows[:-1]
        return await super().decode(handoff, output)


def test_a_request_whose_decode_fails_at_the_decoder_stage_fails_alone(server, tiny_checkpoint, tiny_pipeline):
    good = [GenerationRequest(prompt=f"clip {i}", num_inference_steps=3, seed=i, width=64, height=64) for i in (1, 2)]
    bad = GenerationRequest(prompt="clip bad", num_inference_steps=3, seed=3, width=128, height=64)
    prepared = [PreparedState.of(tiny_pipeline.stages.prepare(r, tiny_pipeline.rules)) for r in (*good, bad)]
    bad_rows = prepared[-1].values["latents"].shape[0]
    assert all(p.values["latents"].shape[0] != bad_rows for p in prepared[:-1])
    decoder_before = stage_report("decoder")
    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    try:

        async def scenario():
            stages = CorruptingStages(
                serve.get_deployment_handle("H3Conditioner", app_name=STAGED),
                serve.get_deployment_handle("H3Decoder", app_name=STAGED),
                "test-engine",
                poisoned_rows=bad_rows,
            )
            engine = Engine(group, EngineLimits(max_active=4), remote=stages)
            tickets = [engine.submit(r, request_id=f"r{i}") for i, r in enumerate((*good, bad))]
            results = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
            return engine, results

        engine, results = asyncio.run(scenario())
        group.check_health()  # the denoiser is fine
    finally:
        group.shutdown()
    assert isinstance(results[-1], Exception), results[-1]
    for request, got in zip(good, results[:2], strict=True):
        # they shared packs with each other: fp32 GEMMs round differently than alone (one uint8 step at most)
        assert_same_media(got, tiny_pipeline.generate(request))
    assert engine.stats.failed_requests == {"decode": 1}
    assert engine.stats.completed == 2
    assert stage_report("decoder")["failures"] == decoder_before["failures"] + 1
    # what crossed, counted by the engine: each prepared state once, each request's final rows once (counted
    # before the corruption), and the two good requests' raw media back
    assert engine.stats.handoff_bytes["prepared"] == sum(p.nbytes for p in prepared)
    latent_bytes = sum(p.values["latents"].nbytes + p.values["audio_latents"].nbytes for p in prepared)
    assert engine.stats.handoff_bytes["latents"] == latent_bytes
    assert engine.stats.handoff_bytes["media"] == sum(r.frames.nbytes + r.audio.nbytes for r in results[:2])
    print(f"hand-off bytes of three tiny requests: {dict(engine.stats.handoff_bytes)}")


def test_a_bad_keyframe_is_the_same_request_error_from_the_conditioner_stage(server):
    bad = GenerationRequest(prompt="a sunrise", num_inference_steps=3, first_frame=b"not an image")
    failures_before = stage_report("conditioner")["failures"]
    causes = []
    for app in (SOLO, STAGED):
        with pytest.raises(RequestError) as caught:
            replica(app).generate_image.remote(bad, f"bad-keyframe-{app}").result(timeout_s=120)
        causes.append(root_cause(caught.value))  # what the ingress maps to its HTTP answer
    assert [type(c) for c in causes] == [RequestError, RequestError]
    assert [c.field for c in causes] == ["first_frame", "first_frame"]  # an HTTP 400 naming first_frame
    assert all(str(c).startswith("first_frame is not a decodable image") for c in causes), causes
    assert stage_report("conditioner")["failures"] == failures_before + 1  # it failed there, not in the denoiser
