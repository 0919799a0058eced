"""The H3 pipeline: config, packing, the packed DiT, sampler determinism, media."""

import io
import math

import pytest
import torch
from PIL import Image

from attention import AdmissionError, BackendUnavailable, Platform, UnknownBackendError
from pipelines.h3 import PRESETS, GenerationRequest, H3Config, validate_deployment
from pipelines.h3.admission import DeploymentConfigError
from pipelines.h3.config import MODALITY_AUDIO, MODALITY_TEXT, MODALITY_VIDEO
from pipelines.h3.media import probe_media
from pipelines.h3.packing import Document, pack_documents, patchify, unpatchify
from pipelines.h3.pipeline import H3Pipeline, create_tiny_checkpoint
from pipelines.h3.weights import CheckpointError

TINY = PRESETS["tiny"]


# --- config --------------------------------------------------------------------------

def test_full_preset_has_the_public_h3_dimensions():
    full = PRESETS["full"]
    assert (full.num_layers, full.hidden_size, full.num_heads, full.head_dim) == (50, 5376, 56, 128)
    assert full.inner_dim == 7168 and full.ffn_size == 14336 and full.rope_dims == 96
    assert (full.video_channels, full.audio_channels, full.patch_size, full.text_dim) == (24, 32, (1, 2, 2), 5120)


def test_full_builds_on_meta_and_has_about_20b_parameters(capsys):
    count = PRESETS["full"].parameter_count()
    with capsys.disabled():
        print(f"\nh3-full DiT parameters: {count:,} ({count / 1e9:.2f}B)")
    assert 19e9 < count < 22e9


@pytest.mark.parametrize("change,field", [
    ({"head_dim": 33}, "head_dim"),
    ({"rope_freqs_per_axis": 6}, "rope_freqs_per_axis"),
    ({"patch_size": (2, 2, 2)}, "patch_size"),
    ({"num_heads": 0}, "num_heads"),
    ({"audio_latent_rate": 7}, "audio_sample_rate"),
])
def test_invalid_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        H3Config(**{**TINY.model_dump(), **change})


def test_sp_degree_must_divide_heads():
    TINY.check_sp_degree(4)
    with pytest.raises(ValueError, match=r"sp_degree=3 must divide num_heads=4; allowed: \[1, 2, 4\]"):
        TINY.check_sp_degree(3)


# --- admission rule ------------------------------------------------------------------

def test_validate_deployment_resolves_auto_on_cpu():
    resolution = validate_deployment(model="tiny", attention_backend="auto", platform=Platform.cpu(),
                                     device="cpu", dtype="float32")
    assert resolution.backend == "torch_sdpa" and resolution.model == "h3-tiny"
    assert resolution.requirements == {"packed_varlen": True}


def test_validate_deployment_rejects_sage_attn():
    platform = Platform.cuda((9, 0), {"sageattention": "2.1", "flash_attn": "2.8"})
    with pytest.raises(AdmissionError, match="'sage_attn' does not implement packed varlen attention"):
        validate_deployment(model="full", attention_backend="sage_attn", platform=platform, device="cuda",
                            dtype="bfloat16", sp_degree=4)


def test_validate_deployment_errors_are_distinct():
    h200 = Platform.cuda((9, 0), {"flash_attn": "2.8"})
    assert validate_deployment(model="full", attention_backend="flash_attn", platform=h200, device="cuda",
                               dtype="bfloat16", sp_degree=4).backend == "flash_attn"
    with pytest.raises(DeploymentConfigError, match="sp_degree=5"):
        validate_deployment(model="full", attention_backend="fa", platform=h200, device="cuda", dtype="bf16", sp_degree=5)
    with pytest.raises(DeploymentConfigError, match="device='cuda'"):
        validate_deployment(model="tiny", attention_backend="auto", platform=Platform.cpu(), device="cuda", dtype="float32")
    with pytest.raises(BackendUnavailable):
        validate_deployment(model="full", attention_backend="fa", platform=h200, device="cuda", dtype="float32")
    with pytest.raises(UnknownBackendError):
        validate_deployment(model="full", attention_backend="xformers", platform=h200, device="cuda", dtype="bf16")


# --- packing -------------------------------------------------------------------------

