"""Prepare and decode, beside the step loop: the stage worker's loop, its thread and the two ways it does the work.

``StageLoop`` is the stage worker's side of the engine: it prepares the waiting request ``scheduler.admit`` names,
ahead of the pack (``limits.max_prepared`` beyond ``max_active``), or decodes the oldest denoised one; an idle model
thread needs a request more than a finished one needs its media. A prepare or decode error fails its request alone.

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
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from h3serve.pipelines.h3 import (
    DecodeHandoff,
    EncodedMedia,
    GeneratedMedia,
    GenerationRequest,
    PreparedState,
    RequestState,
)
from h3serve.pipelines.h3.handoff import payload_bytes
from h3serve.pipelines.h3.media import Mp4Stream
from h3serve.pipelines.h3.pipeline import H3Pipeline
from h3serve.pipelines.h3.tiled_decode import TileRunner

from . import scheduler
from .contract import EngineLimits
from .cuda_faults import fatal
from .progress import Progress
from .requests import RequestTable, Stage, Ticket, check_rows

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

    def streams(self) -> bool:
        """Whether ``decode`` makes the clip's fragmented MP4 as it decodes (``emit``), known before it starts."""
        ...

    async def decode(self, ticket: Ticket, emit: Emit | None = None) -> GeneratedMedia | EncodedMedia: ...


# the bytes of a clip's fragmented MP4 as its decode makes them, with the frames encoded so far (on the stage thread)
Emit = Callable[[bytes, int], None]


class LocalStages:
    """diffusers' blocks and both VAEs on this replica's stage worker."""

    calls = 0

    def __init__(self, pipeline: H3Pipeline, worker: StageWorker, tiles: Callable[[], TileRunner | None] | None = None):
        """``tiles``: at each decode, who decodes its video tiles (the SP group's ranks: ``WorkerGroup.tile_runner``);
        None, or it gives None: rank 0's VAE alone."""
        self.pipeline, self.worker, self.tiles = pipeline, worker, tiles

    async def prepare(self, ticket: Ticket) -> RequestState:
        return await self.worker.run(self.pipeline.prepare, ticket.request, ticket.step_cache, ticket.adapter)

    def _runner(self) -> TileRunner | None:
        return self.tiles() if self.tiles is not None else None  # the current group's (a replaced one's too)

    def streams(self) -> bool:
        """A decode split over the group's ranks is blended whole, not streamed chunk by chunk (``decode_on_ranks``:
        the two are exclusive, as ``TiledVideoDecodeStep`` says)."""
        return self._runner() is None

    async def decode(self, ticket: Ticket, emit: Emit | None = None) -> GeneratedMedia | EncodedMedia:
        """The clip; ``emit``: also its fragmented MP4, fragment by fragment, while it decodes (``media.Mp4Stream``)."""
        runner = self._runner()
        if emit is None or runner is not None:
            return await self.worker.run(self.pipeline.decode, ticket.prepared, runner)
        return await self.worker.run(self._decode_streamed, ticket.prepared, emit)

    def _decode_streamed(self, state: RequestState, emit: Emit) -> GeneratedMedia:
        stream = Mp4Stream(self.pipeline.rules.fps, emit)
        try:
            media = self.pipeline.decode(state, sink=stream)
            stream.finish()
        finally:
            stream.close()  # a failed decode's encoder thread
        media.encoded_mp4 = stream.mp4()  # the stream's packets: the finished file is what was streamed
        return media


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

    def streams(self) -> bool:
        return False  # the decoder stage answers the whole clip (docs/DESIGN.md, issue 58)

    async def decode(self, ticket: Ticket, emit: Emit | None = None) -> GeneratedMedia | EncodedMedia:
        """The decoder stage decodes (and encodes, for ``ticket.output``) its latents, copied to the host once.
        Nothing is streamed (``emit`` unused): the stage answers the whole clip (docs/DESIGN.md, issue 58)."""
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


