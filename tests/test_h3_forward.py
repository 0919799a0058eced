"""h3serve's packed multi-request forward against diffusers' own MiniMaxH3Transformer3DModel.forward."""

import copy

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)

from h3serve.attention import get_backend
from h3serve.attention.backends.torch_sdpa import TorchSDPAImpl
from h3serve.pipelines.h3.attention_processor import Documents, H3VarlenAttnProcessor, attending, install
from h3serve.pipelines.h3.config import preset
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.packing import Document, pack_documents

CONFIG = preset("tiny").transformer
# Packed with other documents, GEMMs run over other row counts and round differently: measured <= 5e-7 on
# outputs of magnitude ~2 (fp32, CPU); 1e-5 leaves room for other BLAS kernels. One document alone is exact.
ATOL = 1e-5


class CountingSDPA(TorchSDPAImpl):
    """The real torch_sdpa kernel, counting its calls: proves attention goes only through forward_varlen."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.varlen_calls = 0

    def forward_varlen(self, q, k, v, **kwargs):
        self.varlen_calls += 1
        return super().forward_varlen(q, k, v, **kwargs)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    reference = MiniMaxH3Transformer3DModel(**CONFIG).eval()  # diffusers' own processor
    served = copy.deepcopy(reference)
    install(served, get_backend("torch_sdpa").make_impl())
    return reference, served


def document(
    n_text: int,
    frames: int,
    height: int,
    width: int,
    n_audio: int,
    t_video: float,
    t_audio: float,
    anchors: tuple[str, ...] = (),
    seed: int = 0,
) -> Document:
    """One request's layout as diffusers' layout blocks build it (t2va, or fl2va with keyframe anchors)."""
    generator = torch.Generator().manual_seed(seed)
    tags = torch.ones(n_text, dtype=torch.long)  # all text
    position_ids, token_tags, video, audio, text, n_cond_video, n_cond_audio = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags, frames, height, width, n_audio, (1, 2, 2), 2, 2, 0, anchors
        )
    )
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, n_cond_video, n_cond_audio, n_text, t_video, t_audio, max(t_video, 0.999), 1.0
    )
    return Document(
        prompt_embeds=torch.randn(n_text, CONFIG["text_dim"], generator=generator),
        video_rows=torch.randn(video.numel(), CONFIG["in_channels"] * 4, generator=generator),
        audio_rows=torch.randn(audio.numel(), CONFIG["audio_in_channels"], generator=generator),
        position_ids=position_ids,
        token_tags=token_tags,
        video_indices=video,
        audio_indices=audio,
        text_indices=text,
        timestep=timestep,
        timestep_indices=timestep_indices,
    )


def diffusers_forward(model, doc: Document) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        video, audio = model(
            hidden_states=doc.video_rows[None],
            audio_hidden_states=doc.audio_rows[None],
            encoder_hidden_states=doc.prompt_embeds[None],
            timestep=doc.timestep,
            timestep_indices=doc.timestep_indices,
            token_tags=doc.token_tags,
            position_ids=doc.position_ids,
            video_indices=doc.video_indices,
            audio_indices=doc.audio_indices,
            text_indices=doc.text_indices,
            return_dict=False,
        )
    return video[0], audio[0]


# Three requests of different sizes, timesteps and tasks (t2va, fl2va with a first frame, with both frames).
DOCUMENTS = [
    dict(n_text=5, frames=7, height=4, width=8, n_audio=20, t_video=0.3, t_audio=0.5, seed=1),
    dict(n_text=9, frames=2, height=4, width=4, n_audio=7, t_video=0.7, t_audio=0.1, anchors=("first",), seed=2),
    dict(
        n_text=3, frames=12, height=8, width=4, n_audio=33, t_video=0.05, t_audio=0.9, anchors=("first", "last"), seed=3
    ),
]


@pytest.mark.parametrize("spec", DOCUMENTS, ids=["t2va", "fl2va-first", "fl2va-both"])
def test_one_request_is_bit_identical_to_diffusers_forward(models, spec):
    """docs/DESIGN.md's claim: for one document the packed forward computes diffusers' bits (fp32, torch_sdpa)."""
    reference, served = models
    doc = document(**spec)
    video, audio = diffusers_forward(reference, doc)
    packed_video, packed_audio = packed_forward(served, pack_documents([doc]))
    assert (packed_video - video).abs().max() == 0 and torch.equal(packed_video, video)
    assert (packed_audio - audio).abs().max() == 0 and torch.equal(packed_audio, audio)
    assert video.abs().max() > 0.1  # a real signal, not zeros compared with zeros


@pytest.mark.parametrize("row_multiple", [1, 64], ids=["no-padding", "padded-to-64"])
def test_three_requests_packed_equal_each_alone(models, row_multiple):
    reference, served = models
    docs = [document(**spec) for spec in DOCUMENTS]
    pack = pack_documents(docs, row_multiple=row_multiple)
    assert pack.total_rows % row_multiple == 0 and pack.padding_rows < row_multiple
    assert len(pack.timestep) > 3  # the documents' distinct timesteps merged into one vector
    for doc, (video, audio) in zip(docs, pack.split(*packed_forward(served, pack)), strict=True):
        expected_video, expected_audio = diffusers_forward(reference, doc)
        torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)


def test_a_pack_has_no_padding_unless_asked():
    pack = pack_documents([document(**spec) for spec in DOCUMENTS])
    assert pack.padding_rows == 0 and pack.cu_seqlens.tolist()[-1] == pack.total_rows == sum(pack.lengths)
    padded = pack_documents([document(**spec) for spec in DOCUMENTS], row_multiple=4)
    assert padded.total_rows % 4 == 0 and padded.padding_rows == -sum(pack.lengths) % 4
    # the padding rows are a document of their own: no request attends to them
    assert padded.cu_seqlens.tolist()[:-1] == pack.cu_seqlens.tolist()


def test_fused_projections_give_the_same_result(models):
    reference, _ = models
    fused = copy.deepcopy(reference)
    install(fused, get_backend("torch_sdpa").make_impl())
    fused.fuse_qkv_projections()
    assert fused.transformer_blocks[0].attn.fused_projections
    doc = document(**DOCUMENTS[1])
    video, audio = diffusers_forward(reference, doc)
    fused_video, fused_audio = packed_forward(fused, pack_documents([doc]))
    torch.testing.assert_close(fused_video, video, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused_audio, audio, atol=ATOL, rtol=0)


def test_attention_runs_only_through_the_admitted_backends_forward_varlen(models):
    reference, _ = models
    served = copy.deepcopy(reference)
    impl = CountingSDPA()
    install(served, impl)
    processors = {type(p) for p in served.attn_processors.values()}
    assert processors == {H3VarlenAttnProcessor}
    assert len(served.attn_processors) == CONFIG["num_layers"] + CONFIG["num_refiner_layers"]
    packed_forward(served, pack_documents([document(**DOCUMENTS[0])]))
    assert impl.varlen_calls == CONFIG["num_layers"] + CONFIG["num_refiner_layers"]


def test_the_processor_refuses_to_run_outside_a_packed_forward(models):
    _, served = models
    attn = served.transformer_blocks[0].attn
    hidden = torch.randn(1, 4, CONFIG["hidden_size"])
    with pytest.raises(RuntimeError, match="only inside h3serve's packed forward"):
        attn(hidden)
    with attending(Documents(torch.tensor([0, 4], dtype=torch.int32), 4)), pytest.raises(ValueError, match="mask"):
        attn(hidden, attention_mask=torch.ones(1, 4, 4))


def test_mixed_precision_matches_diffusers_in_bfloat16(tmp_path):
    """The serving dtype: a bf16 body with diffusers' fp32 boundary modules, loaded as diffusers loads it."""
    torch.manual_seed(1)
    MiniMaxH3Transformer3DModel(**CONFIG).save_pretrained(tmp_path)
    reference = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    assert reference.proj_in.weight.dtype == torch.float32 and reference.proj_out.weight.dtype == torch.float32
    assert reference.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    served = copy.deepcopy(reference)
    install(served, get_backend("torch_sdpa").make_impl())
    doc = document(**DOCUMENTS[0])
    doc.prompt_embeds = doc.prompt_embeds.bfloat16()
    video, audio = diffusers_forward(reference, doc)
    packed_video, packed_audio = packed_forward(served, pack_documents([doc]))
    assert packed_video.dtype == video.dtype == torch.float32  # the fp32 output heads
    torch.testing.assert_close(packed_video, video, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(packed_audio, audio, atol=2e-2, rtol=2e-2)


def test_a_pack_is_rebuilt_bit_for_bit_from_its_layout_and_flat_buffer_and_the_layout_does_not_grow_with_rows():
    """What an SP worker receives of a step: the layout through Ray (host metadata: O(documents), whatever the rows),
    the tensors as one flat byte buffer by a broadcast; together they are the pack, every dtype and shape kept."""
    import dataclasses
    import pickle

    from h3serve.pipelines.h3.packing import Pack, flatten_pack, pack_layout

    small = pack_documents([document(**DOCUMENTS[0]), document(**DOCUMENTS[1])], row_multiple=4)
    layout, flat = flatten_pack(small)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    rebuilt = layout.unflatten(flat)
    for field in dataclasses.fields(Pack):
        want, got = getattr(small, field.name), getattr(rebuilt, field.name)
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype and torch.equal(got, want), field.name
        else:
            assert got == want, field.name
    taller = pack_documents(
        [document(**{**d, "frames": 4 * d["frames"], "n_audio": 4 * d["n_audio"]}) for d in DOCUMENTS[:2]],
        row_multiple=4,
    )
    assert taller.total_rows > 2 * small.total_rows
    assert abs(len(pickle.dumps(pack_layout(taller))) - len(pickle.dumps(layout))) <= 16  # the same, bigger ints
    more = pack_documents([document(**d) for d in DOCUMENTS[:2]] * 4, row_multiple=4)
    per_document = (len(pickle.dumps(pack_layout(more))) - len(pickle.dumps(layout))) / 6
    assert per_document < 64, per_document  # a few ints a document; the rows' bytes never cross Ray
    with pytest.raises(ValueError, match="needs"):
        layout.unflatten(flat[:-1])
