"""The whole MiniMax-H3 pipeline from a checkpoint directory, against diffusers' own modular pipeline."""

import copy
import functools
import io
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from diffusers.modular_pipelines import MiniMaxH3Blocks
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep
from PIL import Image
from safetensors.torch import load_file, save_file

from h3serve.attention import AdmissionError, BackendUnavailable, Platform, UnknownBackendError
from h3serve.pipelines.h3 import (
    CheckpointError,
    GenerationRequest,
    H3Pipeline,
    Reference,
    RequestError,
    preset,
    validate_deployment,
)
from h3serve.pipelines.h3.admission import DeploymentConfigError
from h3serve.pipelines.h3.checkpoint import CheckpointIndex, tiny_components, write_tiny_checkpoint
from h3serve.pipelines.h3.media import probe_media
from h3serve.pipelines.h3.stages import HostRowTimestepsStep

STEPS = 4


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def run(pipeline: H3Pipeline, request: GenerationRequest):
    """h3serve's path: diffusers' blocks before, the packed engine steps, diffusers' blocks after."""
    state = pipeline.prepare(request)
    while not state.done:
        pipeline.step([state])
    return pipeline.stages.decode(state.state, state.video_rows, state.audio_rows)


def diffusers_run(pipeline: H3Pipeline, request: GenerationRequest, replace: dict | None = None, **inputs):
    """diffusers' own MiniMaxH3 modular pipeline, same components (but ``replace``'s) and inputs, its own attention
    processor."""
    reference = MiniMaxH3Blocks().init_pipeline()
    reference.register_to_config(**pipeline.stages.before.config)
    components = {
        name: getattr(pipeline.stages.before, name)
        for name in pipeline.stages.before.component_names
        if getattr(pipeline.stages.before, name, None) is not None
    }
    for name, model in pipeline.denoiser.transformers.items():
        components[name] = copy.deepcopy(model)
        components[name].set_attn_processor(MiniMaxH3AttnProcessor())
    reference.update_components(**{**components, **(replace or {})})
    return reference(
        prompt=request.prompt,
        num_inference_steps=request.num_inference_steps,
        generator=torch.Generator().manual_seed(request.seed),
        output_type="pt",
        num_frames=request.num_frames or pipeline.rules.min_frames,
        **inputs,
    )


def assert_same_generation(ours, theirs):
    torch.testing.assert_close(ours.get("latents"), theirs.get("latents"), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.get("audio_latents"), theirs.get("audio_latents"), atol=1e-5, rtol=0)
    frames = [(state.get("videos") * 255).round().to(torch.int16) for state in (ours, theirs)]
    assert (frames[0] - frames[1]).abs().max() <= 1  # decoded frames within one uint8 step
    torch.testing.assert_close(ours.get("audio"), theirs.get("audio"), atol=1e-4, rtol=0)


# --- one request equals diffusers' modular pipeline -----------------------------------------


def test_t2va_equals_diffusers_modular_pipeline(tiny_pipeline):
    request = GenerationRequest(prompt="a red circle moving left", num_inference_steps=STEPS, seed=3)
    ours, theirs = run(tiny_pipeline, request), diffusers_run(tiny_pipeline, request)
    assert_same_generation(ours, theirs)
    assert ours.get("videos").shape == (1, 124, 3, 64, 128)  # the shortest clip on the tiny 16:9 canvas
    assert ours.get("audio").shape[:2] == (1, 2)  # stereo


def test_every_workflow_builds_its_row_timestep_plan_on_the_host(tiny_pipeline):
    """diffusers indexes a default-device (CPU) vector with execution-device indices, which CUDA refuses; the
    replacement step feeds it host indices and plans the same rows (the equality tests above run through it)."""
    workflows = tiny_pipeline.stages.before.blocks.sub_blocks["denoise"].sub_blocks
    assert {name: type(w.sub_blocks["set_timesteps"]) for name, w in workflows.items()} == {
        name: HostRowTimestepsStep for name in ("t2va", "fl2va", "ref2va")
    }
    video, audio = torch.arange(10, 30), torch.arange(3, 10)
    args = (video, audio, 4, 2, 3, 0.4, 0.2, 0.999, 1.0)
    ours, theirs = HostRowTimestepsStep.build_row_timesteps(*args), MiniMaxH3SetTimestepsStep.build_row_timesteps(*args)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    assert len(ours[0]) == 4  # video, audio, keyframe and reference timesteps


