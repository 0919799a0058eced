"""Device memory of each rank of a deployment: weights from the components' configs, activations per row.

A replica's ranks play two roles. **Rank 0** holds the conditioner (Qwen3-VL through the layer H3
reads), both VAEs and the transformer partition(s); **worker ranks** hold only the partition(s).
Each role's plan is weights + activations of a full pack + a fixed reserve, and admission refuses a
deployment whose rank does not fit the platform's device memory.

With stage deployments of their own (``stages="remote"``, the deploy args' ``stages`` section) rank 0 holds
only the partition(s) like the workers, and the plan has two more roles, each on a GPU of its own: the
**conditioner** (Qwen3-VL trimmed as above and both VAEs, whose encoders read keyframes and references) and
the **decoder** (both VAEs). They hold no pack rows: weights + the reserve, and their per-request transients
(Qwen3-VL over a prompt, a VAE decode) must fit in what is left of their device.

Over 600 lines: one plan, whose formulas are written beside the code that applies them so the docs, admission's
message and the meta-device check quote the same text, and the check of a replica's measured use against it
(``check_measured``: the warm-up at the row budget on CUDA).

* **Weights** are counted by building every component from its config on the ``meta`` device (no
  memory, no checkpoint files) and applying the loading rules: the transformer at the served dtype
  except diffusers' ``_keep_in_fp32_modules`` (fp32), Qwen3-VL at the served dtype with its decoder
  trimmed to ``text_encoder_layer + 1`` layers (as ``H3Pipeline.load`` does), the VAEs at ``vae_dtype`` except their
  ``_keep_in_fp32_modules`` (fp32, as diffusers keeps them: all of a VAE in fp32 when ``vae_dtype`` is fp32).
  Configs come from the checkpoint directory (as admission read them, on the driver or through the
  probe on a replica node; else read here when readable), else from the released configs below (the
  transformer's are diffusers' defaults; Qwen3-VL's is the released ``text_encoder/config.json``:
  Qwen3-VL-32B). The activations are counted at the served transformer's dims, the checkpoint's.
* **Activations** follow ``ACTIVATION_FORMULA`` (below): the live tensors of one packed forward at
  its peak (a block's SwiGLU), per pack row. ``benchmarks/activation_memory.py`` measures the peak
  live bytes on the tiny preset and ``tests/test_memory_plan.py`` checks the formula's slope
  against it; the same formula at the released dims gives the GPU figures.
* **Reserve**: what the allocator cannot hand to tensors — the CUDA context and kernels' module
  images (~0.5-1 GiB), cuBLAS/flash-attn workspaces, NCCL buffers, and fragmentation of PyTorch's
  caching allocator. ``DEFAULT_RESERVE_BYTES`` (4 GiB) is **projected**, not measured: a deliberately round
  figure assuming the context ~1 GiB, workspaces well under 1 GiB, NCCL's all-to-all buffers to 3-7 peers ~1 GiB
  (NVLS off) and the allocator's slack the rest (``RESERVE_NOTE``); pass another. ``benchmarks/gpu_session.sh``
  (part 2) measures each of them but NCCL's peers' buffers, by ``torch.cuda.mem_get_info``.

Only ``torch``, ``diffusers`` and ``transformers``; nothing here loads weights or touches a device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from .checkpoint import CheckpointConfigs, CheckpointError, CheckpointIndex
from .config import preset, transformer_defaults

GiB = 2**30
DEFAULT_RESERVE_BYTES = 4 * GiB
# Step caching (``step_cache``): its [rows, hidden] tensors per pack row beyond a forward without a cache, at its
# peak (inside a block), in units of s*d. tests/test_step_cache_memory.py measures them on real cached forwards.
STEP_CACHE_HELD_ROWS = 2  # kept between steps: a caching document's residuals, h_Fn - h_0 and the middle blocks'
# during a forward, a computing document's next residuals beside the held ones until ``PackCache.commit``: its new
# h_Fn - h_0, and a copy of h_Fn until its middle blocks end, then its new middle residual in the copy's place
STEP_CACHE_PENDING_ROWS = 2
# the blocks' input h_0, which ``packed_forward`` holds until ``cached_blocks`` returns (without a cache it is let
# go after the first block): the whole pack at sp_degree 1, this rank's T/W rows under Ulysses
STEP_CACHE_INPUT_ROWS = 1
# sp_degree 1: while a block runs on a sub-pack of the computing documents, the whole pack beside it (the skipping
# documents' rows stay there; the sub-pack's rows are the block's input)
STEP_CACHE_SUBPACK_ROWS = 1
# Ulysses (sp_degree > 1): full-row [T, hidden] tensors gathered onto every rank beside a block: the rows as of the
# last transition (while a sub-pack runs, the other documents' rows are there) and h_0 until the last decision, which
# outlives a block only when a document decides after others started a sub-pack (tiers of different fn_blocks)
STEP_CACHE_GATHERED_ROWS = 2
STEP_CACHE_GATHERED_ROWS_ONE_DECISION = 1  # every tier's fn_blocks alike: h_0 is let go at the one decision block
RESERVE_NOTE = (
    "reserve: 4 GiB PROJECTED, not measured (assumed: CUDA context ~1 GiB, cuBLAS workspaces < 1 GiB, NCCL's "
    "all-to-all buffers to 3-7 peers ~1 GiB with NVLS off, the caching allocator's slack the rest); "
    "benchmarks/gpu_session.sh measures it on a GPU"
)
TEXT_ENCODER_LAYER = 50  # H3 reads Qwen3-VL's hidden_states[50]; H3Pipeline.load keeps layers [0, 51)

# The released text_encoder/config.json (Qwen3-VL-32B), as Qwen3VLConfig kwargs: read when no checkpoint
# directory is readable where admission runs. The VAEs' released configs are diffusers' class defaults.
RELEASED_TEXT_ENCODER = dict(
    text_config=dict(
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=5120,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    tie_word_embeddings=False,
)

NOT_COUNTED = (
    "rank 0's own transients between forwards (Qwen3-VL over a prompt, a VAE decode of a finished clip) "
    "are not in the activations: the reserve must hold them (measure a decode on the GPU before trusting it)"
)
STAGES_NOT_COUNTED = (
    "the conditioner's and decoder's transients (Qwen3-VL over a prompt, VAE encodes of keyframes and references, "
    "a VAE decode of a finished clip) are not counted: the rest of their device must hold them (measure a decode "
    "on the GPU before trusting it)"
)

ACTIVATION_FORMULA = """\
Live bytes of one packed forward at its peak, per rank, no grad; the peak is the larger of two phases:
  d = hidden_size, f = ffn_dim, i = heads x head_dim, p = heads x 6 x rope_freq_dim (rotated channels),
  r = rope_freq_dim, e = text_dim, c = video/audio latent columns, s = served dtype's bytes,
  W = sp_degree, T = pack rows (each rank computes T/W of them), N = the pack's prompt rows (<= T)
  inputs, per pack row (T), every rank:  40 + 8   positions (3 x float64), tag, timestep index, modality index
                                       + media row 4c (fp32 latents) | text row s*e (prompt embeddings)
  refiner phase: N * s*(4d + 4f)          every rank refines every prompt: a SwiGLU over all N prompt rows
  block phase:   N * s*d                  the refined prompts, kept on every rank
               + T/W * ( s * max(SwiGLU, attention)
                          SwiGLU     4d + 4f   block input, attention output, residual, modulated input;
                                               the projection (2f), its activation (f) and product (f)
                          attention  2d + 4i + 4p (W = 1: block input, modulated input, q before and after
                                               RoPE, k, v, RoPE's temporaries)
                                     2d + 9i  (W > 1: local q, k, v, the exchanged q, k, v, the kernel's
                                               output, the all-to-all's buffer and the re-laid-out result)
                        + 4*2*6r      rotary cos, sin (fp32)
                        + 8 + 8       AdaLN row index, the row's position in its modality (int64; W = 1: the
                                      pack's own positions, no copy: 8)
                        + media row 4d (its fp32 input projection) | text row s*d (its copy on this rank;
                                      W = 1: the refined prompt itself, no copy: 0) )
  step caching (when the deployment offers a tier), per pack row, on every rank (W > 1: every rank holds
  every caching row's full-row tensors, not its own T/W rows'):
    both phases: + T * 2*s*d  held: each row's two residuals (First-Block-Cache's h_Fn - h_0 and the middle
                              blocks'), kept between steps
    block phase: + T * 2*s*d  pending: a computing step's new h_Fn - h_0, and its h_Fn copy until its middle
                              ends, then its new middle residual, beside the held ones until the forward ends
                 + T/W * s*d  the blocks' input h_0, held by the forward until the cached blocks return
                 + W = 1: T * (s*d + 16 + 48r)   while a sub-pack of the computing rows runs a block, the whole
                              pack beside it; the sub-pack's row index, AdaLN index, cos and sin (fp32)
                   W > 1: T * (2*s*d + 24 + (8 + 48r)/W)   the full rows gathered at the transitions (the rows
                              as of the last one, h_0 until the last decision); the sub-pack's row index and its
                              padded copy, every row's AdaLN index; this rank's share's AdaLN index, cos and sin
A budget takes each computed row at its dearer variant and N = T (nothing caps a pack's prompt rows yet).
Released dims: SwiGLU 78848 elements, attention 60928 (W = 1) / 75264 (W > 1); tiny: 1408, 1088 / 1344."""


@dataclasses.dataclass(frozen=True)
class RowCost:
    """Activation bytes on one rank per pack row, by phase: the larger of the two phases is the peak.

    Text (prompt) and media (video, audio, conditioning) rows cost differently: a prompt row is refined on every
    rank and kept there, a media row carries fp32 latents and its fp32 input projection. ``text_rows`` bounds the
    pack's prompt rows (the engine's ``max_text_rows_per_step``); the bytes of a pack then count its rows by
    modality with that many prompt rows at most. Without a bound, ``text_share`` is the share of a pack's rows
    that are prompt rows, and None takes every row at its dearer variant and every row a prompt row (what a
    budget must assume while nothing caps a pack's prompt rows).
    """

    local: float  # block phase, per row this rank computes (T/W of them), at the text share (or the dearer)
    kept_text: float  # block phase, per prompt row of the pack: its refined text, on every rank
    refiner_text: float  # refiner phase, per prompt row of the pack: every rank refines every prompt
    per_pack_row: float  # both phases, per row of the pack: its inputs, on every rank, at the text share
    text_share: float | None = None
    step_cache: float = 0.0  # both phases, per row of a step-caching request: its two residuals, held across steps
    # block phase, per row of a step-caching request, on every rank: its pending residuals, the blocks' input h_0,
    # the sub-pack's per-row indices and angles, and (sp_degree 1) the whole pack beside a sub-pack's block
    step_cache_working: float = 0.0
    step_cache_gathers: float = 0.0  # block phase, per pack row under Ulysses, on every rank: the gathered full rows
    local_text: float = 0.0  # block phase, per prompt row this rank computes
    local_media: float = 0.0  # block phase, per media row this rank computes
    inputs_text: float = 0.0  # both phases, per prompt row of the pack, every rank: positions, tags, embeddings
    inputs_media: float = 0.0  # both phases, per media row of the pack, every rank: positions, tags, fp32 latents
    text_rows: int | None = None  # the pack's prompt rows at most (None: not bounded)

    def _block_phase_every_rank(self) -> float:
        """Per pack row on every rank, block phase only: step caching's tensors of the forward (not the refiner's)."""
        return self.step_cache_working + self.step_cache_gathers

    def bytes_for(self, rows: int, sp_degree: int, text_rows: int | None = None) -> int:
        """Activation bytes on one rank for a pack of ``rows`` split over ``sp_degree`` ranks, ``text_rows`` of them
        prompt rows (None: the bound ``self.text_rows``, if any)."""
        local_rows = -(-rows // sp_degree)  # padding makes T divisible by W
        every_rank = self.per_pack_row + self.step_cache  # per pack row, on every rank, both phases
        text = text_rows if text_rows is not None else self.text_rows
        if text is None:  # no bound: the text share, or every row a prompt row at its dearer variant
            text_rows_f = rows * (1.0 if self.text_share is None else self.text_share)
            block = self.local * local_rows + self.kept_text * text_rows_f + self._block_phase_every_rank() * rows
            return int(every_rank * rows + max(block, self.refiner_text * text_rows_f))
        text = min(text, rows)  # more prompt rows cost more on every rank (W > 1) or as much (W = 1): the bound
        local_text = text / sp_degree  # a rank's share of them, on average
        block = self.local_text * local_text + self.local_media * (local_rows - local_text)
        block += self.kept_text * text + self._block_phase_every_rank() * rows
        inputs = self.inputs_text * text + self.inputs_media * (rows - text) + self.step_cache * rows
        return int(inputs + max(block, self.refiner_text * text))

    def per_row(self, sp_degree: int) -> float:
        """Bytes per pack row on one rank (the pack's padding aside), without a prompt-row bound."""
        share = 1.0 if self.text_share is None else self.text_share
        block = self.local / sp_degree + self.kept_text * share + self._block_phase_every_rank()
        return self.per_pack_row + self.step_cache + max(block, self.refiner_text * share)

    def rows_that_fit(self, free_bytes: int, sp_degree: int) -> int:
        """The most pack rows whose activations fit in ``free_bytes`` on one rank (0 if none)."""
        return _largest(lambda rows: self.bytes_for(rows, sp_degree) <= free_bytes)


def _largest(fits: Callable[[int], bool]) -> int:
    """The largest n >= 0 with fits(n), for a fits() true up to some n and false after (0 if fits(1) is false)."""
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclasses.dataclass(frozen=True)
class RequestCost:
    """Bytes one request holds on rank 0 for as long as it is prepared (its ``RequestState``), per row of it:
    what ``REQUEST_FORMULA`` counts."""

    media_row: float  # fp32 latents (the video row's 96 columns), position, tag, modality index, row-timestep plan
    text_row: float  # prompt embedding (served dtype x text_dim), position, tag, index, row-timestep plan

    def bytes_for(self, rows: int, text_rows: int) -> int:
        text = min(text_rows, rows)
        return int(self.text_row * text + self.media_row * (rows - text))


REQUEST_FORMULA = """\
Bytes a prepared request holds on rank 0 until it finishes (its RequestState), per row, s = served dtype's bytes:
  every row:   24 (position, 3 x float64) + 8 (tag) + 8 (its index in its modality) + 8 x E (the row-timestep
               plan: one int64 timestep index per model evaluation, E = steps - 1)
  media row:   + 4c   fp32 latents (c = the video row's columns; an audio row's are fewer)
  prompt row:  + s*e  its Qwen3-VL hidden state (e = text_dim)
A deployment holds at most max_active + max_prepared prepared requests, each within the row budget and the
prompt-row budget: the plan counts that many full-budget requests on rank 0 (workers hold none)."""


def request_row_cost(config: dict[str, Any], dtype: str | torch.dtype, steps: int) -> RequestCost:
    """``REQUEST_FORMULA`` for a transformer config, a served dtype and requests of at most ``steps`` steps."""
    pt, ph, pw = config["patch_size"]
    c = max(config["in_channels"] * pt * ph * pw, config["audio_in_channels"])
    every = 24 + 8 + 8 + 8 * (steps - 1)
    return RequestCost(media_row=float(every + 4 * c), text_row=float(every + dtype_bytes(dtype) * config["text_dim"]))


def dtype_bytes(dtype: str | torch.dtype) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype.itemsize


def block_phase_elements(config: dict[str, Any], sp_degree: int = 1) -> dict[str, int]:
    """Elements per computed row live inside a block at each phase's peak (``ACTIVATION_FORMULA``)."""
    d, f = config["hidden_size"], config["ffn_dim"]
    i = config["num_attention_heads"] * config["attention_head_dim"]
    rope = config["num_attention_heads"] * 6 * config["rope_freq_dim"]  # rotated channels of all heads
    attention = 2 * d + (4 * i + 4 * rope if sp_degree == 1 else 9 * i)
    return {"swiglu": 4 * d + 4 * f, "attention": attention}


def activation_row_cost(
    config: dict[str, Any],
    dtype: str | torch.dtype,
    text_fraction: float | None = None,
    sp_degree: int = 1,
    phase: str | None = None,
    step_cache: bool = False,
    text_rows: int | None = None,
    late_decisions: bool = True,
) -> RowCost:
    """``ACTIVATION_FORMULA`` for a transformer config at ``dtype`` over ``sp_degree`` ranks.

    ``text_fraction`` (share of the pack's rows that are prompt rows) gives the exact mix, as the
    benchmark measures it; None takes each row at its dearer variant, which is what a budget needs.
    ``phase`` ("swiglu" or "attention") takes that phase's peak; None the larger of the two.
    ``step_cache``: every row may belong to a step-caching request (its residuals live across steps, and a
    forward holds its next ones and its working tensors beside them); over ``sp_degree`` > 1 every rank also
    gathers the full rows at the cache's transitions. ``text_rows``: the most prompt rows a pack holds (the
    engine's ``max_text_rows_per_step``); the bytes of a pack then count its rows by modality.
    ``late_decisions``: some documents may decide after others' sub-pack started (the tiers differ in
    ``fn_blocks``), so under Ulysses h_0 stays gathered beside a block; False when every tier decides at one block.
    """
    s = dtype_bytes(dtype)
    d, f, r, e = config["hidden_size"], config["ffn_dim"], config["rope_freq_dim"], config["text_dim"]
    pt, ph, pw = config["patch_size"]
    c = max(config["in_channels"] * pt * ph * pw, config["audio_in_channels"])
    phases = block_phase_elements(config, sp_degree)
    block = phases[phase] if phase is not None else max(phases.values())
    # W = 1 takes every row as it is (packed_forward's _local): no copy of a row's position or of its refined prompt
    local_common = s * block + 4 * 2 * 6 * r + 8 + (8 if sp_degree > 1 else 0)
    local_text, local_media = (s * d if sp_degree > 1 else 0), 4 * d
    inputs_common, inputs_text, inputs_media = 40 + 8, s * e, 4 * c
    if text_fraction is None:  # each computed row at its dearer variant (used without a prompt-row bound)
        local = local_common + max(local_text, local_media)
        inputs = inputs_common + max(inputs_text, inputs_media)
    else:
        local = local_common + text_fraction * local_text + (1 - text_fraction) * local_media
        inputs = inputs_common + text_fraction * inputs_text + (1 - text_fraction) * inputs_media
    held = working = gathers = 0.0
    if step_cache:
        rope_row = 4 * 2 * 6 * r  # a row's fp32 cos and sin
        held = float(STEP_CACHE_HELD_ROWS * s * d)
        working = float(STEP_CACHE_PENDING_ROWS * s * d + STEP_CACHE_INPUT_ROWS * s * d / sp_degree)
        if sp_degree == 1:  # a sub-pack's block: the whole pack beside it; its row index, AdaLN index, cos, sin
            working += STEP_CACHE_SUBPACK_ROWS * s * d + 8 + 8 + rope_row
        else:  # its row index and padded copy, every row's AdaLN index; this rank's share's AdaLN index, cos, sin
            working += 8 + 8 + 8 + (8 + rope_row) / sp_degree
            gathered = STEP_CACHE_GATHERED_ROWS if late_decisions else STEP_CACHE_GATHERED_ROWS_ONE_DECISION
            gathers = float(gathered * s * d)
    return RowCost(
        local=float(local),
        kept_text=float(s * d),
        refiner_text=float(s * (4 * d + 4 * f)),
        per_pack_row=float(inputs),
        text_share=text_fraction,
        step_cache=held,
        step_cache_working=working,
        step_cache_gathers=gathers,
        local_text=float(local_common + local_text),
        local_media=float(local_common + local_media),
        inputs_text=float(inputs_common + inputs_text),
        inputs_media=float(inputs_common + inputs_media),
        text_rows=text_rows,
    )


# -- weights -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the audio VAE's weight_norm deprecation, config notices
        yield


def _read_config(checkpoint: Path | None, folder: str) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    path = checkpoint / folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def served_itemsize(model: torch.nn.Module, name: str, dtype: str | torch.dtype) -> int:
    """Bytes per element of the transformer's parameter or module ``name`` as served: diffusers keeps its
    ``_keep_in_fp32_modules`` in fp32, the rest at the served dtype."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    return 4 if keep & set(name.split(".")) else dtype_bytes(dtype)


def _transformer_bytes(config: dict[str, Any], dtype: str) -> int:
    from diffusers import MiniMaxH3Transformer3DModel

    with _quiet(), torch.device("meta"):
        model = MiniMaxH3Transformer3DModel.from_config(config)
    return sum(p.numel() * served_itemsize(model, name, dtype) for name, p in model.named_parameters())


def _vae_bytes(cls_name: str, config: dict[str, Any] | None, vae_dtype: str) -> int:
    import diffusers

    cls = getattr(diffusers, cls_name)
    with _quiet(), torch.device("meta"):
        model = cls.from_config(config) if config is not None else cls()
    # at ``vae_dtype``, its ``_keep_in_fp32_modules`` in fp32 (``stage_models``' load, diffusers' rule)
    return sum(p.numel() * served_itemsize(model, name, vae_dtype) for name, p in model.named_parameters())


def _text_encoder_bytes(config: dict[str, Any], dtype: str, layers: int) -> int:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    qwen = Qwen3VLConfig.from_dict(config) if "model_type" in config else Qwen3VLConfig(**config)
    qwen.text_config.num_hidden_layers = min(qwen.text_config.num_hidden_layers, layers)  # the trimmed decoder
    with _quiet(), torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(qwen)
    return sum(p.numel() for p in model.parameters()) * dtype_bytes(dtype)


@functools.cache
def _component_bytes(configs_json: str, dtype: str, vae_dtype: str = "float32") -> dict[str, int]:
    """Bytes of each component of ``configs_json`` ({name: config, or null for the class defaults}) as served."""
    configs = json.loads(configs_json)
    out = {
        name: _transformer_bytes(config, dtype)
        for name, config in configs.items()
        if name not in ("text_encoder", "vae", "audio_vae")
    }
    out["text_encoder"] = _text_encoder_bytes(configs["text_encoder"], dtype, TEXT_ENCODER_LAYER + 1)
    out["vae"] = _vae_bytes("AutoencoderKLMiniMaxH3", configs["vae"], vae_dtype)
    out["audio_vae"] = _vae_bytes("AutoencoderKLMiniMaxH3Audio", configs["audio_vae"], vae_dtype)
    return out


def _served_configs(
    model: str, checkpoint: str | None, partitions: tuple[str, ...], configs: CheckpointConfigs | None = None
) -> dict[str, dict[str, Any] | None]:
    """Each component's config as the plan counts it: the checkpoint's (``configs``, as admission read them; else
    its config.json where readable here), else the preset's, else the released one (None: the class's defaults)."""
    if configs is not None:
        return {name: configs.configs[name] for name in (*partitions, "text_encoder", "vae", "audio_vae")}
    spec = preset(model)
    directory = Path(checkpoint) if checkpoint else None
    released = spec.transformer_config()
    out: dict[str, dict[str, Any] | None] = {p: _read_config(directory, p) or released for p in partitions}
    out["text_encoder"] = (
        _read_config(directory, "text_encoder") or spec.components.get("text_encoder") or RELEASED_TEXT_ENCODER
    )
    out["vae"] = _read_config(directory, "vae") or spec.components.get("vae")
    out["audio_vae"] = _read_config(directory, "audio_vae") or spec.components.get("audio_vae")
    return out


# -- the plan ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank role's device memory at a row budget (a stage role holds no rows: no activations)."""

    role: str  # "rank 0" or "worker ranks"; "conditioner" or "decoder" for a stage
    weights: dict[str, int]  # component -> bytes
    activation_bytes: int
    reserve_bytes: int
    request_bytes: int = 0  # the prepared requests' own tensors (rank 0: REQUEST_FORMULA)
    requests: int = 0  # how many prepared requests it holds at most

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.request_bytes + self.reserve_bytes


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every rank role of one replica, at ``max_rows`` pack rows split over ``sp_degree`` ranks, and the stage
    deployments' roles (``stages``: the conditioner and the decoder, each on a device of its own; empty when
    rank 0 conditions and decodes)."""

    model: str
    dtype: str
    sp_degree: int
    max_rows: int
    row_cost: RowCost
    ranks: tuple[RankPlan, ...]
    notes: tuple[str, ...] = ()
    stages: tuple[RankPlan, ...] = ()
    request_cost: RequestCost | None = None  # per row of a prepared request on rank 0

    @property
    def roles(self) -> tuple[RankPlan, ...]:
        """Every role that needs a device: the replica's ranks, then the stages."""
        return self.ranks + self.stages

    def rows_that_fit(self, rank: RankPlan, device_bytes: int) -> int:
        """The largest row budget with which ``rank`` fits ``device_bytes`` (its requests' tensors grow with it)."""
        free = device_bytes - rank.weight_bytes - rank.reserve_bytes
        return _largest(lambda rows: self.activations_at(rows) + self.requests_at(rank, rows) <= free)

    def activations_at(self, rows: int) -> int:
        return self.row_cost.bytes_for(rows, self.sp_degree)

    def requests_at(self, rank: RankPlan, rows: int) -> int:
        """``rank``'s prepared requests' bytes at a row budget of ``rows``: each as large as the budget allows."""
        if not rank.requests or self.request_cost is None:
            return 0
        text = rows if self.row_cost.text_rows is None else min(rows, self.row_cost.text_rows)
        return rank.requests * self.request_cost.bytes_for(rows, text)

    def max_rows_that_fit(self, device_bytes: int) -> int:
        return min(self.rows_that_fit(rank, device_bytes) for rank in self.ranks)

    def table(self, device_bytes: int | None = None) -> str:
        """A small table: one line per rank role, GiB, and how many rows would fit."""
        head = f"{'rank role':<13} {'weights':>9} {'activations':>12} {'requests':>9} {'reserve':>8} {'total':>8}"
        head += f" {'device':>8} {'rows that fit':>14}" if device_bytes else ""
        lines = [
            f"memory plan: {self.model}, {self.dtype}, sp_degree {self.sp_degree}, max_rows_per_step "
            f"{self.max_rows}: {self.activations_at(self.max_rows) / max(self.max_rows, 1) / 1e3:.1f} kB per pack row "
            f"on a rank (block phase per computed row {self.row_cost.local_media / 1e3:.1f} kB media, "
            f"{self.row_cost.local_text / 1e3:.1f} kB prompt; every prompt row refined on every rank at "
            f"{self.row_cost.refiner_text / 1e3:.1f} kB)"
            + (
                f"; prompt rows at most {self.row_cost.text_rows} (engine.max_text_rows_per_step), the rest media rows"
                if self.row_cost.text_rows is not None
                else "; every row counted as a prompt row at its dearer variant (no engine.max_text_rows_per_step)"
            ),
            head,
        ]
        for rank in self.roles:
            line = (
                f"{rank.role:<13} {gib(rank.weight_bytes):>9} {gib(rank.activation_bytes):>12} "
                f"{gib(rank.request_bytes):>9} {gib(rank.reserve_bytes):>8} {gib(rank.total_bytes):>8}"
            )
            if device_bytes:
                # a stage holds no pack rows: whether it fits does not depend on the row budget
                fits = self.rows_that_fit(rank, device_bytes) if rank in self.ranks else "(no rows)"
                line += f" {gib(device_bytes):>8} {fits:>14}"
            lines.append(line)
            lines.append("  weights: " + ", ".join(f"{k} {gib(v)}" for k, v in rank.weights.items()))
        if any(rank.requests for rank in self.ranks):
            lines.append(
                "  requests: "
                + ", ".join(f"{rank.role} holds up to {rank.requests} prepared" for rank in self.ranks if rank.requests)
                + " (engine.max_active + engine.max_prepared), each at the row budget: latents, layout, prompt"
                " embeddings and the row-timestep plan"
            )
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def gib(n: float) -> str:
    """Bytes as GiB (MiB below one GiB, where the tiny model lives)."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def checkpoint_partitions(checkpoint: str | None) -> tuple[tuple[str, ...], str | None]:
    """The transformer partitions each rank loads, and a note when they could not be read here."""
    if checkpoint is None:  # the built-in tiny checkpoint: T2VA/FL2VA's partition only
        return ("transformer",), None
    try:
        return tuple(CheckpointIndex(Path(checkpoint)).partitions()), None
    except (CheckpointError, OSError):
        return ("transformer",), (
            f"{checkpoint} is not readable here: transformer_ref/ is not counted; the released checkpoint has "
            "it, and every rank then holds a second transformer"
        )


def memory_plan(
    *,
    model: str,
    checkpoint: str | None,
    dtype: str,
    sp_degree: int,
    max_rows: int,
    partitions: tuple[str, ...] | None = None,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    adapters: dict[str, int] | None = None,
    step_cache: bool = False,
    stages: Literal["local", "remote"] = "local",
    configs: CheckpointConfigs | None = None,
    text_rows: int | None = None,
    requests: int = 0,
    steps: int = 50,
    late_decisions: bool = True,
    vae_dtype: str = "float32",
    decode_on_ranks: bool = False,
) -> MemoryPlan:
    """Rank 0's and the worker ranks' memory at a row budget of ``max_rows``.

    ``partitions``: the transformer partitions every rank holds; None reads them from the checkpoint (``configs``'s).
    ``configs``: the checkpoint's component configs as admission read them (on the driver or a replica node); None
    reads ``checkpoint`` here where it is readable, else counts the preset's (or the released) configs.
    ``adapters``: each LoRA adapter's bytes on one rank (``lora.check_adapters``): every rank holds every one.
    ``step_cache``: the deployment offers a step-cache tier, so every pack row may hold two residuals (and, during
    a forward, its next ones and the cache's working tensors: ``ACTIVATION_FORMULA``).
    ``stages``: "local", rank 0 holds the text encoder and both VAEs; "remote", stage deployments hold them
    (the plan's ``stages``: the conditioner and the decoder, each with ``reserve_bytes``) and rank 0 does not.
    ``text_rows``: the most prompt rows a pack holds (``engine.max_text_rows_per_step``; None: every row may be
    one). ``requests``: the prepared requests rank 0 holds at most (``max_active + max_prepared``), each at the
    row budget with requests of up to ``steps`` steps (``REQUEST_FORMULA``). ``late_decisions``: the offered tiers
    differ in ``fn_blocks`` (``activation_row_cost``). ``vae_dtype``: the VAEs' served dtype (``args.vae_dtype``).
    ``decode_on_ranks``: the worker ranks also hold the video VAE (they decode shares of rank 0's clips' tiles).
    """
    if stages not in ("local", "remote"):
        raise ValueError(f"stages must be 'local' or 'remote', got {stages!r}")
    notes: tuple[str, ...] = ()
    if partitions is None and configs is not None:
        partitions = configs.partitions
    elif partitions is None:
        partitions, note = checkpoint_partitions(checkpoint)
        notes = (note,) if note else ()
    # Prepare and decode run between forwards on rank 0, or in the stages; their transients are not counted here.
    notes += (NOT_COUNTED if stages == "local" else STAGES_NOT_COUNTED,)
    components = _served_configs(model, checkpoint, tuple(partitions), configs)
    weights = _component_bytes(json.dumps(components, sort_keys=True), dtype, vae_dtype)
    # the activations of the transformer that is served: the checkpoint's dims, not a preset's
    transformer = {**transformer_defaults(), **(components["transformer"] or {})}
    row_cost = activation_row_cost(
        transformer,
        dtype,
        sp_degree=sp_degree,
        step_cache=step_cache,
        text_rows=text_rows,
        late_decisions=late_decisions,
    )
    request_cost = request_row_cost(transformer, dtype, steps)
    if step_cache:
        notes += (
            f"a request paused under srpt or priority keeps its step cache: "
            f"{STEP_CACHE_HELD_ROWS * dtype_bytes(dtype)} x hidden_size "
            "bytes per row each, beyond the pack's" + (" (on every rank)" if sp_degree > 1 else ""),
        )
    if reserve_bytes == DEFAULT_RESERVE_BYTES:
        notes += (RESERVE_NOTE,)
    activations = row_cost.bytes_for(max_rows, sp_degree)
    transformers = {
        **{p: weights[p] for p in partitions},
        **{f"lora {name}": nbytes for name, nbytes in (adapters or {}).items()},
    }
    vaes = {"vae": weights["vae"], "audio_vae": weights["audio_vae"]}
    conditioner = {"text_encoder": weights["text_encoder"], **vaes}
    rank0 = RankPlan(
        "rank 0",
        {**transformers, **conditioner} if stages == "local" else transformers,
        activations,
        reserve_bytes,
        requests=requests,
    )
    workers = {**transformers, "vae": weights["vae"]} if decode_on_ranks else transformers
    ranks = (rank0,) if sp_degree == 1 else (rank0, RankPlan("worker ranks", workers, activations, reserve_bytes))
    stage_plans: tuple[RankPlan, ...] = ()
    if stages == "remote":
        stage_plans = (
            RankPlan("conditioner", conditioner, 0, reserve_bytes),
            RankPlan("decoder", vaes, 0, reserve_bytes),
        )
    plan = MemoryPlan(model, dtype, sp_degree, max_rows, row_cost, ranks, notes, stage_plans, request_cost)
    rank0 = dataclasses.replace(rank0, request_bytes=plan.requests_at(rank0, max_rows))
    return dataclasses.replace(plan, ranks=(rank0, *plan.ranks[1:]))


# -- the plan measured ----------------------------------------------------------------------------
PLAN_PARTS = ("weights", "activations", "requests", "reserve")


def planned_by_role(plan: MemoryPlan) -> dict[str, dict[str, int]]:
    """Each rank role's planned bytes by part (``PLAN_PARTS``): what a replica checks its warm-up against."""
    return {
        rank.role: dict(
            weights=rank.weight_bytes,
            activations=rank.activation_bytes,
            requests=rank.request_bytes,
            reserve=rank.reserve_bytes,
        )
        for rank in plan.ranks
    }


@dataclasses.dataclass(frozen=True)
class MeasuredUse:
    """One rank's device after a forward at the row budget (``torch.cuda.mem_get_info`` and the allocator's peak)."""

    rank: int
    free_bytes: int
    total_bytes: int
    peak_tensor_bytes: int  # torch.cuda.max_memory_allocated: the tensors' own peak (the rest is the reserve's)

    @property
    def used_bytes(self) -> int:
        """Everything in use on the device: tensors, the allocator's cached blocks, the CUDA context, cuBLAS and NCCL
        buffers, and any other process on it."""
        return self.total_bytes - self.free_bytes


class PlanExceeded(RuntimeError):
    """A rank's measured device use is past its plan by more than the reserve: the replica refuses to serve."""

    reason = "memory_measured"  # the replica's build-failure metric's reason


def check_measured(planned: dict[str, dict[str, int]], uses: list[MeasuredUse]) -> list[str]:
    """Each rank's measured use against its role's plan (``planned_by_role``: rank 0's, the workers' for the others):
    one line per rank. Raises PlanExceeded naming every rank whose device use is past its plan (weights +
    activations + requests) by more than the plan's reserve (the reserve is what the allocator cannot hand to
    tensors: the measured use may spend it, not more)."""
    lines, over = [], []
    for use in sorted(uses, key=lambda u: u.rank):
        role = "rank 0" if use.rank == 0 else "worker ranks"
        if role not in planned:
            raise ValueError(f"rank {use.rank}: no plan for {role!r} (the plan has {sorted(planned)})")
        parts = planned[role]
        tensors = parts["weights"] + parts["activations"] + parts["requests"]
        line = (
            f"rank {use.rank} ({role}): {gib(use.used_bytes)} of {gib(use.total_bytes)} in use after the forward at "
            f"the row budget (tensors' peak {gib(use.peak_tensor_bytes)}); planned {gib(tensors)} "
            f"(weights {gib(parts['weights'])}, activations {gib(parts['activations'])}, requests "
            f"{gib(parts['requests'])}) + reserve {gib(parts['reserve'])} = {gib(tensors + parts['reserve'])}"
        )
        lines.append(line)
        if use.used_bytes > tensors + parts["reserve"]:
            over.append(
                f"{line}: {gib(use.used_bytes - tensors)} past the plan, more than its reserve "
                f"({use.used_bytes} bytes measured, {tensors + parts['reserve']} planned with the reserve)"
            )
    if over:
        raise PlanExceeded(
            "the memory plan is wrong by more than its reserve; this replica refuses to serve (a pack at "
            "max_rows_per_step would run out of memory): "
            + "; ".join(over)
            + ". Lower engine.max_rows_per_step (or max_text_rows_per_step), or measure and raise the reserve"
        )
    return lines
