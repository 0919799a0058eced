"""The driver's one admission check: learn the replica platform and the checkpoint, run H3's rule, count the outcome."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import ray

from h3serve.attention import AttentionSelectionError, Platform, Resolution
from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.common.metrics import RECORD_TIMEOUT_S, admission_recorder
from h3serve.deploy.driver.probe import PlatformProbeError, probe_replica
from h3serve.pipelines.h3 import (
    AUTO,
    CheckpointConfigs,
    CheckpointError,
    CheckpointMismatch,
    DeploymentConfigError,
    TransformerGeometry,
    checkpoint_geometry,
    preset,
    validate_deployment,
)
from h3serve.pipelines.h3.admission import check_memory
from h3serve.pipelines.h3.checkpoint import resolve_checkpoint
from h3serve.pipelines.h3.lora import AdapterFootprint, LoraError, check_adapters
from h3serve.pipelines.h3.memory import DEFAULT_RESERVE_BYTES, MemoryPlan, checkpoint_partitions, gib, memory_plan

logger = logging.getLogger(__name__)


DRIVER = "the driver"  # CheckpointConfigs.read_on when the driver read them


def read_checkpoint_here(args: DeployArgs) -> CheckpointConfigs | None:
    """The checkpoint's configs as the driver reads them; None when the directory is not on this node (a volume
    mounted on GPU nodes only). A directory that is here but cannot be served is refused (reason "checkpoint")."""
    try:
        directory = resolve_checkpoint(args.checkpoint)
        if not directory.exists():
            return None
        return CheckpointConfigs.read(directory, DRIVER)
    except (CheckpointError, OSError) as e:
        raise CheckpointMismatch(f"checkpoint {args.checkpoint or 'the built-in tiny'}: {e}") from None


def target(args: DeployArgs) -> tuple[Platform, CheckpointConfigs | None]:
    """The replicas' platform and the checkpoint's configs: read by the driver where it holds the directory, else by
    the probe on a replica node (refused when neither can). Without a probe, None where the driver cannot read it."""
    here = read_checkpoint_here(args)
    if not args.probe_platform:
        # Without a probe nothing is assumed installed unless the args say so: fail closed.
        return args.assumed_platform or Platform(device_type=args.device, source="assumed"), here
    report = probe_replica(args, read_checkpoint=here is None)
    if here is None and report.checkpoint is None:
        raise CheckpointMismatch(
            f"checkpoint {args.checkpoint} is not readable on the driver nor on {report.node}: "
            f"{report.checkpoint_error}"
        )
    return report.platform, here or report.checkpoint


def admitted_geometry(args: DeployArgs, checkpoint: CheckpointConfigs | None) -> TransformerGeometry:
    """The checkpoint's geometry, checked against ``args.model`` (``checkpoint_geometry``). Unread (not on this node,
    and no probe read it): a preset's geometry, which every replica checks its checkpoint against; ``auto`` has
    none to fall back on and is refused."""
    if checkpoint is not None:
        geometry = checkpoint_geometry(args.model, checkpoint)
    elif args.model == AUTO:
        raise CheckpointMismatch(
            f"model={AUTO!r} serves the checkpoint's own architecture, but checkpoint {args.checkpoint} is not "
            "readable here and no platform probe read it on a replica node: run admission where the directory is "
            "(h3serve admit on a replica node, or probe_platform: true), or set model to its architecture"
        )
    else:
        geometry = preset(args.model).geometry()
        logger.warning(
            "h3serve admission: checkpoint %s is not readable here: admitted for model %r's geometry (%s), which "
            "every replica checks its checkpoint against",
            args.checkpoint,
            args.model,
            geometry.describe(),
        )
    try:
        args.check_step_cache(geometry.num_layers)
    except ValueError as e:
        raise DeploymentConfigError(str(e)) from None
    return geometry


def deployment_memory_plan(
    args: DeployArgs,
    adapters: dict[str, AdapterFootprint] | None = None,
    checkpoint: CheckpointConfigs | None = None,
) -> MemoryPlan:
    """Each rank role's device memory for these args: weights (LoRA adapters included), a full pack's activations
    (with step caches when a tier is offered; prompt rows bounded by ``engine.max_text_rows_per_step``), the
    prepared requests' own tensors on rank 0, the reserve. ``adapters``: ``check_loras``'s, else checked here.
    ``checkpoint``: its configs as admission read them, else read here where readable (else the preset's dims).
    With ``args.stages``, rank 0 holds only the transformer partitions and the plan adds the conditioner's and the
    decoder's roles (checked against the replicas' platform: the args give the stages none of their own)."""
    checkpoint = checkpoint or read_checkpoint_here(args)
    adapters = check_loras(args, checkpoint) if adapters is None else adapters
    return memory_plan(
        model=args.model,
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        sp_degree=args.sp_degree,
        max_rows=args.engine.max_rows_per_step,
        # the reserve is the CUDA context, workspaces and the caching allocator's slack: none of it on CPU
        reserve_bytes=DEFAULT_RESERVE_BYTES if args.device == "cuda" else 0,
        adapters=_adapter_bytes(args, adapters),
        step_cache=bool(args.engine.step_cache.tiers),
        stages="remote" if args.stages is not None else "local",
        configs=checkpoint,
        text_rows=args.engine.max_text_rows_per_step,
        requests=args.engine.max_active + args.engine.max_prepared,  # prepared states held at once
        steps=args.limits.max_steps,
        late_decisions=len({policy.fn_blocks for policy in args.engine.step_cache.tiers.values()}) > 1,
        vae_dtype=args.vae_dtype,  # bf16 on GPUs as released: counted at it, not fp32
        decode_on_ranks=args.decode_on_ranks,
    )


def transformer_configs(args: DeployArgs, checkpoint: CheckpointConfigs | None = None) -> dict[str, dict[str, Any]]:
    """Each transformer partition's config as the replicas will build it: the checkpoint's, else the preset's (a
    checkpoint admission could not read; the replicas check it against the admitted geometry)."""
    if checkpoint is not None:
        return {partition: checkpoint.transformer(partition) for partition in checkpoint.partitions}
    partitions, _ = checkpoint_partitions(args.checkpoint)
    return {partition: preset(args.model).transformer_config() for partition in partitions}


def check_loras(args: DeployArgs, checkpoint: CheckpointConfigs | None = None) -> dict[str, AdapterFootprint]:
    """Every adapter of ``args.loras`` against the served transformer's modules (meta device, no weights)."""
    if not args.loras:
        return {}
    return check_adapters(args.lora_specs, transformer_configs(args, checkpoint), args.dtype)


