"""Measured auto order: backends ranked by time on one platform, written by ``h3serve rank-attention``.

``h3serve rank-attention --out PATH`` (``.measure``; also ``benchmarks.gpu_kernels --ranking-out``) checks and
times every backend's ``forward_varlen`` and writes the ones that ran correctly, fastest first, with the platform
it measured on.
``resolve(requirements, "auto", ...)`` takes its order from a ranking found this way:

1. ``resolve(..., ranking=PATH or Ranking)`` when the caller passes one;
2. otherwise the file named by the environment variable ``H3SERVE_ATTENTION_RANKING``, read in each
   process that resolves: the ``h3serve serve``/``admit`` pre-flight and the Serve application builder
   (give the builder the variable through the serve config's runtime_env, and the file on its node);
3. otherwise none: the backends' declared ``auto_rank`` order.

A ranking applies when its ``device_name`` and ``torch_version`` equal the platform's, and its
``compute_capability``, ``dtype`` and ``head_dim`` too where both sides state them; otherwise it is
ignored and the Resolution says so. It only orders: auto still judges every candidate and takes
the first capable and available one. Names that are unknown, or not auto candidates on the
device (sage_attn is opt-in), are skipped; candidates it does not name follow in declared order.
A file that cannot be read or parsed raises RankingError: a configured ranking that is wrong is a
deployment mistake to report, not a reason to guess.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from .backend import AttentionBackend
from .errors import AttentionSelectionError, UnknownBackendError
from .platform import Platform
from .registry import get_backend

ENV_VAR = "H3SERVE_ATTENTION_RANKING"


class RankingError(AttentionSelectionError, ValueError):
    """The ranking file is missing or malformed (admission refuses, with a metric reason)."""

    reason = "bad_ranking"


class RankedBackend(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    ms: float  # geometric mean over the cases every ranked backend ran


class Ranking(BaseModel):
    """One platform's measured order. JSON round-trips; ``backends`` is fastest first."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_name: str
    compute_capability: tuple[int, int] | None = None
    torch_version: str
    dtype: str | None = None
    head_dim: int | None = None
    backends: tuple[RankedBackend, ...]
    measured: str = ""  # what was timed, for people

    def mismatch(self, platform: Platform, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
        """Why this ranking does not apply to ``platform`` ("" when it does)."""
        dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else None
        for what, mine, theirs in (
            ("device", self.device_name, platform.device_name),
            ("torch", self.torch_version, platform.torch_version),
            ("compute capability", self.compute_capability, platform.compute_capability),
            ("dtype", self.dtype, dtype_name),
            ("head_dim", self.head_dim, head_dim),
        ):
            stated = what in ("device", "torch") or (mine is not None and theirs is not None)
            if stated and mine != theirs:
                return f"measured on {what} {mine!r}, not {theirs!r}"
        return ""

    @classmethod
    def from_times(
        cls,
        platform: Platform,
        times: Mapping[object, Mapping[str, float]],
        *,
        dtype: torch.dtype | None = None,
        head_dim: int | None = None,
        measured: str = "",
    ) -> Ranking | None:
        """Rank by geometric-mean ms over the packs that every backend in ``times`` ran.

        ``times`` maps a pack to {backend: ms}; pass only backends that ran correctly. A pack
        some backend lacks (skipped, cut by a budget) is not compared. None if nothing compares.
        """
        names = sorted({n for per_pack in times.values() for n in per_pack})
        packs = [t for t in times.values() if all(n in t for n in names)]
        if not names or not packs:
            return None
        gmean = {n: math.exp(sum(math.log(t[n]) for t in packs) / len(packs)) for n in names}
        return cls(
            device_name=platform.device_name,
            compute_capability=platform.compute_capability,
            torch_version=platform.torch_version,
            dtype=str(dtype).removeprefix("torch.") if dtype else None,
            head_dim=head_dim,
            backends=tuple(RankedBackend(name=n, ms=gmean[n]) for n in sorted(names, key=lambda n: gmean[n])),
            measured="; ".join(x for x in (measured, f"geometric mean over {len(packs)} packs") if x),
        )

    def describe(self) -> str:
        sm = f" sm{self.compute_capability[0]}{self.compute_capability[1]}" if self.compute_capability else ""
        on = [
            f"{self.device_name}{sm}",
            f"torch {self.torch_version}",
            self.dtype,
            self.head_dim and f"head_dim {self.head_dim}",
        ]
        order = " > ".join(b.name for b in self.backends) or "empty"
        return f"{order} (measured on {', '.join(x for x in on if x)})"


def save(ranking: Ranking, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(ranking.model_dump_json(indent=1) + "\n")
    return path


_loaded: dict[tuple, Ranking] = {}


def load(path: str | os.PathLike) -> Ranking:
    """Read a ranking file; re-read only when its mtime or size changes."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in _loaded:
            _loaded.clear()  # one file is in use at a time
            _loaded[key] = Ranking.model_validate_json(path.read_text())
        return _loaded[key]
    except (OSError, ValidationError) as e:
        raise RankingError(f"cannot read attention ranking {str(path)!r}: {e}") from e


def configured(ranking: Ranking | str | os.PathLike | None) -> Ranking | None:
    """The ranking ``resolve`` uses: the argument, else ``$H3SERVE_ATTENTION_RANKING``, else None."""
    if isinstance(ranking, Ranking):
        return ranking
    if ranking is None:
        ranking = os.environ.get(ENV_VAR) or None
    return None if ranking is None else load(ranking)


def order(candidates: Sequence[AttentionBackend], ranking: Ranking) -> tuple[AttentionBackend, ...]:
    """``candidates`` (declared order) reordered: ranked ones first, in ranking order, then the rest."""
    ranked = []
    for entry in ranking.backends:
        try:
            backend = get_backend(entry.name)
        except UnknownBackendError:
            continue  # measured by a newer build, or a typo: never selected
        if backend in candidates and backend not in ranked:
            ranked.append(backend)
    return tuple(ranked) + tuple(b for b in candidates if b not in ranked)
