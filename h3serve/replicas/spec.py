"""What the driver hands every replica: the admitted backend and how to build the model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3serve.attention import Resolution
from h3serve.pipelines.h3 import TransformerGeometry
from h3serve.pipelines.h3.lora_spec import LoraSpecs
from h3serve.pipelines.h3.placement import StagePlacement


class ReplicaSpec(BaseModel):
    """Built once by the driver; every rank builds exactly ``resolution.backend``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    resolution: Resolution
    checkpoint: str | None = Field(
        description="checkpoint directory in the released MiniMax-H3 layout on every "
        "rank's node; None: the built-in tiny checkpoint"
    )
    model_name: str = Field(description="the model id the API serves")
    # the checkpoint's transformer geometry as the driver admitted it; every rank checks its checkpoint against it
    num_heads: int = Field(gt=0, description="attention heads the deployment was admitted for")
    head_dim: int = Field(gt=0, description="head size the deployment was admitted for")
    num_layers: int = Field(gt=0, description="transformer blocks the deployment was admitted for")
    hidden_size: int = Field(gt=0, description="transformer hidden size the deployment was admitted for")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "float32"
    vae_dtype: str | None = None  # both VAEs' (DeployArgs.vae_dtype); None: default_vae_dtype(device)
    sp_degree: int = Field(default=1, ge=1)
    # a collective that waits longer than this on a peer fails instead of hanging
    collective_timeout_s: float = Field(default=60.0, gt=0)
    # each SP rank's resources (DeployArgs.rank_resources); workers use them when reserving their own group
    rank_resources: dict[str, float] = Field(default_factory=lambda: {"CPU": 1.0})
    # LoRA adapters every rank loads onto every transformer partition, each in its slot (DeployArgs.loras)
    loras: LoraSpecs = Field(default_factory=LoraSpecs)
    # where conditioning and decoding run: "local" on rank 0 (it loads the text encoder and both VAEs), "remote"
    # in stage deployments of their own (DeployArgs.stages; rank 0 holds only the transformer partitions)
    stages: StagePlacement = "local"
    # with stages "local" and sp_degree > 1: each clip's video decode is split by whole tiles over every rank of the
    # replica (each worker also holds the video VAE: its bytes more on every worker's device); False: rank 0 alone
    decode_on_ranks: bool = False
    # each rank role's planned device bytes by part (memory.planned_by_role of admission's plan): the warm-up at the
    # row budget is checked against it on every rank (CUDA); None: admitted without a plan (tests, benchmarks)
    memory_plan: dict[str, dict[str, int]] | None = None

    @model_validator(mode="after")
    def _decode_where_the_vae_is(self) -> ReplicaSpec:
        if self.decode_on_ranks and self.stages != "local":
            raise ValueError(
                "decode_on_ranks splits rank 0's own decode: with stages 'remote' the decoder stage decodes"
            )
        return self

    @property
    def geometry(self) -> TransformerGeometry:
        return TransformerGeometry(
            num_heads=self.num_heads, head_dim=self.head_dim, num_layers=self.num_layers, hidden_size=self.hidden_size
        )
