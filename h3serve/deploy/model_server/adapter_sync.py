"""One H3Replica's run-time adapters kept to the application's registry (``h3serve.deploy.jobs.adapter_registry``).

A replica reconciles at start (before Serve reports it ready: an autoscaled or restarted replica serves what the
others serve), on a request naming an adapter it lacks (the registry read fresh: an adapter POSTed through another
replica is loaded before the request is queued), and at each health check (in the background: an adapter DELETEd
through another replica is unloaded here once its requests here finished). Deploy-time adapters (``args.loras``) are
never touched. An adapter this replica cannot load is never served here: a request naming it is refused, naming it
and why (and the load is tried again at the next reconcile).
"""

from __future__ import annotations

import asyncio
import logging

from h3serve.deploy.jobs.adapter_registry import AdapterRegistry
from h3serve.pipelines.h3.lora_spec import LoraError, LoraSpec, adapter_names
from h3serve.pipelines.h3.request import RequestError
from h3serve.replicas import Engine

logger = logging.getLogger(__name__)


class ReplicaAdapters:
    def __init__(self, engine: Engine, registry: AdapterRegistry):
        self.engine, self.registry = engine, registry
        self.deploy_time = frozenset(engine.pipeline.denoiser.loras.loras)
        self.failed: dict[str, str] = {}  # adapter -> why this replica could not load it
        self._lock = asyncio.Lock()  # one reconcile at a time
        self._background: asyncio.Task | None = None

    def _runtime(self) -> dict[str, LoraSpec]:
        """The run-time adapters this replica serves now."""
        served = self.engine.pipeline.denoiser.loras.loras
        return {name: spec for name, spec in served.items() if name not in self.deploy_time}

    async def reconcile(self, fresh: bool = False, unload: bool = True) -> None:
        """Load what the registry lists and this replica lacks; with ``unload``, unload (waiting for its requests
        here) what it no longer lists or lists with another spec."""
        async with self._lock:
            wanted = (await asyncio.to_thread(self.registry.read, fresh)).loras
            stale = [name for name, spec in self._runtime().items() if wanted.get(name) != spec]
            for name in list(self.failed):
                if name not in wanted:
                    del self.failed[name]
            for name, spec in wanted.items():
                if name in self.deploy_time or name in self.engine.pipeline.denoiser.loras.loras:
                    continue
                if name in self.engine.pipeline.denoiser.retiring:  # its unload waits on requests: next time
                    continue
                try:
                    nbytes = await self.engine.load_adapter(name, spec)
                except LoraError as e:
                    self.failed[name] = str(e)
                    logger.error("adapter %s: this replica cannot load it (it is not served here): %s", name, e)
                    continue
                self.failed.pop(name, None)
                logger.info("adapter %s: loaded from the registry (%d bytes on each rank)", name, nbytes)
            for name in stale if unload else ():  # last: an unload waits for the requests running on it here
                logger.info("adapter %s: no longer in the registry (or changed there): unloading it", name)
                await self.engine.unload_adapter(name)

    async def ensure(self, adapter: str | None) -> None:
        """Before a request on ``adapter`` (a ``composition_key``) is checked: the adapters it names that this
        replica lacks are loaded from the registry, read fresh. RequestError on ``lora`` naming one this replica
        could not load; an adapter the registry does not list either is left to the engine's own refusal."""
        served = self.engine.pipeline.denoiser.loras.loras
        missing = [name for name in adapter_names(adapter) if name is not None and name not in served]
        if not missing:
            return
        await self.reconcile(fresh=True, unload=False)
        for name in missing:
            if name in self.failed:
                raise RequestError("lora", f"adapter {name!r} could not be loaded on this replica: {self.failed[name]}")

    def in_background(self) -> None:
        """A reconcile (``check_health``'s), unless one still runs: an unload may wait for running requests."""
        if self._background is None or self._background.done():
            self._background = asyncio.create_task(self._quietly())

    async def _quietly(self) -> None:
        try:
            await self.reconcile()
        except Exception:  # the store was unreachable, say: the next health check tries again
            logger.exception("reconciling the run-time adapters with the registry failed")
