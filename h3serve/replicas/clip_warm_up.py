"""The warm-up clip: one whole request at the served size through the replica's own path, before it is ready.

Kernels are picked per shape on their first call (cuDNN's convolutions and cuBLAS's GEMMs on a GPU, oneDNN's
primitives on a CPU), and the encoder starts on its first clip. The smallest request's warm-up
(``Executor.warm_up``) shares no shape with a user's clip past the transformer's, so without this the first user
pays for the VAE's and the encoder's first calls at the served size. This runs the request a user gets by default
(the model's canvas and shortest clip, or ``limits.warmup_clip``'s size) the way ``Engine`` runs one: prepared by
the stages, every step on every rank on the model thread, decoded by the stages (streamed when they stream, tiles
over the ranks with ``decode_on_ranks``, one decoder replica with stages of their own) and encoded to MP4. Its
ticket never enters the request table: no event, no metric and no count sees it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from h3serve.pipelines.h3 import EncodedMedia, GeneratedMedia, GenerationRequest, RequestError
from h3serve.pipelines.h3.pipeline import H3Pipeline

from .executor import Executor
from .requests import Ticket
from .stage_worker import Stages

logger = logging.getLogger(__name__)


class ClipWarmUpRefused(ValueError):
    """``limits.warmup_clip`` names a request the served model refuses: the replica does not start."""


@dataclasses.dataclass(frozen=True)
class ClipWarmUp:
    """What the warm-up clip ran and how long each part took (wall clock, seconds)."""

    frames: tuple[int, ...] | None  # the decoded clip's (F, H, W) (None: a decoder stage encoded it)
    rows: int  # its pack's rows (padding included)
    forwards: int
    streamed: bool  # decoded as a fragmented MP4 stream (the path a followed video takes)
    prepare_s: float
    steps_s: float
    decode_s: float
    encode_s: float
    mp4_bytes: int


async def warm_up_clip(
    request: GenerationRequest, pipeline: H3Pipeline, executor: Executor, stages: Stages
) -> ClipWarmUp:
    """Run ``request`` through prepare, its steps, the decode and the MP4, discarding the clip. Raises
    ClipWarmUpRefused when the model refuses the request; any other failure is the replica's (it does not start)."""
    try:
        rows = pipeline.validate(request)
    except RequestError as e:
        raise ClipWarmUpRefused(f"engine.warmup_clip: the served model refuses it: {e}") from None
    loop = asyncio.get_running_loop()
    ticket = Ticket("warm-up-clip", request, rows, loop, None)  # never in the request table
    ticket.output = "mp4"  # a decoder stage encodes it, as it does a user's video
    started = time.perf_counter()
    ticket.state = await stages.prepare(ticket)
    prepared = time.perf_counter()
    forwards, pack_rows = await executor.denoise(ticket.prepared)
    stepped = time.perf_counter()
    streamed = stages.streams()
    chunks: list[int] = []
    media = await stages.decode(ticket, (lambda data, _frames: chunks.append(len(data))) if streamed else None)
    decoded = time.perf_counter()
    mp4 = media.data if isinstance(media, EncodedMedia) else await asyncio.to_thread(media.mp4)
    encoded = time.perf_counter()
    warm = ClipWarmUp(
        frames=tuple(int(n) for n in media.frames.shape[:3]) if isinstance(media, GeneratedMedia) else None,
        rows=pack_rows,
        forwards=forwards,
        streamed=bool(chunks),
        prepare_s=prepared - started,
        steps_s=stepped - prepared,
        decode_s=decoded - stepped,
        encode_s=encoded - decoded,
        mp4_bytes=len(mp4),
    )
    logger.info(
        "warm-up clip %s: prepare %.2f s, %d forwards of %d rows %.2f s, decode %.2f s%s, MP4 %.2f s",
        "x".join(map(str, warm.frames)) if warm.frames else "(decoded by the decoder stage)",
        warm.prepare_s,
        forwards,
        pack_rows,
        warm.steps_s,
        warm.decode_s,
        " (streamed)" if warm.streamed else "",
        warm.encode_s,
    )
    return warm
