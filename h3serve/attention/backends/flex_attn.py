"""torch.nn.attention.flex_attention with a document mask: packed varlen from torch built-ins.

On CUDA the call goes through ``torch.compile(flex_attention)`` (compiled once per process, on
first use; a new pack length may recompile once before shapes turn dynamic). On CPU it runs in
eager mode, which materializes each head's [T, T] scores: correct, but for small packs only,
so CPU auto selection never picks it (it is opt-in there).
"""

from __future__ import annotations

import functools
import itertools
from typing import ClassVar

import torch

from ..backend import AttentionBackend
from ..impl import AttentionImpl, check_varlen_inputs
from .torch_sdpa import dense_sdpa

BLOCK = 128  # flex_attention's default sparse block size: the BlockMask's tile
MASK_CACHE_SIZE = 16  # pack layouts kept; a layout repeats for every step and layer while the pack holds


def _checked_bounds(bounds_list: list[int], rows: int, which: str) -> tuple[int, ...]:
    """Host bounds as a tuple, checked to start at 0, not decrease and end at ``rows``."""
    bounds = tuple(bounds_list)
    if bounds[0] != 0 or any(b < a for a, b in itertools.pairwise(bounds)) or bounds[-1] != rows:
        raise ValueError(
            f"{which} must start at 0, never decrease and end at the tensor's row count {rows} "
            f"(flex_attn has no rows outside a document); got {list(bounds)}"
        )
    return bounds


def _document_ids(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[T] int32: the document each row belongs to (empty documents own no rows)."""
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=device)
    docs = torch.arange(len(lengths), dtype=torch.int32, device=device)
    return torch.repeat_interleave(docs, lengths, output_size=bounds[-1])


def _block_docs(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First doc, last doc and completeness of each BLOCK-row tile: [T] -> 3 x [ceil(T / BLOCK)]."""
    starts = torch.arange(0, doc.shape[0], BLOCK, device=doc.device)
    ends = (starts + BLOCK).clamp(max=doc.shape[0])
    return doc[starts], doc[ends - 1], ends - starts == BLOCK


def _ordered(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Qb, Kb] bool -> BlockMask's (counts [1, 1, Qb], indices [1, 1, Qb, Kb]): kept tiles first, ascending."""
    counts = mask.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~mask).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], indices[None, None]


@functools.lru_cache(maxsize=MASK_CACHE_SIZE)
def document_block_mask(bounds_q: tuple[int, ...], bounds_k: tuple[int, ...], q_len: int, kv_len: int, device: str):
    """The BlockMask where query document i attends to key document i only, for one pack layout.

    Built at tile level from the bounds, never as a [T, T] mask (64k rows would be 4 GiB): a tile
    is kept when its query and key document ranges overlap, and ``full`` (mask_mod skipped) when
    both sides are whole tiles inside one and the same document. ``mask_mod`` decides the rest.
    """
    from torch.nn.attention.flex_attention import BlockMask

    dev = torch.device(device)
    doc_q, doc_k = _document_ids(bounds_q, dev), _document_ids(bounds_k, dev)
    q_first, q_last, q_whole = _block_docs(doc_q)
    k_first, k_last, k_whole = _block_docs(doc_k)
    overlap = (q_first[:, None] <= k_last[None, :]) & (k_first[None, :] <= q_last[:, None])  # [Qb, Kb]
    one_doc = (q_first == q_last) & q_whole
    full = (one_doc[:, None] & ((k_first == k_last) & k_whole)[None, :]) & (q_first[:, None] == k_first[None, :])

    def mask_mod(b, h, q_idx, kv_idx):
        return doc_q[q_idx] == doc_k[kv_idx]

    counts, indices = _ordered(overlap & ~full)
    full_counts, full_indices = _ordered(full)
    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )


@functools.cache
def _compiled_flex():
    """torch.compile(flex_attention), made once per process on first CUDA use."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _flex(device_type: str):
    if device_type == "cuda":
        return _compiled_flex()
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention  # eager: CPU inference only


class FlexAttnImpl(AttentionImpl):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_sdpa(q, k, v, self.scale_for(q.shape[-1]))  # no mask needed: sdpa's fused kernels

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
        bounds_q = _checked_bounds(self.host_bounds(cu_seqlens), q.shape[0], "cu_seqlens")
        bounds_k = (
            bounds_q if cu_seqlens_k is None else _checked_bounds(cu_seqlens_k.tolist(), k.shape[0], "cu_seqlens_k")
        )
        if q.shape[0] == 0 or k.shape[0] == 0:  # nothing to attend: zeros, as torch_sdpa gives
            return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
        mask = document_block_mask(bounds_q, bounds_k, q.shape[0], k.shape[0], str(q.device))
        # [T, H, D] -> [1, H, T, D] views; a query with no keys (empty key document) comes out as zeros
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        out = _flex(q.device.type)(qh, kh, vh, block_mask=mask, scale=self.scale_for(q.shape[-1]))
        return out[0].transpose(0, 1)


class FlexAttnBackend(AttentionBackend):
    name = "flex_attn"
    impl_cls = FlexAttnImpl
    aliases = ("flex", "flex_attention", "flexattention", "torch_flex")
    library = "torch.nn.attention.flex_attention"
    devices = ("cuda", "cpu")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    max_head_dim = 256  # the Triton template's shared-memory budget; unmeasured beyond 128
    min_compute_capability = (8, 0)  # bf16 and the tuned Triton configs target Ampere+; older GPUs untested
    # CUDA: after torch_sdpa until measured (compile cost, unbenchmarked); a measured ranking can promote it.
    # CPU: absent, eager flex materializes [T, T] scores, so torch_sdpa stays the CPU choice.
    auto_rank: ClassVar[dict[str, int]] = {"cuda": 3}
