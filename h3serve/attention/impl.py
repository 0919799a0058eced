"""The attention implementation interface every backend's kernel class fills in."""

from __future__ import annotations

import torch


class AttentionImpl:
    """Non-causal multi-head attention over ``[..., H, D]`` tensors.

    ``forward`` is dense attention on ``[B, S, H, D]``. ``forward_varlen`` is packed
    attention on ``[T, H, D]``: rows ``cu_seqlens[i]:cu_seqlens[i+1]`` form document
    ``i`` and attend only within it. An implementation that overrides
    ``forward_varlen`` declares, by that override alone, that it can do packed varlen.
    """

    def __init__(self, softmax_scale: float | None = None) -> None:
        self.softmax_scale = softmax_scale
        self._bounds: tuple[torch.Tensor, list[int]] | None = None

    def host_bounds(self, cu_seqlens: torch.Tensor) -> list[int]:
        """``cu_seqlens`` as a host list, one device sync per pack rather than one per layer.

        Every layer of a forward passes the same bounds tensor, so the last one is kept (bounds
        tensors are never written in place).
        """
        if self._bounds is None or self._bounds[0] is not cu_seqlens:
            self._bounds = (cu_seqlens, cu_seqlens.tolist())
        return self._bounds[1]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dense attention")

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
        raise NotImplementedError(f"{type(self).__name__} does not implement packed varlen attention (forward_varlen)")

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.forward(q, k, v)

    def scale_for(self, head_dim: int) -> float:
        return self.softmax_scale if self.softmax_scale is not None else head_dim**-0.5


def check_varlen_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_k: int | None = None,
) -> None:
    """Shape and dtype checks shared by every varlen implementation."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"forward_varlen takes packed [T, H, D] tensors; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D int32 tensor with at least 2 entries; "
            f"got dtype={cu_seqlens.dtype} shape={tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens_k is not None:
        if max_seqlen_k is None:
            raise ValueError("cu_seqlens_k needs max_seqlen_k")
        if cu_seqlens_k.dtype != torch.int32 or cu_seqlens_k.shape != cu_seqlens.shape:
            raise ValueError(
                "cu_seqlens_k must be int32 with one entry per cu_seqlens entry; got "
                f"dtype={cu_seqlens_k.dtype} shape={tuple(cu_seqlens_k.shape)} "
                f"for cu_seqlens shape={tuple(cu_seqlens.shape)}"
            )
    elif k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows but q has {q.shape[0]}; pass cu_seqlens_k for different key bounds")