def _adapter_bytes(args: DeployArgs, adapters: dict[str, AdapterFootprint]) -> dict[str, int]:
    """The plan's adapter lines: the declared adapters' bytes, or the run-time budget (``lora_limits``'s
    ``max_adapter_bytes``) when it is larger: adapters loaded at run time must fit the plan too."""
    declared = {name: footprint.bytes for name, footprint in adapters.items()}
    budget = args.lora_limits.max_adapter_bytes
    if budget is not None and budget > sum(declared.values()):
        return {"adapters (lora_limits.max_adapter_bytes)": budget}
    return declared


def describe_adapters(args: DeployArgs, adapters: dict[str, AdapterFootprint]) -> str:
    return (
        ", ".join(
            f"{args.served_model_name}:{name} ({footprint.layers} layers, {gib(footprint.bytes)} a rank)"
            for name, footprint in adapters.items()
        )
        or "no adapters"
    )


def outcome_tags(
    args: DeployArgs, stage: str, resolution: Resolution | None = None, error: Exception | None = None
) -> dict[str, str]:
    requested = args.attention_backend.strip().lower()
    return {
        "model": args.served_model_name,
        "backend": resolution.backend if resolution else (getattr(error, "backend", None) or requested),
        "chosen_by": "auto" if requested == "auto" else "explicit",
        "outcome": "admitted" if error is None else "rejected",
        "reason": "ok" if error is None else getattr(error, "reason", type(error).__name__),
        "stage": stage,
    }


ADMISSION_ERRORS = (AttentionSelectionError, DeploymentConfigError, PlatformProbeError, LoraError)


def record_in_ray(tags: dict[str, str]) -> None:
    """Count an admission decision in the detached recorder (scraped from Ray's metrics port)."""
    ray.get(admission_recorder().record_admission.remote(tags), timeout=RECORD_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class Admission:
    """The driver's decision: the backend every replica builds, the checkpoint geometry every rank checks, and
    what was checked to get there."""

    resolution: Resolution
    geometry: TransformerGeometry
    checkpoint: CheckpointConfigs | None  # None: not readable where admission ran (the replicas check it)
    plan: MemoryPlan


def admit(
    args: DeployArgs,
    stage: str = "build",
    platform: Platform | None = None,
    record: Callable[[dict[str, str]], None] = record_in_ray,
) -> Admission:
    """H3's admission rule for these args on the replicas' platform, counted; raises on refusal.

    Runs once in the driver (the application builder) and in the pre-flights; the replicas receive
    the Resolution and the geometry. Without ``platform`` it is learned from a probe task shaped like one SP rank,
    which also reads the checkpoint where the driver cannot. Checks the checkpoint against ``args.model`` (its
    geometry, and its consistency; a ``CheckpointMismatch``, reason "checkpoint"), the attention backend, the SP
    layout, every LoRA adapter against the transformer's modules (one that does not fit is a ``LoraError``, reason
    "lora"), then every rank role's device memory with the adapters' weights at the checkpoint's dims
    (``h3serve.pipelines.h3.memory``): a rank that does not fit is a ``MemoryBudgetError`` (reason "memory"); with
    ``args.stages`` so is a conditioner or decoder that does not fit the same platform.
    """
    resolution, error = None, None
    try:
        if platform is None:
            platform, checkpoint = target(args)
        else:  # given (h3serve admit, tests): the checkpoint as this node reads it
            checkpoint = read_checkpoint_here(args)
        geometry = admitted_geometry(args, checkpoint)
        if checkpoint is not None:
            logger.info("h3serve admission: checkpoint %s: %s", checkpoint.where(), geometry.describe())
        resolution = validate_deployment(
            model=args.served_model_name,
            geometry=geometry,
            attention_backend=args.attention_backend,
            platform=platform,
            device=args.device,
            dtype=args.dtype,
            sp_degree=args.sp_degree,
            ranking=args.attention_ranking,
        )
        adapters = check_loras(args, checkpoint)
        logger.info("h3serve admission: LoRA adapters: %s", describe_adapters(args, adapters))
        # the rank roles' device memory at the row budget: refused (reason "memory") when a rank cannot fit
        plan = deployment_memory_plan(args, adapters, checkpoint)
        logger.info("h3serve admission: memory: %s", check_memory(plan, platform))
    except ADMISSION_ERRORS as e:
        error = e
    record(outcome_tags(args, stage, resolution, error))
    if error is not None:
        logger.error("h3serve admission refused the deployment: %s", error)
        raise error
    assert resolution is not None
    logger.info("h3serve admission: %s", resolution.describe())
    return Admission(resolution, geometry, checkpoint, plan)
