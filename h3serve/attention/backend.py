"""A backend: a name, an impl class, and what it can do, derived from its code."""

from __future__ import annotations

import dataclasses
import inspect
from typing import ClassVar

import torch

from .impl import AttentionImpl
from .platform import Platform
from .requirements import AttentionRequirements


@dataclasses.dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a platform now, and if not, every reason why."""

    reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def __bool__(self) -> bool:
        return self.ok


def _underlying_function(attr: object) -> object:
    """The plain function behind a descriptor or a functools.wraps chain."""
    if isinstance(attr, (staticmethod, classmethod)):
        attr = attr.__func__
    return inspect.unwrap(attr) if callable(attr) else attr


def overrides(impl_cls: type, method: str, base: type = AttentionImpl) -> bool:
    """True when ``impl_cls`` provides its own ``method`` rather than ``base``'s.

    Resolves the attribute through the MRO without binding, then unwraps
    ``functools.wraps`` chains, so an alias (``forward_varlen = _packed``) or a
    decorated override counts, while a wrapper around the base method does not.
    """
    if not (isinstance(impl_cls, type) and issubclass(impl_cls, base)):
        raise TypeError(f"{impl_cls!r} is not a subclass of {base.__name__}")
    mine = _underlying_function(inspect.getattr_static(impl_cls, method))
    theirs = _underlying_function(inspect.getattr_static(base, method))
    return mine is not theirs


class AttentionBackend:
    """Base class of backends. A subclass sets ``name`` and ``impl_cls``.

    Capabilities are methods named ``supports_<requirement>``; a requirement with
    no such method is unsupported. ``availability`` answers the runtime question.
    """

    name: ClassVar[str]
    impl_cls: ClassVar[type[AttentionImpl]]
    aliases: ClassVar[tuple[str, ...]] = ()
    # module that must import on the node for this backend to run (None: torch only)
    library: ClassVar[str | None] = None
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    max_head_dim: ClassVar[int | None] = None
    min_compute_capability: ClassVar[tuple[int, int] | None] = None
    # device type -> position in auto selection (lower first); absent: never auto-selected
    auto_rank: ClassVar[dict[str, int]] = {}

    # -- capability: static, from the impl's code ---------------------------------
    def supports_packed_varlen(self) -> bool:
        return overrides(self.impl_cls, "forward_varlen")

    def supports(self, requirement: str) -> bool:
        check = getattr(self, f"supports_{requirement}", None)
        return bool(check()) if check is not None else False

    def unsupported_requirements(self, requirements: AttentionRequirements) -> tuple[str, ...]:
        return tuple(r for r in requirements.required() if not self.supports(r))

    # -- availability: runtime, on a platform -------------------------------------
    def availability(
        self,
        platform: Platform,
        *,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
    ) -> Availability:
        reasons = []
        if platform.device_type not in self.devices:
            reasons.append(f"{self.name} runs on {'/'.join(self.devices)}, not {platform.device_type}")
        if self.library is not None and not platform.has_library(self.library):
            reasons.append(f"{self.name} needs {self.library!r}, which is not installed on this node")
        if self.min_compute_capability is not None and platform.device_type == "cuda":
            cc = platform.compute_capability
            if cc is None or tuple(cc) < self.min_compute_capability:
                need = "{}.{}".format(*self.min_compute_capability)
                reasons.append(f"{self.name} needs CUDA compute capability >= {need}, the node has {cc}")
        if dtype is not None and dtype not in self.dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"{self.name} supports dtypes {allowed}, not {str(dtype).removeprefix('torch.')}")
        if head_dim is not None and self.max_head_dim is not None and head_dim > self.max_head_dim:
            reasons.append(f"{self.name} supports head_dim <= {self.max_head_dim}, not {head_dim}")
        return Availability(tuple(reasons))

    def make_impl(self, softmax_scale: float | None = None) -> AttentionImpl:
        return self.impl_cls(softmax_scale=softmax_scale)

    def __repr__(self) -> str:
        return f"<AttentionBackend {self.name}>"
