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
import io
from pathlib import Path

import av
import numpy as np
import pytest
import ray
from PIL import Image
from ray import serve

from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.common.errors import RETRY_AFTER_S, StageUnavailable, http_error, root_cause
from h3serve.deploy.common.serve_controller import SERVE_CONTROLLER
from h3serve.deploy.model_server.stage_client import STAGE_ATTEMPTS, ServeStages
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline, H3StageModels, PreparedState, Reference, RequestError
from h3serve.pipelines.h3.checkpoint import write_tiny_checkpoint
from h3serve.pipelines.h3.pipeline import StagesElsewhere
from h3serve.replicas import Engine, EngineLimits, ReplicaSpec, WorkerGroup
from tests.harness import ServeProcess, default_config, finished_video, free_port, scrape, wait_for, write_config
from tests.test_engine_faults import assert_same_media
from tests.test_replicas import RESOLUTION, spec

pytestmark = [pytest.mark.ray]
SOLO, STAGED = "solo", "staged"
SMALL = {"num_cpus": 0.2}


def two_apps_config(checkpoint: Path) -> dict:
    """Both apps on ``checkpoint``: the tiny preset with a transformer_ref partition, so Ref2VA runs too."""
    base = default_config()
    template = base["applications"][0]
    template["args"].update(rank_resources={"CPU": 0.2}, limits={"default_steps": 4}, checkpoint=str(checkpoint))

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
    # one request per staged pack: concurrent requests then make exactly what each makes alone (co-batching would
    # round fp32 GEMMs differently), so a run with a stage replica killed compares bit for bit with the solo app
    one_per_pack = dict(template["args"]["engine"], max_active=1)
    base["applications"] = [app(SOLO, {}, 1), app(STAGED, {"stages": stages, "engine": one_per_pack}, 2)]
    return base


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory):
    port = free_port()
    # the same tensors as tiny_checkpoint for every component but the added transformer_ref (drawn last)
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("ref-checkpoint"), with_ref=True)
    process = ServeProcess(
        write_config(tmp_path_factory.mktemp("stages"), two_apps_config(checkpoint), port), ray_cluster.address, port
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
    # an image reference goes through Qwen3-VL's image processor, which needs no torchvision (video ones do)
    "ref2va": GenerationRequest(
        prompt="the subject walks",
        num_inference_steps=4,
        seed=7,
        references=(Reference(kind="image", data=keyframe_png()),),
    ),
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

            from h3serve.replicas import WorkerGroup

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
    from h3serve.deploy.model_server.h3_replica import H3Replica

    unbuilt = object.__new__(H3Replica)
    with pytest.raises(ValueError, match="spec.stages='remote' needs both conditioner and decoder handles"):
        asyncio.run(H3Replica.__init__(unbuilt, staged_spec(1, tiny_checkpoint), EngineLimits()))
    assert not hasattr(unbuilt, "group")  # nothing was built


def test_every_staged_denoiser_replica_serves_with_the_transformer_partitions_alone(server):
    solo = replica(SOLO).diagnostics.remote().result(timeout_s=60)
    assert {"transformer", "text_encoder", "vae", "audio_vae"} <= set(solo["rank0_models"])
    for _ in range(4):  # Serve routes each call to either denoiser
        staged = replica(STAGED).diagnostics.remote().result(timeout_s=60)
        assert staged["stages"] is True
        assert staged["rank0_models"] == {p: solo["rank0_models"][p] for p in ("transformer", "transformer_ref")}


# the default canvas; a first frame sets the canvas's aspect (the 64x64 keyframe: square)
STILL_SHAPES = {"t2va": (64, 128, 3), "fl2va": (64, 64, 3), "ref2va": (64, 128, 3)}


@pytest.mark.parametrize("task", ["t2va", "fl2va", "ref2va"])
def test_the_staged_app_makes_exactly_what_the_one_replica_app_makes(server, task):
    request = REQUESTS[task]
    images = [
        replica(app).generate_image.remote(request, f"{task}-still").result(timeout_s=300) for app in (SOLO, STAGED)
    ]
    solo_still, staged_still = (png_pixels(png) for png in images)
    assert solo_still.shape == STILL_SHAPES[task]
    np.testing.assert_array_equal(staged_still, solo_still)  # bit-identical: same blocks, same weights, fp32 CPU
    solo_clip, staged_clip = (mp4_frames_and_audio(video_of(app, request, f"{task}-clip")) for app in (SOLO, STAGED))
    np.testing.assert_array_equal(staged_clip[0], solo_clip[0])
    np.testing.assert_array_equal(staged_clip[1], solo_clip[1])


def test_the_readmes_examples_over_http_from_the_staged_app(server):
    """The README's openai-client lines against the staged app's route: a clip with sound, and a still that is
    the one-replica app's pixel for pixel."""
    import base64

    import openai

    def api(app: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{server.url}/{app}/v1", api_key="unused", max_retries=0)

    staged = api(STAGED)
    video = staged.videos.create(prompt="a red circle moving left with a high beep")
    assert finished_video(staged, video.id, timeout=300).status == "completed"
    frames, audio = mp4_frames_and_audio(staged.videos.download_content(video.id).read())
    assert frames.shape == (124, 64, 128, 3) and audio.shape[0] == 2  # the shortest clip, stereo

    def still(app: str) -> np.ndarray:
        result = api(app).images.generate(prompt="a blue square", response_format="b64_json", extra_body={"seed": 9})
        return png_pixels(base64.b64decode(result.data[0].b64_json))

    np.testing.assert_array_equal(still(STAGED), still(SOLO))


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


def stage_handles():
    """The staged app's conditioner and decoder deployments' handles, for a ServeStages of a test's own."""
    return (
        serve.get_deployment_handle("H3Conditioner", app_name=STAGED),
        serve.get_deployment_handle("H3Decoder", app_name=STAGED),
    )


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
                *stage_handles(),
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


class LoadingStages(ServeStages):
    """The real stage deployments, the conditioner answering only after ``delay_s`` (as a replacement replica that
    is still loading Qwen3-VL would)."""

    def __init__(self, *args, delay_s: float):
        super().__init__(*args)
        self.delay_s = delay_s

    async def prepare(self, request, shift):
        await asyncio.sleep(self.delay_s)
        return await super().prepare(request, shift)


def test_waiting_on_a_stage_is_not_a_stall_of_the_denoiser(server, tiny_checkpoint):
    group = WorkerGroup.create(staged_spec(1, tiny_checkpoint))
    stall_min_s = 0.5
    try:

        async def scenario():
            stages = LoadingStages(
                *stage_handles(),
                "test-engine",
                delay_s=8 * stall_min_s,
            )
            engine = Engine(group, EngineLimits(max_active=2, stall_min_s=stall_min_s), remote=stages)
            ticket = engine.submit(GenerationRequest(prompt="a clip", num_inference_steps=2, seed=1), request_id="r")
            healthy_while_waiting = 0
            while not ticket.future.done():
                await asyncio.sleep(stall_min_s)
                if engine.stats.completed == 0 and engine.stages.calls:  # only the stage works, past the window
                    engine.check_health()  # EngineStalled here would fail the test
                    healthy_while_waiting += 1
            return await ticket.future, healthy_while_waiting

        media, healthy_while_waiting = asyncio.run(scenario())
    finally:
        group.shutdown()
    assert healthy_while_waiting >= 4  # checked well past the stall window while the conditioner was "loading"
    assert media.frames.shape[0] > 0


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


# -- a stage replica that dies: its calls are made again, no request fails ------------------------------------------
class DyingStageReplicas:
    """A stage deployment's handle in miniature (same methods), over real Ray actors: each call goes to a replica
    started for it, as Serve's router sends a call made again to a live replica and never to the one that died. A
    replica's process exits in the middle of the call if fewer than ``deaths`` calls have died so far (counted in
    ``ledger``, a file shared by all of them); after that each call is answered with what it was sent, or with the
    stage's own RequestError when ``flaw``. (One actor restarted in place made the count of calls made again depend on
    how fast Ray restarted it: on a busy machine a retry met "the actor is restarting" and was counted too.)"""

    def __init__(self, ledger: Path, deaths: int, flaw: bool = False):
        self.init = (str(ledger), deaths, flaw)
        self.actor = _dying_stage_actor()  # one actor class: Ray exports its definition once, not once a call
        self.started: list[ray.actor.ActorHandle] = []
        self.prepare = _Route(self, "prepare")
        self.decode = _Route(self, "decode")

    def next_replica(self) -> ray.actor.ActorHandle:
        self.started.append(self.actor.remote(*self.init))
        return self.started[-1]

    def close(self) -> None:
        for replica in self.started:
            ray.kill(replica)


class _Route:
    def __init__(self, replicas: DyingStageReplicas, method: str):
        self.replicas, self.method = replicas, method

    def remote(self, *args):
        return getattr(self.replicas.next_replica(), self.method).remote(*args)


def _dying_stage_actor():
    class DyingStage:  # defined here so that Ray ships it by value (its worker needs no tests package)
        def __init__(self, ledger: str, deaths: int, flaw: bool):
            self.ledger, self.deaths, self.flaw = ledger, deaths, flaw

        def _call(self, role: str, args: tuple) -> tuple:
            import os

            with open(self.ledger, "a+") as ledger:
                ledger.seek(0)
                died = len(ledger.readlines())
                if died < self.deaths:
                    ledger.write(f"{role}\n")
                    ledger.flush()
                    os._exit(1)  # the worker process dies under the call, as a killed replica does
            if self.flaw:
                from h3serve.pipelines.h3 import RequestError

                raise RequestError("first_frame", "first_frame is not a decodable image")
            return (role, *args)

        def prepare(self, request, shift, caller):
            return self._call("conditioner", (request, shift, caller))

        def decode(self, handoff, output, caller):
            return self._call("decoder", (handoff, output, caller))

    return ray.remote(num_cpus=0.05, max_restarts=0, max_task_retries=0)(DyingStage)


def test_a_stage_call_whose_replica_dies_is_made_again_with_the_same_arguments(ray_cluster, tmp_path):
    import torch

    latents = torch.arange(24, dtype=torch.float32, device="cpu").reshape(4, 6)  # [rows, channels] finished rows
    request = REQUESTS["t2va"]
    for role, died in (("decoder", STAGE_ATTEMPTS - 1), ("conditioner", 1)):
        ledger = tmp_path / f"{role}.deaths"
        stage = DyingStageReplicas(ledger, died)
        stages = ServeStages(stage, stage, "denoiser-1")  # type: ignore[arg-type]  # the handle's two methods
        if role == "decoder":
            got = asyncio.run(stages.decode(latents, "mp4"))  # type: ignore[arg-type]  # the stand-in echoes it
            assert got[0] == "decoder" and torch.equal(got[1], latents) and got[2:] == ("mp4", "denoiser-1")
        else:
            got = asyncio.run(stages.prepare(request, 3.0))
            assert got == ("conditioner", request, 3.0, "denoiser-1")
        assert ledger.read_text().splitlines() == [role] * died  # it really died that often, then answered
        assert stages.retries == {role: died}
        assert len(stage.started) == died + 1  # one call per death, and the one that answered
        stage.close()


def test_a_stage_that_keeps_dying_fails_the_request_naming_the_stage_and_its_own_error_is_never_retried(
    ray_cluster, tmp_path
):
    ledger = tmp_path / "always.deaths"
    stage = DyingStageReplicas(ledger, 100)
    stages = ServeStages(stage, stage, "denoiser-1")  # type: ignore[arg-type]  # the handle's two methods
    with pytest.raises(
        StageUnavailable, match=f"the decoder stage's replica died under this request {STAGE_ATTEMPTS}"
    ) as unavailable:
        asyncio.run(stages.decode(b"rows", None))  # type: ignore[arg-type]
    error = http_error(unavailable.value, "test")  # the client may retry: 503 + Retry-After, not a 500
    assert (error.status, error.headers) == (503, {"Retry-After": RETRY_AFTER_S})
    assert ledger.read_text().splitlines() == ["decoder"] * STAGE_ATTEMPTS  # bounded: no call after the last
    assert stages.retries == {"decoder": STAGE_ATTEMPTS - 1}
    stage.close()

    flawed = DyingStageReplicas(tmp_path / "flawed.deaths", 0, flaw=True)
    stages = ServeStages(flawed, flawed, "denoiser-1")  # type: ignore[arg-type]  # the handle's two methods
    with pytest.raises(RequestError, match="first_frame is not a decodable image") as caught:
        asyncio.run(stages.prepare(REQUESTS["t2va"], None))
    assert caught.value.field == "first_frame"  # the stage's own error, as if it had run in process
    assert stages.retries == {}  # a bad request is never made again
    assert len(flawed.started) == 1
    flawed.close()


STAGE_DEPLOYMENT = {"conditioner": "H3Conditioner", "decoder": "H3Decoder"}
RETRIES_SERIES = "ray_h3serve_stage_retries_total"


@pytest.fixture(scope="module")
def solo_clips(server) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The kill test's videos made by the one-replica app, one at a time (nothing killed): frames and audio."""
    return {rid: mp4_frames_and_audio(video_of(SOLO, request, f"solo-{rid}")) for rid, request in KILL_RUN.items()}


# default canvas (128x64, 5 s): a decode takes seconds on a CPU, a prepare a fraction of one
KILL_RUN = {f"kite-{i}": GenerationRequest(prompt=f"a kite {i}", num_inference_steps=3, seed=20 + i) for i in range(4)}


def staged_denoisers() -> set[str]:
    controller = ray.get_actor(*SERVE_CONTROLLER)
    details = ray.get(controller.get_deployment_details.remote(STAGED, "H3Replica"))
    return {r.replica_id for r in details.replicas if r.state == "RUNNING"}


def stage_retries_scraped(metrics_port: int, role: str) -> float:
    return sum(s.value for s in scrape(metrics_port).get(RETRIES_SERIES, []) if s.labels.get("stage") == role)


def stage_retries_reported(role: str) -> int:
    views: dict[str, dict] = {}
    for _ in range(40):  # the router picks one denoiser per call
        view = replica(STAGED).diagnostics.remote().result(timeout_s=60)
        views[view["replica"]] = view
        if len(views) == 2:
            break
    assert len(views) == 2, views
    return sum(view["stage_retries"].get(role, 0) for view in views.values())


@pytest.mark.parametrize("role", ["decoder", "conditioner"])
def test_killing_a_stage_replica_mid_run_loses_no_request(server, ray_cluster, solo_clips, role):
    """Videos in flight on both denoisers; the stage's one replica is killed while it works on some of them. Every
    video completes, equal to the solo app's, the denoisers stay up, and the calls it held are made again."""
    denoisers = staged_denoisers()
    assert len(denoisers) == 2
    stage = serve.get_deployment_handle(STAGE_DEPLOYMENT[role], app_name=STAGED)
    retries_before = stage_retries_reported(role)
    scraped_before = stage_retries_scraped(ray_cluster.metrics_port, role)

    async def run() -> tuple[dict[str, bytes], dict]:
        async def video(request_id: str, request: GenerationRequest) -> bytes:
            stream = replica(STAGED).options(stream=True).generate_video.remote(request, f"{role}-{request_id}")
            return [chunk async for chunk in stream if "mp4" in chunk][-1]["mp4"]

        # the stage's one replica's actor, found before the run: between seeing it at work and the kill there is
        # no controller call, so a short call (the conditioner's) is still held when the kill lands
        controller = ray.get_actor(*SERVE_CONTROLLER)
        details = await controller.get_deployment_details.remote(STAGED, STAGE_DEPLOYMENT[role])
        [victim] = details.replicas
        actor = ray.get_actor(victim.actor_name, namespace="serve")
        videos = [asyncio.ensure_future(video(rid, request)) for rid, request in KILL_RUN.items()]
        while True:  # kill it while it works on a call (report() is answered during its work)
            report = await stage.report.remote()
            if report["ongoing"] > 0:
                break
            assert not all(v.done() for v in videos), "every video finished before the stage was seen at work"
            await asyncio.sleep(0.005)
        ray.kill(actor, no_restart=True)
        assert report["replica_id"] == victim.replica_id
        done = await asyncio.wait_for(asyncio.gather(*videos), timeout=600)
        return dict(zip(KILL_RUN, done, strict=True)), report

    clips, killed = asyncio.run(run())
    for request_id, mp4 in clips.items():  # every request completed, exactly as the unkilled one-replica run
        frames, audio = mp4_frames_and_audio(mp4)
        np.testing.assert_array_equal(frames, solo_clips[request_id][0])
        np.testing.assert_array_equal(audio, solo_clips[request_id][1])
    assert staged_denoisers() == denoisers  # no denoiser failed or was replaced
    replacement = stage.report.remote().result(timeout_s=120)
    assert replacement["replica_id"] != killed["replica_id"]  # Serve replaced the killed replica
    # the calls the killed replica held were made again: each counted once by its denoiser, and the replacement
    # served them (with every call that came after the kill)
    retried = stage_retries_reported(role) - retries_before
    assert 1 <= retried <= len(KILL_RUN) * (STAGE_ATTEMPTS - 1), (retried, killed)
    assert set(replacement["calls"]) <= denoisers and sum(replacement["calls"].values()) >= retried, replacement
    wait_for(
        lambda: stage_retries_scraped(ray_cluster.metrics_port, role) - scraped_before == retried,
        timeout=60,
        interval=0.5,
        what=f"{RETRIES_SERIES}{{stage={role!r}}} to count {retried} more",
    )
