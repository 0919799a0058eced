"""The driver's one admission check: learn the replica platform, run H3's rule, count the outcome."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from attention import AttentionSelectionError, DeviceType, Platform, Resolution, probe_platform
from pipelines.h3 import DeploymentConfigError, preset, validate_deployment
from pipelines.h3.admission import check_memory
from pipelines.h3.lora import AdapterFootprint, LoraError, check_adapters
from pipelines.h3.memory import DEFAULT_RESERVE_BYTES, MemoryPlan, checkpoint_partitions, gib, memory_plan

from .args import DeployArgs
from .metrics import RECORD_TIMEOUT_S, admission_recorder

logger = logging.getLogger(__name__)


class PlatformProbeError(RuntimeError):
    reason = "probe_failed"


@ray.remote(num_cpus=0)
def _probe(device: DeviceType) -> str:
    return probe_platform(device).model_dump_json()


def probe_replica_platform(args: DeployArgs) -> Platform:
    """Run a short task shaped like one SP rank, so it lands where replicas will."""
    resources = dict(args.rank_resources)
    task = _probe.options(
        num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources or None
    )
    try:
        return Platform.model_validate_json(ray.get(task.remote(args.device), timeout=args.platform_probe_timeout_s))
    except ray.exceptions.GetTimeoutError:
        raise PlatformProbeError(
            f"no node with {args.rank_resources} ran the platform probe within {args.platform_probe_timeout_s:.0f}s; "
            "add such nodes (or let the autoscaler), or set probe_platform: false with an assumed_platform"
        ) from None


def target_platform(args: DeployArgs) -> Platform:
    if args.probe_platform:
        return probe_replica_platform(args)
    # Without a probe nothing is assumed installed unless the args say so: fail closed.
    return args.assumed_platform or Platform(device_type=args.device, source="assumed")


def deployment_memory_plan(args: DeployArgs, adapters: dict[str, AdapterFootprint] | None = None) -> MemoryPlan:
    """Each rank role's device memory for these args: weights (LoRA adapters included), a full pack's activations
    (with step caches when a tier is offered; prompt rows bounded by ``engine.max_text_rows_per_step``), the
    prepared requests' own tensors on rank 0, the reserve. ``adapters``: ``check_loras``'s, else checked here.
    With ``args.stages``, rank 0 holds only the transformer partitions and the plan adds the conditioner's and the
    decoder's roles (checked against the replicas' platform: the args give the stages none of their own)."""
    adapters = check_loras(args) if adapters is None else adapters
    return memory_plan(
        model=args.model,
        checkpoint=args.checkpoint,
        dtype=args.dtype,
        sp_degree=args.sp_degree,
        max_rows=args.engine.max_rows_per_step,
        # the reserve is the CUDA context, workspaces and the caching allocator's slack: none of it on CPU
        reserve_bytes=DEFAULT_RESERVE_BYTES if args.device == "cuda" else 0,
        adapters={name: footprint.bytes for name, footprint in adapters.items()},
        step_cache=bool(args.engine.step_cache.tiers),
        stages="remote" if args.stages is not None else "local",
        text_rows=args.engine.max_text_rows_per_step,
        requests=args.engine.max_active + args.engine.max_prepared,  # prepared states held at once
        steps=args.limits.max_steps,
        late_decisions=len({policy.fn_blocks for policy in args.engine.step_cache.tiers.values()}) > 1,
    )


def transformer_configs(args: DeployArgs) -> dict[str, dict[str, Any]]:
    """Each transformer partition's config as the replicas will build it: the checkpoint's config.json, else the
    preset's (the built-in tiny checkpoint, or a checkpoint this node cannot read; the replicas check again)."""
    partitions, _ = checkpoint_partitions(args.checkpoint)
    released = preset(args.model).transformer_config()
    configs = {}
    for partition in partitions:
        path = Path(args.checkpoint) / partition / "config.json" if args.checkpoint else None
        configs[partition] = json.loads(path.read_text()) if path is not None and path.is_file() else released
    return configs


def check_loras(args: DeployArgs) -> dict[str, AdapterFootprint]:
    """Every adapter of ``args.loras`` against the served transformer's modules (meta device, no weights)."""
    if not args.loras:
        return {}
    return check_adapters(args.lora_specs, transformer_configs(args), args.dtype)


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


def admit(
    args: DeployArgs,
    stage: str = "build",
    platform: Platform | None = None,
    record: Callable[[dict[str, str]], None] = record_in_ray,
) -> Resolution:
    """H3's admission rule for these args on the replicas' platform, counted; raises on refusal.

    Runs once in the driver (the application builder) and in the pre-flights; the replicas receive
    the Resolution. Without ``platform`` it is learned from a probe task shaped like one SP rank.
    Checks the attention backend, the SP layout, every LoRA adapter against the transformer's modules (one
    that does not fit is a ``LoraError``, reason "lora"), then every rank role's device memory with the
    adapters' weights (``pipelines.h3.memory``): a rank that does not fit is a ``MemoryBudgetError`` (reason
    "memory"); with ``args.stages`` so is a conditioner or decoder that does not fit the same platform.
    """
    resolution, error = None, None
    try:
        platform = platform or target_platform(args)
        resolution = validate_deployment(
            model=args.served_model_name,
            geometry=args.geometry,
            attention_backend=args.attention_backend,
            platform=platform,
            device=args.device,
            dtype=args.dtype,
            sp_degree=args.sp_degree,
            ranking=args.attention_ranking,
        )
        adapters = check_loras(args)
        logger.info("h3serve admission: LoRA adapters: %s", describe_adapters(args, adapters))
        # the rank roles' device memory at the row budget: refused (reason "memory") when a rank cannot fit
        logger.info("h3serve admission: memory: %s", check_memory(deployment_memory_plan(args, adapters), platform))
    except ADMISSION_ERRORS as e:
        error = e
    record(outcome_tags(args, stage, resolution, error))
    if error is not None:
        logger.error("h3serve admission refused the deployment: %s", error)
        raise error
    assert resolution is not None
    logger.info("h3serve admission: %s", resolution.describe())
    return resolution
