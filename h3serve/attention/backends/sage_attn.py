"""SageAttention (quantized QK): dense attention only.

It has no ``forward_varlen`` override, so by its code it cannot do packed varlen,
and the selector refuses it for H3.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backend import AttentionBackend
from ..impl import AttentionImpl


class SageAttnImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from sageattention import sageattn

        return sageattn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=self.scale_for(q.shape[-1]))


class SageAttnBackend(AttentionBackend):
    name = "sage_attn"
    impl_cls = SageAttnImpl
    aliases = ("sage", "sageattention", "sage_attention")
    library = "sageattention"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 128
    min_compute_capability = (8, 0)
    auto_rank: ClassVar[dict[str, int]] = {}  # opt-in only
