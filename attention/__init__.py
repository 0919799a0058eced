"""Attention admission: requirements, backends proven by their code, one selector.

>>> from attention import AttentionRequirements, Platform, resolve
>>> resolve(AttentionRequirements(packed_varlen=True), "auto", Platform.cpu()).backend
'torch_sdpa'
"""

from .backend import AttentionBackend, Availability, overrides
from .errors import AdmissionError, AttentionSelectionError, BackendUnavailable, UnknownBackendError
from .impl import AttentionImpl
from .platform import DeviceType, Platform
from .ranking import RankedBackend, Ranking, RankingError
from .registry import BACKENDS, backend_names, get_backend, probe_platform
from .requirements import AttentionRequirements
from .selector import Rejection, Resolution, clear_cache, parse_dtype, resolve, selector_calls

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