def test_fl2va_equals_diffusers_modular_pipeline(tiny_pipeline):
    first, last = png(96, 64, seed=1), png(64, 64, seed=2)
    request = GenerationRequest(
        prompt="a sunrise", num_inference_steps=STEPS, seed=5, first_frame=first, last_frame=last
    )
    ours = run(tiny_pipeline, request)
    theirs = diffusers_run(
        tiny_pipeline,
        request,
        image=Image.open(io.BytesIO(first)).convert("RGB"),
        last_image=Image.open(io.BytesIO(last)).convert("RGB"),
    )
    assert_same_generation(ours, theirs)
    assert ours.get("videos").shape[-2:] == (64, 96)  # the canvas follows the first frame's aspect


@pytest.fixture(scope="module")
def ref_pipeline(tmp_path_factory):
    return H3Pipeline.load(write_tiny_checkpoint(tmp_path_factory.mktemp("ref"), with_ref=True), "torch_sdpa")


def test_ref2va_equals_diffusers_modular_pipeline(ref_pipeline):
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3ImageReference

    image = png(80, 48, seed=4)
    request = GenerationRequest(
        prompt="the subject walks", num_inference_steps=STEPS, seed=2, references=(Reference(kind="image", data=image),)
    )
    assert "transformer_ref" in ref_pipeline.rules.partitions
    ours = run(ref_pipeline, request)
    width, height = ref_pipeline.rules.default_canvas
    theirs = diffusers_run(
        ref_pipeline,
        request,
        height=height,
        width=width,
        references=[MiniMaxH3ImageReference(image=Image.open(io.BytesIO(image)).convert("RGB"))],
    )
    assert_same_generation(ours, theirs)


def test_ref2va_without_its_partition_names_it(tiny_pipeline):
    request = GenerationRequest(prompt="x", references=(Reference(kind="image", data=png(32, 32)),))
    with pytest.raises(RequestError, match="transformer_ref") as error:
        tiny_pipeline.validate(request)
    assert error.value.field == "references"


def test_video_references_need_torchvision(ref_pipeline):
    assert not ref_pipeline.rules.video_references  # this CPU venv has no torchvision
    request = GenerationRequest(prompt="x", references=(Reference(kind="video", data=b"\x00" * 8),))
    with pytest.raises(RequestError, match="torchvision"):
        ref_pipeline.validate(request)


# --- many requests, of different tasks, in one pack --------------------------------------------


def test_mixed_tasks_share_a_pack_and_equal_each_alone(tiny_pipeline):
    requests = [
        GenerationRequest(prompt="a red circle", num_inference_steps=STEPS, seed=1),
        GenerationRequest(
            prompt="waves on a beach at night",
            width=64,
            height=64,
            num_frames=141,
            num_inference_steps=STEPS + 2,
            seed=2,
        ),
        GenerationRequest(prompt="a blue square", num_inference_steps=STEPS, seed=3, first_frame=png(64, 32)),
    ]
    states = [tiny_pipeline.prepare(r) for r in requests]
    forwards = 0
    while not all(s.done for s in states):
        forwards += len(tiny_pipeline.step([s for s in states if not s.done]))
    assert forwards == max(s.steps for s in states)  # every step was one forward for all of them
    for request, state in zip(requests, states, strict=True):
        alone = tiny_pipeline.prepare(request)
        while not alone.done:
            tiny_pipeline.step([alone])
        torch.testing.assert_close(state.video_rows, alone.video_rows, atol=1e-5, rtol=0)
        torch.testing.assert_close(state.audio_rows, alone.audio_rows, atol=1e-5, rtol=0)


