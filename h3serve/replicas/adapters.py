"""LoRA adapters loaded and unloaded while the engine serves (``Engine.load_adapter`` / ``unload_adapter``).

A load reads and checks the adapter off the event loop and the model thread (``H3Denoiser.add_adapter``: the tables
are replaced whole, so a forward in flight reads the old or the new one), then serves it in a fresh slot. An unload
first takes the adapter out of service (a request naming it from then on is refused: 400 naming the served ones;
one queued but not yet prepared is refused when it is prepared), then waits until no held request names it, and
only then frees its factors: a running request finishes with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from h3serve.pipelines.h3.lora import LoraError, LoraSpec
from h3serve.pipelines.h3.lora_spec import adapter_names
from h3serve.pipelines.h3.pipeline import H3Pipeline

from .requests import RequestTable

logger = logging.getLogger(__name__)


class RuntimeAdapters:
    """Adds and removes one replica's adapters; ``sp_degree`` > 1 is refused (the worker ranks are not reached)."""

    def __init__(self, pipeline: H3Pipeline, requests: RequestTable, sp_degree: Callable[[], int]):
        self.pipeline, self.requests, self.sp_degree = pipeline, requests, sp_degree
        self._lock = asyncio.Lock()  # one change at a time: slots and budgets are read, then written

    def _single_rank(self) -> None:
        if self.sp_degree() != 1:
            raise LoraError(
                f"adapters are loaded at run time only on replicas of sp_degree 1 (this one has {self.sp_degree()}); "
                "declare them in args.loras"
            )

    async def load(self, name: str, spec: LoraSpec) -> int:
        """Serve adapter ``name`` from ``spec.path``; its bytes on this rank. LoraError for one that does not fit the
        checkpoint (naming the module) or the budget, or a name already served."""
        self._single_rank()
        denoiser = self.pipeline.denoiser
        async with self._lock:
            limit = denoiser.loras.limits.max_adapter_bytes
            return await asyncio.to_thread(denoiser.add_adapter, name, spec, limit)

    async def unload(self, name: str, poll_s: float = 0.05, timeout_s: float | None = None) -> None:
        """Refuse new requests on ``name`` now; free it once no held request names it (TimeoutError after
        ``timeout_s``: it stays out of service, its factors are freed when its last request leaves at a later
        unload call)."""
        self._single_rank()
        denoiser = self.pipeline.denoiser
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

    def _holders(self, name: str) -> list[str]:
        return [t.id for t in self.requests.held() if name in adapter_names(t.adapter)]
