"""The LoRA adapters a deployment declares, and what they ask of a request: torch-free (the ingress checks a
request's steps against its adapter before any replica sees it). Loading and applying them: ``lora``.

A request runs on one adapter or on a *composition*: several adapters, each at its own weight, as diffusers'
``set_adapters(names, weights)`` activates them. Between processes (ingress, job records, replicas) the choice travels
as one string, ``composition_key``: ``"style"`` (one adapter at its deploy-time scale), ``"style@0.8,motion@-0.5"``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
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


class LoraLimits(BaseModel):
    """What one request and one pack may ask of the adapters (deploy args' ``lora_limits``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_per_request: int = Field(
        default=4, ge=1, description="adapters one request may compose (its `lora` list); more: HTTP 400 on `lora`"
    )
    max_rank_per_pack: int | None = Field(
        default=None,
        ge=1,
        description="the sum of the ranks of the distinct adapters one pack runs (each adapter's largest layer rank): "
        "it bounds the deltas' extra activations and GEMMs. A request whose own list is over it is a 400 on `lora`; "
        "requests that fit alone but not together run in separate packs of the same step. null: no bound",
    )

    max_adapter_bytes: int | None = Field(
        default=None,
        ge=0,
        description="bytes every adapter together may hold on one rank (its factors on the device); an adapter "
        "loaded at run time (POST /v1/adapters) past it is refused, and the deploy-time memory plan counts this "
        "budget instead of the declared adapters' bytes when it is larger. null: no run-time bound",
    )


# one adapter of a request: its name and weight (None: the adapter's deploy-time scale)
AdapterUse = tuple[str, float | None]


def composition_key(uses: Sequence[AdapterUse]) -> str | None:
    """The one string a request's adapters travel as (None: the base model); ``parse_composition`` reverses it."""
    if not uses:
        return None
    if len(uses) == 1 and uses[0][1] is None:
        return uses[0][0]
    return ",".join(name if weight is None else f"{name}@{float(weight)!r}" for name, weight in uses)


def parse_composition(key: str | None) -> tuple[AdapterUse, ...]:
    """The adapters of ``composition_key``'s string (a float's repr holds no ',' or '@'); ValueError if malformed."""
    if not key:
        return ()
    uses = []
    for part in key.split(","):
        name, at, weight = part.partition("@")
        uses.append((name, float(weight) if at else None))
    return tuple(uses)


def adapter_names(key: str | None) -> tuple[str | None, ...]:
    """The adapters a request's ``composition_key`` names, for counting by adapter; (None,) for the base model."""
    return tuple(name for name, _ in parse_composition(key)) or (None,)


@dataclasses.dataclass(frozen=True)
class Composition:
    """A request's adapters resolved against a deployment: what its documents run and how it steps."""

    names: tuple[str, ...]  # in the request's order
    uses: tuple[tuple[int, float], ...]  # (slot, weight) of each: the weight is the request's or the spec's scale
    steps: int | None  # the steps it runs (None: the base model's as given)
    shift: float | None  # the video scheduler's shift an adapter was distilled for (None: the released one)


class LoraSpecs(BaseModel):
    """The deploy args' ``loras`` mapping, names checked, and the limits on composing them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    loras: dict[str, LoraSpec] = Field(default_factory=dict)
    limits: LoraLimits = Field(default_factory=LoraLimits)
    # each adapter's slot once adapters come and go at run time (``adding``/``removing``): a slot is never reused while
    # a request may hold it. Empty: declaration order
    assigned: dict[str, int] = Field(default_factory=dict)

    @field_validator("loras")
    @classmethod
    def _names(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        for name in loras:
            validate_lora_name(name)
        return loras

    @property
    def slots(self) -> dict[str, int]:
        """Each adapter's slot, 1, 2, ... in declaration order (0 is the base model): the same on every rank; once
        adapters were added or removed at run time, the slots ``assigned``."""
        if self.assigned:
            return dict(self.assigned)
        return {name: slot for slot, name in enumerate(self.loras, BASE_SLOT + 1)}

    def adding(self, name: str, spec: LoraSpec, slot: int) -> LoraSpecs:
        """These specs with adapter ``name`` in ``slot`` (the caller's fresh one)."""
        validate_lora_name(name)
        if name in self.loras:
            raise LoraError(f"adapter {name!r} is already served")
        return LoraSpecs(loras={**self.loras, name: spec}, limits=self.limits, assigned={**self.slots, name: slot})

    def removing(self, name: str) -> LoraSpecs:
        """These specs without adapter ``name``; the others keep their slots."""
        slots = self.slots
        slots.pop(name)
        return LoraSpecs(loras={n: s for n, s in self.loras.items() if n != name}, limits=self.limits, assigned=slots)

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

    def compose(self, key: str | None, num_inference_steps: int | None, given: bool = True) -> Composition:
        """The request on adapters ``key`` (``composition_key``; None: the base model) with ``num_inference_steps``
        (``given``: the request set them, else they are a default an adapter's own steps replace).

        RequestError on ``lora`` (``model`` for a single adapter named by its model id) for an unknown adapter (naming
        it and the served ones), a repeated one, more than ``limits.max_per_request``, or adapters distilled for
        different steps or shifts; on ``num_inference_steps`` for steps a few-step adapter was not distilled for.
        """
        try:
            uses = parse_composition(key)
        except ValueError:
            raise RequestError("lora", f"malformed adapter list {key!r}") from None
        if not uses:
            return Composition((), (), num_inference_steps, None)
        field = "model" if key is not None and len(uses) == 1 and uses[0][1] is None else "lora"
        names = tuple(name for name, _ in uses)
        if len(uses) > self.limits.max_per_request:
            raise RequestError(
                field, f"{len(uses)} adapters; this deployment composes at most {self.limits.max_per_request}"
            )
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise RequestError(field, f"adapter {repeated[0]!r} is listed more than once")
        for name in names:
            if name not in self.loras:
                served = ", ".join(sorted(self.loras)) or "none"
                raise RequestError(field, f"no adapter {name!r} on this deployment; its adapters: {served}")
        specs = [self.loras[n] for n in names]
        stepped = {n: s for n, s in zip(names, specs, strict=True) if s.steps is not None}
        if len({s.steps for s in stepped.values()}) > 1:
            listed = ", ".join(f"{n!r} {s.steps}" for n, s in stepped.items())
            raise RequestError(field, f"adapters distilled for different step counts cannot compose: {listed}")
        shifts = {n: s.shift for n, s in zip(names, specs, strict=True) if s.shift is not None}
        if len(set(shifts.values())) > 1:
            listed = ", ".join(f"{n!r} {v:g}" for n, v in shifts.items())
            raise RequestError(field, f"adapters distilled for different scheduler shifts cannot compose: {listed}")
        steps = num_inference_steps
        if stepped:
            name, spec = next(iter(stepped.items()))
            steps = check_request_steps(name, spec, num_inference_steps if given else None)
        uses_slots = tuple(
            (self.slots[name], spec.scale if weight is None else weight)
            for (name, weight), spec in zip(uses, specs, strict=True)
        )
        return Composition(names, uses_slots, steps, next(iter(shifts.values()), None))
