"""Scale from zero, as one ingress replica sees it (``args.autoscaling.min_replicas: 0``).

While no H3Replica runs, a request sent through the deployment handle waits in the handle's queue, and a request
waiting there is what makes Serve start a replica (its cold start, before any autoscaling policy). The ingress uses
that: ``wake`` sends one light call (``rules``) that waits there until a replica serves, so a request it refuses
(an image: HTTP 503 with Retry-After) still starts one. It learns whether a replica runs from Serve's controller
(what ``DrainWatch`` reads), cached for ``RUNNING_CACHE_S``; a controller it cannot reach counts as "running", so
requests take the ordinary path (they wait in the handle's queue) rather than being refused. It measures how long
its last wake took, the expected load time its Retry-After is counted down from.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ray.serve.handle import DeploymentHandle

from h3serve.deploy.common.serve_controller import ReplicaStates
from h3serve.pipelines.h3 import ModelRules

logger = logging.getLogger(__name__)
RUNNING_CACHE_S = 1.0  # how long one answer of the controller stands


class ColdStart:
    def __init__(self, app: str, replica: DeploymentHandle, expected_load_s: float, deployment: str = "H3Replica"):
        self.app, self.deployment, self.replica = app, deployment, replica
        self.expected_load_s = expected_load_s  # configured; replaced by the last measured wake
        self.rules: ModelRules | None = None  # what the woken replica answered
        self._asked_at = -math.inf
        self._running = 0
        self._woke_at: float | None = None  # when the wake in flight was sent (None: none is)
        self._wake: asyncio.Task | None = None
        self._states = ReplicaStates(app, deployment)

    async def running(self) -> int:
        """H3Replica replicas RUNNING now, by the controller (cached); 1 when it cannot be asked."""
        now = time.monotonic()
        if now - self._asked_at < RUNNING_CACHE_S:
            return self._running
        try:
            self._running = sum(state == "RUNNING" for state in (await self._states.poll()).values())
        except Exception as e:
            logger.warning("cannot ask the Serve controller how many %s replicas run: %r", self.deployment, e)
            self._running = 1
        self._asked_at = now
        return self._running

    def wake(self) -> None:
        """One call waiting at the handle for a replica (Serve's cold start starts one for it); none if one waits."""
        if self._wake is None or self._wake.done():
            self._woke_at = time.monotonic()
            self._wake = asyncio.get_running_loop().create_task(self._until_serving(self._woke_at))

    async def _until_serving(self, woke_at: float) -> None:
        try:
            self.rules = await self.replica.rules.remote()
        except Exception as e:  # a replica that fails to start: the next request wakes the deployment again
            logger.warning("waking %s failed: %r", self.deployment, e)
            return
        finally:
            self._woke_at = None
        self.expected_load_s = time.monotonic() - woke_at
        self._running, self._asked_at = max(self._running, 1), time.monotonic()
        logger.info("%s serves %.1f s after it was woken", self.deployment, self.expected_load_s)

    def retry_after_s(self) -> int:
        """Whole seconds until a replica is expected to serve: the expected load time less what has passed."""
        waited = 0.0 if self._woke_at is None else time.monotonic() - self._woke_at
        return max(1, math.ceil(self.expected_load_s - waited))
