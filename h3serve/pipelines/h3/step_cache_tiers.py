"""The step-cache tiers a deployment offers and a request names (``cache``): torch-free, so the deploy args and
the ingress hold them without torch. How a policy skips blocks inside a pack: ``step_cache``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .request import RequestError

OFF = "off"  # the request's ``cache`` value that turns caching off


class StepCachePolicy(BaseModel):
    """How one request caches its steps (one tier of ``engine.step_cache``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = Field(
        ge=0,
        description="skip the middle blocks when the relative L1 change of the first-blocks residual since the "
        "last computed step is at or under this; 0 never skips",
    )
    fn_blocks: int = Field(default=1, ge=1, description="first blocks that always run; their residual decides")
    bn_blocks: int = Field(default=0, ge=0, description="last blocks that always run (DBCache's Bn)")
    warmup_steps: int = Field(default=2, ge=1, description="first steps of a request that never skip")
    max_consecutive_skips: int = Field(
        default=3, ge=0, description="after this many skipped steps in a row the next one computes"
    )

    def check_blocks(self, num_blocks: int) -> None:
        """ValueError unless at least one middle block is left to skip among ``num_blocks``."""
        if self.fn_blocks + self.bn_blocks >= num_blocks:
            raise ValueError(
                f"fn_blocks={self.fn_blocks} + bn_blocks={self.bn_blocks} leave no block to skip "
                f"in a transformer of {num_blocks} blocks"
            )


# Built-in tiers (First-Block-Cache's F1B0 with rising thresholds): measured by benchmarks/step_cache.py.
BUILTIN_TIERS: dict[str, StepCachePolicy] = {
    "high": StepCachePolicy(threshold=0.05, warmup_steps=4, max_consecutive_skips=2),
    "medium": StepCachePolicy(threshold=0.12, warmup_steps=3, max_consecutive_skips=3),
    "low": StepCachePolicy(threshold=0.25, warmup_steps=2, max_consecutive_skips=5),
}


class StepCacheTiers(BaseModel):
    """The step-cache tiers a deployment offers; a request names one in its ``cache`` field (or ``off``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: str = Field(default=OFF, description="the tier of a request that names none: 'off' or a tier name")
    tiers: dict[str, StepCachePolicy] = Field(
        default_factory=lambda: dict(BUILTIN_TIERS),
        description="named policies a request may ask for with `cache`: threshold (relative L1 of the "
        "first-blocks residual), fn_blocks, bn_blocks, warmup_steps, max_consecutive_skips",
    )

    @model_validator(mode="after")
    def _names(self) -> StepCacheTiers:
        if OFF in self.tiers:
            raise ValueError(f"{OFF!r} is not a tier name: it means no caching")
        if self.default != OFF and self.default not in self.tiers:
            raise ValueError(f"default {self.default!r} is not 'off' or one of the tiers {sorted(self.tiers)}")
        return self

    @property
    def names(self) -> list[str]:
        """Every value a request's ``cache`` field may take."""
        return [OFF, *sorted(self.tiers)]

    def policy(self, name: str | None) -> StepCachePolicy | None:
        """The policy of ``name`` (None: the default); None for off; RequestError("cache") naming the allowed."""
        name = self.default if name is None else name
        if name == OFF:
            return None
        if name not in self.tiers:
            raise RequestError("cache", f"cache must be one of {', '.join(self.names)}, got {name!r}")
        return self.tiers[name]
