"""H3Replica: the Serve deployment around one SP worker group and its step engine."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
from ray import serve

from attention import selector_calls
from pipelines.h3 import GenerationRequest, ModelRules
from replicas import Engine, EngineLimits, ReplicaSpec, WorkerGroup

from .args import DeployArgs
from .metrics import EngineMetrics, admission_recorder

logger = logging.getLogger(__name__)


class H3Replica:
    """One SP worker group and its engine (the builder makes it a Serve deployment with ``deployment_options``)."""

    @staticmethod
    def deployment_options(args: DeployArgs) -> dict[str, Any]:
        """The replica's Serve options: one placement-group bundle per SP rank (it takes bundle 0)."""
        bundles = args.placement_bundles()
        return dict(
            name="H3Replica",
            health_check_period_s=5,
            health_check_timeout_s=30,
            placement_group_bundles=bundles,
            placement_group_strategy="STRICT_PACK",
            ray_actor_options={"num_cpus": bundles[0].get("CPU", 0), "num_gpus": bundles[0].get("GPU", 0)},
            # the engine's bounded queue is the backpressure point (QueueFull -> 503), so Serve must route
            # past it rather than queue in front of it
            max_ongoing_requests=2 * (args.engine.max_queue + args.engine.max_active),
        )

    def __init__(self, spec: ReplicaSpec, limits: EngineLimits):
        self.spec = spec
        backend = spec.resolution.backend
        try:
            # builds exactly the driver's backend; fails closed if it is incapable or this node cannot run it
            self.group = WorkerGroup.create(spec)
        except Exception as e:
            reason = getattr(e, "reason", type(e).__name__)
            ray.get(admission_recorder().record_build_failure.remote(backend, reason), timeout=30)
            logger.error("H3 replica failed to build with %s: %s", backend, e)
            raise
        self.engine = Engine(self.group, limits, EngineMetrics())
        logger.info("H3 replica ready: %s", spec.resolution.describe())

    def rules(self) -> ModelRules:
        """What the served checkpoint generates (the ingress validates requests against it)."""
        return self.group.pipeline.rules

    def validate(self, request: GenerationRequest) -> int:
        """Check a request without queueing it (video jobs are validated before they are accepted)."""
        return self.engine.validate(request)

    async def generate_image(self, request: GenerationRequest) -> bytes:
        media = await self.engine.generate(request)
        return await asyncio.to_thread(media.png)

    async def generate_video(self, request: GenerationRequest):
        """Stream {"progress": [done, total]} per step, then {"mp4": bytes}."""
        ticket = self.engine.submit(request)
        try:
            while not ticket.future.done():
                yield {"progress": list(ticket.progress)}
                changed = asyncio.ensure_future(ticket.changed.wait())
                waiters: list[asyncio.Future[Any]] = [changed, ticket.future]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                ticket.changed.clear()
            media = await ticket.future
            yield {"progress": list(ticket.progress)}
            yield {"mp4": await asyncio.to_thread(media.mp4)}
        finally:  # the consumer went away (job deleted, ingress gone): leave the pack
            self.engine.cancel(ticket)

    async def check_health(self) -> None:
        await asyncio.to_thread(self.engine.check_health)

    def diagnostics(self) -> dict:
        waiting, active = self.engine.queue_depth
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "pid": os.getpid(),
            "backend": self.spec.resolution.backend,
            "chosen_by": self.spec.resolution.chosen_by,
            "sp_degree": self.spec.sp_degree,
            "selector_calls": selector_calls(),
            "waiting": waiting,
            "active": active,
            "forwards": self.engine.stats.forwards,
        }

    async def __del__(self):
        """Serve stops this replica: fail what is queued, release the SP workers and their placement group."""
        engine, group = getattr(self, "engine", None), getattr(self, "group", None)
        if engine is not None:
            await engine.close("replica is shutting down")
        if group is not None:
            group.shutdown()
