"""Ulysses sequence parallelism over packed ``[T, H, D]`` rows, and the collectives of one step around it.

Rank r holds rows ``r*T/W : (r+1)*T/W`` of the pack with all heads. Before attention
an all-to-all gives every rank all T rows for H/W heads, so varlen attention runs with
the pack's global ``cu_seqlens``; a second all-to-all brings the rows home. Step caching gathers
every rank's rows onto every rank at its transitions (``all_gather_rows``) and follows rank 0's decisions
(``follow_rank0``).

One step's collectives, in order, on every rank: an agreement (``ready``) that every rank can take its side of the
broadcast (an OOM making its buffer, or any earlier error, ends the step there on every rank); the pack's tensors
broadcast from rank 0 (``send_pack`` / ``receive_pack``); the row-local prologue, then one agreement (``agree``)
that carries any rank's error from before it to every rank, so all leave the step there together and nothing is
left unmatched; the blocks' all-to-alls (and step caching's gathers and decision broadcasts); the gather of the
output rows onto rank 0; then each rank waits for its device (``finish``). An out-of-memory past the agreement (a
block's SwiGLU is the step's peak) is the pack's too: that rank enters the step's remaining collectives with
scratch buffers (``drain``) and reports it; no collective or host sync is spent on it while nothing fails.
Every collective is counted (``collectives``), so a rank's outcome says how far into the step it failed. ``abort`` ends
the communicator without a collective (NCCL: in-flight kernels exit; gloo: the sockets close once nothing holds the
group) on a thread with a deadline (``h3serve.replicas.nccl``), and every later collective of this object raises.
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

import torch
import torch.distributed as dist

from h3serve.pipelines.h3.packing import Pack, PackLayout, flatten_pack

from . import nccl
from .faults import ALL_TO_ALLS_PER_BLOCK, FaultInjector

logger = logging.getLogger(__name__)


def abort_process_group(deadline_s: float = nccl.ABORT_DEADLINE_S) -> bool:
    """Abort this process's torch.distributed group, if any: no collective, the world state cleared for a new one;
    whether the abort returned within ``deadline_s``."""
    return nccl.abort(deadline_s)


class GroupAborted(RuntimeError):
    """This rank's communicator was aborted: the step it was in is over."""


class PeerFailed(RuntimeError):
    """Another rank failed before the step's agreement; every rank leaves the step there, together."""


class DeviceTimeout(RuntimeError):
    """The device did not finish the step's work within the step's bound."""


