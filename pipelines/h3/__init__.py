"""MiniMax-H3 served by h3serve: diffusers' model under a packed multi-request varlen forward (no Ray here)."""

from .admission import DeploymentConfigError, validate_deployment
from .checkpoint import CheckpointError, VisionUnavailable
from .config import PRESETS, H3Preset, TransformerGeometry, default_dtype, preset
from .pipeline import REQUIREMENTS, GeneratedMedia, H3Denoiser, H3Pipeline, RequestState, StepStats
from .request import GenerationRequest, ModelRules, Reference, RequestError

__all__ = [
    "CheckpointError",
    "DeploymentConfigError",
    "GeneratedMedia",
    "GenerationRequest",
    "H3Denoiser",
    "H3Pipeline",
    "H3Preset",
    "ModelRules",
    "PRESETS",
    "REQUIREMENTS",
    "Reference",
    "RequestError",
    "RequestState",
    "StepStats",
    "TransformerGeometry",
    "VisionUnavailable",
    "default_dtype",
    "preset",
    "validate_deployment",
]