class StageLoop:
    """The stage worker's loop over the request table (``run``, one task beside the step loop)."""

    def __init__(
        self,
        table: RequestTable,
        stages: Stages,
        progress: Progress,
        limits: EngineLimits,
        wake_step: asyncio.Event,
        on_fatal: Callable[[str], None] | None = None,
    ):
        """``on_fatal``: a CUDA-fatal error in a prepare or decode here (``cuda_faults.fatal``'s why): the process is
        poisoned, so the engine stops (its requests fail retryably) rather than failing the request as its own."""
        self.table, self.stages, self.progress, self.limits = table, stages, progress, limits
        self.on_fatal = on_fatal
        self._wake_step = wake_step  # the step loop's: a request became ready
        self.wake = asyncio.Event()  # a request waits for prepare or decode, or the engine stops
        self.draining = self.stopped = False
        self.progress_at = time.monotonic()  # the watchdog: when a prepare or decode last ended

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()

    async def run(self) -> None:
        while not self.stopped:
            ticket: Ticket | None = None
            try:
                self.table.drop_finished(Stage.DENOISED)
                ticket, denoised = self._next_to_prepare(), self.table.first(Stage.DENOISED)
                if ticket is not None and (not self.table.live(Stage.RESIDENT) or denoised is None):
                    await self._prepare(ticket)  # an idle model thread needs a request more than a finished one
                elif denoised is not None:
                    ticket = denoised
                    await self._decode(ticket)
                else:
                    self.progress.account_busy(bool(self.table.held()))
                    self.wake.clear()
                    await self.wake.wait()
            except Exception:  # a fault of the engine itself: fail the request at hand, never the stage worker
                logger.exception("the stage worker failed outside a prepare or decode (request %s)", ticket)
                if ticket is None:
                    await asyncio.sleep(1.0)  # no request to fail; the watchdog reports it if it persists
                else:
                    error = RuntimeError(f"request {ticket.id} failed; see the replica log")
                    self.progress.fail(ticket, error, "error")
                    self.table.drop_finished(Stage.PREPARING)

    def _poisoned(self, error: BaseException) -> bool:
        """Whether ``error`` poisoned this process (then the engine was told: it fails every request, retryably)."""
        why = fatal(error)
        if why is None or self.on_fatal is None:
            return False
        self.on_fatal(why)
        return True

    def _next_to_prepare(self) -> Ticket | None:
        """The waiting request ``scheduler.admit`` names; the prepared one it evicts waits again, its state freed."""
        if self.draining or self.stopped:
            return None
        self.table.drop_finished(Stage.WAITING)
        limits = self.limits
        best, worst = scheduler.admit(
            self.table.at(Stage.WAITING),
            self.table.live(Stage.RESIDENT),
            limits.max_active + limits.max_prepared,
            limits.policy,
            time.monotonic(),
            limits.aging_s,
            self.table.served(limits.fair_share),
        )
        if best is not None and worst is not None:
            self.table.move(worst, Stage.WAITING)
            worst.state = None  # its prepared state is freed; it is prepared again when its turn comes
            policy = limits.policy
            logger.info("request %s gives its prepared room to %s (%s) and waits again", worst.id, best.id, policy)
        return best

    async def _prepare(self, ticket: Ticket) -> None:
        self.table.move(ticket, Stage.PREPARING)
        if not ticket.prepares:  # a request that gave its prepared room back waits on, and is timed once
            self.progress.stage("queue_wait", time.monotonic() - ticket.submitted)
        ticket.prepares += 1
        started = time.perf_counter()
        ticket.marks["prepare"] = time.monotonic()
        try:
            state = await self.stages.prepare(ticket)
            check_rows(self.limits, state.rows, state.text_rows)  # the estimate at submit was short (keyframes)
        except Exception as e:
            logger.warning("request %s: prepare failed", ticket.id, exc_info=True)
            if self._poisoned(e):
                self.table.move(ticket, Stage.DONE)
                return
            self.progress.fail(ticket, e, "prepare")
            self.table.move(ticket, Stage.DONE)
            return
        finally:
            self.progress_at = time.monotonic()
        self.progress.stage("prepare", time.perf_counter() - started)
        ticket.marks["prepared"] = time.monotonic()
        if ticket.future.done():  # cancelled, past its deadline or handed back while being prepared
            self.table.move(ticket, Stage.DONE)
            return
        ticket.state, ticket.rows, ticket.text_rows = state, state.rows, state.text_rows
        self.progress.prepared(ticket)
        self.table.move(ticket, Stage.RESIDENT)
        logger.info("request %s prepared (%d rows, %d steps)", ticket.id, state.rows, state.steps)
        self.progress.report_queue()
        self._wake_step.set()

    def _emitter(self, ticket: Ticket) -> Emit:
        """Each run of the stream's bytes, from the stage thread, as a ``fragment`` event on this loop (in order, and
        before the decode's own end reaches it: both go through ``call_soon_threadsafe``)."""
        loop = asyncio.get_running_loop()
        count = iter(range(1 << 62))

        def emit(data: bytes, frames: int) -> None:
            fields = dict(index=next(count), frames=frames, data=data)
            loop.call_soon_threadsafe(functools.partial(self.progress.event, ticket, "fragment", **fields))

        return emit

    async def _decode(self, ticket: Ticket) -> None:
        if ticket.future.done():
            self.table.move(ticket, Stage.DONE)
            return
        self.table.move(ticket, Stage.DECODING)
        streamed = ticket.stream and self.stages.streams()
        # `streamed`: the ingress opens the clip's live MP4 for readers only when fragments will come
        self.progress.event(ticket, "decoding", eta_s=self.progress.decode_s.value, streamed=streamed)
        started = time.perf_counter()
        ticket.marks["decode"] = time.monotonic()
        try:
            media = await self.stages.decode(ticket, self._emitter(ticket) if streamed else None)
        except Exception as e:
            logger.error("request %s: decode failed", ticket.id, exc_info=True)
            if not self._poisoned(e):
                self.progress.fail(ticket, e, "decode")
            return
        finally:
            self.table.move(ticket, Stage.DONE)
            self.progress_at = time.monotonic()
            self.progress.account_busy(bool(self.table.held()))
        seconds = time.perf_counter() - started
        ticket.marks["decoded"] = time.monotonic()
        self.progress.decode_s.add(seconds)
        self.progress.stage("decode", seconds)
        if ticket.future.done():
            return
        ticket.future.set_result(media)
        self.progress.stats.completed += 1
        end_to_end = time.monotonic() - ticket.submitted
        self.progress.stage("end_to_end", end_to_end)
        self.progress.report_queue()
        logger.info("request %s done in %.2f s (%d forwards)", ticket.id, end_to_end, ticket.forwards)