class UlyssesGroup:
    """Implements the packed forward's ``SequenceParallel`` hook on a torch.distributed group."""

    def __init__(
        self,
        sp_degree: int,
        rank: int,
        num_heads: int,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ):
        if sp_degree < 1 or not 0 <= rank < sp_degree:
            raise ValueError(f"rank {rank} is not within sp_degree {sp_degree}")
        if num_heads % sp_degree:
            raise ValueError(f"Ulysses needs num_heads % sp_degree == 0; got {num_heads} heads over {sp_degree} ranks")
        self.sp_degree, self.rank, self.num_heads, self.group = sp_degree, rank, num_heads, group
        self.device = torch.device(device)
        self.faults = FaultInjector(rank)  # armed by tests only (``h3serve.replicas.faults``)
        self.aborted = False
        self.abort_returned = True  # the abort (once it ran) returned within its deadline
        self.disagreements = 0  # step-cache decisions where this rank's own differed from rank 0's
        self.begin_step()

    # -- one step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.collectives = 0  # collectives this rank entered in the current step
        self.all_to_alls = 0
        # the step ended with every collective matched: at the agreement, on every rank, or after ``drain``
        self.left_together = False
        self.early_error: BaseException | None = None  # raised before the first collective: carried to ``agree``
        self.gathered = False  # it entered the step's gather of the output rows
        self.all_gathers = 0  # step caching's all-gathers of rows onto every rank

    def _collective(self) -> None:
        if self.aborted:
            raise GroupAborted(f"rank {self.rank}: the communicator was aborted")
        self.collectives += 1

    def send_pack(self, pack: Pack, flat: torch.Tensor | None = None) -> None:
        """Rank 0: the pack's tensors to every rank, as one flat buffer (its layout went ahead, through Ray). ``flat``:
        ``flatten_pack(pack)``'s buffer, made before the step was launched (``WorkerGroup.forward_async``: a failure
        to make it, an OOM, is then the pack's before any rank waits in this broadcast)."""
        if flat is None:
            try:
                _, flat = flatten_pack(pack)  # [nbytes] uint8 on the pack's device
            except torch.OutOfMemoryError as e:
                self.early_error = self.early_error or e
        self.ready()
        assert flat is not None  # ready() raised otherwise
        self._collective()
        dist.broadcast(flat, src=0, group=self.group)

    def receive_pack(self, layout: PackLayout) -> Pack:
        """Ranks 1..W-1: rank 0's pack, on this rank's device (its tensors are views of one received buffer)."""
        flat = None
        try:  # the receive buffer: an OOM making it is the pack's, carried to ``ready``
            self.faults.at("receive_buffer")
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)  # [nbytes]
        except torch.OutOfMemoryError as e:
            self.early_error = self.early_error or e
        self.ready()
        assert flat is not None  # ready() raised otherwise
        self._collective()
        dist.broadcast(flat, src=0, group=self.group)
        return layout.unflatten(flat)

    def ready(self) -> None:
        """Before the pack's broadcast, whose buffers must exist on every rank: if any rank failed so far (its
        ``early_error``: an OOM making its side of the broadcast, its step caches, an injected fault), every rank
        raises here together (rank 0 fails the pack). One all-reduce of W flags and its read-back, at the step's
        start, where the device has nothing queued: its latency only, no drained queue."""
        self.agree(None)

    def agree(self, error: BaseException | None) -> None:
        """After the row-local prologue, before any collective that depends on the data: if any rank failed so far
        (``error``, or an early one), every rank raises here, having entered the same collectives."""
        error = error or self.early_error
        failed = torch.zeros(self.sp_degree, dtype=torch.int32, device=self.device)  # [W]: 1 where a rank failed
        failed[self.rank] = error is not None
        self._collective()
        dist.all_reduce(failed, group=self.group)
        ranks = [r for r, flag in enumerate(failed.tolist()) if flag]
        if not ranks:
            return
        self.left_together = True
        if error is not None:
            raise error
        raise PeerFailed(f"rank(s) {ranks} failed before the step's collectives")

    def follow_rank0(self, skips: list[bool]) -> list[bool]:
        """Rank 0's step-cache decisions (one per deciding document), on every rank: a rank that decided otherwise
        from its own arithmetic follows rank 0, so every rank runs the same sub-packs and the same collectives."""
        mine = self.faults.decisions(skips)
        decided = torch.tensor(mine, dtype=torch.uint8, device=self.device)  # [n deciding]
        self._collective()
        dist.broadcast(decided, src=0, group=self.group)
        agreed = [bool(skip) for skip in decided.tolist()]
        if agreed != mine:
            self.disagreements += 1
            logger.warning("rank %d: step-cache decisions %s, rank 0's %s: following rank 0", self.rank, mine, agreed)
        return agreed

    def finish(self, bound_s: float) -> None:
        """Return once this rank's device has finished the step (CUDA: an event polled within ``bound_s``, so a step
        is reported finished only when its kernels are; CPU: at once, the work is done when the host returns)."""
        self.faults.sync()  # an injected asynchronous device fault surfaces at this sync, as a real one would
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + bound_s
        while not done.query():
            if self.aborted:
                raise GroupAborted(f"rank {self.rank}: the communicator was aborted while the device finished")
            if time.monotonic() > deadline:
                raise DeviceTimeout(f"rank {self.rank}: the device did not finish the step within {bound_s:g} s")
            time.sleep(0.0002)

    def abort(self, deadline_s: float = nccl.ABORT_DEADLINE_S) -> bool:
        """End the communicator now, without a collective (never ``destroy``, which may wait on a wedged peer), on a
        daemon thread; whether it returned within ``deadline_s`` (False: this process cannot be trusted with another
        communicator). Once: a later call (a shutdown after a replacement) must not end the new group this process
        may have joined."""
        if self.aborted:
            return self.abort_returned
        self.aborted = True
        self.faults.release()
        self.abort_returned = nccl.abort(deadline_s, before=lambda: self.faults.at("abort"))
        return self.abort_returned

    # -- Ulysses ---------------------------------------------------------------------------
    def check_rows(self, total_rows: int) -> None:
        if total_rows % self.sp_degree:
            raise ValueError(
                f"a pack of {total_rows} rows does not split over {self.sp_degree} ranks; "
                f"pad it to a multiple of {self.sp_degree}"
            )

    def _all_to_all(self, chunks: torch.Tensor) -> torch.Tensor:
        """chunks [W, ...]: chunk j goes to rank j; returns [W, ...] with chunk i from rank i."""
        if self.all_to_alls % ALL_TO_ALLS_PER_BLOCK == 1:  # between a block's first all-to-all and its second
            self.faults.at("between_all_to_alls", block=self.all_to_alls // ALL_TO_ALLS_PER_BLOCK)
        chunks = chunks.contiguous()  # before empty_like, which would copy a transposed view's strides
        out = torch.empty_like(chunks)
        self._collective()
        self.all_to_alls += 1
        dist.all_to_all_single(out, chunks, group=self.group)
        if self.all_to_alls % ALL_TO_ALLS_PER_BLOCK == 0:  # the block's attention is over: its FFN, the peak, is next
            self.faults.at("after_attention", block=self.all_to_alls // ALL_TO_ALLS_PER_BLOCK - 1)
        return out

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
        """An out-of-memory past the agreement is the pack's, not the group's: enter every collective left in this
        step with scratch buffers of the shapes the peers use (the rest of ``blocks`` blocks' all-to-alls of this
        rank's ``rows`` x ``inner`` channels in ``dtype``, then the gather of ``rows`` x ``columns`` in
        ``gather_dtype``; ``then_agree``: then the outcome's agreement a step-caching step ends with, whose blocks'
        collectives the step cache entered itself: ``blocks`` 0), so nothing is left unmatched and every peer finishes
        the step, then raise ``error``, having
        left the step with every collective matched (``left_together``): rank 0 fails the pack (``PackFailed``) and
        the engine retries it in halves. The peers compute on the scratch rows; rank 0 discards the step. Anything
        raised while draining (another OOM, an abort) is raised instead, past the agreement: the group breaks."""
        left = ALL_TO_ALLS_PER_BLOCK * blocks - self.all_to_alls
        logger.warning(
            "rank %d: out of memory past the step's agreement, after %d of %d all-to-all(s): entering the %d left "
            "and the gather with scratch rows, so the pack fails alone (%s)",
            self.rank,
            self.all_to_alls,
            ALL_TO_ALLS_PER_BLOCK * blocks,
            left,
            error,
        )
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed block's blocks back to the device before the scratch is made
        if left > 0:
            chunks = torch.zeros((self.sp_degree, rows, inner // self.sp_degree), dtype=dtype, device=self.device)
            out = torch.empty_like(chunks)  # [W, T/W, H/W * D]: the bytes of one all-to-all of the step
            for _ in range(left):
                self._collective()
                self.all_to_alls += 1
                dist.all_to_all_single(out, chunks, group=self.group)
            del chunks, out
        if not self.gathered and self.sp_degree > 1:
            self._gather(torch.zeros((rows, columns), dtype=gather_dtype, device=self.device))
        if then_agree:  # a step-caching step ends with an agreement on its outcome: it says the pack failed here
            self.agree(error)
        self.left_together = True
        raise error

    def fill_block(self, rows: int, inner: int, dtype: torch.dtype, entered: int = 0) -> None:
        """Step caching, out of memory: enter the all-to-alls left of one block (``entered`` of them done) with
        scratch buffers of the shapes the peers use (``rows`` rows this rank runs, ``inner`` channels in ``dtype``)."""
        left = ALL_TO_ALLS_PER_BLOCK - entered
        if left <= 0:
            return
        chunks = torch.zeros((self.sp_degree, rows, inner // self.sp_degree), dtype=dtype, device=self.device)
        out = torch.empty_like(chunks)  # [W, n, H/W * D]: the bytes of one all-to-all of the block
        for _ in range(left):
            self._collective()
            self.all_to_alls += 1
            dist.all_to_all_single(out, chunks, group=self.group)

    def fill_all_gather(self, rows: int, width: int, dtype: torch.dtype) -> None:
        """Step caching, out of memory: enter one all-gather of ``rows`` x ``width`` rows with scratch buffers."""
        local = torch.zeros((rows, width), dtype=dtype, device=self.device)
        out = local.new_empty((self.sp_degree * rows, width))  # [W*n, width]
        self._collective()
        self.all_gathers += 1
        dist.all_gather_into_tensor(out, local, group=self.group)

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
        self.faults.at("final_gather")
        return self._gather(local)

    def _gather(self, local: torch.Tensor) -> torch.Tensor | None:
        # every buffer before the count: an OOM making one leaves the gather to ``drain``
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.sp_degree)] if self.rank == 0 else None
        self._collective()
        self.gathered = True
        dist.gather(local, parts, dst=0, group=self.group)
        return None if parts is None else torch.cat(parts)

    def all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank -> [W*n, ...]: every rank's rows, concatenated in rank order, on every rank."""
        if self.sp_degree == 1:
            return local
        self.faults.at("all_gather", block=self.all_gathers)  # its [W*n, ...] buffer is step caching's peak under sp
        local = local.contiguous()
        out = local.new_empty((self.sp_degree * local.shape[0], *local.shape[1:]))
        self._collective()
        self.all_gathers += 1
        dist.all_gather_into_tensor(out, local, group=self.group)
        return out
