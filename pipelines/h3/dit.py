"""The H3 diffusion transformer over packed rows.

Text, video and audio rows of many documents share one sequence. Everything but
attention is row-local (AdaLN, norms, RoPE, FFN), so a sequence-parallel rank runs
the same code on its slice of rows; attention goes through the injected backend's
``forward_varlen`` with the global ``cu_seqlens``, between two Ulysses all-to-alls
supplied by a ``SequenceParallel`` hook (see replicas/sequence_parallel.py).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import AttentionImpl

from .config import MODALITY_AUDIO, MODALITY_VIDEO, NUM_MODALITIES, H3Config
from .packing import DiTInputs


class SequenceParallel(Protocol):
    """The hook through which a DiT rank exchanges attention rows with its peers."""

    world_size: int

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T/W, H, D] local rows, all heads -> [T, H/W, D] all rows, local heads."""

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H/W, D] -> [T/W, H, D]."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden)  # w1 and w3 fused
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of (possibly fractional) timesteps: [N] -> [N, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_angles(positions: torch.Tensor, freqs_per_axis: int, theta: float) -> torch.Tensor:
    """Per-row rotation angles for 3D RoPE: positions [n, 3] -> [n, 3 * freqs_per_axis]."""
    inv_freq = theta ** (-torch.arange(freqs_per_axis, dtype=torch.float32, device=positions.device) / freqs_per_axis)
    return (positions.float()[:, :, None] * inv_freq).flatten(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x [n, H, D] in interleaved pairs; the rest pass through."""
    rot = 2 * cos.shape[-1]
    pairs = x[..., :rot].float().unflatten(-1, (-1, 2))  # [n, H, rot/2, 2]
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), x[..., rot:]], dim=-1)


class Attention(nn.Module):
    """QK-RMSNorm attention with partial 3D RoPE; the kernel is the injected backend's."""

    def __init__(self, config: H3Config, impl: AttentionImpl):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.inner_dim)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.out = nn.Linear(config.inner_dim, config.hidden_size)
        self.impl = impl

    def forward(self, x, cu_seqlens, max_seqlen, rope=None, sp: SequenceParallel | None = None):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)  # each [n, H, D]
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if sp is not None and sp.world_size > 1:
            q, k, v = sp.seq_to_heads(q), sp.seq_to_heads(k), sp.seq_to_heads(v)  # [T, H/W, D]
        o = self.impl.forward_varlen(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        if sp is not None and sp.world_size > 1:
            o = sp.heads_to_seq(o)  # [n, H, D]
        return self.out(o.flatten(1))


class DiTBlock(nn.Module):
    """Pre-norm block with per-row AdaLN: shift/scale/gate for attention and for the MLP."""

    def __init__(self, config: H3Config, impl: AttentionImpl):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, elementwise_affine=False)
        self.attn = Attention(config, impl)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps, elementwise_affine=False)
        self.ffn = SwiGLU(config.hidden_size, config.ffn_size)
        # learned per-modality offsets added to the shared timestep modulation: [3, 6, hidden]
        self.modulation = nn.Parameter(torch.randn(NUM_MODALITIES, 6, config.hidden_size) / config.hidden_size**0.5)

    def forward(self, x, time_mod, combo, cu_seqlens, max_seqlen, rope, sp):
        # time_mod [n_t, 6, hidden]; table row (t, m) sits at t * 3 + m, chosen per row by combo [n]
        table = (time_mod[:, None] + self.modulation[None]).flatten(0, 1)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = table[combo].unbind(1)  # each [n, hidden]
        h = self.norm1(x) * (1 + scale_a) + shift_a
        x = x + gate_a * self.attn(h, cu_seqlens, max_seqlen, rope, sp)
        h = self.norm2(x) * (1 + scale_m) + shift_m
        return x + gate_m * self.ffn(h)


class RefinerBlock(nn.Module):
    """Token refiner for text: pre-norm attention + MLP, no AdaLN, no RoPE."""

    def __init__(self, config: H3Config, impl: AttentionImpl):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config, impl)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn = SwiGLU(config.hidden_size, config.ffn_size)

    def forward(self, x, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen)
        return x + self.ffn(self.norm2(x))


