"""Prepare and decode, beside the step loop: the stage worker's thread and the two ways it does the work.

``Stages`` is what the engine asks of them: prepare a ticket's request into a ``RequestState`` on the model's device,
decode a finished one into its media. ``LocalStages`` runs diffusers' blocks and the VAEs here; ``RemoteStages``
hands the work to stages of their own (``StageClient``: deploy's Serve handles of a shared conditioner and decoder),
keeping only the host-to-device placement (``H3Pipeline.admit``) and the copy back (``decode_handoff``) here. Either
way the work on this node runs on the ``StageWorker``'s one thread, on CUDA on its own stream.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from pipelines.h3 import DecodeHandoff, EncodedMedia, GeneratedMedia, GenerationRequest, PreparedState, RequestState
from pipelines.h3.pipeline import H3Pipeline, payload_bytes

from .requests import Ticket

logger = logging.getLogger(__name__)

T = TypeVar("T")


def lower_thread_priority(nice: int) -> None:
    """This thread's Linux niceness raised by ``nice`` (capped at 19), per thread (PRIO_PROCESS with its native id).
    Relative, since Ray starts its workers niced already (15) and lowering a niceness needs privilege. A no-op for 0
    and where the platform has no per-thread niceness."""
    if nice > 0 and hasattr(os, "setpriority"):
        tid = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        except OSError:
            logger.warning("cannot raise this thread's niceness by %d", nice, exc_info=True)


class StageWorker:
    """One thread for prepare and decode; on CUDA its work runs on a stream of its own.

    The stream keeps its VAE and text-encoder kernels from queueing behind the forwards on the model
    thread's stream. It is synchronized before a result is handed back, so the model thread only ever
    reads finished tensors; the model thread synchronizes its own stream at the end of every step
    (``Executor._apply``), so a decode only ever reads finished latents.
    """

    def __init__(self, device: torch.device, nice: int = 0):
        """``nice``: the thread's niceness above the step loop's (``EngineLimits.stage_nice``)."""
        self.executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="h3-stages", initializer=lower_thread_priority, initargs=(nice,)
        )
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.stream = torch.cuda.Stream(device=torch.device("cuda", index))

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        return asyncio.get_running_loop().run_in_executor(self.executor, self._on_stream, fn, *args)

    def _on_stream(self, fn: Callable[..., T], *args: Any) -> T:
        if self.stream is None:
            return fn(*args)
        with torch.cuda.stream(self.stream):
            result = fn(*args)
        self.stream.synchronize()  # every tensor of the result is complete before another thread reads it
        return result

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class StageClient(Protocol):
    """Conditioner and decoder stages of their own (deploy wires this to Serve deployment handles): the engine
    hands a request over to them instead of preparing or decoding it on its stage worker. Their errors are the
    request's (RequestError stays a RequestError), never the engine's."""

    async def prepare(self, request: GenerationRequest, shift: float | None) -> PreparedState: ...

    async def decode(self, handoff: DecodeHandoff, output: str | None) -> GeneratedMedia | EncodedMedia: ...


class Stages(Protocol):
    """Prepare and decode for the engine; an error is the request's."""

    calls: int  # calls to stage deployments in flight (the watchdog does not count their time as a stall)

    async def prepare(self, ticket: Ticket) -> RequestState: ...

    async def decode(self, ticket: Ticket) -> GeneratedMedia | EncodedMedia: ...


class LocalStages:
    """diffusers' blocks and both VAEs on this replica's stage worker."""

    calls = 0

    def __init__(self, pipeline: H3Pipeline, worker: StageWorker):
        self.pipeline, self.worker = pipeline, worker

    async def prepare(self, ticket: Ticket) -> RequestState:
        return await self.worker.run(self.pipeline.prepare, ticket.request, ticket.step_cache, ticket.adapter)

    async def decode(self, ticket: Ticket) -> GeneratedMedia | EncodedMedia:
        return await self.worker.run(self.pipeline.decode, ticket.prepared)


class RemoteStages:
    """A conditioner and a decoder of their own; ``handoff_bytes`` counts what crossed, by direction."""

    def __init__(
        self,
        pipeline: H3Pipeline,
        worker: StageWorker,
        client: StageClient,
        handoff_bytes: collections.Counter[str],
    ):
        self.pipeline, self.worker, self.client, self.handoff_bytes = pipeline, worker, client, handoff_bytes
        self.calls = 0

    @contextlib.contextmanager
    def _awaiting(self) -> Iterator[None]:
        """Around a call to a stage deployment: the watchdog does not count it as this engine's stall."""
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1

    async def prepare(self, ticket: Ticket) -> RequestState:
        """The conditioner stage prepares it; its host tensors become this pipeline's state on the stage worker."""
        _, shift = self.pipeline.check_prepare(ticket.request, ticket.step_cache, ticket.adapter)  # refuse before
        with self._awaiting():
            prepared = await self.client.prepare(ticket.request, shift)
        self.handoff_bytes["prepared"] += prepared.nbytes
        logger.info("request %s: %d prepared bytes from the conditioner stage", ticket.id, prepared.nbytes)
        return await self.worker.run(self.pipeline.admit, ticket.request, prepared, ticket.step_cache, ticket.adapter)

    async def decode(self, ticket: Ticket) -> GeneratedMedia | EncodedMedia:
        """The decoder stage decodes (and encodes, for ``ticket.output``) its latents, copied to the host once."""
        handoff = await self.worker.run(self.pipeline.decode_handoff, ticket.prepared)
        self.handoff_bytes["latents"] += handoff.nbytes
        with self._awaiting():
            media = await self.client.decode(handoff, ticket.output)
        media_bytes = len(media.data) if isinstance(media, EncodedMedia) else payload_bytes(media)
        self.handoff_bytes["media"] += media_bytes
        logger.info(
            "request %s: %d latent bytes to the decoder stage, %d media bytes back",
            ticket.id,
            handoff.nbytes,
            media_bytes,
        )
        return media