def make_docs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = TINY.hidden_size
    return [
        Document(torch.randn(5, h, generator=g), torch.randn(24, 1, 4, 6, generator=g), None, 900.0),
        Document(torch.randn(1, h, generator=g), torch.randn(24, 3, 2, 2, generator=g), torch.randn(7, 32, generator=g), 500.0),
        Document(torch.randn(17, h, generator=g), torch.randn(24, 2, 6, 4, generator=g), torch.randn(3, 32, generator=g), 10.0),
    ]


def test_patchify_round_trips():
    video = torch.randn(24, 3, 8, 6)
    rows, grid = patchify(video, (1, 2, 2))
    assert rows.shape == (3 * 4 * 3, 96) and grid == (3, 4, 3)
    torch.testing.assert_close(unpatchify(rows, grid, 24, (1, 2, 2)), video, rtol=0, atol=0)


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_pack_layout(sp):
    docs = make_docs()
    packed = pack_documents(docs, TINY, sp_degree=sp)
    lengths = [5 + 6, 1 + 3 + 7, 17 + 12 + 3]
    used = sum(lengths)
    assert packed.total_rows % math.lcm(64, sp) == 0 and packed.total_rows - packed.padding_rows == used
    bounds = [0, 11, 22, 54] + ([packed.total_rows] if packed.padding_rows else [])
    assert packed.inputs.cu_seqlens.tolist() == bounds and packed.inputs.cu_seqlens.dtype == torch.int32
    assert packed.inputs.max_seqlen == max(b - a for a, b in zip(bounds, bounds[1:]))
    # doc 1: text, then video, then audio; its own timestep; text positions first
    modality = packed.inputs.modality[11:22].tolist()
    assert modality == [MODALITY_TEXT] + [MODALITY_VIDEO] * 3 + [MODALITY_AUDIO] * 7
    assert packed.inputs.timesteps[packed.inputs.t_index[11:22]].tolist() == [500.0] * 11
    assert packed.doc_id[:used].tolist() == [0] * 11 + [1] * 11 + [2] * 32
    assert (packed.doc_id[used:] == -1).all()
    pos = packed.inputs.positions[22:54]
    assert pos[:17, 0].tolist() == list(range(17)) and (pos[:17, 1:] == 0).all()
    assert pos[17, 0] == 17  # video starts after the text
    assert pos[17:29, 1:].amax(0).tolist() == [2.0, 1.0] and pos[17:29, 0].tolist() == [17] * 6 + [18] * 6


def test_pack_unpack_round_trips():
    docs = make_docs()
    packed = pack_documents(docs, TINY)
    out = torch.zeros(packed.total_rows, TINY.out_dim)
    out[packed.inputs.video_rows] = packed.inputs.video_x
    out[packed.inputs.audio_rows, :32] = packed.inputs.audio_x
    for doc, result in zip(docs, packed.unpack(out)):
        torch.testing.assert_close(result.video, doc.video, rtol=0, atol=0)
        if doc.audio is None:
            assert result.audio is None
        else:
            torch.testing.assert_close(result.audio, doc.audio, rtol=0, atol=0)


def test_shards_cover_the_pack():
    packed = pack_documents(make_docs(), TINY, sp_degree=2)
    shards = [packed.shard(r, 2) for r in range(2)]
    assert sum(s.num_rows for s in shards) == packed.total_rows
    assert torch.equal(torch.cat([s.modality for s in shards]), packed.inputs.modality)
    assert sum(len(s.video_rows) for s in shards) == len(packed.inputs.video_rows)
    assert all(torch.equal(s.cu_seqlens, packed.inputs.cu_seqlens) for s in shards)


# --- the packed DiT --------------------------------------------------------------------

def test_documents_are_isolated(tiny_pipeline):
    """Perturbing document A's rows leaves document B's output unchanged."""
    dit = tiny_pipeline.model.dit
    docs = make_docs()
    base = pack_documents(docs, TINY)
    out = dit(base.inputs)
    docs[0] = Document(docs[0].text * 3 + 1, docs[0].video.flip(-1) * 5, None, 3.0)
    changed = dit(pack_documents(docs, TINY).inputs)
    a, b = slice(0, 11), slice(11, base.used_rows)
    assert (changed[a] - out[a]).abs().max() > 1e-2
    torch.testing.assert_close(changed[b], out[b], rtol=0, atol=0)


