"""The LoRA adapters a deployment declares, and what they ask of a request: torch-free (the ingress checks a
request's steps against its adapter before any replica sees it). Loading and applying them: ``lora``."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .request import RequestError

BASE_SLOT = 0  # rows of documents served by the base model
_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


class LoraError(ValueError):
    """An adapter that cannot be served with this transformer. The message names the directory and keys."""

    reason = "lora"  # the admission-failure metric's reason label


class LoraSpec(BaseModel):
    """One adapter as the deploy args declare it: ``loras: {name: {path, scale, steps, shift}}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: Path = Field(description="local directory holding the adapter in diffusers' LoRA format for MiniMax-H3")
    scale: float = Field(default=1.0, allow_inf_nan=False, description="multiplies every delta B(A x)")
    steps: int | None = Field(default=None, ge=1, description="the step count a few-step adapter was distilled for")
    shift: float | None = Field(
        default=None, gt=0, allow_inf_nan=False, description="the scheduler shift the adapter was distilled for"
    )


def asked_steps(spec: LoraSpec | None, num_inference_steps: int | None, given: bool) -> int | None:
    """The steps a request asks of adapter ``spec`` (None: the base model): what it set, or None (the adapter's
    own) when it set none and the adapter declares some; on an adapter without steps, the request's default."""
    return num_inference_steps if given or spec is None or spec.steps is None else None


def check_request_steps(name: str, spec: LoraSpec, num_inference_steps: int | None) -> int:
    """The steps a request on adapter ``name`` runs: the adapter's own when it gives none, else the same.

    A few-step adapter produces noise at other step counts, so a request asking for others is refused
    (``RequestError`` on ``num_inference_steps``, naming both counts), never silently run.
    """
    if num_inference_steps is None:
        if spec.steps is None:
            raise RequestError("num_inference_steps", f"adapter {name!r} declares no steps; give num_inference_steps")
        return spec.steps
    if spec.steps is not None and num_inference_steps != spec.steps:
        raise RequestError(
            "num_inference_steps",
            f"adapter {name!r} was distilled for {spec.steps} steps; the request asks for {num_inference_steps}",
        )
    return num_inference_steps


def validate_lora_name(name: str) -> str:
    """An adapter name becomes part of a model id and a metric label: short, lowercase, no separators."""
    if not _NAME.fullmatch(name):
        raise LoraError(
            f"adapter name {name!r} is not allowed: use 1-63 characters of a-z, 0-9, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


class LoraSpecs(BaseModel):
    """The deploy args' ``loras`` mapping, names checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loras: dict[str, LoraSpec] = Field(default_factory=dict)

    @field_validator("loras")
    @classmethod
    def _names(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        for name in loras:
            validate_lora_name(name)
        return loras

    @property
    def slots(self) -> dict[str, int]:
        """Each adapter's slot, 1, 2, ... in declaration order (0 is the base model): the same on every rank."""
        return {name: slot for slot, name in enumerate(self.loras, BASE_SLOT + 1)}

    def resolve(self, name: str | None, num_inference_steps: int | None) -> tuple[int, LoraSpec | None, int | None]:
        """(slot, spec, steps) of a request on adapter ``name`` (None: the base model, steps as given).

        RequestError("model") for a name this deployment does not serve, RequestError("num_inference_steps")
        when the request's steps are not the adapter's (``check_request_steps``).
        """
        if name is None:
            return BASE_SLOT, None, num_inference_steps
        if name not in self.loras:
            served = ", ".join(sorted(self.loras)) or "none"
            raise RequestError("model", f"no adapter {name!r} on this deployment; its adapters: {served}")
        spec = self.loras[name]
        return self.slots[name], spec, check_request_steps(name, spec, num_inference_steps)
