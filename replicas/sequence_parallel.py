"""Ulysses sequence parallelism over packed ``[T, H, D]`` rows.

Rank r holds rows ``r*T/W : (r+1)*T/W`` of the pack with all heads. Before attention
an all-to-all gives every rank all T rows for H/W heads, so varlen attention runs with
the pack's global ``cu_seqlens``; a second all-to-all brings the rows home. Step caching gathers
every rank's rows onto every rank at its transitions (``all_gather_rows``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class UlyssesGroup:
    """Implements the packed forward's ``SequenceParallel`` hook on a torch.distributed group."""

    def __init__(self, sp_degree: int, rank: int, num_heads: int, group: dist.ProcessGroup | None = None):
        if sp_degree < 1 or not 0 <= rank < sp_degree:
            raise ValueError(f"rank {rank} is not within sp_degree {sp_degree}")
        if num_heads % sp_degree:
            raise ValueError(f"Ulysses needs num_heads % sp_degree == 0; got {num_heads} heads over {sp_degree} ranks")
        self.sp_degree, self.rank, self.num_heads, self.group = sp_degree, rank, num_heads, group

    def check_rows(self, total_rows: int) -> None:
        if total_rows % self.sp_degree:
            raise ValueError(
                f"a pack of {total_rows} rows does not split over {self.sp_degree} ranks; "
                f"pad it to a multiple of {self.sp_degree}"
            )

    def _all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """chunks [W, ...]: chunk j goes to rank j; returns [W, ...] with chunk i from rank i."""
        chunks = chunks.contiguous()  # before empty_like, which would copy a transposed view's strides
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=self.group)
        return out

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[n, H, D] (my rows, all heads) -> [W*n, H/W, D] (all rows, my heads)."""
        n, H, D = x.shape
        if H != self.num_heads:
            raise ValueError(f"expected {self.num_heads} heads, got {H}")
        chunks = x.reshape(n, self.sp_degree, H // self.sp_degree, D).transpose(0, 1)  # [W, n, H/W, D]
        return self._all_to_all(chunks).reshape(self.sp_degree * n, H // self.sp_degree, D)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[W*n, H/W, D] -> [n, H, D]."""
        T, h, D = x.shape
        self.check_rows(T)
        chunks = x.reshape(self.sp_degree, T // self.sp_degree, h, D)  # chunk i: rank i's rows
        back = self._all_to_all(chunks)  # [W, n, H/W, D]: chunk j holds head group j
        return back.transpose(0, 1).reshape(T // self.sp_degree, h * self.sp_degree, D)

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's output rows, concatenated in rank order, on rank 0 (None elsewhere)."""
        if self.sp_degree == 1:
            return local
        if self.rank != 0:
            dist.gather(local.contiguous(), None, dst=0, group=self.group)
            return None
        parts = [torch.empty_like(local) for _ in range(self.sp_degree)]
        dist.gather(local.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts)

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [W*n, ...]: every rank's rows, concatenated in rank order, on every rank."""
        if self.sp_degree == 1:
            return local
        local = local.contiguous()
        out = local.new_empty((self.sp_degree * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=self.group)
        return out
