"""MiniMax-H3 at any size without a checkpoint: model, synthetic requests, FLOPs, memory (beside ``memory.py``'s plan).

* ``build_transformer``: ``MiniMaxH3Transformer3DModel(**config)`` on the meta device, then random
  weights straight on the target device, at ``dtype`` except where diffusers' ``_keep_in_fp32_modules``
  says float32 (the released checkpoint's mixed precision) — no full-size fp32 copy ever exists.
* ``clip_document``: one T2VA request as its packed ``Document``, laid out by diffusers' own layout
  and row-timestep builders from the request's geometry (random latents and prompt embeddings).
* ``forward_flops``: the matmul and attention FLOPs of one ``packed_forward`` over a pack (formula below).
* ``handoff_bytes``: the object-store bytes of a prepared request and of its decode handoff (a staged app's cost).
* ``LiveStorages``: the live and peak bytes of the tensor storages a block of code makes, to hold the plan against.

Needs torch, diffusers and this repo's pipelines package (pydantic); no Ray, no checkpoint. The benchmarks, the
meta-device run and the tests build their synthetic requests and FLOP counts here.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import weakref
from collections.abc import Mapping

import torch
from diffusers import MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel
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
    MiniMaxH3ModularPipeline,
    audio_latent_num_frames,
    video_latent_num_frames,
)
from torch.utils._python_dispatch import TorchDispatchMode

from h3serve.pipelines.h3.packing import Document, Pack

# The released VAEs' geometry and the conditioning rows' timestep floor, read from diffusers' MiniMaxH3ModularPipeline:
# its properties fall back to the released values when no VAE is loaded (the tiny preset keeps them too).
_RELEASED = MiniMaxH3ModularPipeline
SPATIAL: int = _RELEASED.vae_spatial_compression_ratio.fget(None)  # 16
FRAMES_PER_CHUNK: int = _RELEASED.vae_frames_per_chunk.fget(None)  # 17
LATENTS_PER_CHUNK: int = _RELEASED.vae_latents_per_chunk.fget(None)  # 5
KEYFRAME_NOISE_AUG: float = _RELEASED.keyframe_noise_aug.fget(None)  # 0.999
VIDEO_SHIFT, AUDIO_SHIFT = 12.0, 3.0  # the released scheduler/ and audio_scheduler/ (ARCHITECTURE.md)
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
  Ulysses over W ranks, per rank: its T/W rows (and their n_v, n_a) through the blocks and heads, i/W of every
  document's attention; the refiner, the prompt projection, AdaLN tables and timestep path on every rank
  MFU = FLOPs / seconds / peak (H200 bf16 dense: 989 TFLOP/s)"""


