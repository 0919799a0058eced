"""H3's admission rule, the analogue of sglang's ``validate_server_args``."""

from __future__ import annotations

import inspect
from typing import Any

from h3serve.attention import Platform, Resolution, parse_dtype, resolve

from .checkpoint import CheckpointConfigs
from .config import AUTO, TransformerGeometry, preset
from .memory import MemoryPlan, gib
from .pipeline import REQUIREMENTS


class DeploymentConfigError(ValueError):
    """Deployment args that can never work for this model, whatever the backend. Names the field."""

    reason = "invalid_config"


class CheckpointMismatch(DeploymentConfigError):
    """A checkpoint that is not what ``model`` names, is not consistent in itself, or cannot be read."""

    reason = "checkpoint"


def _with_defaults(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    defaults = {
        name: p.default
        for name, p in inspect.signature(cls).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    return {**defaults, **config}


def check_consistent(checkpoint: CheckpointConfigs) -> None:
    """Every partition shares the transformer's geometry (one Ulysses group, one memory plan serve them all), and
    takes what the VAEs and the text encoder give it: their latent channels and the conditioning width."""
    import diffusers
    from transformers import Qwen3VLConfig

    geometry = checkpoint.geometry()
    for partition in checkpoint.partitions[1:]:
        other = checkpoint.geometry(partition)
        if other != geometry:
            raise CheckpointMismatch(
                f"checkpoint {checkpoint.where()} has {geometry.describe()}, but {checkpoint.where(partition)} has "
                f"{other.describe()} ({'; '.join(geometry.differences(other))}): every transformer partition must "
                "share heads, head size, layers and hidden size"
            )
    vae = _with_defaults(diffusers.AutoencoderKLMiniMaxH3, checkpoint.configs["vae"])
    audio_vae = _with_defaults(diffusers.AutoencoderKLMiniMaxH3Audio, checkpoint.configs["audio_vae"])
    text_width = Qwen3VLConfig.from_dict(checkpoint.configs["text_encoder"]).text_config.hidden_size
    for partition in checkpoint.partitions:
        config = checkpoint.transformer(partition)
        for key, value, source in (
            ("in_channels", vae["latent_channels"], "vae latent_channels"),
            ("audio_in_channels", audio_vae["latent_channels"], "audio_vae latent_channels"),
            ("text_dim", text_width, "text_encoder text_config.hidden_size"),
        ):
            if config[key] != value:
                raise CheckpointMismatch(
                    f"checkpoint {checkpoint.where(partition)} has {key}={config[key]}, but its {source} is {value}: "
                    "the transformer must take what the checkpoint's other components give it"
                )


def checkpoint_geometry(model: str, checkpoint: CheckpointConfigs) -> TransformerGeometry:
    """The geometry a deployment of ``model`` is admitted for: the checkpoint's own, consistent in itself
    (``check_consistent``) and, unless ``model`` is ``auto``, the preset's. CheckpointMismatch (reason
    "checkpoint") names the field, the checkpoint's folder and both geometries otherwise."""
    check_consistent(checkpoint)
    geometry = checkpoint.geometry()
    if model == AUTO:
        return geometry
    expected = preset(model).geometry()
    if geometry != expected:
        raise CheckpointMismatch(
            f"model={model!r} names the {preset(model).name} architecture ({expected.describe()}), but checkpoint "
            f"{checkpoint.where()} has {geometry.describe()} ({'; '.join(expected.differences(geometry))}): set "
            f"model to the checkpoint's architecture, or model: {AUTO} to serve the checkpoint's own"
        )
    return geometry


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


class MemoryBudgetError(DeploymentConfigError):
    """A rank of the deployment does not fit its device's memory at the configured row budget."""

    reason = "memory"


def check_memory(plan: MemoryPlan, platform: Platform) -> str:
    """Refuse a plan whose rank role does not fit ``platform``'s device memory; returns what was checked.

    The stage roles of a plan (``plan.stages``: the conditioner and the decoder, with the deploy args' ``stages``)
    are checked against the same platform: their deployments reserve whole GPUs of the replicas' kind (the args
    give them no platform of their own). They hold no pack rows, so the row budget cannot make them fit.

    On CPU nothing is checked: the ranks share host memory with Ray's object store and every other
    process, so there is no per-rank device budget to hold them to (the tiny CPU model needs MBs). On
    CUDA a platform that does not state its device memory is refused (fail closed): `h3serve probe`
    records it, an assumed platform must give ``device_memory_bytes``.
    """
    if platform.device_type == "cpu":
        return "device memory not checked on cpu (ranks share host memory)"
    device = platform.device_memory_bytes
    if device is None:
        raise MemoryBudgetError(
            f"the replica platform [{platform.describe()}] does not state device_memory_bytes, so the memory plan "
            "cannot be checked: probe the platform (h3serve probe --device cuda) or add device_memory_bytes to "
            "the assumed platform"
        )
    fits = plan.max_rows_that_fit(device)
    over = [rank for rank in plan.roles if rank.total_bytes > device]
    if over:
        problems = "; ".join(
            f"{rank.role} needs {gib(rank.total_bytes)} = weights {gib(rank.weight_bytes)} ("
            + ", ".join(f"{name} {gib(size)}" for name, size in rank.weights.items())
            + f") + activations {gib(rank.activation_bytes)}"
            + (f" + {rank.requests} prepared requests {gib(rank.request_bytes)}" if rank.request_bytes else "")
            + f" + reserve {gib(rank.reserve_bytes)}"
            for rank in over
        )
        advice = []
        if any(rank in plan.ranks for rank in over):
            if fits > 0:
                advice.append(f"the largest max_rows_per_step that fits is {fits}")
            else:
                advice.append("no max_rows_per_step fits: the weights and reserve alone exceed the device")
        stages = [rank.role for rank in over if rank in plan.stages]
        if stages:
            what = "stages hold no pack rows: their" if len(stages) > 1 else "stage holds no pack rows: its"
            advice.append(f"the {' and '.join(stages)} {what} weights and reserve alone exceed the device")
        raise MemoryBudgetError(
            f"{problems}, but a {platform.device_name} has {gib(device)} "
            f"(engine.max_rows_per_step {plan.max_rows} over sp_degree {plan.sp_degree}); {'; '.join(advice)}"
            + "".join(f"; note: {note}" for note in plan.notes)
        )
    checked = f"every rank fits {gib(device)}; the largest max_rows_per_step that fits is {fits}"
    if plan.stages:
        checked += "; " + " and ".join(
            f"the {stage.role} stage fits it with {gib(device - stage.total_bytes)} left for its transients"
            for stage in plan.stages
        )
    return checked