def test_packed_forward_equals_separate_forwards(tiny_pipeline):
    """The key property: 3 requests of different sizes and timesteps in one pack == 3 forwards."""
    dit = tiny_pipeline.model.dit
    docs = make_docs()
    assert len({d.timestep for d in docs}) == 3
    packed = pack_documents(docs, TINY)
    together = packed.unpack(dit(packed.inputs))
    for doc, joint in zip(docs, together):
        alone_pack = pack_documents([doc], TINY)
        alone = alone_pack.unpack(dit(alone_pack.inputs))[0]
        torch.testing.assert_close(joint.video, alone.video, rtol=1e-5, atol=1e-5)
        if doc.audio is not None:
            torch.testing.assert_close(joint.audio, alone.audio, rtol=1e-5, atol=1e-5)
        assert joint.video.abs().mean() > 1e-3  # a real output, not zeros


# --- sampler, determinism, media -------------------------------------------------------

def test_same_seed_same_output(tiny_pipeline):
    request = GenerationRequest(prompt="a lighthouse at dusk", width=128, height=96, steps=4, seed=7)
    first = tiny_pipeline.generate(request)
    second = tiny_pipeline.generate(request)
    other = tiny_pipeline.generate(request.model_copy(update={"seed": 8}))
    assert torch.equal(first.frames, second.frames)
    assert not torch.equal(first.frames, other.frames)


def test_cfg_changes_the_output(tiny_pipeline):
    request = GenerationRequest(prompt="a lighthouse", width=64, height=64, steps=3, guidance_scale=1.0)
    plain = tiny_pipeline.generate(request)
    guided = tiny_pipeline.generate(request.model_copy(update={"guidance_scale": 6.0}))
    assert not torch.equal(plain.frames, guided.frames)


def test_image_is_a_real_png_of_the_requested_size(tiny_pipeline):
    media = tiny_pipeline.generate(GenerationRequest(prompt="fox", width=256, height=128, steps=2))
    image = Image.open(io.BytesIO(media.png()))
    assert image.format == "PNG" and image.size == (256, 128) and image.mode == "RGB"
    assert media.audio is None


def test_video_is_a_real_mp4_with_audio(tiny_pipeline):
    request = GenerationRequest(prompt="surf", width=128, height=128, num_frames=17, fps=8, steps=2)
    media = tiny_pipeline.generate(request)
    info = probe_media(media.mp4())
    assert (info.width, info.height, info.frames) == (128, 128, 17)
    assert info.video_codec == "h264" and info.audio_codec == "aac"
    assert info.duration_s == pytest.approx(17 / 8, abs=0.01)
    assert info.audio_duration_s == pytest.approx(17 / 8, abs=0.05)


@pytest.mark.parametrize("update,field", [
    ({"width": 250}, "width"), ({"height": 40}, "height"), ({"num_frames": 4}, "num_frames"),
])
def test_request_geometry_errors_name_the_field(tiny_pipeline, update, field):
    request = GenerationRequest(prompt="x", **update)
    with pytest.raises(ValueError, match=field):
        tiny_pipeline.prepare(request)


def test_prompt_longer_than_the_encoder_takes_is_rejected(tiny_pipeline):
    with pytest.raises(ValueError, match="at most 256"):
        tiny_pipeline.prepare(GenerationRequest(prompt="x" * 300))


# --- weights into the pipeline ---------------------------------------------------------

def test_tiny_weights_are_deterministic(tmp_path):
    from safetensors.torch import load_file

    a = load_file(create_tiny_checkpoint(tmp_path / "a") / "model.safetensors")
    b = load_file(create_tiny_checkpoint(tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_config_mismatch_is_a_clear_error(tmp_path):
    directory = create_tiny_checkpoint(tmp_path / "ckpt")
    other = H3Config(**{**TINY.model_dump(), "ffn_size": 128})
    with pytest.raises(CheckpointError, match="ffn_size: checkpoint 256, expected 128"):
        H3Pipeline.build(other, "torch_sdpa", checkpoint=directory)


def test_replica_side_build_fails_closed_for_an_unavailable_backend(tmp_path):
    directory = create_tiny_checkpoint(tmp_path / "ckpt")
    with pytest.raises(BackendUnavailable, match="flash_attn"):
        H3Pipeline.build(TINY, "flash_attn", checkpoint=directory)