@dataclasses.dataclass(frozen=True)
class Clip:
    """A request's geometry: T2VA, or FL2VA with ``keyframes`` ("first", "last")."""

    width: int
    height: int
    num_frames: int
    text_tokens: int = TEXT_TOKENS
    keyframes: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}" + (" FL2VA" if self.keyframes else "")

    @property
    def vision_tokens(self) -> int:
        """Qwen3-VL's tokens for the keyframes, in the text stream (video-tagged): one per 32 x 32 pixels of each
        keyframe at the canvas (its 16-pixel patches merged 2 x 2), an assumption of this geometry."""
        return len(self.keyframes) * (self.width // 32) * (self.height // 32)


def transformer_config(name: str) -> dict:
    from h3serve.pipelines.h3.config import preset

    return preset(name).transformer_config()


def keeps_fp32(model: torch.nn.Module, name: str) -> bool:
    """diffusers' loading rule: a parameter stays float32 when a path component is in ``_keep_in_fp32_modules``."""
    keep: list[str] = getattr(model, "_keep_in_fp32_modules", None) or []
    return any(m in name.split(".") for m in keep)


@torch.no_grad()
def build_transformer(config: dict, device: str | torch.device, dtype: torch.dtype, seed: int = 0):
    """Random weights, laid out and typed as ``from_pretrained(torch_dtype=dtype)`` would load the checkpoint.

    On the ``meta`` device: the same layout and dtypes, no weights (``h3serve.pipelines.h3.meta`` runs it).
    """
    meta = torch.device(device).type == "meta"
    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**config)
    generator = None if meta else torch.Generator(device).manual_seed(seed)
    for name, param in list(model.named_parameters()):
        parent, _, leaf = name.rpartition(".")
        tensor = torch.empty(param.shape, dtype=torch.float32 if keeps_fp32(model, name) else dtype, device=device)
        if meta:
            pass
        elif param.ndim == 1:  # norm weights 1, biases 0
            tensor.fill_(1.0 if "norm" in name and leaf == "weight" else 0.0)
        else:  # fan-in scaled: activations keep their size through 50 blocks
            tensor.normal_(0.0, param.shape[1] ** -0.5, generator=generator)
        setattr(model.get_submodule(parent), leaf, torch.nn.Parameter(tensor, requires_grad=False))
    # the one buffer (rope.inv_freq) is computed, not loaded: rebuild it off the meta device (fp32, as diffusers)
    model.rope = MiniMaxH3RotaryPosEmbed(config["rope_freq_dim"], config["rope_theta"]).to(device)
    assert meta or not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def clip_layout(config: dict, clip: Clip) -> tuple:
    """diffusers' packed layout of a T2VA clip, on the host: (position_ids, token_tags, video, audio and text
    indices, conditioning video and audio rows), as ``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` returns."""
    text_tags = torch.full((clip.text_tokens,), MINIMAX_H3_TEXT_TAG, dtype=torch.long, device="cpu")
    vision = torch.full((clip.vision_tokens,), MINIMAX_H3_VIDEO_TAG, dtype=torch.long, device="cpu")
    return MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.cat([text_tags, vision]),
        video_latent_num_frames(clip.num_frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK),
        clip.height // SPATIAL,
        clip.width // SPATIAL,
        audio_latent_num_frames(clip.num_frames),
        tuple(config["patch_size"]),
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_VIDEO_TAG,
        clip.keyframes,
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
        text_idx.numel(),
        video_t,
        audio_t,
        max(video_t, KEYFRAME_NOISE_AUG),
        1.0,
    )
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    document = Document(
        prompt_embeds=torch.randn(text_idx.numel(), config["text_dim"], generator=g),  # [n_text, text_dim]
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


def clip_prepared(
    config: dict, clip: Clip, steps: int = 50, seed: int = 0, embed_dtype: torch.dtype = torch.bfloat16
) -> dict:
    """What a conditioner stage hands the denoiser for one request (``h3serve.pipelines.h3.stages.PREPARED_KEYS``), on
    the
    host, as diffusers' blocks build it: the layout (``build_packed_sequence``), both schedules (the released
    shifts) and one row-timestep pair per step (``build_row_timesteps``, as ``MiniMaxH3SetTimestepsStep`` calls it);
    random latents (fp32) and prompt embeddings (``embed_dtype``, Qwen3-VL's)."""
    position_ids, token_tags, video_idx, audio_idx, text_idx, cond_video, cond_audio = clip_layout(config, clip)
    video, audio = MiniMaxH3Scheduler(shift=VIDEO_SHIFT), MiniMaxH3Scheduler(shift=AUDIO_SHIFT)
    video.set_timesteps(steps, device="cpu")
    audio.set_timesteps(steps, device="cpu")
    plan = [
        MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_idx,
            audio_idx,
            cond_video,
            cond_audio,
            text_idx.numel(),
            float(t),
            float(t_audio),
            max(float(t), KEYFRAME_NOISE_AUG),
            1.0,
        )  # fmt: skip
        for t, t_audio in zip(video.timesteps, audio.timesteps, strict=True)
    ]
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = config["patch_size"]
    latent_frames = video_latent_num_frames(clip.num_frames, FRAMES_PER_CHUNK, LATENTS_PER_CHUNK)
    return dict(
        latents=torch.randn(video_idx.numel(), config["in_channels"] * pt * ph * pw, generator=g),  # [n_v, C*p]
        audio_latents=torch.randn(audio_idx.numel(), config["audio_in_channels"], generator=g),  # [n_a, C_a]
        row_timestep_plan=plan,  # per step: ([k] fp32 distinct timesteps, [S] int64 row -> index)
        timesteps=video.timesteps,
        prompt_embeds=torch.randn(1, text_idx.numel(), config["text_dim"], generator=g).to(embed_dtype),
        position_ids=position_ids,
        token_tags=token_tags,
        video_indices=video_idx,
        audio_indices=audio_idx,
        text_indices=text_idx,
        num_condition_video_rows=cond_video,
        num_condition_audio_rows=cond_audio,
        num_latent_frames=latent_frames,
        latent_height=clip.height // SPATIAL,
        latent_width=clip.width // SPATIAL,
        num_audio_latents=audio_latent_num_frames(clip.num_frames),
    )


