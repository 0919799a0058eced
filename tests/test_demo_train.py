"""The demo world's training recipe: its conventions checked against the libraries, and one short run end to end."""

import dataclasses
import json

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, MiniMaxH3Scheduler

from demo import world
from demo.train import DecodeWindows, Recipe, TrainingDocuments, latent_statistics, train
from pipelines.h3 import GenerationRequest, H3Pipeline, preset


@pytest.fixture(scope="module")
def pipeline(tiny_checkpoint):
    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa")


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


def test_latent_statistics_are_per_channel():
    a = torch.stack([torch.full((4, 5), 1.0), torch.full((4, 5), 3.0)])  # channel 0: 1s, channel 1: 3s
    mean, std = latent_statistics([a, a + 1], 0)
    assert mean == pytest.approx([1.5, 3.5]) and std[0] == pytest.approx(std[1])


def test_recipe_scaling_keeps_every_stage():
    quick = Recipe().scaled(0.0001)
    assert (
        quick.transformer_steps == quick.video_decoder_steps == 2
        and quick.transformer_batch == Recipe().transformer_batch
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)  # encoding every clip of the world is ~3 min on 2 free cores, far more on a loaded machine
def test_a_short_run_writes_a_servable_checkpoint_with_its_record(tmp_path):
    out = tmp_path / "demo"
    recipe = Recipe(video_decoder_steps=2, audio_decoder_steps=2, transformer_steps=3, transformer_batch=2)
    report = train(out, recipe)
    record = json.loads((out / "training.json").read_text())
    assert record["recipe"]["transformer_steps"] == 3 and record == json.loads(json.dumps(report))
    assert {s: record[s]["steps"] for s in ("video_decoder", "audio_decoder", "transformer")} == {
        "video_decoder": 2,
        "audio_decoder": 2,
        "transformer": 3,
    }
    trained = H3Pipeline.load(out, "torch_sdpa")
    vae = trained.stages.after.vae.config
    assert list(vae.latents_std) != [1.0] * 8  # the latents' own statistics, not the preset's identity
    # the checkpoint carries its own, wider decoder; the encoder is the tiny preset's
    assert (vae.decoder_num_attention_heads, vae.decoder_attention_head_dim) == (4, 32)
    assert tuple(vae.block_out_channels) == tuple(preset("tiny").components["vae"]["block_out_channels"])
    media = trained.generate(GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=1))
    assert media.frames.shape[1:] == (64, 128, 3) and media.audio.shape[0] == 2

    # a transformer-only run over its VAEs: the VAEs are the first run's, bit for bit, and its record says so
    again = tmp_path / "transformer-only"
    report = train(again, dataclasses.replace(recipe, transformer_steps=2), vaes_from=out)
    assert report["vaes_from"]["checkpoint"] == str(out) and "video_decoder" not in report
    assert report["vaes_from"]["video_decoder"] == record["video_decoder"] and report["transformer"]["steps"] == 2
    assert {"final_video_loss", "final_audio_loss"} <= set(report["transformer"])
    for folder in ("vae", "audio_vae"):
        assert (again / folder / "diffusion_pytorch_model.safetensors").read_bytes() == (
            out / folder / "diffusion_pytorch_model.safetensors"
        ).read_bytes()
    assert (again / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != (
        out / "transformer" / "diffusion_pytorch_model.safetensors"
    ).read_bytes()
