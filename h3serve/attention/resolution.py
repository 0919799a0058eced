"""The driver's attention decision as every replica receives it: which backend, chosen how, on what platform,
and what was passed over. Torch-free data, so the deploy args carry it into processes that load no model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from .platform import Platform


class Rejection(BaseModel):
    model_config = ConfigDict(frozen=True)

    backend: str
    kind: Literal["incapable", "unavailable"]
    reason: str


class Resolution(BaseModel):
    """The driver's decision, handed to every replica. JSON-serializable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str
    chosen_by: Literal["explicit", "auto"]
    requested: str
    model: str | None = None
    requirements: dict[str, bool]
    platform: Platform
    dtype: str | None = None
    head_dim: int | None = None
    rejected: tuple[Rejection, ...] = ()
    # auto's candidate order: the backends' declared auto_rank, or a measured ranking that applied
    order: Literal["declared", "measured"] = "declared"
    ranking: str | None = None  # the ranking consulted, or why it was ignored

    def describe(self) -> str:
        why = "explicitly selected" if self.chosen_by == "explicit" else "auto-selected"
        text = f"attention backend {self.backend!r} {why} for model {self.model or '?'} on {self.platform.describe()}"
        if self.ranking:
            text += f"; {self.order} order, ranking {self.ranking}"
        if self.rejected:
            text += "; passed over: " + "; ".join(f"{r.backend} ({r.reason})" for r in self.rejected)
        return text
