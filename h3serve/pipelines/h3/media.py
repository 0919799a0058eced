"""Encode generated media to PNG / MP4 bytes, and probe such bytes back.

PNG goes through Pillow; MP4 (H.264 video + optional AAC audio) through PyAV.
Inputs may be numpy arrays or torch tensors; torch is never imported here.
Every rejected input raises :class:`MediaError` naming the offending field.
"""

from __future__ import annotations

import io
import numbers
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import av
import numpy as np
from PIL import Image

#: Sample rates the AAC encoder accepts (MPEG-4 sampling-frequency table, ≤ 48 kHz).
AAC_SAMPLE_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)

# x264 preset: on 2 CPU cores a 17x256x256 clip with 2 s of audio takes
# ~80-120 ms with "veryfast" vs ~60-75 ms with "ultrafast" (which drops CABAC
# and B-frames, giving 25-40% bigger files) and up to ~300 ms with "medium"
# (no smaller). "veryfast" is the size/latency knee.
X264_PRESET = "veryfast"

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}


class MediaError(ValueError):
    """Bad media input. The message names the offending field and the allowed values."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class MediaInfo:
    """What :func:`probe_media` found. MP4-only fields are None for PNG."""

    container: str  # "png" or "mp4"
    width: int
    height: int
    frames: int  # decoded video frames; 1 for PNG
    fps: float | None
    duration_s: float | None  # video stream duration
    video_codec: str | None
    pixel_format: str | None
    audio_codec: str | None  # None when there is no audio stream
    audio_sample_rate: int | None
    audio_channels: int | None
    audio_duration_s: float | None  # from decoded samples


def _dtype_name(x) -> str:
    return str(getattr(x, "dtype", type(x).__name__)).removeprefix("torch.")


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.float()  # numpy has no bfloat16
        return x.numpy()
    return np.asarray(x)


def _uint8_rgb(x, field: str, layout: str, ndim: int) -> np.ndarray:
    """Validate a uint8 RGB array with `ndim` dims ending in 3 channels."""
    if _dtype_name(x) != "uint8":
        raise MediaError(field, f"must be uint8 {layout}, got dtype {_dtype_name(x)}")
    arr = _to_numpy(x)
    if arr.ndim != ndim or arr.shape[-1] != 3:
        raise MediaError(field, f"must have shape {layout} (RGB), got {list(arr.shape)}")
    return np.ascontiguousarray(arr)  # PyAV and Pillow read the raw buffer


def encode_png(image) -> bytes:
    """Encode a uint8 [H, W, 3] RGB image as PNG bytes."""
    arr = _uint8_rgb(image, "image", "[H, W, 3]", ndim=3)
    if 0 in arr.shape[:2]:
        raise MediaError("image", f"height and width must be > 0, got {list(arr.shape)}")
    buf = io.BytesIO()
    # level 1: ~4x faster than PIL's default 6 for ~25% more bytes; encoding sits on the request path
    Image.fromarray(arr).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def _check_audio(audio) -> np.ndarray:
    """Validate a waveform; return it as contiguous float32 [C, S] in [-1, 1]."""
    arr = _to_numpy(audio)
    if not np.issubdtype(arr.dtype, np.floating):
        raise MediaError("audio", f"must be a float waveform in [-1, 1], got dtype {_dtype_name(audio)}")
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[0] not in _AUDIO_LAYOUTS or arr.shape[1] == 0:
        raise MediaError(
            "audio", f"must have shape [S] or [C, S] with C in (1, 2) and S > 0, got {list(np.shape(audio))}"
        )
    if not np.isfinite(arr).all():
        raise MediaError("audio", "contains NaN or inf")
    # Out-of-range samples are clipped rather than rejected: diffusion decoders
    # overshoot slightly, and clipping is what playback would do anyway.
    return np.ascontiguousarray(np.clip(arr, -1.0, 1.0), dtype=np.float32)


def encode_mp4(frames, fps: int, audio=None, sample_rate: int = 16000, crf: int = 23) -> bytes:
    """Encode uint8 [F, H, W, 3] RGB frames as H.264/yuv420p MP4, optionally with AAC audio.

    `audio` is a float waveform, [S] (mono) or [C, S] with C in (1, 2), in [-1, 1];
    values outside that range are clipped, NaN/inf is an error. Audio and video
    durations need not match: the container holds both streams as given.
    """
    arr = _uint8_rgb(frames, "frames", "[F, H, W, 3]", ndim=4)
    n, height, width = arr.shape[:3]
    if n == 0:
        raise MediaError("frames", "must contain at least 1 frame, got 0")
    _check_encoding(width, height, fps, crf, sample_rate)
    wave = None if audio is None else _check_audio(audio)
    fps, sample_rate = int(fps), int(sample_rate)  # plain ints for PyAV (numpy ints pass validation)

    buf = io.BytesIO()
    # No "+faststart": the mp4 muxer implements it as a second pass that
    # reopens the output by filename, which fails on a BytesIO at close().
    with av.open(buf, "w", format="mp4") as out:
        video, sound = _add_streams(out, width, height, fps, crf, wave, sample_rate)
        for packet in _encode_frames(video, arr, 0):
            out.mux(packet)
        out.mux(video.encode(None))
        if sound is not None and wave is not None:
            out.mux(_encode_audio(sound, wave, sample_rate))
    return buf.getvalue()


def _check_encoding(width: int, height: int, fps: int, crf: int, sample_rate: int) -> None:
    for name, size in (("height", height), ("width", width)):
        if size <= 0 or size % 2:
            raise MediaError(name, f"must be a positive even number (yuv420p halves chroma), got {size}")
    if not isinstance(fps, numbers.Integral) or isinstance(fps, bool) or fps <= 0:
        raise MediaError("fps", f"must be a positive integer, got {fps!r}")
    if not isinstance(crf, numbers.Integral) or isinstance(crf, bool) or not 0 <= crf <= 51:
        raise MediaError("crf", f"must be an integer in [0, 51], got {crf!r}")
    # Checked even without audio, so a bad config fails before audio shows up.
    if not isinstance(sample_rate, numbers.Integral) or sample_rate not in AAC_SAMPLE_RATES:
        raise MediaError("sample_rate", f"must be one of {list(AAC_SAMPLE_RATES)}, got {sample_rate!r}")


def _add_streams(out, width: int, height: int, fps: int, crf: int, wave: np.ndarray | None, sample_rate: int):
    """The H.264 stream and (with ``wave``) the AAC one, set up alike for the whole MP4 and the fragmented one: the
    same encoder on the same frames makes the same packets."""
    video = out.add_stream("libx264", rate=fps)
    video.width, video.height, video.pix_fmt = width, height, "yuv420p"
    video.options = {"crf": str(crf), "preset": X264_PRESET}
    sound = None
    if wave is not None:
        sound = out.add_stream("aac", rate=sample_rate, layout=_AUDIO_LAYOUTS[wave.shape[0]])
    return video, sound


def _encode_frames(video, frames: np.ndarray, first: int) -> Iterator:
    """The packets the encoder has ready after ``frames`` (numbered from ``first``). Explicit pts so output depends
    only on the inputs."""
    tb = Fraction(1, video.codec_context.framerate)
    for i, rgb in enumerate(frames, first):
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts, frame.time_base = i, tb
        yield from video.encode(frame)


def _encode_audio(sound, wave: np.ndarray, sample_rate: int) -> list:
    """Every AAC packet of ``wave``: one frame for the whole waveform, which PyAV re-chunks into the encoder's
    1024-sample AAC frames itself."""
    frame = av.AudioFrame.from_ndarray(wave, format="fltp", layout=sound.layout.name)
    frame.sample_rate, frame.pts, frame.time_base = sample_rate, 0, Fraction(1, sample_rate)
    return [*sound.encode(frame), *sound.encode(None)]


class _Appended:
    """A write-only file PyAV muxes into: what was written since the last ``take``."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data, self.parts = b"".join(self.parts), []
        return data


