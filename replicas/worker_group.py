"""The SP worker group of one replica: rank 0 is the replica process, ranks 1..W-1 are Ray actors.

The actors are placed in the replica's own placement group (bundle i for rank i), the way Ray Serve
LLM places multi-GPU engines; outside Serve the group reserves one. torch.distributed runs nccl on
CUDA and gloo on CPU, rendezvousing at rank 0. Rank 0 holds the whole pipeline (conditioning and
decoding run there); the other ranks hold only the transformer partitions.
"""

from __future__ import annotations

import datetime
import logging
import socket

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

from pipelines.h3 import H3Denoiser, H3Pipeline, TransformerGeometry
from pipelines.h3.packing import Pack

from .sequence_parallel import UlyssesGroup
from .spec import ReplicaSpec

logger = logging.getLogger(__name__)


class WorkerGroupBroken(RuntimeError):
    """A rank died or a collective failed; the group must be rebuilt (Serve replaces the replica)."""


def _load_kwargs(spec: ReplicaSpec) -> dict:
    return dict(
        device=spec.device,
        dtype=spec.dtype,
        expected=TransformerGeometry(num_heads=spec.num_heads, head_dim=spec.head_dim),
    )


def build_rank0(spec: ReplicaSpec) -> H3Pipeline:
    """Rank 0's whole pipeline with exactly the resolved backend; fails closed if this node cannot run it."""
    return H3Pipeline.load(spec.checkpoint, spec.resolution.backend, name=spec.model_name, **_load_kwargs(spec))


def build_worker(spec: ReplicaSpec) -> H3Denoiser:
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


@ray.remote
class SPWorker:
    """Ranks 1..W-1. Two concurrent calls so ``ping`` answers while ``forward`` runs."""

    def __init__(self, spec: ReplicaSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.denoiser: H3Denoiser | None = None
        self.sp: UlyssesGroup | None = None

    def build(self) -> str:
        self.denoiser = build_worker(self.spec)
        return ray.util.get_node_ip_address()

    def join(self, master: str) -> None:
        self.sp = init_distributed(self.spec, self.rank, master)

    def forward(self, pack: Pack) -> None:
        assert self.denoiser is not None, "build() first"
        self.denoiser.forward(pack, self.sp)

    def ping(self) -> int:
        return self.rank


class WorkerGroup:
    """Rank 0's view of the group: build, launch a step on every rank, check health, shut down."""

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
        # packs are now aligned for, and run on, the whole group
        pipeline.row_multiple = spec.sp_degree
        pipeline.forward = self

    @property
    def sp_degree(self) -> int:
        return self.spec.sp_degree

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
                        max_concurrency=2,
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

    # -- one forward: launch on ranks 1..W-1, run rank 0 -------------------------------------
    def launch(self, pack: Pack) -> list[ray.ObjectRef]:
        """Start ranks 1..W-1 on this pack; run ``forward_rank0`` next, on rank 0."""
        if self.broken_reason:
            raise WorkerGroupBroken(self.broken_reason)
        if not self.workers:
            return []
        ref = ray.put(pack)
        return [w.forward.remote(ref) for w in self.workers]

    def forward_rank0(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            out = self.pipeline.denoiser.forward(pack, self.sp)
            assert out is not None  # rank 0 gathers every rank's rows
            return out
        except RuntimeError as e:
            if self.sp is None:
                raise
            # a collective timed out or a peer reset the connection
            self.mark_broken(f"collective failed on rank 0: {e}")
            raise WorkerGroupBroken(self.broken_reason) from e

    def __call__(self, pack: Pack) -> tuple[torch.Tensor, torch.Tensor]:
        """Synchronous forward (the pipeline's); the engine uses launch/forward_rank0 to watch the workers."""
        refs = self.launch(pack)
        out = self.forward_rank0(pack)
        if refs:  # sp=1 never touches Ray
            ray.get(refs)
        return out

    def mark_broken(self, reason: str) -> None:
        if not self.broken_reason:
            self.broken_reason = reason
            logger.error("SP group broken: %s", reason)

    # -- health ---------------------------------------------------------------------------
    def check_health(self, timeout_s: float = 5.0) -> None:
        """Raise WorkerGroupBroken if any rank is gone or the group already failed."""
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
