"""The VAEs as released: bf16 with diffusers' ``_keep_in_fp32_modules`` in fp32, equal to diffusers' own pipeline."""

import pytest
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline, default_vae_dtype
from tests.test_h3_pipeline import STEPS, diffusers_run, run


@pytest.fixture(scope="module")
def bf16_pipeline(tiny_checkpoint):
    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa", vae_dtype="bfloat16")


def test_the_gpu_default_is_bf16_and_the_cpu_default_fp32():
    assert (default_vae_dtype("cuda"), default_vae_dtype("cpu")) == ("bfloat16", "float32")


def test_bf16_vaes_keep_exactly_diffusers_fp32_modules_in_fp32(bf16_pipeline, tiny_checkpoint):
    vae = bf16_pipeline.stages.after.vae
    theirs = AutoencoderKLMiniMaxH3.from_pretrained(tiny_checkpoint / "vae", torch_dtype=torch.bfloat16)
    ours_dtypes = {name: p.dtype for name, p in vae.named_parameters()}
    assert ours_dtypes == {name: p.dtype for name, p in theirs.named_parameters()}
    assert torch.float32 in ours_dtypes.values() and torch.bfloat16 in ours_dtypes.values()
    assert {p.dtype for p in vae.encoder.parameters()} == {torch.float32}  # pinned by _keep_in_fp32_modules
    assert {p.dtype for p in vae.decoder.transformer_blocks[0].attn.parameters()} == {torch.bfloat16}
    assert bf16_pipeline.stages.after.audio_vae.dtype in (torch.float32, torch.bfloat16)


def test_a_bf16_vae_clip_equals_diffusers_own_pipeline_at_bf16(bf16_pipeline, tiny_checkpoint):
    """h3serve's path with bf16 VAEs against diffusers' modular pipeline whose VAEs diffusers loaded itself at bf16:
    frames within one uint8 step. The bf16 frames differ from the fp32 ones, so the dtype really reached the VAE."""
    request = GenerationRequest(prompt="a red circle moving left", num_inference_steps=STEPS, seed=3)
    ours = run(bf16_pipeline, request)
    theirs = diffusers_run(
        bf16_pipeline,
        request,
        replace=dict(
            vae=AutoencoderKLMiniMaxH3.from_pretrained(tiny_checkpoint / "vae", torch_dtype=torch.bfloat16),
            audio_vae=AutoencoderKLMiniMaxH3Audio.from_pretrained(
                tiny_checkpoint / "audio_vae", torch_dtype=torch.bfloat16
            ),
        ),
    )
    frames = [(state.get("videos") * 255).round().to(torch.int16) for state in (ours, theirs)]
    assert (frames[0] - frames[1]).abs().max() <= 1
    torch.testing.assert_close(ours.get("audio"), theirs.get("audio"), atol=1e-4, rtol=0)
    fp32 = H3Pipeline.load(tiny_checkpoint, "torch_sdpa")  # the CPU default
    assert fp32.stages.after.vae.decoder.proj_out.weight.dtype == torch.float32
    fp32_frames = (run(fp32, request).get("videos") * 255).round().to(torch.int16)
    assert (fp32_frames - frames[0]).abs().max() > 0