def clip_rows(config: dict, clip: Clip) -> int:
    return clip_document(config, clip).length


def _per_row(config: dict) -> int:
    d, f, i = config["hidden_size"], config["ffn_dim"], config["num_attention_heads"] * config["attention_head_dim"]
    return 2 * d * 3 * i + 2 * i * d + 3 * 2 * d * f  # q, k, v; out; SwiGLU gate, up, down


def _attention(config: dict, lengths: list[int]) -> int:
    return sum(4 * n * n * config["num_attention_heads"] * config["attention_head_dim"] for n in lengths)


def block_flops(config: dict, pack: Pack, local_rows: int | None = None, sp_degree: int = 1) -> dict:
    """FLOPs of one ``MiniMaxH3TransformerBlock`` over ``pack``: {"matmul", "attention", "total"}.

    Under Ulysses (``sp_degree`` W) one rank's: its ``local_rows`` (T/W) through the projections and the FFN, and
    H/W heads of every document's attention (a padding document, of fewer than W rows, is run like the others).
    Every rank computes the whole AdaLN table.
    """
    d, e, K = config["hidden_size"], config["time_embed_dim"], pack.timestep.numel()
    rows = pack.total_rows if local_rows is None else local_rows
    matmul = rows * _per_row(config) + K * 2 * e * 6 * d * MINIMAX_H3_MODALITY_NUM
    lengths = pack.lengths + ([pack.padding_rows] if pack.padding_rows else [])
    attention = _attention(config, lengths) // sp_degree
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def forward_flops(
    config: dict, pack: Pack, sp_degree: int = 1, rank: int = 0, skipped_blocks: list[int] | None = None
) -> dict:
    """FLOPs of ``packed_forward(model, pack)`` by ``FLOPS_FORMULA``: {"matmul", "attention", "total"}.

    ``pack``'s index tensors on the host. Under Ulysses (``sp_degree`` W) rank ``rank``'s share: its rows through
    the blocks, the input projections and the output heads, H/W heads of attention; every rank embeds and refines
    every prompt and computes the timestep path. ``skipped_blocks`` (sp_degree 1): the blocks each document left
    out by step caching, its rows and its attention taken off those blocks.
    """
    d, e, e_h = config["hidden_size"], config["time_embed_dim"], config["time_embed_hidden_dim"]
    K, n_t = pack.timestep.numel(), pack.text_indices.numel()
    lo, hi = rank * pack.total_rows // sp_degree, (rank + 1) * pack.total_rows // sp_degree
    n_v, n_a = (int(((i >= lo) & (i < hi)).sum()) for i in (pack.video_indices, pack.audio_indices))
    c_v, c_a = pack.video_rows.shape[1], pack.audio_rows.shape[1]
    block = block_flops(config, pack, hi - lo, sp_degree)
    matmul = config["num_layers"] * block["matmul"] + config["num_refiner_layers"] * n_t * _per_row(config)
    matmul += 2 * d * (n_t * config["text_dim"] + 2 * n_v * c_v + 2 * n_a * c_a)
    matmul += K * 2 * (config["freq_dim"] * e_h + e_h * e + e * 2 * d)
    attention = config["num_layers"] * block["attention"]
    attention += config["num_refiner_layers"] * _attention(config, doc_lengths(pack.text_cu_seqlens))
    if skipped_blocks and any(skipped_blocks):
        if sp_degree != 1:
            raise ValueError("skipped_blocks is counted at sp_degree 1 only")
        for length, skipped in zip(pack.lengths, skipped_blocks, strict=True):
            matmul -= skipped * length * _per_row(config)
            attention -= skipped * _attention(config, [length])
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


