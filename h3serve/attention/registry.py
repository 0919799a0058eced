"""Name lookup for backends: case-insensitive, with aliases, and a helpful error."""

from __future__ import annotations

from .backend import AttentionBackend
from .backends import ALL_BACKENDS
from .errors import UnknownBackendError
from .platform import DeviceType, Platform, probe


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in ALL_BACKENDS}
_LOOKUP: dict[str, AttentionBackend] = {}
for _backend in ALL_BACKENDS:
    for _key in (_backend.name, *_backend.aliases):
        _LOOKUP[_normalize(_key)] = _backend


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(BACKENDS))


def get_backend(name: str) -> AttentionBackend:
    """The backend called ``name`` (or an alias of it); raises UnknownBackendError otherwise."""
    if not isinstance(name, str) or _normalize(name) not in _LOOKUP:
        aliases = ", ".join(f"{a}->{b.name}" for b in ALL_BACKENDS for a in b.aliases)
        raise UnknownBackendError(
            f"Unknown attention backend {name!r}. Valid names: auto, {', '.join(backend_names())} (aliases: {aliases})",
            backend=str(name),
        )
    return _LOOKUP[_normalize(name)]


def auto_candidates(device_type: str) -> tuple[AttentionBackend, ...]:
    """Backends auto selection tries on ``device_type``, best first."""
    ranked = [b for b in ALL_BACKENDS if device_type in b.auto_rank]
    return tuple(sorted(ranked, key=lambda b: b.auto_rank[device_type]))


def kernel_libraries() -> tuple[str, ...]:
    return tuple(sorted({b.library for b in ALL_BACKENDS if b.library}))


def probe_platform(device: DeviceType | None = None) -> Platform:
    """Probe this node for every kernel library any backend needs."""
    return probe(device, kernel_libraries())
