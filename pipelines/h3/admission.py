"""H3's admission rule, the analogue of sglang's ``validate_server_args``."""

from __future__ import annotations

from attention import Platform, Resolution, parse_dtype, resolve

from .config import TransformerGeometry
from .pipeline import REQUIREMENTS


class DeploymentConfigError(ValueError):
    """Deployment args that can never work for this model, whatever the backend. Names the field."""

    reason = "invalid_config"


def validate_deployment(
    *,
    model: str,
    geometry: TransformerGeometry,
    attention_backend: str,
    platform: Platform,
    device: str,
    dtype: str,
    sp_degree: int = 1,
    ranking: str | None = None,
) -> Resolution:
    """Resolve the transformer's attention backend for ``platform`` and check the SP layout.

    Returns the Resolution that every replica builds with. ``ranking`` is a measured attention
    ranking file for ``auto`` (None: ``$H3SERVE_ATTENTION_RANKING``, else the declared order).
    Raises DeploymentConfigError, or the selector's UnknownBackendError / AdmissionError /
    BackendUnavailable / RankingError.
    """
    try:
        geometry.check_sp_degree(sp_degree)
    except ValueError as e:
        raise DeploymentConfigError(str(e)) from None
    if platform.device_type != device:
        raise DeploymentConfigError(
            f"device={device!r} but the replica platform is {platform.device_type!r} [{platform.describe()}]"
        )
    return resolve(
        REQUIREMENTS,
        attention_backend,
        platform,
        model=model,
        dtype=parse_dtype(dtype),
        head_dim=geometry.head_dim,
        ranking=ranking,
    )
