"""Resolve an explicit or automatic backend choice for a platform, failing closed.

One function, ``resolve``. It never falls back: an explicit choice either
satisfies the requirements on the platform or raises. ``auto`` tries the candidates in
declared ``auto_rank`` order, or in a measured order when a ranking applies (see .ranking).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import overload

import torch

from .backend import AttentionBackend
from .errors import AdmissionError, BackendUnavailable
from .platform import Platform
from .ranking import Ranking, configured, order
from .registry import auto_candidates, backend_names, get_backend, probe_platform
from .requirements import AttentionRequirements
from .resolution import Rejection, Resolution

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@overload
def parse_dtype(dtype: None) -> None: ...
@overload
def parse_dtype(dtype: torch.dtype | str) -> torch.dtype: ...
def parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.")
    key = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[key]


def clear_cache() -> None:
    _resolve_cached.cache_clear()


def selector_calls() -> int:
    """How often ``resolve`` ran in this process: a replica must report zero (it never re-resolves)."""
    info = _resolve_cached.cache_info()
    return info.hits + info.misses


def _missing(backend: AttentionBackend, requirements: AttentionRequirements) -> str:
    return ", ".join(AttentionRequirements.describe(r) for r in backend.unsupported_requirements(requirements))


def _capable_names(requirements: AttentionRequirements) -> str:
    return ", ".join(n for n in backend_names() if not get_backend(n).unsupported_requirements(requirements))


def _judge(backend, requirements, platform, dtype, head_dim) -> Rejection | None:
    if backend.unsupported_requirements(requirements):
        return Rejection(
            backend=backend.name, kind="incapable", reason=f"does not implement {_missing(backend, requirements)}"
        )
    available = backend.availability(platform, dtype=dtype, head_dim=head_dim)
    if not available:
        return Rejection(backend=backend.name, kind="unavailable", reason=available.reason)
    return None


def resolve(
    requirements: AttentionRequirements,
    selected: str = "auto",
    platform: Platform | None = None,
    model: str | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    head_dim: int | None = None,
    ranking: Ranking | str | os.PathLike | None = None,
) -> Resolution:
    """Choose the attention backend for ``model`` on ``platform`` (probed here if None).

    ``ranking`` (a Ranking or a file path; None: ``$H3SERVE_ATTENTION_RANKING`` if set) orders
    auto's candidates when it matches the platform; an explicit choice ignores it.

    Raises UnknownBackendError (a ValueError) for a bad name, AdmissionError when the
    backend cannot meet the requirements (or auto finds none), BackendUnavailable when
    an explicitly chosen, capable backend cannot run on the platform; RankingError (a ValueError)
    for a ranking file that cannot be read.
    """
    platform = platform if platform is not None else probe_platform()
    explicit = selected.strip().lower() != "auto"
    measured = None if explicit else configured(ranking)  # the file's content, not its path, is in the key
    return _resolve_cached(
        requirements,
        selected.strip().lower(),
        platform.model_dump_json(),
        model,
        parse_dtype(dtype),
        head_dim,
        measured,
    )


@functools.lru_cache(maxsize=256)
def _resolve_cached(requirements, selected, platform_json, model, dtype, head_dim, measured) -> Resolution:
    """One decision per distinct question (the platform travels as JSON: it holds a dict, so no hash)."""
    resolution = _resolve(
        requirements,
        selected,
        Platform.model_validate_json(platform_json),
        model,
        dtype,
        head_dim,
        selected != "auto",
        measured,
    )
    logger.info("h3serve admission: %s", resolution.describe())
    return resolution


def _resolve(requirements, selected, platform, model, dtype, head_dim, explicit, measured) -> Resolution:
    for_model = f" for model {model!r}" if model else ""
    common = dict(
        requested=selected,
        model=model,
        requirements=requirements.to_dict(),
        platform=platform,
        dtype=str(dtype).removeprefix("torch.") if dtype else None,
        head_dim=head_dim,
    )
    if explicit:
        backend = get_backend(selected)
        rejection = _judge(backend, requirements, platform, dtype, head_dim)
        if rejection is not None and rejection.kind == "incapable":
            requires = f", which model {model!r} requires" if model else ""
            raise AdmissionError(
                f"Attention backend {backend.name!r} {rejection.reason}{requires}. "
                f"Choose one that does: {_capable_names(requirements)} (or 'auto').",
                backend=backend.name,
                model=model,
                missing=backend.unsupported_requirements(requirements),
            )
        if rejection is not None:
            raise BackendUnavailable(
                f"Attention backend {backend.name!r} cannot run{for_model} on the target platform "
                f"[{platform.describe()}]: {rejection.reason}.",
                backend=backend.name,
                model=model,
            )
        return Resolution(backend=backend.name, chosen_by="explicit", **common)

    candidates = auto_candidates(platform.device_type)
    if measured is not None:
        mismatch = measured.mismatch(platform, dtype, head_dim)
        common["ranking"] = f"ignored: {mismatch}" if mismatch else measured.describe()
        if not mismatch:
            candidates, common["order"] = order(candidates, measured), "measured"
    rejected: list[Rejection] = []
    for backend in candidates:
        rejection = _judge(backend, requirements, platform, dtype, head_dim)
        if rejection is None:
            return Resolution(backend=backend.name, chosen_by="auto", rejected=tuple(rejected), **common)
        rejected.append(rejection)
    listing = "; ".join(f"{r.backend}: {r.kind}, {r.reason}" for r in rejected) or "no candidates for this device"
    raise AdmissionError(
        f"No attention backend can serve{for_model} on [{platform.describe()}]: {listing}.",
        backend="auto",
        model=model,
        reason="no_candidate",
    )
