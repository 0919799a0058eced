"""Conditioner and decoder stages of their own (issue 27), on a real local Ray cluster.

Two applications from one `h3serve serve` config: "solo" (today's one-deployment app) and "staged" (two
H3Replica denoisers sharing one H3Conditioner and one H3Decoder, args.stages). Outputs are compared
bit for bit: the stages run the same diffusers blocks on the same weights, in float32 on the CPU, and
the hand-off moves host tensors through the object store unchanged (pickling a tensor is exact). A staged
denoiser's rank 0 holds only the transformer (no text encoder, no VAE): counted on the live objects of a
fresh process that built a real WorkerGroup.
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
from pipelines.h3 import GenerationRequest, H3Pipeline, H3StageModels, PreparedState, RequestError
from pipelines.h3.pipeline import StagesElsewhere
from replicas import Engine, EngineLimits, ReplicaSpec, WorkerGroup
from tests.harness import ServeProcess, default_config, free_port, write_config
from tests.test_engine_faults import assert_same_media
from tests.test_replicas import RESOLUTION, spec

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


def staged_spec(sp: int, checkpoint) -> ReplicaSpec:
    return spec(sp, checkpoint).model_copy(update={"stages": "remote"})


def test_builder_binds_no_stage_without_a_stages_section():
    assert DeployArgs().stage_deployments() == {}
    assert DeployArgs().replica_spec(RESOLUTION).stages == "local"  # rank 0 loads the text encoder and VAEs
    staged = DeployArgs.model_validate({"stages": {"decoder": {"num_replicas": 2}}})
    assert staged.replica_spec(RESOLUTION).stages == "remote"  # rank 0 holds only the transformer
    assert staged.stage_deployments()["conditioner"].ray_actor_options == {"num_cpus": 1.0}
    assert staged.stage_deployments()["decoder"].num_replicas == 2
    with pytest.raises(ValueError, match="stages.conditioner.ray_actor_options must reserve num_gpus >= 1"):
        DeployArgs.model_validate({"device": "cuda", "stages": {"conditioner": {"ray_actor_options": {"num_gpus": 0}}}})


# the top-level model classes of a checkpoint's components (transformers, text encoder, VAEs)
MODEL_CLASSES = (
    "MiniMaxH3Transformer3DModel",
    "Qwen3VLForConditionalGeneration",
    "AutoencoderKLMiniMaxH3",
    "AutoencoderKLMiniMaxH3Audio",
)


def models_alive_after_building_rank0(replica_spec: ReplicaSpec) -> dict[str, list]:
    """In a fresh Ray actor process: build a real WorkerGroup's rank 0 from ``replica_spec``, collect garbage, and
    list every live model object of ``MODEL_CLASSES``: class -> [(parameters, devices)] per instance."""

    class Rank0Process:  # defined here so that Ray ships it by value (its worker needs no tests package)
        def build(self, replica_spec: ReplicaSpec, classes: tuple[str, ...]) -> dict[str, list]:
            import gc

            import torch

            from replicas import WorkerGroup

            self.group = WorkerGroup.create(replica_spec)  # kept alive while the objects are counted
            gc.collect()
            alive: dict[str, list] = {}
            for obj in gc.get_objects():
                if isinstance(obj, torch.nn.Module) and type(obj).__name__ in classes:
                    params = list(obj.parameters())
                    devices = sorted({p.device.type for p in params})
                    alive.setdefault(type(obj).__name__, []).append((sum(p.numel() for p in params), devices))
            return alive

    actor = ray.remote(num_cpus=0.2, max_restarts=0)(Rank0Process).remote()
    try:
        return ray.get(actor.build.remote(replica_spec, MODEL_CLASSES), timeout=300)
    finally:
        ray.kill(actor)


def test_a_staged_rank0_holds_only_the_transformer(ray_cluster, tiny_checkpoint, tiny_pipeline):
    solo = models_alive_after_building_rank0(spec(1, tiny_checkpoint))
    staged = models_alive_after_building_rank0(staged_spec(1, tiny_checkpoint))
    transformer = sum(p.numel() for p in tiny_pipeline.denoiser.transformers["transformer"].parameters())
    # the one-replica rank 0 holds one of each (the check can see them), all on the replica's device
    assert {name: len(instances) for name, instances in solo.items()} == dict.fromkeys(MODEL_CLASSES, 1)
    assert all(instance[1] == ["cpu"] for instances in solo.values() for instance in instances)
    # staged: the transformer alone, not even a meta-device VAE left over from reading the model rules
    assert staged == {"MiniMaxH3Transformer3DModel": [(transformer, ["cpu"])]}


def test_a_denoiser_only_pipeline_refuses_to_prepare_or_decode_and_keeps_the_model_rules(
    tiny_checkpoint, tiny_pipeline
):
    pipeline = H3Pipeline.load(tiny_checkpoint, "torch_sdpa", stages="remote")
    assert not pipeline.has_stages and set(pipeline.held_models()) == {"transformer"}
    assert tiny_pipeline.has_stages
    with pytest.raises(StagesElsewhere, match="cannot run diffusers' blocks before or after the loop"):
        pipeline.stages  # noqa: B018  # the attribute itself refuses
    assert {"transformer", "text_encoder", "vae", "audio_vae"} <= set(tiny_pipeline.held_models())
    assert pipeline.rules == tiny_pipeline.rules  # read off config-only VAEs: the same frame and sample rates
    request = REQUESTS["t2va"]
    assert pipeline.validate(request) == tiny_pipeline.validate(request)  # its tokenizer sizes the rows
    with pytest.raises(StagesElsewhere, match="holds only the transformer partitions"):
        pipeline.prepare(request)
    # a conditioner's prepared state steps here exactly as in the whole pipeline, then the decoder decodes it
    conditioner = H3StageModels.load("conditioner", tiny_checkpoint)
    decoder = H3StageModels.load("decoder", tiny_checkpoint)
    state = pipeline.admit(request, conditioner.prepare(request))
    reference = tiny_pipeline.prepare(request)
    while not state.done:
        pipeline.step([state])
        tiny_pipeline.step([reference])
    with pytest.raises(StagesElsewhere, match="cannot decode a request"):
        pipeline.decode(state)
    got, want = decoder.decode(pipeline.decode_handoff(state)), tiny_pipeline.decode(reference)
    np.testing.assert_array_equal(got.frames, want.frames)
    np.testing.assert_array_equal(got.audio, want.audio)
    with pytest.raises(ValueError, match="stages must be one of local, remote, got 'elsewhere'"):
        H3Pipeline.load(tiny_checkpoint, "torch_sdpa", stages="elsewhere")  # type: ignore[arg-type]


def test_a_replica_refuses_stage_handles_that_do_not_match_its_spec(tiny_checkpoint):
    """A staged spec without the stages' handles would leave a rank 0 that cannot prepare: refused before it builds."""
    from deploy.replica import H3Replica

    unbuilt = object.__new__(H3Replica)
    with pytest.raises(ValueError, match="spec.stages='remote' needs both conditioner and decoder handles"):
        asyncio.run(H3Replica.__init__(unbuilt, staged_spec(1, tiny_checkpoint), EngineLimits()))
    assert not hasattr(unbuilt, "group")  # nothing was built


def test_every_staged_denoiser_replica_serves_with_the_transformer_alone(server):
    solo = replica(SOLO).diagnostics.remote().result(timeout_s=60)
    assert {"transformer", "text_encoder", "vae", "audio_vae"} <= set(solo["rank0_models"])
    for _ in range(4):  # Serve routes each call to either denoiser
        staged = replica(STAGED).diagnostics.remote().result(timeout_s=60)
        assert staged["stages"] is True
        assert staged["rank0_models"] == {"transformer": solo["rank0_models"]["transformer"]}


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
    group = WorkerGroup.create(staged_spec(1, tiny_checkpoint))  # rank 0 without text encoder and VAEs
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
