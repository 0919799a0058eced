"""Attention admission: requirements, backends proven by their code, one selector.

>>> from attention import AttentionRequirements, Platform, resolve
>>> resolve(AttentionRequirements(packed_varlen=True), "auto", Platform.cpu()).backend
'torch_sdpa'
"""

import importlib
from typing import TYPE_CHECKING

from .errors import AdmissionError, AttentionSelectionError, BackendUnavailable, UnknownBackendError
from .platform import DeviceType, Platform
from .requirements import AttentionRequirements
from .resolution import Rejection, Resolution

# Backends, the ranking and the selector import torch (seconds of CPU): imported when one of their names is first
# used, so that a process that only carries a Resolution (the ingress, in its deploy args) starts without torch.
_LAZY = {
    "AttentionBackend": ".backend",
    "Availability": ".backend",
    "overrides": ".backend",
    "AttentionImpl": ".impl",
    "RankedBackend": ".ranking",
    "Ranking": ".ranking",
    "RankingError": ".ranking",
    "BACKENDS": ".registry",
    "backend_names": ".registry",
    "get_backend": ".registry",
    "probe_platform": ".registry",
    "clear_cache": ".selector",
    "parse_dtype": ".selector",
    "resolve": ".selector",
    "selector_calls": ".selector",
}

if TYPE_CHECKING:
    from .backend import AttentionBackend, Availability, overrides
    from .impl import AttentionImpl
    from .ranking import RankedBackend, Ranking, RankingError
    from .registry import BACKENDS, backend_names, get_backend, probe_platform
    from .selector import clear_cache, parse_dtype, resolve, selector_calls


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


__all__ = [
    "AdmissionError",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionRequirements",
    "AttentionSelectionError",
    "Availability",
    "BACKENDS",
    "BackendUnavailable",
    "DeviceType",
    "Platform",
    "RankedBackend",
    "Ranking",
    "RankingError",
    "Rejection",
    "Resolution",
    "UnknownBackendError",
    "backend_names",
    "clear_cache",
    "get_backend",
    "overrides",
    "parse_dtype",
    "probe_platform",
    "resolve",
    "selector_calls",
]
