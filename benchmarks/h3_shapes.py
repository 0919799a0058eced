"""MiniMax-H3 at any size without a checkpoint, for the GPU benchmarks: model, requests, FLOPs, memory.

* ``build_transformer``: ``MiniMaxH3Transformer3DModel(**config)`` on the meta device, then random
  weights straight on the target device, at ``dtype`` except where diffusers' ``_keep_in_fp32_modules``
  says float32 (the released checkpoint's mixed precision) — no full-size fp32 copy ever exists.
* ``clip_document``: one T2VA request as its packed ``Document``, laid out by diffusers' own layout
  and row-timestep builders from the request's geometry (random latents and prompt embeddings).
* ``forward_flops``: the matmul and attention FLOPs of one ``packed_forward`` over a pack (formula below).

Needs torch, diffusers and this repo's pipelines package (pydantic); no Ray, no checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM, MiniMaxH3RotaryPosEmbed
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    audio_latent_num_frames,
    video_latent_num_frames,
)

from pipelines.h3.packing import Document, Pack

# The released VAEs' geometry (diffusers' MiniMaxH3ModularPipeline defaults; the tiny preset keeps them too).
SPATIAL, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 16, 17, 5
KEYFRAME_NOISE_AUG = 0.999  # MiniMaxH3ModularPipeline.keyframe_noise_aug: conditioning rows' timestep floor
TEXT_TOKENS = 256  # prompt rows of a synthetic request (Qwen3-VL hidden states of a prompt of a few sentences)

FLOPS_FORMULA = """\
FLOPs of one packed forward (2 per multiply-add; elementwise work, norms and RoPE not counted):
  d = hidden_size, i = heads * head_dim, f = ffn_dim, e = time_embed_dim, K = distinct timesteps of the pack,
  T = pack rows, L_j = rows of document j, n_t / n_v / n_a = text / video / audio rows, l_j = text rows of doc j
  per block:    T * (2*d*3i  [q, k, v]  +  2*i*d  [out]  +  3 * 2*d*f  [SwiGLU: gate, up, down])
              + K * 2*e*(6*d*3)  [AdaLN table: 6 vectors x 3 modalities per timestep]
              + sum_j 4 * L_j^2 * i  [attention within each document: QK^T and PV]
  refiner block: the same over the n_t text rows and their documents l_j (no AdaLN)
  once:  2*n_t*text_dim*d + 2*n_v*c_v*d + 2*n_a*c_a*d  [input projections]
       + 2*n_v*d*c_v + 2*n_a*d*c_a  [output heads, on their own rows]  + K * 2*(freq*e_h + e_h*e + e*2d)
  MFU = FLOPs / seconds / peak (H200 bf16 dense: 989 TFLOP/s)"""


@dataclasses.dataclass(frozen=True)
class Clip:
    """A T2VA request's geometry."""

    width: int
    height: int
    num_frames: int
    text_tokens: int = TEXT_TOKENS

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}"


def transformer_config(name: str) -> dict:
    from pipelines.h3.config import preset

    return preset(name).transformer_config()


def keeps_fp32(model: torch.nn.Module, name: str) -> bool:
    """diffusers' loading rule: a parameter stays float32 when a path component is in ``_keep_in_fp32_modules``."""
    return any(m in name.split(".") for m in (model._keep_in_fp32_modules or []))


