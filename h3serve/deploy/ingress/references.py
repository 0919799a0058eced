"""Video and audio references, bounded at submit from their container's metadata, before any replica decodes them.

A Ref2VA reference is decoded on rank 0 or the conditioner (``pipelines.h3.stages``); a 16 MiB MP4 can hold an hour
of 4K. So the ingress opens each one with PyAV and reads what the container declares (duration, frame count and
size, sample rate, codec) against the deployment's ``limits``, without decoding a frame: ``avformat_find_stream_info``
is bounded to PROBE_BYTES and no analysis time, and no packet is demuxed here. A file that declares no duration, or
that PyAV cannot open as a container, is refused: its cost could only be learnt by decoding it.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3serve.deploy.common.args import RequestLimits

PROBE_BYTES = 1 << 20  # what the header probe may read: an MP4's moov atom or a WAV's header, not its frames
PROBE_OPTIONS = {"probesize": str(PROBE_BYTES), "analyzeduration": "0"}


def _seconds(container, stream, time_base: int) -> float | None:
    """The stream's declared duration, else the container's; None when neither is declared."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / time_base
    return None


def media_problem(data: bytes, kind: str, limits: RequestLimits) -> str | None:
    """What makes a ``kind`` ("video" or "audio") reference unacceptable under ``limits``, read from its container's
    metadata only, or None."""
    import av  # here: an ingress that never sees a video or audio reference does not load FFmpeg's libraries

    try:
        container = av.open(io.BytesIO(data), mode="r", options=PROBE_OPTIONS)
    except Exception as e:  # PyAV raises InvalidDataError, ValueError...: the upload's fault
        return f"is not a {kind} file PyAV can open ({type(e).__name__})"
    with container:
        streams = container.streams.video if kind == "video" else container.streams.audio
        if not streams:
            return f"holds no {kind} stream"
        stream = streams[0]
        codec = stream.codec_context.name
        allowed = limits.reference_video_codecs if kind == "video" else limits.reference_audio_codecs
        if codec not in allowed:
            return f"is {codec}; {kind} references may be {', '.join(allowed)}"
        seconds = _seconds(container, stream, av.time_base)
        if seconds is None:
            return "declares no duration in its container; send a file that does (an MP4, WebM or WAV)"
        if seconds > limits.max_reference_seconds:
            return f"is {seconds:.1f} s long; references may be at most {limits.max_reference_seconds:g} s"
        if kind == "audio":
            rate = stream.codec_context.sample_rate or 0
            if rate > limits.max_reference_sample_rate:
                return f"is sampled at {rate} Hz; audio references may be at most {limits.max_reference_sample_rate} Hz"
            return None
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > limits.max_reference_pixels:
            return f"is {width}x{height} pixels; video references may have at most {limits.max_reference_pixels}"
        frames = stream.frames or (round(seconds * float(stream.average_rate)) if stream.average_rate else 0)
        if frames > limits.max_reference_frames:
            return f"has {frames} frames; video references may have at most {limits.max_reference_frames}"
    return None
