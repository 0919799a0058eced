"""Where a replica's per-request stages run, and which stage deployments exist: torch-free names the deploy
args, the replica spec and the metrics share."""

from __future__ import annotations

from typing import Literal

# "local" on rank 0 (it loads the text encoder and both VAEs), "remote" in conditioner and decoder deployments of
# their own (rank 0 holds only the transformer partitions)
StagePlacement = Literal["local", "remote"]
STAGE_PLACEMENTS: tuple[StagePlacement, ...] = ("local", "remote")

STAGE_ROLES = ("conditioner", "decoder")