def test_generate_makes_a_clip_with_stereo_sound_at_the_vae_rate(tiny_pipeline):
    media = tiny_pipeline.generate(GenerationRequest(prompt="a lighthouse at dusk", num_inference_steps=3))
    assert media.frames.shape == (124, 64, 128, 3) and media.frames.dtype == np.uint8
    info = probe_media(media.mp4())
    assert (info.frames, info.fps, info.video_codec) == (124, 24.0, "h264")
    assert (info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("aac", 2, 8000)
    assert info.audio_duration_s == pytest.approx(124 / 24, abs=0.05)
    still = probe_media(media.png())
    assert (still.container, still.width, still.height) == ("png", 128, 64)


# --- the model's own rules ----------------------------------------------------------------------


def test_rules_come_from_the_checkpoint(tiny_pipeline):
    rules = tiny_pipeline.rules
    assert (rules.fps, rules.min_frames, rules.max_frames) == (24, 124, 345)
    assert (rules.canvas_multiple, rules.sample_rate, rules.default_canvas) == (32, 8000, (128, 64))
    assert rules.frames_for_seconds(5) == 124 and rules.frames_for_seconds(6) == 158
    assert rules.frames_for_seconds(14.375) == 345


@pytest.mark.parametrize(
    "change,field,message",
    [
        (dict(num_frames=120), "num_frames", "17n\\+5"),
        (dict(num_frames=107), "num_frames", "between 124 and 345"),
        (dict(width=100, height=64), "size", "multiples of 32"),
        (dict(width=320, height=64), "size", "aspect ratio"),
        (dict(width=256, height=128), "size", "larger than the model's canvas"),
        (dict(width=128), "size", "give both or neither"),
    ],
)
def test_requests_outside_the_rules_name_the_field(tiny_pipeline, change, field, message):
    with pytest.raises(RequestError, match=message) as error:
        tiny_pipeline.validate(GenerationRequest(prompt="x", **change))
    assert error.value.field == field


@pytest.mark.parametrize("seconds", [3, 15, 0, float("nan")])
def test_seconds_outside_the_models_clip_lengths(tiny_pipeline, seconds):
    with pytest.raises(RequestError) as error:
        tiny_pipeline.rules.frames_for_seconds(seconds)
    assert error.value.field == "seconds"


def test_a_bad_keyframe_names_the_field(tiny_pipeline):
    with pytest.raises(RequestError, match="first_frame is not a decodable image"):
        tiny_pipeline.prepare(GenerationRequest(prompt="x", first_frame=b"not an image"))


def test_distilled_model_takes_no_guidance_fields():
    with pytest.raises(ValueError, match="guidance_scale"):
        GenerationRequest(prompt="x", guidance_scale=4.0)


# --- checkpoints: the released layout, strictly, offline -----------------------------------------


def test_a_checkpoint_saved_by_the_libraries_themselves_serves(tmp_path):
    """Not h3serve's writer: diffusers' ModularPipeline.save_pretrained, whose index holds absolute paths."""
    components = tiny_components(seed=7)
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.register_to_config(**preset("tiny").pipeline_config)
    pipe.update_components(**components)
    pipe.save_pretrained(str(tmp_path / "saved"), overwrite_modular_index=True)
    moved = shutil.move(tmp_path / "saved", tmp_path / "moved")  # the index's paths now point nowhere
    pipeline = H3Pipeline.load(moved, "torch_sdpa")
    media = pipeline.generate(GenerationRequest(prompt="a fox", num_inference_steps=2))
    assert media.frames.shape == (124, 64, 128, 3)


def corrupt(checkpoint, tmp_path, edit):
    copy_ = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy_)
    weights = copy_ / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights)
    return copy_


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("proj_out.weight"), "missing keys: proj_out.weight"),
        (lambda t: t.update({"extra.weight": torch.zeros(2)}), "unexpected keys: extra.weight"),
        (lambda t: t.update({"proj_out.weight": torch.zeros(3, 3)}), "proj_out.weight"),
    ],
    ids=["missing", "unexpected", "wrong-shape"],
)
def test_a_checkpoint_that_does_not_fit_is_refused(tiny_checkpoint, tmp_path, edit, message):
    bad = corrupt(tiny_checkpoint, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message) as error:
        H3Pipeline.load(bad, "torch_sdpa")
    assert "transformer" in str(error.value)  # names the folder


def test_a_missing_built_in_checkpoint_is_refused_by_name_not_replaced(monkeypatch, tmp_path):
    import h3serve.pipelines.h3.checkpoint as checkpoint

    CheckpointIndex(checkpoint.resolve_checkpoint(None))  # shipped, in the released layout
    monkeypatch.setattr(checkpoint, "BUILT_IN_TINY", tmp_path / "left-out")
    with pytest.raises(CheckpointError, match="built-in tiny checkpoint is not in this install") as error:
        H3Pipeline.load(None, "torch_sdpa")
    assert str(tmp_path / "left-out" / "modular_model_index.json") in str(error.value)


