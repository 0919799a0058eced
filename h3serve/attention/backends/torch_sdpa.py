"""PyTorch scaled_dot_product_attention: CPU and CUDA, any float dtype."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from ..backend import AttentionBackend
from ..impl import AttentionImpl, check_varlen_inputs


def dense_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, S, H, D] -> sdpa's [B, H, S, D] and back."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
    return out.transpose(1, 2)


class TorchSDPAImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_sdpa(q, k, v, self.scale_for(q.shape[-1]))

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
        check_varlen_inputs(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k)
        # The bounds on the host (one sync per pack); the loop below runs one sdpa per document.
        bounds_q = self.host_bounds(cu_seqlens)
        bounds_k = cu_seqlens_k.tolist() if cu_seqlens_k is not None else bounds_q
        if bounds_q[-1] > q.shape[0] or bounds_k[-1] > k.shape[0]:
            raise ValueError(
                f"cu_seqlens end at {bounds_q[-1]} (q) / {bounds_k[-1]} (k) but the tensors "
                f"have {q.shape[0]} / {k.shape[0]} rows"
            )
        scale = self.scale_for(q.shape[-1])
        # [T, H, D] -> [1, H, T, D] once: each document is a slice, and 4-D lets sdpa use fused kernels
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        out = torch.zeros_like(qh)
        for i in range(len(bounds_q) - 1):
            q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
            if q1 == q0 or k1 == k0:  # an empty document, or one with no keys, yields zeros
                continue
            out[:, :, q0:q1] = F.scaled_dot_product_attention(
                qh[:, :, q0:q1], kh[:, :, k0:k1], vh[:, :, k0:k1], scale=scale
            )
        return out[0].transpose(0, 1)


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"
    impl_cls = TorchSDPAImpl
    aliases = ("sdpa", "torch", "native")
    auto_rank: ClassVar[dict[str, int]] = {"cuda": 2, "cpu": 0}
