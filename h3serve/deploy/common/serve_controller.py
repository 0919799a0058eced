"""The Serve controller's view of one deployment's replicas: whether this replica is being stopped (an H3Replica's
drain) and how many run (the ingress's cold start). Both ask the controller's ``get_deployment_details``, what the
dashboard's Serve view is built from; each caller decides what a failing poll means to it."""

from __future__ import annotations

import ray

SERVE_CONTROLLER = ("SERVE_CONTROLLER_ACTOR", "serve")  # ray.serve._private.constants: name, namespace


class ReplicaStates:
    """One deployment's replicas by id, and their state (RUNNING, STOPPING...), as the controller sees them."""

    def __init__(self, app: str, deployment: str):
        self.app, self.deployment = app, deployment
        self._controller: ray.actor.ActorHandle | None = None

    async def poll(self) -> dict[str, str]:
        """Replica id -> state; raises what the controller lookup or call raised."""
        try:
            if self._controller is None:
                self._controller = ray.get_actor(*SERVE_CONTROLLER)
            details = await self._controller.get_deployment_details.remote(self.app, self.deployment)
        except Exception:
            self._controller = None  # a restarted controller is a new actor: look it up again
            raise
        return {replica.replica_id: replica.state for replica in details.replicas}