class FragmentedMp4:
    """A fragmented MP4 (an empty ``moov``, then a ``moof``/``mdat`` per frame) written as its frames come, for a
    player to play while it arrives. The encoders and their settings are ``encode_mp4``'s and the frames go to them
    in the same order, so the packets, and the frames and sound they decode to, are the whole MP4's.

    The waveform comes first (``start``): a browser starts playing only once every track it was told of has data,
    so each fragment carries the sound of its time. ``add`` returns the bytes made of the frames so far (the
    encoder's lookahead holds the newest few back); ``finish`` the rest. One thread at a time."""

    # frag_every_frame: the muxer writes a frame's fragment when the next packet arrives (frag_custom would need
    # av_write_frame(NULL), which PyAV does not expose); flush_packets: each write reaches ``_Appended`` at once
    MOVFLAGS = "frag_every_frame+empty_moov+default_base_moof"

    def __init__(self, width: int, height: int, fps: int, sample_rate: int = 16000, crf: int = 23):
        _check_encoding(width, height, fps, crf, sample_rate)
        self.width, self.height, self.fps, self.sample_rate, self.crf = width, height, int(fps), int(sample_rate), crf
        self.file = _Appended()
        self.out: Any = None  # the container, once started
        self.frames = 0
        self.audio: list = []  # AAC packets not muxed yet, in time order
        self.muxed: list = []  # every packet muxed, in order: ``whole`` muxes them again
        self.leads: dict[int, int] = {}  # stream index -> what its timestamps are moved by (its first dts to 0)

    def start(self, audio=None) -> bytes:
        """Open the stream with its sound (None: no audio track); the header bytes."""
        wave = None if audio is None else _check_audio(audio)
        self.out = av.open(self.file, "w", format="mp4", options={"movflags": self.MOVFLAGS, "flush_packets": "1"})
        self.video, sound = _add_streams(self.out, self.width, self.height, self.fps, self.crf, wave, self.sample_rate)
        self.streams = [self.video] if sound is None else [self.video, sound]
        if sound is not None and wave is not None:
            self.audio = _encode_audio(sound, wave, self.sample_rate)
        self.out.start_encoding()
        return self.file.take()

    def _mux(self, packets: list) -> None:
        for packet in packets:
            if packet.pts is not None and packet.time_base is not None:
                self._mux_audio_until(float(packet.pts * packet.time_base))
            self._mux_one(packet)

    def _mux_one(self, packet) -> None:
        self.muxed.append((packet.stream.index, packet.pts, packet.dts, packet.time_base, packet))
        # Both encoders start before 0 (x264's B-frame delay, AAC's priming samples), each by its own amount; a
        # fragmented MP4 has no edit list to say so, and its muxer stretched the later track's first sample (players
        # then dropped frames). Each track starts at 0 instead: the sound plays |1024/rate - 2/fps| off the
        # pictures in the stream (19 ms at 16 kHz and 24 fps), never in the finished file (``whole``)
        lead = self.leads.setdefault(packet.stream.index, -packet.dts)
        packet.pts, packet.dts = packet.pts + lead, packet.dts + lead
        self.out.mux(packet)

    def _mux_audio_until(self, seconds: float | None) -> None:
        while self.audio and (seconds is None or float(self.audio[0].pts * self.audio[0].time_base) <= seconds):
            self._mux_one(self.audio.pop(0))

    def add(self, frames) -> bytes:
        """Encode uint8 [f, H, W, 3] frames; the bytes made so far."""
        if self.out is None:
            raise RuntimeError("FragmentedMp4.add before start")
        arr = _uint8_rgb(frames, "frames", "[F, H, W, 3]", ndim=4)
        if arr.shape[1:3] != (self.height, self.width):
            raise MediaError("frames", f"must be {self.height}x{self.width}, got {arr.shape[1]}x{arr.shape[2]}")
        self._mux(list(_encode_frames(self.video, arr, self.frames)))
        self.frames += len(arr)
        return self.file.take()

    def finish(self) -> bytes:
        """Flush the encoder and the sound left; the last bytes."""
        if self.out is None:
            raise RuntimeError("FragmentedMp4.finish before start")
        if self.frames == 0:
            raise MediaError("frames", "must contain at least 1 frame, got 0")
        self._mux(list(self.video.encode(None)))
        self._mux_audio_until(None)
        self.out.close()
        return self.file.take()

    def whole(self) -> bytes:
        """After ``finish``: the same packets in a whole MP4, muxed as ``encode_mp4`` muxes its own (nothing is
        encoded again, so the frames and sound are the stream's exactly; two ``encode_mp4`` runs of the same frames
        differ: x264's frame threads are not deterministic here)."""
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as out:
            streams = {s.index: out.add_stream_from_template(s) for s in self.streams}
            for index, pts, dts, time_base, packet in self.muxed:  # as they were before the muxer rebased them
                packet.stream, packet.time_base, packet.pts, packet.dts = streams[index], time_base, pts, dts
                out.mux(packet)
        return buf.getvalue()


