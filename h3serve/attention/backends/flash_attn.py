"""FlashAttention-2: CUDA, SM 8.0+, fp16/bf16, head_dim <= 256.

flash_attn is imported inside the methods, so the driver can introspect this
backend's capability on a machine where flash-attn is not installed.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ..backend import AttentionBackend
from ..impl import AttentionImpl, check_varlen_inputs


class FlashAttnImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from flash_attn import flash_attn_func

        return flash_attn_func(q, k, v, softmax_scale=self.scale_for(q.shape[-1]), causal=False)

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func

        check_varlen_inputs(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k)
        return flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
            max_seqlen_q=max_seqlen,
            max_seqlen_k=max_seqlen if cu_seqlens_k is None else max_seqlen_k,
            softmax_scale=self.scale_for(q.shape[-1]),
            causal=False,
        )


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    impl_cls = FlashAttnImpl
    aliases = ("fa", "fa2", "flash", "flash_attention", "flash-attn")
    library = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 256
    min_compute_capability = (8, 0)
    auto_rank: ClassVar[dict[str, int]] = {"cuda": 0}
