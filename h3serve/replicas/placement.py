"""Where a replica's worker ranks run (its placement group) and the ports their rendezvous listens on."""

from __future__ import annotations

import dataclasses
import random
import socket

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .spec import ReplicaSpec


@dataclasses.dataclass
class Placement:
    """Where ranks 1..W-1 run: bundles ``first``.. of ``pg`` (the replica's own, or one this group reserved)."""

    pg: PlacementGroup
    owned: bool  # reserved by this group (outside Serve): removed with it
    first: int  # the bundle of rank 1

    def strategy(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.first + rank - 1)

    def bundle(self, rank: int) -> dict[str, float]:
        return self.pg.bundle_specs[self.first + rank - 1]

    @classmethod
    def reserve(cls, spec: ReplicaSpec, timeout_s: float) -> Placement:
        """The replica's placement group (rank i -> bundle i), or one reserved for ranks 1..W-1."""
        pg = get_current_placement_group()
        if pg is not None:
            if len(pg.bundle_specs) < spec.sp_degree:
                raise ValueError(
                    f"sp_degree={spec.sp_degree} needs {spec.sp_degree} placement group bundles, "
                    f"the replica has {len(pg.bundle_specs)}"
                )
            return cls(pg, False, 1)
        pg = placement_group([dict(spec.rank_resources)] * (spec.sp_degree - 1), strategy="PACK")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except BaseException:
            remove_placement_group(pg)  # never leave a reservation behind
            raise
        return cls(pg, True, 0)

    def release(self) -> None:
        if self.owned:
            remove_placement_group(self.pg)


FREE_PORTS = range(20000, 32768)  # below Linux's ephemeral range (32768-60999), above Ray's worker ports (10002-19999)


def free_port() -> int:
    """A port free now, for a listener started a moment later (a TCPStore, an HTTP server). Not ``bind(0)``: that
    draws from the ephemeral range, where every connection and ``bind(0)`` of the processes starting meanwhile draw
    too, so the port can be gone by the time it is bound (a test run saw it)."""
    for port in random.sample(FREE_PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORTS.start}-{FREE_PORTS.stop - 1}")