class Mp4Stream:
    """A ``stages.MediaSink`` that writes the clip as a ``FragmentedMp4`` while it decodes: ``emit(data, frames)``
    gets each run of bytes in order with the frames encoded so far (the header with the first frames: their size
    opens it); ``finish`` emits the rest. The encode runs on a thread of its own beside the decode (x264 and the
    colour conversion release the GIL), at most ``AHEAD`` chunks behind it: the decode waits there rather than hold
    more frames. ``emit`` is called on that thread (the last run, ``finish``'s, on the caller's) and must hand off,
    not block; every call comes before ``finish`` returns. ``close`` ends the thread of a decode that failed (a no-op
    after ``finish``)."""

    AHEAD = 2  # chunks decoded but not yet encoded (a 1344x768 chunk of 17 frames: 53 MB)

    def __init__(self, fps: int, emit: Callable[[bytes, int], None], crf: int = 23):
        self.fps, self.emit, self.crf = fps, emit, crf
        self.wave: np.ndarray | None = None
        self.sample_rate = 16000
        self.writer: FragmentedMp4 | None = None
        self._chunks: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=self.AHEAD)
        self._encoder: threading.Thread | None = None
        self._error: BaseException | None = None

    def audio(self, audio, sample_rate: int) -> None:
        self.wave, self.sample_rate = audio, sample_rate

    def frames(self, frames) -> None:
        self._raise()
        if self._encoder is None:
            self._encoder = threading.Thread(target=self._encode, name="h3serve-mp4-stream", daemon=True)
            self._encoder.start()
        self._chunks.put(np.asarray(frames))  # [f, H, W, 3] uint8; blocks while AHEAD chunks wait

    def _encode(self) -> None:
        """The encoder thread: each chunk into the stream, in order, until None; the first error is kept for the
        decoding thread (``_raise``) and the chunks after it are dropped."""
        while (frames := self._chunks.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._add(frames)
            except BaseException as e:  # noqa: BLE001 - raised on the decoding thread
                self._error = e

    def _add(self, frames: np.ndarray) -> None:
        if self.writer is None:
            height, width = np.shape(frames)[1:3]
            self.writer = FragmentedMp4(width, height, self.fps, self.sample_rate, self.crf)
            header = self.writer.start(self.wave)
            self._emit(header + self.writer.add(frames))
            return
        self._emit(self.writer.add(frames))

    def _emit(self, data: bytes) -> None:
        assert self.writer is not None
        self.emit(data, self.writer.frames)

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the encoder thread (after its queued chunks) and wait for it."""
        if self._encoder is not None and self._encoder.is_alive():
            self._chunks.put(None)
            self._encoder.join()

    def finish(self) -> None:
        if self._encoder is None:
            raise MediaError("frames", "must contain at least 1 frame, got 0")
        self.close()
        self._raise()
        self._emit(self.writer.finish())  # type: ignore[union-attr]  # set by the first chunk, or _raise raised

    def mp4(self) -> bytes:
        """The finished file: the stream's own packets in a whole MP4 (``FragmentedMp4.whole``), so its frames and
        sound are the stream's exactly, and no second encode is paid."""
        assert self.writer is not None
        return self.writer.whole()


def _probe_png(data: bytes) -> MediaInfo:
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # decode, so truncated data is caught here
            width, height = img.size
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError("data", f"not a decodable PNG: {e}") from e
    return MediaInfo("png", width, height, 1, None, None, None, None, None, None, None, None)


def _probe_mp4(data: bytes) -> MediaInfo:
    try:
        with av.open(io.BytesIO(data), "r", format="mp4") as inp:
            if not inp.streams.video:
                raise MediaError("data", "MP4 has no video stream")
            video = inp.streams.video[0]
            sound = inp.streams.audio[0] if inp.streams.audio else None
            frames = samples = 0
            for frame in inp.decode(*(s for s in (video, sound) if s)):  # one pass, both streams
                if isinstance(frame, av.VideoFrame):
                    frames += 1
                else:
                    samples += frame.samples
            ctx = video.codec_context
            rate = video.average_rate or video.guessed_rate
            fps = float(rate) if rate else None
            duration: float | None = None
            if video.duration is not None and video.time_base:
                duration = float(video.duration * video.time_base)
            else:
                duration = frames / fps if fps else None
            info = dict(
                container="mp4",
                width=ctx.width,
                height=ctx.height,
                frames=frames,
                fps=fps,
                duration_s=duration,
                video_codec=ctx.name,
                pixel_format=ctx.format.name if ctx.format else None,
                audio_codec=None,
                audio_sample_rate=None,
                audio_channels=None,
                audio_duration_s=None,
            )
            if sound is not None:
                rate_hz = sound.codec_context.sample_rate
                audio_s = samples / rate_hz
                # The AAC decoder emits whole 1024-sample frames; the padding in
                # the last one is only trimmed by the container's declared
                # duration, so cap at it to report what a player plays.
                if sound.duration is not None and sound.time_base:
                    audio_s = min(audio_s, float(sound.duration * sound.time_base))
                info.update(
                    audio_codec=sound.codec_context.name,
                    audio_sample_rate=rate_hz,
                    audio_channels=sound.codec_context.channels,
                    audio_duration_s=audio_s,
                )
    except av.FFmpegError as e:
        raise MediaError("data", f"neither PNG nor decodable MP4: {e}") from e
    return MediaInfo(**info)


def probe_media(data: bytes) -> MediaInfo:
    """Fully decode PNG or MP4 bytes and report what they contain."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
        raise MediaError("data", "must be non-empty PNG or MP4 bytes")
    data = bytes(data)
    return _probe_png(data) if data.startswith(_PNG_SIGNATURE) else _probe_mp4(data)
