"""MiniMax-H3 served by h3serve: diffusers' model under a packed multi-request varlen forward (no Ray here)."""

import importlib
from typing import TYPE_CHECKING

from .config import AUTO, PRESETS, H3Preset, TransformerGeometry, default_dtype, default_vae_dtype, preset
from .placement import STAGE_ROLES
from .request import GenerationRequest, ModelRules, Reference, RequestError, VisionUnavailable

# The model's modules import torch and diffusers (seconds of CPU): imported when one of their names is first
# used, so that what needs only the request schema and the presets (the ingress, the CLI) starts without them.
_LAZY = {
    "CheckpointMismatch": ".admission",
    "DeploymentConfigError": ".admission",
    "checkpoint_geometry": ".admission",
    "validate_deployment": ".admission",
    "CheckpointConfigs": ".checkpoint",
    "CheckpointError": ".checkpoint",
    "REQUIREMENTS": ".denoiser",
    "DecodeHandoff": ".handoff",
    "EncodedMedia": ".handoff",
    "GeneratedMedia": ".handoff",
    "H3Denoiser": ".denoiser",
    "H3Pipeline": ".pipeline",
    "H3StageModels": ".stage_models",
    "PreparedState": ".handoff",
    "RequestState": ".request_state",
    "StepStats": ".request_state",
    "checkpoint_rules": ".stage_models",
}

if TYPE_CHECKING:
    from .admission import CheckpointMismatch, DeploymentConfigError, checkpoint_geometry, validate_deployment
    from .checkpoint import CheckpointConfigs, CheckpointError
    from .denoiser import REQUIREMENTS, H3Denoiser
    from .handoff import DecodeHandoff, EncodedMedia, GeneratedMedia, PreparedState
    from .pipeline import H3Pipeline
    from .request_state import RequestState, StepStats
    from .stage_models import H3StageModels, checkpoint_rules


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


__all__ = [
    "AUTO",
    "CheckpointConfigs",
    "CheckpointError",
    "CheckpointMismatch",
    "DecodeHandoff",
    "DeploymentConfigError",
    "EncodedMedia",
    "GeneratedMedia",
    "GenerationRequest",
    "H3Denoiser",
    "H3Pipeline",
    "H3StageModels",
    "H3Preset",
    "ModelRules",
    "PRESETS",
    "PreparedState",
    "REQUIREMENTS",
    "STAGE_ROLES",
    "Reference",
    "RequestError",
    "RequestState",
    "StepStats",
    "TransformerGeometry",
    "VisionUnavailable",
    "checkpoint_geometry",
    "checkpoint_rules",
    "default_dtype",
    "default_vae_dtype",
    "preset",
    "validate_deployment",
]
