"""torch.nn.attention.varlen.varlen_attn: PyTorch's own packed attention (CUDA only)."""

from __future__ import annotations

import inspect
from typing import ClassVar

import torch

from ..backend import AttentionBackend
from ..impl import AttentionImpl, check_varlen_inputs
from .torch_sdpa import dense_sdpa


class TorchVarlenImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_sdpa(q, k, v, self.scale_for(q.shape[-1]))  # varlen_attn is packed-only

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
        from torch.nn.attention.varlen import varlen_attn

        check_varlen_inputs(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k)
        kwargs: dict = {}
        # `scale` arrived after varlen_attn itself; without it only the default scale is possible.
        if "scale" in inspect.signature(varlen_attn).parameters:
            kwargs["scale"] = self.scale_for(q.shape[-1])
        elif self.softmax_scale is not None and self.softmax_scale != q.shape[-1] ** -0.5:
            raise ValueError("this torch's varlen_attn takes no scale; a custom softmax_scale cannot be honoured")
        out = varlen_attn(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens if cu_seqlens_k is None else cu_seqlens_k,
            max_seqlen,
            max_seqlen_k if cu_seqlens_k is not None and max_seqlen_k is not None else max_seqlen,
            **kwargs,
        )
        return out[0] if isinstance(out, tuple) else out  # (out, aux) when auxiliaries are requested


class TorchVarlenBackend(AttentionBackend):
    name = "torch_varlen"
    impl_cls = TorchVarlenImpl
    aliases = ("varlen", "torch_varlen_attn")
    library = "torch.nn.attention.varlen"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    max_head_dim = 256
    min_compute_capability = (8, 0)
    auto_rank: ClassVar[dict[str, int]] = {"cuda": 1}
