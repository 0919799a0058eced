"""The typed arguments of the application builder, as written under ``args:`` in a serve config."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from attention import Platform
from replicas import EngineLimits


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_queue: int = Field(default=64, ge=1, description="waiting requests per replica; more get HTTP 503")
    max_active: int = Field(default=16, ge=1, description="requests in the running pack")
    max_rows_per_step: int = Field(default=16384, ge=64, description="token budget of one packed forward")

    def limits(self) -> EngineLimits:
        return EngineLimits(max_queue=self.max_queue, max_active=self.max_active,
                            max_rows_per_step=self.max_rows_per_step)


class RequestLimits(BaseModel):
    """What one HTTP request may ask for. Violations are 4xx errors naming the field."""

    model_config = ConfigDict(extra="forbid")

    max_pixels: int = Field(default=512 * 512, ge=1)
    max_frames: int = Field(default=33, ge=1)
    max_seconds: int = Field(default=8, ge=1)
    max_fps: int = Field(default=24, ge=1)
    max_n: int = Field(default=4, ge=1)
    max_steps: int = Field(default=50, ge=1)
    max_prompt_chars: int = Field(default=1000, ge=1)
    max_video_jobs: int = Field(default=256, ge=1, description="stored video jobs; the oldest finished ones are dropped")


class DeployArgs(BaseModel):
    """Everything the driver needs to admit and build one H3 application."""

    model_config = ConfigDict(extra="forbid")

    model: Literal["tiny", "full"] = "tiny"
    checkpoint: str | None = Field(default=None, description="directory of safetensors; tiny has built-in weights")
    attention_backend: str = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="default: float32 on cpu, bfloat16 on cuda")
    sp_degree: int = Field(default=1, ge=1, description="Ulysses ranks per replica, one placement-group bundle each")
    rank_resources: dict[str, float] | None = Field(
        default=None, description="one bundle per SP rank; default {CPU: 1} on cpu, {CPU: 4, GPU: 1} on cuda")

    probe_platform: bool = Field(default=True, description="learn the replica platform with a probe task")
    platform_probe_timeout_s: float = Field(default=600.0, gt=0)
    assumed_platform: Platform | None = Field(
        default=None, description="the replica platform when probe_platform is false; default: bare `device`")

    collective_timeout_s: float = Field(default=60.0, gt=0)
    engine: EngineArgs = EngineArgs()
    limits: RequestLimits = RequestLimits()
    served_model_name: str | None = Field(default=None, description="the id in /v1/models; default h3-<model>")
    api_key_env: str = Field(default="H3SERVE_API_KEY", description="bearer token env var; unset or empty: no auth")

    @model_validator(mode="after")
    def _defaults(self) -> DeployArgs:
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.rank_resources is None:
            self.rank_resources = {"CPU": 4.0, "GPU": 1.0} if self.device == "cuda" else {"CPU": 1.0}
        if self.device == "cuda" and self.rank_resources.get("GPU", 0) < 1:
            raise ValueError(f"rank_resources must hold GPU >= 1 on device cuda, got {self.rank_resources}")
        if self.model != "tiny" and self.checkpoint is None:
            raise ValueError(f"checkpoint is required for model {self.model!r} (only tiny has built-in weights)")
        if self.served_model_name is None:
            self.served_model_name = f"h3-{self.model}"
        return self

    def placement_bundles(self) -> list[dict[str, float]]:
        return [dict(self.rank_resources) for _ in range(self.sp_degree)]
