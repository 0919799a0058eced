"""The SP worker group of one replica: rank 0 is the replica process, ranks 1..W-1 are Ray actors.

The actors are placed in the replica's own placement group (bundle i for rank i), the
way Ray Serve LLM places multi-GPU engines; outside Serve the group reserves one.
torch.distributed runs nccl on CUDA and gloo on CPU, rendezvousing at rank 0.
"""

from __future__ import annotations

import datetime
import logging
import socket

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipelines.h3 import H3Pipeline, load_pipeline
from pipelines.h3.packing import PackedBatch

from .sequence_parallel import UlyssesGroup
from .spec import ReplicaSpec

logger = logging.getLogger(__name__)


class WorkerGroupBroken(RuntimeError):
    """A rank died or a collective failed; the group must be rebuilt (Serve replaces the replica)."""


def build_rank(spec: ReplicaSpec) -> H3Pipeline:
    """Every rank builds exactly the resolved backend; BackendUnavailable if this node cannot run it."""
    return load_pipeline(spec.model, spec.resolution.backend, checkpoint=spec.checkpoint,
                         device=spec.device, dtype=spec.dtype)


def init_distributed(spec: ReplicaSpec, rank: int, master: str, num_heads: int) -> UlyssesGroup:
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
    return UlyssesGroup(spec.sp_degree, rank, num_heads)


def run_rank(pipeline: H3Pipeline, sp: UlyssesGroup, packed: PackedBatch) -> torch.Tensor | None:
    """This rank's share of one packed forward; rank 0 gets every rank's rows back."""
    sp.check_rows(packed.total_rows)
    with torch.no_grad():
        local = pipeline.model.dit(packed.shard(sp.rank, sp.world_size).to(pipeline.device), sp)
    return sp.gather_rows(local)


@ray.remote
class SPWorker:
    """Ranks 1..W-1. Two concurrent calls so ``ping`` answers while ``forward`` runs."""

    def __init__(self, spec_json: str, rank: int):
        self.spec, self.rank = ReplicaSpec.model_validate_json(spec_json), rank
        self.pipeline: H3Pipeline | None = None
        self.sp: UlyssesGroup | None = None

    def build(self) -> str:
        self.pipeline = build_rank(self.spec)
        return ray.util.get_node_ip_address()

    def join(self, master: str) -> None:
        self.sp = init_distributed(self.spec, self.rank, master, self.pipeline.config.num_heads)

    def forward(self, packed: PackedBatch) -> None:
        run_rank(self.pipeline, self.sp, packed)

    def ping(self) -> int:
        return self.rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Rank 0's view of the group: build, launch a step on every rank, check health."""

    def __init__(self, spec: ReplicaSpec, pipeline: H3Pipeline, workers: list, sp: UlyssesGroup | None,
                 own_pg: PlacementGroup | None):
        self.spec, self.pipeline, self.workers, self.sp, self._own_pg = spec, pipeline, workers, sp, own_pg
        self.broken: str | None = None
        pipeline.runner = self  # packs are now aligned for, and run on, the whole group

    @property
    def world_size(self) -> int:
        return self.spec.sp_degree

    @classmethod
    def create(cls, spec: ReplicaSpec, startup_timeout_s: float = 600.0) -> WorkerGroup:
        pipeline = build_rank(spec)  # rank 0 fails closed first, before reserving anything
        if spec.sp_degree == 1:
            return cls(spec, pipeline, [], None, None)
        pg, own_pg, first = cls._placement(spec)
        workers = []
        try:
            for rank in range(1, spec.sp_degree):
                bundle = pg.bundle_specs[first + rank - 1]
                workers.append(SPWorker.options(
                    num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_concurrency=2,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=first + rank - 1),
                ).remote(spec.model_dump_json(), rank))
            # build everywhere before any rendezvous, so BackendUnavailable surfaces at once
            ray.get([w.build.remote() for w in workers], timeout=startup_timeout_s)
            master = f"{ray.util.get_node_ip_address()}:{_free_port()}"
            joins = [w.join.remote(master) for w in workers]
            sp = init_distributed(spec, 0, master, pipeline.config.num_heads)
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
    def _placement(spec: ReplicaSpec) -> tuple[PlacementGroup, PlacementGroup | None, int]:
        """The replica's placement group (rank i -> bundle i), or one reserved for ranks 1..W-1."""
        pg = get_current_placement_group()
        if pg is not None:
            if len(pg.bundle_specs) < spec.sp_degree:
                raise ValueError(f"sp_degree={spec.sp_degree} needs {spec.sp_degree} placement group bundles, "
                                 f"the replica has {len(pg.bundle_specs)}")
            return pg, None, 1
        pg = placement_group([dict(spec.worker_resources)] * (spec.sp_degree - 1), strategy="PACK")
        ray.get(pg.ready(), timeout=120)
        return pg, pg, 0

    # -- one step: launch on ranks 1..W-1, run rank 0 -------------------------------------
    def launch(self, packed: PackedBatch) -> list[ray.ObjectRef]:
        """Start ranks 1..W-1 on this pack; run ``forward_rank0`` next, on rank 0."""
        if self.broken:
            raise WorkerGroupBroken(self.broken)
        if not self.workers:
            return []
        ref = ray.put(packed)
        return [w.forward.remote(ref) for w in self.workers]

    def forward_rank0(self, packed: PackedBatch) -> torch.Tensor:
        if self.sp is None:
            with torch.no_grad():
                return self.pipeline.model.dit(packed.inputs.to(self.pipeline.device))
        try:
            return run_rank(self.pipeline, self.sp, packed)
        except RuntimeError as e:  # a collective timed out or a peer reset the connection
            self.mark_broken(f"collective failed on rank 0: {e}")
            raise WorkerGroupBroken(self.broken) from e

    def __call__(self, packed: PackedBatch) -> torch.Tensor:
        """Synchronous step (the pipeline's DiTRunner); the engine uses launch/forward_rank0."""
        refs = self.launch(packed)
        out = self.forward_rank0(packed)
        if refs:  # sp=1 never touches Ray
            ray.get(refs)
        return out

    def mark_broken(self, reason: str) -> None:
        if not self.broken:
            self.broken = reason
            logger.error("SP group broken: %s", reason)

    # -- health ---------------------------------------------------------------------------
    def check_health(self, timeout_s: float = 5.0) -> None:
        """Raise WorkerGroupBroken if any rank is gone or the group already failed."""
        if self.broken:
            raise WorkerGroupBroken(self.broken)
        if not self.workers:
            return
        pings = {w.ping.remote(): rank for rank, w in enumerate(self.workers, start=1)}
        try:
            ray.get(list(pings), timeout=timeout_s)
        except Exception as e:
            self.mark_broken(f"SP worker did not answer a health check: {type(e).__name__}: {e}")
            raise WorkerGroupBroken(self.broken) from e

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
