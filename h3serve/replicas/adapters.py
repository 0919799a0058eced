"""LoRA adapters loaded and unloaded while the engine serves (``Engine.load_adapter`` / ``unload_adapter``).

A load reads and checks the adapter on rank 0 off the event loop and the model thread (``H3Denoiser.stage_adapter``:
the tables are replaced whole, so a forward in flight reads the old or the new one) into a fresh slot that no request
can name yet. Then, between two steps (``model_lock``), every SP worker reads it into the same slot
(``WorkerGroup.mirror_adapters``; a worker the group starts again later loads it too) and one warm-up forward runs
on its slot on every rank, as a deploy-time adapter's does; only then is it served. A rank that cannot read it
fails the load closed (LoraError naming the rank and module): nothing serves it.

An unload first takes the adapter out of service (a request naming it from then on is refused: 400 naming the served
ones; one queued but not yet prepared is refused when it is prepared), then waits until no held request names it,
and only then frees its factors on every rank: a running request finishes with it.
"""

from __future__ import annotations

import asyncio
import logging

from h3serve.pipelines.h3.lora import LoraSpec
from h3serve.pipelines.h3.lora_spec import adapter_names

from .executor import Executor
from .requests import RequestTable
from .warm_up import WarmUps

logger = logging.getLogger(__name__)


class RuntimeAdapters:
    """Adds and removes one replica's adapters, on every rank of its SP group."""

    def __init__(self, executor: Executor, warm_ups: WarmUps, requests: RequestTable, model_lock: asyncio.Lock):
        self.executor, self.warm_ups, self.requests, self.model_lock = executor, warm_ups, requests, model_lock
        self._lock = asyncio.Lock()  # one change at a time: slots and budgets are read, then written

    async def load(self, name: str, spec: LoraSpec) -> int:
        """Serve adapter ``name`` from ``spec.path``; its bytes on each rank. LoraError for one that does not fit the
        checkpoint (naming the module), the budget, or a rank that cannot read it, or a name already served."""
        denoiser = self.executor.pipeline.denoiser
        async with self._lock:
            limit = denoiser.loras.limits.max_adapter_bytes
            loras, slot, nbytes = await asyncio.to_thread(denoiser.stage_adapter, name, spec, limit)
            try:
                async with self.model_lock:  # between two steps: no forward runs on any rank
                    group = self.executor.group
                    await asyncio.to_thread(group.mirror_adapters, loras, denoiser.retiring)
                    seconds = await self.executor.run_blocking(self.warm_ups.adapter, slot)
            except BaseException:
                denoiser.drop_staged(slot)
                raise
            denoiser.serve_staged(loras, slot, nbytes)
            if seconds is not None:
                logger.info("adapter %s: warm-up forward on %d rank(s) %.2f s", name, group.sp_degree, seconds)
            return nbytes

    async def unload(self, name: str, poll_s: float = 0.05, timeout_s: float | None = None) -> None:
        """Refuse new requests on ``name`` now; free it once no held request names it (TimeoutError after
        ``timeout_s``: it stays out of service, its factors are freed when its last request leaves at a later
        unload call)."""
        denoiser = self.executor.pipeline.denoiser
        async with self._lock:
            if name not in denoiser.retiring:
                denoiser.retire_adapter(name)
            deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
            while self._holders(name):
                if deadline is not None and asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"adapter {name!r}: requests still run on it: {self._holders(name)}")
                await asyncio.sleep(poll_s)
            held = [slot for t in self.requests.held() if t.state is not None for slot, _ in t.state.adapters]
            denoiser.release_retired(held)
            # the workers free it too (and a worker started again from now loads the adapters served without it)
            await asyncio.to_thread(self.executor.group.mirror_adapters, denoiser.loras, denoiser.retiring)

    def _holders(self, name: str) -> list[str]:
        return [t.id for t in self.requests.held() if name in adapter_names(t.adapter)]
