"""The SP worker group of one replica: rank 0 is the replica process, ranks 1..W-1 are Ray actors.

The actors are placed in the replica's own placement group (bundle i for rank i), the way Ray Serve
LLM places multi-GPU engines; outside Serve the group reserves one. torch.distributed runs nccl on
CUDA and gloo on CPU, rendezvousing at rank 0. Rank 0 holds the whole pipeline (conditioning and
decoding run there), unless ``spec.stages`` is "remote" (stage deployments of their own condition and decode):
then rank 0, like the other ranks, holds only the transformer partitions (and the tokenizer).

Step caching: rank 0's per-request states live in its ``RequestState``s; each worker keeps its own
(``step_cache.RankCaches``), the same states, kept in step by the ``CacheMirror`` each pack carries
(the documents' keys, policies and counters, and the keys rank 0 freed since its last pack).

Steps are strictly serial on every rank (the workers' "step" concurrency group holds one call; health
pings have their own group). A step ends when every rank returned or raised: rank 0 waits for the
workers' side of a step it failed in, bounded by the collective timeout plus a margin, before anything
else is launched. Then one classification (``WorkerGroup.settle``): no rank failed in a collective and a
one-number resync of every rank passes -> the pack's data failed (``PackFailed``), the group is healthy;
a dead rank, a rank past the bound, a collective error or a failed resync -> ``WorkerGroupBroken`` for good.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipelines.h3 import H3Denoiser, H3Pipeline
from pipelines.h3.packing import Pack
from pipelines.h3.step_cache import CachedPack, CacheMirrorWriter, RankCaches

from .allocator import cuda_allocator_defaults
from .sequence_parallel import UlyssesGroup
from .spec import ReplicaSpec

logger = logging.getLogger(__name__)


class WorkerGroupBroken(RuntimeError):
    """A rank died, hung or a collective failed; the group must be rebuilt (Serve replaces the replica)."""


class PackFailed(RuntimeError):
    """Every rank finished the step and none failed in a collective: the pack's data failed, the group is fine.

    ``errors`` maps each rank that raised to its error text; the requests of the pack go to isolation.
    """

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("; ".join(f"rank {rank}: {error}" for rank, error in sorted(errors.items())))


# What torch.distributed raises when a collective times out or a peer went away. gloo raises a plain
# RuntimeError (torch 2.13: "[.../gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 3000ms for send
# operation to complete", "Connection closed by peer", "Application timeout caused pair closure"); nccl and the
# c10d store raise torch.distributed.DistError subclasses.
_COLLECTIVE_ERROR_MARKERS = (
    "gloo/",
    "Timed out waiting",
    "Connection closed by peer",
    "Connection reset by peer",
    "pair closure",
    "NCCL",
    "ProcessGroup",
    "c10d",
)


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` came from a collective (its peers may be mid-collective): the group cannot be trusted."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(marker in str(error) for marker in _COLLECTIVE_ERROR_MARKERS)


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank's side of one step ended (workers return it rather than raise, so rank 0 can classify)."""

    rank: int
    step: int
    error: str | None = None  # "Type: message" when the rank raised
    collective: bool = False  # the error came from torch.distributed

    @classmethod
    def of(cls, rank: int, step: int, error: BaseException | None) -> RankOutcome:
        if error is None:
            return cls(rank, step)
        return cls(rank, step, f"{type(error).__name__}: {error}", is_collective_error(error))


def _load_kwargs(spec: ReplicaSpec) -> dict:
    return dict(
        device=spec.device,
        dtype=spec.dtype,
        expected=spec.geometry,
        loras=spec.loras,
    )


def build_rank0(spec: ReplicaSpec) -> H3Pipeline:
    """Rank 0's pipeline with exactly the resolved backend; fails closed if this node cannot run it. With
    ``spec.stages`` "remote" it loads no text encoder and no VAE (``H3Pipeline.load_denoiser_only``)."""
    cuda_allocator_defaults(spec.device)  # before anything touches CUDA in this process
    return H3Pipeline.load(
        spec.checkpoint, spec.resolution.backend, name=spec.model_name, stages=spec.stages, **_load_kwargs(spec)
    )


def build_worker(spec: ReplicaSpec) -> H3Denoiser:
    cuda_allocator_defaults(spec.device)
    return H3Denoiser.load(spec.checkpoint, spec.resolution.backend, **_load_kwargs(spec))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def init_distributed(spec: ReplicaSpec, rank: int, master: str) -> UlyssesGroup:
    if dist.is_initialized():  # a previous, broken group in this process
        dist.destroy_process_group()
    if spec.device == "cuda":
        torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU as device 0
    dist.init_process_group(
        "nccl" if spec.device == "cuda" else "gloo",
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=spec.sp_degree,
        timeout=datetime.timedelta(seconds=spec.collective_timeout_s),
    )
    return UlyssesGroup(spec.sp_degree, rank, spec.num_heads)


