"""The demo world's training recipe: its conventions checked against the libraries, and one short run end to end."""

import dataclasses
import json
import math

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Scheduler

from h3serve.demo import world
from h3serve.demo.train import (
    DecodeWindows,
    Recipe,
    TrainingDocuments,
    WorldClips,
    crop_to_window,
    demo_video_vae,
    latent_statistics,
    train,
    train_video_on_frames,
)
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline, preset


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa")


@pytest.mark.slow  # the demo's tooling, ~6 s: `make test-fast` (the four packages' layers) leaves it out
def test_a_decode_window_is_exactly_the_encoding_of_its_frames(pipeline):
    """The VAEs train on windows: latents 5k .. 5k+7 of a whole clip must be what the window's frames encode to."""
    fmt = world.ClipFormat.of(pipeline.rules)
    windows = DecodeWindows.of(pipeline.rules, fmt.num_frames)
    last_frames, last_latents = windows(windows.count - 1)
    assert (windows.count, last_frames.stop, last_latents.stop) == (7, fmt.num_frames, 37)

    torch.manual_seed(0)
    vae = AutoencoderKLMiniMaxH3(**preset("tiny").components["vae"]).eval()
    clip = torch.rand(2, 3, fmt.num_frames, fmt.height, fmt.width)  # a batch of 2: oneDNN's conv3d on CPU
    with torch.no_grad():
        whole = vae.encode(clip).latent_dist.mode()  # [2, C, 37, h, w]
        frames, latents = windows(3)
        alone = vae.encode(clip[:, :, frames]).latent_dist.mode()  # [2, C, 7, h, w]
    assert alone.shape[2] == latents.stop - latents.start == 7
    torch.testing.assert_close(alone, whole[:, :, latents], rtol=1e-5, atol=1e-5)


def test_a_frame_trains_the_encoder_as_the_first_frame_of_a_clip_encodes(pipeline):
    """The frame stage encodes frames alone: what a clip's first frame encodes to (causal in time), through the
    library's own ``encode``; a few steps move the encoder, which the decoder stage alone never does."""
    torch.manual_seed(0)
    vae = demo_video_vae(Recipe()).eval()
    fmt = world.ClipFormat.of(pipeline.rules)
    clip = torch.rand(2, 3, 22, fmt.height, fmt.width)  # [B, 3, F, H, W]
    channels = vae.config.latent_channels
    with torch.no_grad():
        alone = vae.quant_conv(vae.encoder(clip[:, :, :1]))[:, :channels]  # the stage's path: [2, C, 1, h, w]
        first = vae.encode(clip).latent_dist.mode()[:, :, :1]
    torch.testing.assert_close(alone, first, rtol=1e-5, atol=1e-5)

    small = world.ClipFormat(fmt.width, fmt.height, 5, fmt.fps, fmt.sample_rate)  # 5 frames: renders in moments
    seeded = {k: v.clone() for k, v in vae.encoder.state_dict().items()}
    report = train_video_on_frames(
        vae,
        WorldClips(small),
        Recipe(video_frame_steps=3, video_frame_batch=2),
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    )
    assert report["steps"] == 3 and math.isfinite(report["final_loss"])
    assert any(not torch.equal(seeded[k], v) for k, v in vae.encoder.state_dict().items())


def test_the_training_target_is_the_velocity_the_scheduler_steps_with(pipeline):
    """One Euler step to sigma 0 with the target velocity must land on the clean rows: the loss and the
    sampler agree on the sign and the time convention (diffusers' scheduler, clean-time t = 1 - sigma)."""
    fmt = world.ClipFormat.of(pipeline.rules, 64, 64)
    scene = world.Scene("red", "circle", "left", "low hum")
    layout = pipeline.prepare(
        GenerationRequest(prompt=scene.prompt, width=64, height=64, num_frames=fmt.num_frames, num_inference_steps=2)
    ).layout
    n_video, n_audio = layout["video_indices"].numel(), layout["audio_indices"].numel()
    clean_video, clean_audio = torch.randn(n_video, 32), torch.randn(n_audio, 8)
    documents = TrainingDocuments(pipeline, {scene.combination: clean_video}, {scene.sound: clean_audio}, fmt, seed=3)
    for _ in range(3):
        document, video_target, audio_target = documents.document(scene)
        row_t = document.timestep[document.timestep_indices]  # [S] each row's clean-time timestep
        for rows, target, clean, at, shift in (
            (document.video_rows, video_target, clean_video, layout["video_indices"], 12.0),
            (document.audio_rows, audio_target, clean_audio, layout["audio_indices"], 3.0),
        ):
            t = row_t[at].unique()
            assert t.numel() == 1 and 0.0 <= float(t) <= 1.0
            scheduler = MiniMaxH3Scheduler(shift=shift)
            scheduler.set_timesteps(sigmas=[1.0 - float(t), 0.0])
            stepped = scheduler.step(target, scheduler.timesteps[0], rows, return_dict=False)[0]
            torch.testing.assert_close(stepped, clean, rtol=1e-4, atol=1e-4)
        # video and audio share one uniform draw through their own shifts, as every inference step pairs them
        t_video, t_audio = (float(row_t[layout[k]][0]) for k in ("video_indices", "audio_indices"))
        u = (1 - t_video) / (12 - 11 * (1 - t_video))  # the video shift inverted
        assert t_audio == pytest.approx(1 - 3 * u / (1 + 2 * u), abs=1e-5)