def lora_flops(config: dict, pack: Pack, adapters: Mapping[int, Mapping[str, tuple[int, int, int]]]) -> int:
    """FLOPs ``lora.adapting`` adds to a forward at sp_degree 1 (``pack``'s indices on the host).

    ``adapters``: slot -> {adapted module: (in_features, out_features, rank)}. Every adapted layer adds
    2 * r * (in + out) per row of the documents running its adapter (alone or in a composition) on the layer's
    stream (``lora.stream_of``: a block's rows, the text rows, the video or audio rows, or K timesteps); when an
    adapter adapts the timestep path, the pack's timestep path runs once per slot group G (the base model's
    included): (G - 1) * K more rows through the time embedder, every block's AdaLN table and ``norm_out``'s
    projection.
    """
    from h3serve.pipelines.h3.lora import stream_of

    d, e, e_h = config["hidden_size"], config["time_embed_dim"], config["time_embed_hidden_dim"]
    K, slots = pack.timestep.numel(), pack.document_slots or [0] * len(pack.lengths)
    text = doc_lengths(pack.text_cu_seqlens)
    rows = {"rows": pack.lengths, "text": text, "video": pack.video_counts, "audio": pack.audio_counts}
    # a document's value is an adapter slot, or a composition id of several adapters (``Pack.compositions``)
    compositions = pack.compositions or {s: ((s, None),) for s in adapters}
    flops, widened = 0, False
    for group, uses in compositions.items():
        if group not in slots:
            continue
        for slot, _ in uses:
            for module, (n_in, n_out, r) in adapters[slot].items():
                stream = stream_of(module)
                widened |= stream == "timesteps"
                n = (
                    K
                    if stream == "timesteps"
                    else sum(c for c, s in zip(rows[stream], slots, strict=True) if s == group)
                )
                flops += 2 * n * r * (n_in + n_out)
    if widened:
        groups = len(set(slots))
        per_timestep = config["num_layers"] * 2 * e * 6 * d * MINIMAX_H3_MODALITY_NUM
        per_timestep += 2 * (config["freq_dim"] * e_h + e_h * e + e * 2 * d)
        flops += (groups - 1) * K * per_timestep
    return flops


def doc_lengths(cu_seqlens: torch.Tensor) -> list[int]:
    bounds = cu_seqlens.tolist()
    return [b - a for a, b in itertools.pairwise(bounds)]


def activation_bytes_per_row(config: dict, dtype: torch.dtype) -> float:
    """The memory plan's live activations per media row of a pack on one rank (``h3serve.pipelines.h3.memory``'s
    ``ACTIVATION_FORMULA``: the block's SwiGLU peak, the row's inputs), which ``meta.step`` checks against
    the released step's measured peak on the meta device."""
    from h3serve.pipelines.h3.memory import activation_row_cost

    cost = activation_row_cost(config, dtype)
    return cost.local_media + cost.inputs_media