def resync(step: int, world: int, device: str, timeout_s: float) -> None:
    """After a failed step: every rank shows its step number in one tiny collective, within ``timeout_s``.

    Ranks that left the step at different collective counts, or a transport the failure left unusable,
    fail or disagree here instead of corrupting the next step.
    """
    seen = torch.tensor([step, -step], dtype=torch.int64, device=device)  # [max step, -min step] after MAX
    work = dist.all_reduce(seen, op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None  # async_op=True returns the pending work
    work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    highest, lowest = int(seen[0]), -int(seen[1])
    if highest != step or lowest != step:
        raise WorkerGroupBroken(
            f"ranks disagree about the step after a failure: steps {lowest}..{highest}, rank at {step}"
        )


@ray.remote(concurrency_groups={"step": 1, "health": 1})
class SPWorker:
    """Ranks 1..W-1. Model work runs in the "step" group, one call at a time, so two forwards never
    interleave their collectives; ``ping`` has its own group and answers while a forward runs."""

    def __init__(self, spec: ReplicaSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.denoiser: H3Denoiser | None = None
        self.sp: UlyssesGroup | None = None
        self.step_caches = RankCaches()  # this rank's copy of each caching request's state, by key

    @ray.method(concurrency_group="step")
    def build(self) -> str:
        self.denoiser = build_worker(self.spec)
        return ray.util.get_node_ip_address()

    @ray.method(concurrency_group="step")
    def join(self, master: str) -> None:
        self.sp = init_distributed(self.spec, self.rank, master)

    @ray.method(concurrency_group="step")
    def forward(self, pack: Pack, step: int) -> RankOutcome:
        """This rank's share of step ``step``; an error is returned (classified), not raised."""
        try:
            assert self.denoiser is not None and self.sp is not None, "build() and join() first"
            if isinstance(pack, CachedPack) and pack.mirror is not None:  # this rank's states of the documents
                cache = self.step_caches.pack_cache(pack.mirror)  # first drops the states rank 0 freed
                if pack.mirror.documents:
                    pack = CachedPack.of(pack, cache)
            self.denoiser.forward(pack, self.sp)
        except Exception as e:
            logger.exception("rank %d: step %d failed", self.rank, step)
            return RankOutcome.of(self.rank, step, e)
        return RankOutcome.of(self.rank, step, None)

    @ray.method(concurrency_group="step")
    def step_cache_bytes(self) -> dict[int, int]:
        """Each step-cache state this rank holds (by key): the bytes of its residuals."""
        return {key: state.residual_bytes for key, state in self.step_caches.documents.items()}

    @ray.method(concurrency_group="step")
    def resync(self, step: int, timeout_s: float) -> RankOutcome:
        try:
            resync(step, self.spec.sp_degree, self.spec.device, timeout_s)
        except Exception as e:
            logger.exception("rank %d: resync after step %d failed", self.rank, step)
            return RankOutcome(self.rank, step, f"{type(e).__name__}: {e}", collective=True)
        return RankOutcome.of(self.rank, step, None)

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        return self.rank


class WorkerGroup:
    """Rank 0's view of the group: build, run one step on every rank, classify its failure, check health.

    One failure semantics. A step whose ranks all finished (returned or raised) within ``settle_bound_s``
    after rank 0, none of them in a collective, and which then pass a resync, failed because of its pack's
    data: ``PackFailed``, and the group stays healthy. A dead rank, a rank past the bound, a collective
    error or a failed resync break the group for good: ``WorkerGroupBroken`` from every later call.
    """

    settle_margin_s = 10.0  # beyond the collective timeout: a rank's compute before its first collective

    def __init__(
        self,
        spec: ReplicaSpec,
        pipeline: H3Pipeline,
        workers: list,
        sp: UlyssesGroup | None,
        own_pg: PlacementGroup | None,
    ):
        self.spec, self.pipeline, self.workers, self.sp, self._own_pg = spec, pipeline, workers, sp, own_pg
        self.broken_reason: str | None = None
        self.steps = 0  # steps launched; every rank numbers them alike
        self.step_cache_mirror = CacheMirrorWriter()  # what the workers hold of the requests' step caches
        # packs are now aligned for, and run on, the whole group
        pipeline.row_multiple = spec.sp_degree
        pipeline.forward = self

    @property
    def sp_degree(self) -> int:
        return self.spec.sp_degree

    @property
    def settle_bound_s(self) -> float:
        """How long the workers may take to finish a step after rank 0 finished its side of it."""
        return self.spec.collective_timeout_s + self.settle_margin_s

    @property
    def resync_timeout_s(self) -> float:
        return min(self.spec.collective_timeout_s, 10.0)

    @classmethod
    def create(
        cls, spec: ReplicaSpec, startup_timeout_s: float = 600.0, placement_timeout_s: float = 120.0
    ) -> WorkerGroup:
        pipeline = build_rank0(spec)  # rank 0 fails closed first, before reserving anything
        if spec.sp_degree == 1:
            return cls(spec, pipeline, [], None, None)
        workers: list = []
        own_pg = None
        try:
            pg, own_pg, first = cls._placement(spec, placement_timeout_s)
            for rank in range(1, spec.sp_degree):
                bundle = pg.bundle_specs[first + rank - 1]
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + rank - 1)
                workers.append(
                    SPWorker.options(  # type: ignore[attr-defined]  # a Ray actor class
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        scheduling_strategy=strategy,
                    ).remote(spec, rank)
                )
            # build everywhere before any rendezvous, so BackendUnavailable surfaces at once
            ray.get([w.build.remote() for w in workers], timeout=startup_timeout_s)
            master = f"{ray.util.get_node_ip_address()}:{free_port()}"
            joins = [w.join.remote(master) for w in workers]
            sp = init_distributed(spec, 0, master)
            ray.get(joins, timeout=spec.collective_timeout_s)
        except BaseException:
            for w in workers:
                ray.kill(w)
            if own_pg is not None:
                remove_placement_group(own_pg)
            raise
        logger.info("SP group of %d ranks up (%s)", spec.sp_degree, spec.resolution.backend)
        return cls(spec, pipeline, workers, sp, own_pg)

    @staticmethod
    def _placement(spec: ReplicaSpec, timeout_s: float) -> tuple[PlacementGroup, PlacementGroup | None, int]:
        """The replica's placement group (rank i -> bundle i), or one reserved for ranks 1..W-1."""
        pg = get_current_placement_group()
        if pg is not None:
            if len(pg.bundle_specs) < spec.sp_degree:
                raise ValueError(
                    f"sp_degree={spec.sp_degree} needs {spec.sp_degree} placement group bundles, "
                    f"the replica has {len(pg.bundle_specs)}"
                )
            return pg, None, 1
        pg = placement_group([dict(spec.rank_resources)] * (spec.sp_degree - 1), strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except BaseException:
            remove_placement_group(pg)  # never leave a reservation behind
            raise
        return pg, pg, 0

    # -- one step: launch on ranks 1..W-1, run rank 0, wait for every rank, classify -----------------
    def launch(self, pack: Pack) -> list[ray.ObjectRef]:
        """Start step ``steps`` on ranks 1..W-1; run ``forward_rank0`` next, on rank 0, then ``settle``."""
        if self.broken_reason:
            raise WorkerGroupBroken(self.broken_reason)
        self.steps += 1
        if not self.workers:
            return []
        wire = pack.to("cpu")
        # the step-cache states' keys and counters, not their tensors; and those rank 0 freed since its last pack
        mirror = self.step_cache_mirror.mirror(pack.step_cache if isinstance(pack, CachedPack) else None)
        if mirror is not None:
            wire = CachedPack.of(wire, mirror=mirror)
        ref = ray.put(wire)  # one host copy for every worker; each moves it to its own device
        return [w.forward.remote(ref, self.steps) for w in self.workers]

    def forward_rank0(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's share of the launched step; raises whatever the forward raised (``settle`` classifies it)."""
        out = self.pipeline.denoiser.forward(pack, self.sp)
        assert out is not None  # rank 0 gathers every rank's rows
        return out

    def collect(self, refs: list[ray.ObjectRef]) -> list[RankOutcome]:
        """The workers' outcomes of the launched step, within ``settle_bound_s`` (blocking)."""
        try:
            return ray.get(refs, timeout=self.settle_bound_s)
        except Exception as e:
            raise self.broken_by(e) from e

    def broken_by(self, error: BaseException) -> WorkerGroupBroken:
        """Mark the group broken by a worker's failure to finish the step; the error to raise."""
        if isinstance(error, ray.exceptions.GetTimeoutError | TimeoutError):
            self.mark_broken(f"an SP worker did not finish step {self.steps} within {self.settle_bound_s:g} s")
        elif isinstance(error, ray.exceptions.RayActorError):
            self.mark_broken(f"an SP worker died in step {self.steps}: {type(error).__name__}")
        else:
            self.mark_broken(f"an SP worker failed in step {self.steps}: {type(error).__name__}: {error}")
        return WorkerGroupBroken(self.broken_reason)

    def settle(self, rank0_error: BaseException | None, outcomes: list[RankOutcome]) -> None:
        """Classify the finished step (every rank returned or raised): nothing, PackFailed or WorkerGroupBroken."""
        ranks = [RankOutcome.of(0, self.steps, rank0_error), *outcomes]
        collective = [o for o in ranks if o.collective]
        if collective:
            self.mark_broken("; ".join(f"collective failed on rank {o.rank}: {o.error}" for o in collective))
            raise WorkerGroupBroken(self.broken_reason) from rank0_error
        errors = {o.rank: o.error for o in ranks if o.error is not None}
        if not errors:
            return
        if self.workers:
            self._resync()
        raise PackFailed(errors) from rank0_error

    def _resync(self) -> None:
        timeout_s = self.resync_timeout_s
        refs = [w.resync.remote(self.steps, timeout_s) for w in self.workers]
        try:
            resync(self.steps, self.sp_degree, self.spec.device, timeout_s)
        except Exception as e:
            self.mark_broken(f"resync after failed step {self.steps} failed on rank 0: {type(e).__name__}: {e}")
            raise WorkerGroupBroken(self.broken_reason) from e
        for outcome in self.collect(refs):
            if outcome.error is not None:
                self.mark_broken(
                    f"resync after failed step {self.steps} failed on rank {outcome.rank}: {outcome.error}"
                )
                raise WorkerGroupBroken(self.broken_reason)

    def __call__(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """One step, blocking (the pipeline's forward, warm-up); the engine uses ``forward_async``."""
        refs = self.launch(pack)
        try:
            out, error = self.forward_rank0(pack), None
        except Exception as e:
            out, error = None, e
        broken = error is not None and is_collective_error(error)  # broken whatever the workers say
        self.settle(error, self.collect(refs) if refs and not broken else [])
        assert out is not None  # settle raised otherwise
        return out

    async def forward_async(
        self, pack: Pack, run_blocking: Callable[..., Awaitable[Any]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step with rank 0 on ``run_blocking`` (the engine's model thread); a dead worker fails it at once,
        not at the collective timeout. Raises PackFailed (data) or WorkerGroupBroken."""
        refs = self.launch(pack)
        local = asyncio.ensure_future(run_blocking(self.forward_rank0, pack))
        workers = [asyncio.wrap_future(ref.future()) for ref in refs]
        # workers return their outcome, so only a dead or lost worker raises here
        done, _ = await asyncio.wait([local, *workers], return_when=asyncio.FIRST_EXCEPTION)
        for future in done:
            if future is not local and future.exception() is not None:
                local.add_done_callback(_consume)  # rank 0 comes back at its collective timeout
                raise self.broken_by(future.exception()) from future.exception()  # type: ignore[arg-type]
        await asyncio.wait([local])
        if local.exception() is not None and is_collective_error(local.exception()):  # type: ignore[arg-type]
            for worker in workers:
                worker.add_done_callback(_consume)
            outcomes: list[RankOutcome] = []  # broken whatever the workers say: nothing waits for them
        else:
            try:
                outcomes = await asyncio.wait_for(asyncio.gather(*workers), timeout=self.settle_bound_s)
            except Exception as e:
                raise self.broken_by(e) from e
        await run_blocking(self.settle, local.exception(), list(outcomes))
        return local.result()

    def mark_broken(self, reason: str) -> None:
        if not self.broken_reason:
            self.broken_reason = reason
            logger.error("SP group broken: %s", reason)

    # -- health ---------------------------------------------------------------------------
    def check_health(self, timeout_s: float = 5.0) -> None:
        """Raise WorkerGroupBroken if any rank is gone or the group already failed (answers while a step runs)."""
        if self.broken_reason:
            raise WorkerGroupBroken(self.broken_reason)
        if not self.workers:
            return
        try:
            ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)
        except Exception as e:
            self.mark_broken(f"SP worker did not answer a health check: {type(e).__name__}: {e}")
            raise WorkerGroupBroken(self.broken_reason) from e

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self._own_pg is not None:
            remove_placement_group(self._own_pg)
            self._own_pg = None
        if self.sp is not None and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a broken group may refuse a clean teardown; the process is moving on
                logger.warning("process group teardown failed", exc_info=True)
            self.sp = None


def _consume(future: asyncio.Future) -> None:
    """Retrieve a result nobody awaits any more, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
