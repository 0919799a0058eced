"""The application builder: the driver. Admission runs here, once, before any replica exists.

    serve run deploy/serve_config.yaml      (import_path: deploy.app:build_app)
"""

import logging

from pydantic import ValidationError
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from attention import Resolution
from replicas import ReplicaSpec

from .admission import ADMISSION_ERRORS, admit
from .api import H3Ingress
from .args import DeployArgs
from .replica import H3Replica

logger = logging.getLogger(__name__)


def replica_spec(args: DeployArgs, resolution: Resolution) -> ReplicaSpec:
    return ReplicaSpec(resolution=resolution, model=args.model, checkpoint=args.checkpoint, device=args.device,
                       dtype=args.dtype, sp_degree=args.sp_degree, collective_timeout_s=args.collective_timeout_s,
                       worker_resources=dict(args.rank_resources))


class DeploymentRefused(RayServeException):
    """Serve retries a builder's ordinary exceptions; a refusal is final, so it reports this at once."""


def build_app(args: DeployArgs) -> Application:
    """Admit, then bind. A refusal raises here: the app goes DEPLOY_FAILED with no H3 replica."""
    try:
        args = DeployArgs.model_validate(args)  # Serve passes a dict when called without its type
        resolution = admit(args, stage="build")
    except (*ADMISSION_ERRORS, ValidationError) as e:
        raise DeploymentRefused(f"h3serve refused the deployment: {type(e).__name__}: {e}") from e
    spec = replica_spec(args, resolution)
    bundles = args.placement_bundles()
    rank0 = bundles[0]
    replica = H3Replica.options(
        # one bundle per SP rank: the replica takes bundle 0, its SP workers the rest
        placement_group_bundles=bundles,
        placement_group_strategy="STRICT_PACK",
        ray_actor_options={"num_cpus": rank0.get("CPU", 0), "num_gpus": rank0.get("GPU", 0)},
        # the engine's bounded queue is the backpressure point (QueueFull -> 503), so Serve must
        # route past it rather than queue in front of it
        max_ongoing_requests=2 * (args.engine.max_queue + args.engine.max_active),
    ).bind(spec.model_dump_json(), args.engine.model_dump())
    return H3Ingress.bind(replica, args.model, args.served_model_name, args.limits.model_dump(), args.api_key_env)
