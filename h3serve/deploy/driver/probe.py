"""The platform probe: a short task shaped like one SP rank, so it lands where the replicas will, that reports the
node's platform and, where the driver cannot read the checkpoint, the checkpoint's configs as that node reads them.

Apart from admission's rules on purpose: Ray imports a task's module in the worker that runs it, and a probe's worker
is a new process for each build running at once. This module imports torch, the attention probe and the
checkpoint's config reader, no diffusers, transformers or peft: a process that imports it and probes took 4.4 s of
CPU (user + sys, a quiet core), one that imports admission instead 7.5 s.
"""

from __future__ import annotations

import ray
from pydantic import BaseModel

from h3serve.attention.platform import DeviceType, Platform
from h3serve.attention.registry import probe_platform
from h3serve.deploy.common.args import DeployArgs
from h3serve.pipelines.h3.checkpoint import CheckpointConfigs, CheckpointError, resolve_checkpoint


class PlatformProbeError(RuntimeError):
    reason = "probe_failed"


class ProbeReport(BaseModel):
    """What the probe task learned on a replica node: its platform, and where the driver could not read the
    checkpoint directory, the checkpoint's configs as that node reads them (or why it could not)."""

    node: str
    platform: Platform
    checkpoint: CheckpointConfigs | None = None
    checkpoint_error: str | None = None


@ray.remote(num_cpus=0)
def _probe(device: DeviceType, checkpoint: str | None, read_checkpoint: bool) -> str:
    node = f"replica node {ray.util.get_node_ip_address()}"
    report = ProbeReport(node=node, platform=probe_platform(device))
    if read_checkpoint:
        try:
            report.checkpoint = CheckpointConfigs.read(resolve_checkpoint(checkpoint), node)
        except (CheckpointError, OSError) as e:
            report.checkpoint_error = str(e)
    return report.model_dump_json()


def probe_replica(args: DeployArgs, read_checkpoint: bool = False) -> ProbeReport:
    """Run the probe where a rank of ``args`` would run (``read_checkpoint``: it also reads the checkpoint's configs
    there); refused when no such node runs it within ``platform_probe_timeout_s``."""
    resources = dict(args.rank_resources)
    task = _probe.options(
        num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources or None
    )
    try:
        raw = ray.get(task.remote(args.device, args.checkpoint, read_checkpoint), timeout=args.platform_probe_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise PlatformProbeError(
            f"no node with {args.rank_resources} ran the platform probe within {args.platform_probe_timeout_s:.0f}s; "
            "add such nodes (or let the autoscaler), or set probe_platform: false with an assumed_platform"
        ) from None
    return ProbeReport.model_validate_json(raw)