def rows_that_fit(free_bytes: int, bytes_per_row: float) -> int:
    return int(free_bytes // max(bytes_per_row, 1))


def human_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- what crosses between stages: the object-store bytes of a prepared request ----------------------------------
# a released-size request (the default canvas; the shortest and the longest clip; the request's default steps)
RELEASED_CANVAS = (1344, 768)
RELEASED_FRAMES = (124, 345)
RELEASED_STEPS = 50
RELEASED_TEXT_TOKENS = TEXT_TOKENS  # a prompt of a few sentences


def handoff_bytes(
    config: dict,
    width: int,
    height: int,
    num_frames: int,
    steps: int,
    text_tokens: int,
    embed_dtype: torch.dtype,
    shifts: tuple[float, float] = (12.0, 3.0),
) -> dict[str, int]:
    """The bytes of each tensor of a T2VA request's ``PreparedState`` (``PREPARED_KEYS``) and of its
    ``DecodeHandoff`` ("handoff latents"), built as the conditioner's blocks build them: diffusers' layout
    (``build_packed_sequence``) and row-timestep (``build_row_timesteps``) builders on the request's geometry,
    its two schedulers (video and audio shifts) for ``steps``; latents float32, prompt embeddings ``embed_dtype``.
    ``config``: the transformer's (patch, channels, text width)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    patch = tuple(config["patch_size"])
    position_ids, token_tags, video_idx, audio_idx, text_idx, cond_video, cond_audio = clip_layout(
        config, Clip(width=width, height=height, num_frames=num_frames, text_tokens=text_tokens)
    )
    video, audio = MiniMaxH3Scheduler(shift=shifts[0]), MiniMaxH3Scheduler(shift=shifts[1])
    video.set_timesteps(steps, device="cpu")
    audio.set_timesteps(steps, device="cpu")
    plan = 0  # one (distinct timesteps [K] fp32, row -> index [rows] int64) pair per step
    for t, t_audio in zip(video.timesteps, audio.timesteps, strict=True):
        unique, inverse = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            video_idx, audio_idx, cond_video, cond_audio, text_tokens, float(t), float(t_audio),
            max(float(t), KEYFRAME_NOISE_AUG), 1.0,
        )  # fmt: skip
        plan += nbytes(unique) + nbytes(inverse)
    columns = config["in_channels"] * patch[0] * patch[1] * patch[2]
    latents = video_idx.numel() * columns * 4  # [n_video, C*p] float32
    audio_latents = audio_idx.numel() * config["audio_in_channels"] * 4  # [n_audio, C_audio] float32
    embed_size = torch.empty((), dtype=embed_dtype, device="cpu").element_size()
    prepared = {
        "latents": latents,
        "audio_latents": audio_latents,
        "row_timestep_plan": plan,
        "timesteps": nbytes(video.timesteps),
        "prompt_embeds": text_tokens * config["text_dim"] * embed_size,  # [1, n_text, text_dim]
        "position_ids": nbytes(position_ids),  # [rows, 3] float64
        "token_tags": nbytes(token_tags),
        "video_indices": nbytes(video_idx),
        "audio_indices": nbytes(audio_idx),
        "text_indices": nbytes(text_idx),
    }
    return {**prepared, "prepared": sum(prepared.values()), "handoff latents": latents + audio_latents}


def released_bytes(embed_dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """``handoff_bytes`` of released-size requests on the released transformer's config."""
    config = transformer_config("full")
    width, height = RELEASED_CANVAS
    out = []
    for frames in RELEASED_FRAMES:
        sizes = handoff_bytes(config, width, height, frames, RELEASED_STEPS, RELEASED_TEXT_TOKENS, embed_dtype)
        out.append({"request": f"{width}x{height}x{frames}, {RELEASED_STEPS} steps", **sizes})
    return out


# -- live memory, measured: the plan's counterpart (tests/live_memory.py, tests/test_step_cache_memory) ---------
class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages created under this mode that are still referenced; and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.views: collections.Counter[int] = collections.Counter()  # storage address -> live tensors on it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self.peak_op = ""
        self.in_attention = False  # set by hooks around the blocks' attention modules
        self.attention_peak = 0

    def _release(self, key: int) -> None:
        self.views[key] -= 1
        if self.views[key] == 0:
            del self.views[key]
            self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                continue
            key = storage.data_ptr()
            if key not in self.views:
                self.sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
            self.views[key] += 1
            weakref.finalize(tensor, self._release, key)
        if self.live > self.peak:
            self.peak, self.peak_op = self.live, str(func)
        if self.in_attention:
            self.attention_peak = max(self.attention_peak, self.live)
        return out

    def watch_attention(self, model: torch.nn.Module) -> list:
        """Hooks marking the blocks' attention calls, so the attention phase's own peak is known."""

        def enter(*_):
            self.in_attention = True

        def leave(*_):
            self.in_attention = False

        handles = []
        blocks: list = list(model.transformer_blocks)  # type: ignore[arg-type]  # an nn.ModuleList
        for block in blocks:
            handles += [block.attn.register_forward_pre_hook(enter), block.attn.register_forward_hook(leave)]
        return handles
