"""The H3 joint video+audio DiT pipeline (no Ray here)."""

from .admission import DeploymentConfigError, validate_deployment
from .config import PRESETS, H3Config, preset
from .pipeline import REQUIREMENTS, GeneratedMedia, H3Pipeline, load_pipeline
from .request import GenerationRequest, RequestError, RequestState, video_frames

__all__ = [
    "DeploymentConfigError",
    "GeneratedMedia",
    "GenerationRequest",
    "H3Config",
    "H3Pipeline",
    "PRESETS",
    "REQUIREMENTS",
    "RequestError",
    "RequestState",
    "load_pipeline",
    "preset",
    "validate_deployment",
    "video_frames",
]