def test_a_window_keeps_the_prompt_and_the_same_seconds_of_video_and_audio(pipeline):
    """A window of a training document: every text row, the video and audio rows of one stretch of time with
    their whole-clip positions and targets, and nothing else; a window over the whole clip is the clip."""
    from h3serve.pipelines.h3.forward import packed_forward
    from h3serve.pipelines.h3.packing import pack_documents

    fmt = world.ClipFormat.of(pipeline.rules)
    scene = world.Scene("blue", "square", "up", "high beep")
    layout = pipeline.prepare(GenerationRequest(prompt=scene.prompt, num_inference_steps=2)).layout
    n_video, n_audio = layout["video_indices"].numel(), layout["audio_indices"].numel()
    clean = {scene.combination: torch.randn(n_video, 32)}, {scene.sound: torch.randn(n_audio, 8)}
    document, video_target, audio_target = TrainingDocuments(pipeline, *clean, fmt, seed=1).document(scene)

    whole = crop_to_window(document, video_target, audio_target, float("-inf"), float("inf"))
    for a, b in zip(
        (*dataclasses.astuple(whole[0]), *whole[1:]),
        (*dataclasses.astuple(document), video_target, audio_target),
        strict=True,
    ):
        assert torch.equal(a, b)

    time = document.position_ids[:, 0]
    start, stop = float(time[layout["video_indices"]].quantile(0.4)), float(time[layout["video_indices"]].quantile(0.6))
    window, window_video, window_audio = crop_to_window(document, video_target, audio_target, start, stop)
    for indices, rows, target, window_indices, window_rows, window_target in (
        (
            document.video_indices,
            document.video_rows,
            video_target,
            window.video_indices,
            window.video_rows,
            window_video,
        ),
        (
            document.audio_indices,
            document.audio_rows,
            audio_target,
            window.audio_indices,
            window.audio_rows,
            window_audio,
        ),
    ):
        inside = (time[indices] >= start) & (time[indices] <= stop)
        assert 0 < int(inside.sum()) < indices.numel()
        assert torch.equal(window.position_ids[window_indices], document.position_ids[indices[inside]])
        assert torch.equal(window_rows, rows[inside]) and torch.equal(window_target, target[inside])
        assert torch.equal(window.timestep_indices[window_indices], document.timestep_indices[indices[inside]])
    assert torch.equal(window.position_ids[window.text_indices], document.position_ids[document.text_indices])
    assert torch.equal(window.prompt_embeds, document.prompt_embeds)
    assert window.length == document.text_indices.numel() + window_video.shape[0] + window_audio.shape[0]
    # the window packs beside a whole clip, and the forward answers each of its rows
    video_out, audio_out = packed_forward(
        pipeline.denoiser.transformers["transformer"], pack_documents([window, document])
    )
    assert (video_out.shape[0], audio_out.shape[0]) == (
        window_video.shape[0] + n_video,
        window_audio.shape[0] + n_audio,
    )


def test_latent_statistics_are_per_channel():
    a = torch.stack([torch.full((4, 5), 1.0), torch.full((4, 5), 3.0)])  # channel 0: 1s, channel 1: 3s
    mean, std = latent_statistics([a, a + 1], 0)
    assert mean == pytest.approx([1.5, 3.5]) and std[0] == pytest.approx(std[1])


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"transformer_window_share": 1.5}, "transformer_window_share"),
        ({"transformer_window_min": 0.5, "transformer_window_max": 0.2}, "transformer_window_min"),
        ({"transformer_window_min": 0.0}, "transformer_window_min"),
    ],
)
def test_a_recipe_refuses_windows_it_cannot_draw(fields, named):
    with pytest.raises(ValueError, match=named):
        Recipe(**fields)