class H3DiT(nn.Module):
    def __init__(self, config: H3Config, impl: AttentionImpl | None = None):
        super().__init__()
        if impl is None:  # only for meta-device construction and parameter counting
            impl = AttentionImpl()
        self.config = config
        hidden = config.hidden_size
        # text: condition projection, then the refiner
        self.text_proj = nn.Sequential(nn.Linear(config.text_dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, hidden))
        self.refiner = nn.ModuleList(RefinerBlock(config, impl) for _ in range(config.refiner_layers))
        # input embeddings per modality
        self.video_embed = nn.Linear(config.video_patch_dim, hidden)
        self.audio_embed = nn.Linear(config.audio_channels, hidden)
        # timesteps -> shared modulation for every block (6 vectors) and the final layer (2)
        self.time_embed = nn.Sequential(nn.Linear(config.freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))
        self.final_proj = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.blocks = nn.ModuleList(DiTBlock(config, impl) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(hidden, eps=config.norm_eps, elementwise_affine=False)
        self.final_modulation = nn.Parameter(torch.randn(NUM_MODALITIES, 2, hidden) / hidden**0.5)
        # fp32 output heads (kept fp32 whatever the body's dtype)
        self.video_head = nn.Linear(hidden, config.video_patch_dim, dtype=torch.float32)
        self.audio_head = nn.Linear(hidden, config.audio_channels, dtype=torch.float32)

    @property
    def dtype(self) -> torch.dtype:
        return self.video_embed.weight.dtype

    def to_serving_dtype(self, dtype: torch.dtype) -> H3DiT:
        """Cast the body to ``dtype`` and keep the output heads in fp32."""
        self.to(dtype)
        self.video_head.float()
        self.audio_head.float()
        return self

    def refine_text(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        """Text encoder features [L_i, text_dim] -> refined rows [L_i, hidden], all prompts in one pack."""
        lengths = [f.shape[0] for f in features]
        x = self.text_proj(torch.cat(features).to(self.dtype))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=x.device)
        for block in self.refiner:
            x = block(x, cu, max(lengths))
        return list(x.split(lengths))

    def forward(self, inputs: DiTInputs, sp: SequenceParallel | None = None) -> torch.Tensor:
        """One denoising forward over this rank's rows -> [n, out_dim] fp32 (video patch or audio latent)."""
        cfg, dtype = self.config, self.dtype
        x = torch.zeros(inputs.num_rows, cfg.hidden_size, dtype=dtype, device=inputs.modality.device)
        x[inputs.text_rows] = inputs.text_x.to(dtype)
        x[inputs.video_rows] = self.video_embed(inputs.video_x.to(dtype))
        x[inputs.audio_rows] = self.audio_embed(inputs.audio_x.to(dtype))

        temb = self.time_embed(timestep_features(inputs.timesteps, cfg.freq_dim).to(dtype))  # [n_t, hidden]
        time_mod = self.time_proj(temb).unflatten(-1, (6, cfg.hidden_size))
        combo = inputs.t_index * NUM_MODALITIES + inputs.modality  # row -> (timestep, modality) table row
        angles = rope_angles(inputs.positions, cfg.rope_freqs_per_axis, cfg.rope_theta)
        rope = (angles.cos(), angles.sin())
        for block in self.blocks:
            x = block(x, time_mod, combo, inputs.cu_seqlens, inputs.max_seqlen, rope, sp)

        final = (self.final_proj(temb).unflatten(-1, (2, cfg.hidden_size))[:, None] + self.final_modulation[None]).flatten(0, 1)
        shift, scale = final[:, 0][combo], final[:, 1][combo]
        h = (self.final_norm(x) * (1 + scale) + shift).float()
        out = torch.zeros(inputs.num_rows, cfg.out_dim, dtype=torch.float32, device=x.device)
        video = inputs.modality == MODALITY_VIDEO
        audio = inputs.modality == MODALITY_AUDIO
        out[video, : cfg.video_patch_dim] = self.video_head(h[video])
        out[audio, : cfg.audio_channels] = self.audio_head(h[audio])
        return out
