"""MiniMax-H3 served by h3serve: diffusers' model under a packed multi-request varlen forward (no Ray here)."""

from .admission import CheckpointMismatch, DeploymentConfigError, checkpoint_geometry, validate_deployment
from .checkpoint import CheckpointConfigs, CheckpointError, VisionUnavailable
from .config import AUTO, PRESETS, H3Preset, TransformerGeometry, default_dtype, preset
from .pipeline import (
    REQUIREMENTS,
    STAGE_ROLES,
    DecodeHandoff,
    EncodedMedia,
    GeneratedMedia,
    H3Denoiser,
    H3Pipeline,
    H3StageModels,
    PreparedState,
    RequestState,
    StepStats,
    checkpoint_rules,
)
from .request import GenerationRequest, ModelRules, Reference, RequestError

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
    "preset",
    "validate_deployment",
]