def test_the_built_in_checkpoint_is_what_the_recipe_defaults_make():
    from h3serve.pipelines.h3.checkpoint import resolve_checkpoint

    record = json.loads((resolve_checkpoint(None) / "training.json").read_text())
    assert record["recipe"] == dataclasses.asdict(Recipe())  # `python -m h3serve.demo.train OUT` remakes it
    assert record["seconds"] < 3600  # the budget: an hour on 2 cores, every stage included
    steps = {"audio_decoder": "audio_decoder", "video_decoder": "video_decoder", "video_frames": "video_frame"}
    steps |= {"video_refine": "video_refine", "transformer": "transformer"}  # every stage ran, all its steps
    assert {stage: record[stage]["steps"] for stage in steps} == {
        stage: record["recipe"][f"{field}_steps"] for stage, field in steps.items()
    }


def test_recipe_scaling_keeps_every_stage():
    quick = Recipe().scaled(0.0001)
    assert (
        quick.transformer_steps == quick.video_decoder_steps == quick.video_frame_steps == 2
        and quick.transformer_batch == Recipe().transformer_batch
    )
    off = Recipe(video_frame_steps=0, video_refine_steps=0).scaled(0.0001)
    assert off.video_frame_steps == off.video_refine_steps == 0  # off stays off


@pytest.mark.slow
@pytest.mark.timeout(1800)  # encoding every clip of the world is ~3 min on 2 free cores, far more on a loaded machine
def test_a_short_run_writes_a_servable_checkpoint_with_its_record(tmp_path):
    out = tmp_path / "demo"
    recipe = Recipe(
        video_decoder_steps=2,
        video_decoder_batch=1,
        video_frame_steps=2,
        video_frame_batch=1,
        video_refine_steps=2,
        audio_decoder_steps=2,
        audio_decoder_batch=1,
        audio_decoder_latents=8,
        transformer_steps=3,
        transformer_batch=2,
    )
    # a corner of the world: encoding every clip (twice) is most of a run's time, and nothing here needs them all
    few = [c for c in world.COMBINATIONS if c not in world.HELD_OUT][:2]
    report = train(out, recipe, combinations=few)
    record = json.loads((out / "training.json").read_text())
    assert record["combinations"] == [list(c) for c in few]
    assert record["recipe"]["transformer_steps"] == 3 and record == json.loads(json.dumps(report))
    stages = ("video_decoder", "video_frames", "video_refine", "audio_decoder", "transformer")
    assert {s: record[s]["steps"] for s in stages} == dict(zip(stages, (2, 2, 2, 2, 3), strict=True))
    trained = H3Pipeline.load(out, "torch_sdpa")
    vae = trained.stages.after.vae.config
    assert list(vae.latents_std) != [1.0] * 8  # the latents' own statistics, not the preset's identity
    # the checkpoint carries its own, wider decoder; the encoder is the tiny preset's, trained on frames
    assert (vae.decoder_num_attention_heads, vae.decoder_attention_head_dim) == (4, 32)
    assert tuple(vae.block_out_channels) == tuple(preset("tiny").components["vae"]["block_out_channels"])
    seeded = demo_video_vae(recipe).encoder.state_dict()
    assert any(not torch.equal(seeded[k], v) for k, v in trained.stages.after.vae.encoder.state_dict().items())
    media = trained.generate(GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=1))
    assert media.frames.shape[1:] == (64, 128, 3) and media.audio.shape[0] == 2

    # a transformer-only run over its VAEs: the VAEs are the first run's, bit for bit, and its record says so
    again = tmp_path / "transformer-only"
    report = train(again, dataclasses.replace(recipe, transformer_steps=2), vaes_from=out, combinations=few)
    assert report["vaes_from"]["checkpoint"] == str(out) and "video_decoder" not in report
    assert all(report["vaes_from"][s] == record[s] for s in stages[:-1]) and report["transformer"]["steps"] == 2
    assert {"final_video_loss", "final_audio_loss"} <= set(report["transformer"])
    for folder in ("vae", "audio_vae"):
        assert (again / folder / "diffusion_pytorch_model.safetensors").read_bytes() == (
            out / folder / "diffusion_pytorch_model.safetensors"
        ).read_bytes()
    assert (again / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != (
        out / "transformer" / "diffusion_pytorch_model.safetensors"
    ).read_bytes()
