"""h3serve's attention processor for diffusers' ``MiniMaxH3Attention``: packed varlen, optionally Ulysses.

Installed on every attention module of the transformer (blocks and token refiner). It projects q/k/v
exactly as diffusers' ``MiniMaxH3AttnProcessor`` does, then calls the admitted backend's
``forward_varlen`` with the bounds of the documents the packed forward is running — the model never
chooses a backend itself. Under sequence parallelism it exchanges rows for heads around the kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import NoReturn, Protocol

import torch
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

from h3serve.attention import AttentionImpl


class SequenceParallel(Protocol):
    """Ulysses over a process group (replicas.UlyssesGroup implements it)."""

    rank: int
    sp_degree: int
    collectives: int  # collectives this rank entered in the current step
    all_to_alls: int  # of them, the blocks' all-to-alls

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T/W, H, D] (my rows, all heads) -> [T, H/W, D] (all rows, my heads)."""
        ...

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H/W, D] -> [T/W, H, D]."""
        ...

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's rows in rank order on rank 0, None elsewhere."""
        ...

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [W*n, ...], every rank's rows in rank order, on every rank (step caching)."""
        ...

    def agree(self, error: BaseException | None) -> None:
        """After the row-local prologue: raise on every rank if any rank failed so far (``error`` here), so every
        rank leaves the step at the same collective."""
        ...

    def follow_rank0(self, skips: list[bool]) -> list[bool]:
        """Rank 0's step-cache decisions on every rank (one per deciding document): every rank runs the same rows."""
        ...

    def drain(
        self,
        error: BaseException,
        *,
        blocks: int,
        rows: int,
        inner: int,
        dtype: torch.dtype,
        columns: int,
        gather_dtype: torch.dtype,
        then_agree: bool = False,
    ) -> NoReturn:
        """An out-of-memory past the agreement: enter every collective left in the step (``blocks`` blocks' all-to-alls
        of ``[rows, inner]`` in ``dtype``, then the gather of ``[rows, columns]`` in ``gather_dtype``, then with
        ``then_agree`` the outcome's agreement) with scratch buffers, then raise ``error``: the step ends with every
        collective matched, a failure of the pack's."""
        ...

    def fill_block(self, rows: int, inner: int, dtype: torch.dtype, entered: int = 0) -> None:
        """Out of memory in a step-caching step: the all-to-alls left of one block (``entered`` done), with scratch."""
        ...

    def fill_all_gather(self, rows: int, width: int, dtype: torch.dtype) -> None:
        """Out of memory in a step-caching step: one all-gather of ``[rows, width]``, with scratch."""
        ...


@dataclasses.dataclass(frozen=True)
class Documents:
    """The attention documents of the rows now flowing through the model."""

    cu_seqlens: torch.Tensor  # [D+1] int32, global row bounds
    max_seqlen: int
    sp: SequenceParallel | None = None  # rows are sharded over sp.sp_degree ranks when set


_current: contextvars.ContextVar[Documents | None] = contextvars.ContextVar("h3serve_documents", default=None)


@contextlib.contextmanager
def attending(documents: Documents) -> Iterator[None]:
    """Every attention call inside runs over ``documents``."""
    token = _current.set(documents)
    try:
        yield
    finally:
        _current.reset(token)


class H3VarlenAttnProcessor:
    """Full self-attention within each packed document, through ``impl.forward_varlen``."""

    def __init__(self, impl: AttentionImpl):
        self.impl = impl

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        documents = _current.get()
        if documents is None:
            raise RuntimeError("H3VarlenAttnProcessor runs only inside h3serve's packed forward (no documents set)")
        if attention_mask is not None:
            raise ValueError("packed documents replace attention masks; got an attention_mask")
        # hidden_states: [1, n, hidden] -> q, k, v: [1, n, H, Dh], as diffusers' own processor computes them
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
        key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
        value = value.unflatten(-1, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _apply_rotary_emb(query, *rotary_emb), _apply_rotary_emb(key, *rotary_emb)

        q, k, v = query[0], key[0], value[0]  # [n, H, Dh]
        sp = documents.sp
        if sp is not None:  # [T/W, H, Dh] -> [T, H/W, Dh]: every row, this rank's heads
            q, k, v = sp.seq_to_heads(q), sp.seq_to_heads(k), sp.seq_to_heads(v)
        out = self.impl.forward_varlen(q, k, v, cu_seqlens=documents.cu_seqlens, max_seqlen=documents.max_seqlen)
        if sp is not None:
            out = sp.heads_to_seq(out)  # back to [T/W, H, Dh]
        out = out[None].flatten(2, 3).type_as(query)  # [1, n, H*Dh]
        return attn.to_out[1](attn.to_out[0](out))


def install(transformer, impl: AttentionImpl) -> H3VarlenAttnProcessor:
    """Put one processor with ``impl`` on every attention module of ``transformer``."""
    processor = H3VarlenAttnProcessor(impl)
    transformer.set_attn_processor(processor)
    return processor