def test_missing_components_and_index_are_named(tiny_checkpoint, tmp_path):
    copy_ = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, copy_)
    shutil.rmtree(copy_ / "audio_vae")
    with pytest.raises(CheckpointError, match="audio_vae is missing"):
        H3Pipeline.load(copy_, "torch_sdpa")
    (copy_ / "modular_model_index.json").unlink()
    with pytest.raises(CheckpointError, match="has no modular_model_index.json"):
        H3Pipeline.load(copy_, "torch_sdpa")


def test_a_checkpoint_of_another_geometry_is_refused(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="admitted for"):
        H3Pipeline.load(tiny_checkpoint, "torch_sdpa", expected=preset("full").geometry())


def test_the_index_declares_the_released_classes(tiny_checkpoint):
    index = json.loads((tiny_checkpoint / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    assert index["transformer"][:2] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    assert index["text_encoder"][:2] == ["transformers", "Qwen3VLForConditionalGeneration"]
    assert index["processor"][:2] == ["transformers", "Qwen3VLProcessor"]
    assert CheckpointIndex(tiny_checkpoint).partitions() == ("transformer",)
    for folder in (
        "transformer",
        "vae",
        "audio_vae",
        "text_encoder",
        "tokenizer",
        "processor",
        "scheduler",
        "audio_scheduler",
    ):
        assert (tiny_checkpoint / folder).is_dir()


def test_the_tiny_checkpoint_is_deterministic(tmp_path):
    a, b = write_tiny_checkpoint(tmp_path / "a", seed=0), write_tiny_checkpoint(tmp_path / "b", seed=0)
    for folder in ("transformer", "vae", "audio_vae", "text_encoder"):
        for file in (a / folder).glob("*.safetensors"):
            assert file.read_bytes() == (b / folder / file.name).read_bytes()
    assert (a / "modular_model_index.json").read_text() == (b / "modular_model_index.json").read_text()


def test_the_backend_is_built_exactly_as_admitted(tiny_checkpoint):
    with pytest.raises(AdmissionError, match="does not implement packed varlen attention") as error:
        H3Pipeline.load(tiny_checkpoint, "sage_attn")
    assert error.value.reason == "incapable"
    with pytest.raises(BackendUnavailable, match="cannot run on this node"):
        H3Pipeline.load(tiny_checkpoint, "flash_attn")


# --- the driver's admission rule -------------------------------------------------------------------


def test_validate_deployment_on_cpu_and_for_the_released_geometry():
    on_cpu = functools.partial(validate_deployment, platform=Platform.cpu(), device="cpu", dtype="float32")
    resolution = on_cpu(model="minimax-h3-tiny", geometry=preset("tiny").geometry(), attention_backend="auto")
    assert resolution.backend == "torch_sdpa" and resolution.head_dim == 32
    full = preset("full").geometry()
    assert (full.num_heads, full.head_dim) == (56, 128)  # the released transformer, from diffusers' defaults
    with pytest.raises(DeploymentConfigError, match=r"sp_degree=3 must divide the transformer's 56 attention heads"):
        on_cpu(model="minimax-h3", geometry=full, attention_backend="auto", sp_degree=3)
    with pytest.raises(UnknownBackendError):
        on_cpu(model="minimax-h3", geometry=full, attention_backend="nope")


def test_text_encoder_layers_after_the_one_h3_reads_are_dropped_without_changing_it():
    from h3serve.pipelines.h3.checkpoint import keep_decoder_layers

    text_encoder = tiny_components(seed=0)["text_encoder"].eval()
    language_model = text_encoder.model.language_model
    language_model.layers.extend(copy.deepcopy(language_model.layers[-1]) for _ in range(4))  # a deeper stack
    text_encoder.config.text_config.num_hidden_layers = len(language_model.layers)
    ids = torch.tensor([[3, 5, 7, 9]])
    kwargs = dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=torch.zeros_like(ids),
        use_cache=False,
        output_hidden_states=True,
    )
    with torch.no_grad():
        before = text_encoder.model(**kwargs).hidden_states[50]
        keep_decoder_layers(text_encoder, 51)
        after = text_encoder.model(**kwargs).hidden_states[50]
    assert len(language_model.layers) == text_encoder.config.text_config.num_hidden_layers == 51
    torch.testing.assert_close(after, before, atol=0, rtol=0)
