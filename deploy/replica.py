"""H3Replica: the Serve deployment around one SP worker group and its step engine."""

from __future__ import annotations

import asyncio
import logging
import os

import ray
from ray import serve

import attention.selector
from pipelines.h3 import GenerationRequest
from replicas import Engine, ReplicaSpec, WorkerGroup

from .args import EngineArgs
from .metrics import EngineMetrics, admission_recorder

logger = logging.getLogger(__name__)


@serve.deployment(name="H3Replica", health_check_period_s=5, health_check_timeout_s=30)
class H3Replica:
    def __init__(self, spec_json: str, engine: dict):
        self.spec = ReplicaSpec.model_validate_json(spec_json)
        backend = self.spec.resolution.backend
        try:
            # builds exactly the driver's backend; fails closed if this node cannot run it
            self.group = WorkerGroup.create(self.spec)
        except Exception as e:
            reason = getattr(e, "reason", type(e).__name__)
            ray.get(admission_recorder().record_build_failure.remote(backend, reason), timeout=30)
            logger.error("H3 replica failed to build with %s: %s", backend, e)
            raise
        self.engine = Engine(self.group, EngineArgs(**engine).limits(), EngineMetrics())
        logger.info("H3 replica ready: %s", self.spec.resolution.describe())

    def validate(self, request: dict) -> int:
        """Check a request without queueing it (video jobs are validated before they are accepted)."""
        return self.engine.validate(GenerationRequest(**request))

    async def generate_image(self, request: dict) -> bytes:
        media = await self.engine.generate(GenerationRequest(**request))
        return await asyncio.to_thread(media.png)

    async def generate_video(self, request: dict):
        """Stream {"progress": [done, total]} per step, then {"mp4": bytes}."""
        ticket = self.engine.submit(GenerationRequest(**request))
        try:
            while not ticket.future.done():
                yield {"progress": list(ticket.progress)}
                changed = asyncio.ensure_future(ticket.changed.wait())
                await asyncio.wait([changed, ticket.future], return_when=asyncio.FIRST_COMPLETED)
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
            "selector_calls": attention.selector.stats.calls,
            "waiting": waiting,
            "active": active,
            "forwards": self.engine.stats.forwards,
        }