@torch.no_grad()
def build_transformer(config: dict, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """Random weights, laid out and typed as ``from_pretrained(torch_dtype=dtype)`` would load the checkpoint."""
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        parent, _, leaf = name.rpartition(".")
        tensor = torch.empty(param.shape, dtype=torch.float32 if keeps_fp32(model, name) else dtype, device=device)
        if param.ndim == 1:  # norm weights 1, biases 0
            tensor.fill_(1.0 if "norm" in name and leaf == "weight" else 0.0)
        else:  # fan-in scaled: activations keep their size through 50 blocks
            tensor.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        setattr(model.get_submodule(parent), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    # the one buffer (rope.inv_freq) is computed, not loaded: rebuild it off the meta device
    model.rope = MiniMaxH3RotaryPosEmbed(config["rope_freq_dim"], config["rope_theta"]).to(device)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def clip_layout(config: dict, clip: Clip) -> tuple:
    """diffusers' packed layout of a T2VA clip, on the host: (position_ids, token_tags, video, audio and text
    indices, conditioning video and audio rows), as ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` returns."""
    text_tags = torch.full((clip.text_tokens,), MINIMAX_H3_TEXT_TAG, dtype=torch.long, device="cpu")
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags,
        video_latent_num_frames(clip.num_frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK),
        clip.height // SPATIAL,
        clip.width // SPATIAL,
        audio_latent_num_frames(clip.num_frames),
        tuple(config["patch_size"]),
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )


def clip_document(
    config: dict, clip: Clip, progress: float = 0.5, seed: int = 0, device: str | torch.device = "cpu"
) -> Document:
    """One T2VA request at denoising ``progress`` (0 = pure noise), as diffusers' blocks lay it out.

    On ``device``, as diffusers' layout step leaves it (on the execution device); built on the host.
    """
    position_ids, token_tags, video_idx, audio_idx, text_idx, cond_video, cond_audio = clip_layout(config, clip)
    video_t, audio_t = 1.0 - progress, (1.0 - progress) ** 2  # two schedules: two distinct timesteps
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx,
        audio_idx,
        cond_video,
        cond_audio,
        clip.text_tokens,
        video_t,
        audio_t,
        max(video_t, KEYFRAME_NOISE_AUG),
        1.0,
    )
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    document = Document(
        prompt_embeds=torch.randn(clip.text_tokens, config["text_dim"], generator=g),  # [n_text, text_dim]
        video_rows=torch.randn(video_idx.numel(), config["in_channels"] * pt * ph * pw, generator=g),  # [n_v, C*p]
        audio_rows=torch.randn(audio_idx.numel(), config["audio_in_channels"], generator=g),  # [n_a, C_a]
        position_ids=position_ids,
        token_tags=token_tags,
        video_indices=video_idx,
        audio_indices=audio_idx,
        text_indices=text_idx,
        timestep=timestep.float(),
        timestep_indices=timestep_indices,
    )
    return dataclasses.replace(
        document, **{f.name: getattr(document, f.name).to(device) for f in dataclasses.fields(document)}
    )


def clip_rows(config: dict, clip: Clip) -> int:
    return clip_document(config, clip).length


def _per_row(config: dict) -> int:
    d, f, i = config["hidden_size"], config["ffn_dim"], config["num_attention_heads"] * config["attention_head_dim"]
    return 2 * d * 3 * i + 2 * i * d + 3 * 2 * d * f  # q, k, v; out; SwiGLU gate, up, down


def _attention(config: dict, lengths: list[int]) -> int:
    return sum(4 * n * n * config["num_attention_heads"] * config["attention_head_dim"] for n in lengths)


def block_flops(config: dict, pack: Pack) -> dict:
    """FLOPs of one ``MiniMaxH3TransformerBlock`` over ``pack``: {"matmul", "attention", "total"}."""
    d, e, K = config["hidden_size"], config["time_embed_dim"], pack.timestep.numel()
    matmul = pack.total_rows * _per_row(config) + K * 2 * e * 6 * d * MINIMAX_H3_MODALITY_NUM
    attention = _attention(config, pack.lengths)  # real documents only: a padding document is not counted
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def forward_flops(config: dict, pack: Pack) -> dict:
    """FLOPs of ``packed_forward(model, pack)`` by ``FLOPS_FORMULA``: {"matmul", "attention", "total"}."""
    d, e, e_h = config["hidden_size"], config["time_embed_dim"], config["time_embed_hidden_dim"]
    K, n_t = pack.timestep.numel(), pack.text_indices.numel()
    n_v, n_a = pack.video_indices.numel(), pack.audio_indices.numel()
    c_v, c_a = pack.video_rows.shape[1], pack.audio_rows.shape[1]
    block = block_flops(config, pack)
    matmul = config["num_layers"] * block["matmul"] + config["num_refiner_layers"] * n_t * _per_row(config)
    matmul += 2 * d * (n_t * config["text_dim"] + 2 * n_v * c_v + 2 * n_a * c_a)
    matmul += K * 2 * (config["freq_dim"] * e_h + e_h * e + e * 2 * d)
    attention = config["num_layers"] * block["attention"]
    attention += config["num_refiner_layers"] * _attention(config, doc_lengths(pack.text_cu_seqlens))
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def doc_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    bounds = cu_seqlens.tolist()
    return [b - a for a, b in itertools.pairwise(bounds)]


def activation_bytes_per_row(config: dict, dtype: torch.dtype) -> int:
    """An estimate of the live activations per pack row at a block's peak (the SwiGLU), for inference.

    hidden, residual, the normed and modulated input (4 x d), the gate/up projection (2f) and its
    product (f), at ``dtype``; plus the rotary cos/sin (fp32, 2 x 6*rope_freq_dim) held for the pass.
    """
    size = torch.finfo(dtype).bits // 8
    return size * (4 * config["hidden_size"] + 3 * config["ffn_dim"]) + 4 * 2 * 6 * config["rope_freq_dim"]


def rows_that_fit(free_bytes: int, bytes_per_row: float) -> int:
    return int(free_bytes // max(bytes_per_row, 1))


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
