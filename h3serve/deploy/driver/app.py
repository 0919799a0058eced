"""The application builder: the driver. Admission runs here, once, before any replica exists.

serve run h3serve/deploy/serve_config.yaml      (import_path: h3serve.deploy.driver.app:build_app)
"""

import logging

from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.driver.preflight import ADMISSION_ERRORS, DRIVER, Admission, admit
from h3serve.deploy.ingress.routes import H3Ingress, ingress_options
from h3serve.deploy.model_server.h3_replica import H3Replica
from h3serve.deploy.model_server.stage_deployments import H3Conditioner, H3Decoder
from h3serve.pipelines.h3 import ModelRules, checkpoint_rules

logger = logging.getLogger(__name__)


class DeploymentRefused(RayServeException):
    """Serve retries a builder's ordinary exceptions; a refusal is final, so it reports this at once."""


def build_app(args: DeployArgs) -> Application:
    """Admit, then bind. A refusal raises here: the app goes DEPLOY_FAILED with no H3 replica."""
    try:
        args = DeployArgs.model_validate(args)  # Serve passes a dict when called without its type
        admission = admit(args, stage="build")
    except (*ADMISSION_ERRORS, ValidationError) as e:
        raise DeploymentRefused(f"h3serve refused the deployment: {type(e).__name__}: {e}") from e
    replica = serve.deployment(H3Replica, **H3Replica.deployment_options(args))
    stages = []  # with args.stages: the conditioner and decoder deployments, shared by every H3Replica
    for role, stage in ((H3Conditioner.role, H3Conditioner), (H3Decoder.role, H3Decoder)):
        if role in args.stage_deployments():
            deployment = serve.deployment(stage, **stage.deployment_options(args))
            fanout = (args.stages.decode_split(),) if role == H3Decoder.role and args.stages is not None else ()
            stages.append(deployment.bind(args.checkpoint, args.device, args.dtype, args.vae_dtype, *fanout))
    spec = args.replica_spec(admission.resolution, admission.geometry, admission.plan)
    replica = replica.bind(spec, args.engine, *stages, jobs=args.jobs)  # its run-time adapters' registry
    # sized from the engine's bounds and ingress.h3_replicas, so polls and /health never wait behind generations
    ingress = H3Ingress.options(**ingress_options(args))  # type: ignore[attr-defined]  # a Serve deployment
    return ingress.bind(replica, args, cold_start_rules(args, admission))


def cold_start_rules(args: DeployArgs, admission: Admission) -> ModelRules | None:
    """The checkpoint's model rules for an ingress whose H3 replicas scale to zero (it accepts video jobs while none
    runs), read here from the configs where the driver holds the checkpoint; None otherwise (the ingress asks the
    first replica, and a video job sent while none runs waits for it to load)."""
    if args.autoscaling is None or args.autoscaling.min_replicas > 0:
        return None
    if admission.checkpoint is None or admission.checkpoint.read_on != DRIVER:
        logger.warning("the driver cannot read the checkpoint: video jobs sent while no replica runs wait for one")
        return None
    return checkpoint_rules(admission.checkpoint.directory)
