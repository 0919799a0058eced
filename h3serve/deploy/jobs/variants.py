"""A finished clip's image variants, made from its MP4's decoded frames (PyAV) and kept beside it in the job store.

``thumbnail``: the middle frame, full size, PNG (lossless: its pixels are the decoded frame's). ``spritesheet``: a
SPRITE_COLUMNS x SPRITE_ROWS grid of evenly spaced frames (the first to the last), each scaled to SPRITE_TILE_WIDTH
pixels wide, row-major, JPEG; a clip with fewer frames repeats some. Both are made once, on the first request, by
whichever ingress gets it (``store.JobStore.media``); two ingresses making one at once write the same bytes.

``joined``: an extension (``POST /v1/videos/{id}/extend`` with ``join: true``) after its source, one MP4 (``join``),
made once when the extension completes and kept with it (its bytes counted in the store's cap), never on request.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np

SPRITE_COLUMNS, SPRITE_ROWS = 3, 3
SPRITE_TILE_WIDTH = 256  # a gallery's hover preview; a narrower clip keeps its own width
SPRITE_QUALITY = 85
# variant -> (store name suffix, media type); "video" is the MP4 itself
VARIANTS: dict[str, tuple[str, str]] = {
    "video": (".mp4", "video/mp4"),
    "thumbnail": (".thumbnail.png", "image/png"),
    "spritesheet": (".spritesheet.jpg", "image/jpeg"),
    "joined": (".joined.mp4", "video/mp4"),
}


def frame_count(mp4: bytes) -> int:
    """The video stream's frames, counted from its packets (the container's count is not always written)."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return sum(1 for packet in container.demux(video=0) if packet.size)


def decoded_frames(mp4: bytes, indices: list[int]) -> dict[int, np.ndarray]:
    """The frames at ``indices`` (counted in presentation order, as PyAV decodes them), each [H, W, 3] uint8 RGB."""
    import av

    wanted, found = set(indices), {}
    with av.open(io.BytesIO(mp4)) as container:
        for index, frame in enumerate(container.decode(video=0)):
            if index in wanted:
                found[index] = frame.to_ndarray(format="rgb24")  # [H, W, 3]
            if len(found) == len(wanted):
                break
    if len(found) != len(wanted):
        raise ValueError(f"the MP4 has {len(found)} of the frames {sorted(wanted)}")
    return found


def thumbnail(mp4: bytes) -> bytes:
    """The middle frame as a PNG."""
    from PIL import Image

    middle = frame_count(mp4) // 2
    out = io.BytesIO()
    Image.fromarray(decoded_frames(mp4, [middle])[middle]).save(out, format="PNG")
    return out.getvalue()


def sprite_indices(frames: int, tiles: int = SPRITE_COLUMNS * SPRITE_ROWS) -> list[int]:
    """``tiles`` evenly spaced frame indices from the first to the last (repeating when the clip is shorter)."""
    if frames < 1:
        raise ValueError("the MP4 has no video frames")
    return [round(i * (frames - 1) / max(tiles - 1, 1)) for i in range(tiles)]


def sprite_tile_size(width: int, height: int) -> tuple[int, int]:
    """A tile's (width, height) for a clip of ``width`` x ``height``: SPRITE_TILE_WIDTH wide at most, aspect kept."""
    tile_width = min(width, SPRITE_TILE_WIDTH)
    return tile_width, max(1, math.floor(height * tile_width / width + 0.5))


def spritesheet(mp4: bytes) -> bytes:
    """SPRITE_COLUMNS x SPRITE_ROWS evenly spaced frames in one JPEG, row-major."""
    from PIL import Image

    indices = sprite_indices(frame_count(mp4))
    frames = decoded_frames(mp4, indices)
    height, width, _ = frames[indices[0]].shape
    tile_w, tile_h = sprite_tile_size(width, height)
    sheet = Image.new("RGB", (tile_w * SPRITE_COLUMNS, tile_h * SPRITE_ROWS))
    for slot, index in enumerate(indices):
        tile = Image.fromarray(frames[index]).resize((tile_w, tile_h), Image.Resampling.LANCZOS)
        sheet.paste(tile, ((slot % SPRITE_COLUMNS) * tile_w, (slot // SPRITE_COLUMNS) * tile_h))
    out = io.BytesIO()
    sheet.save(out, format="JPEG", quality=SPRITE_QUALITY)
    return out.getvalue()


def _video_and_sound(mp4: bytes) -> tuple[np.ndarray, int, np.ndarray | None, int]:
    """An MP4's frames [N, H, W, 3] uint8, its frame rate, its sound [C, S] float32 (None without) and sample rate."""
    import av

    with av.open(io.BytesIO(mp4)) as container:
        video = container.streams.video[0]
        fps = int(video.average_rate or video.guessed_rate)
        audio = container.streams.audio[0] if container.streams.audio else None
        rate = audio.codec_context.sample_rate if audio is not None else 0
        frames, sound = [], []
        for frame in container.decode(*(s for s in (video, audio) if s is not None)):  # one pass, both streams
            if isinstance(frame, av.VideoFrame):
                frames.append(frame.to_ndarray(format="rgb24"))  # [H, W, 3]
            else:
                sound.append(frame.to_ndarray())  # [C, n] float32: AAC decodes to planar float
    return np.stack(frames), fps, np.concatenate(sound, axis=1) if sound else None, rate


def _span(sound: np.ndarray, first: int, last: int) -> np.ndarray:
    """Samples [first, last) of ``sound`` [C, S], silence past its end (AAC's frames rarely end on the video's)."""
    part = sound[:, first:last]
    return np.pad(part, ((0, 0), (0, last - first - part.shape[1])))


def join(source: bytes, extension: bytes) -> bytes:
    """The source's frames then the extension's after its first (FL2VA's first frame is the source's last: shown
    once), the sound cut to match: the source's for its frames' time, then the extension's from its second frame's.
    Both are decoded and encoded again as one MP4 with the served clips' encoder and settings (``encode_mp4``): H.264
    has no frame to cut at but a keyframe, and the extension's only keyframe is the dropped frame. The frames are the
    decoded ones within one more encode's loss."""
    from h3serve.pipelines.h3.media import encode_mp4

    before, fps, sound_before, rate = _video_and_sound(source)
    after, fps_after, sound_after, rate_after = _video_and_sound(extension)
    if (fps_after, after.shape[1:]) != (fps, before.shape[1:]) or rate_after != rate:
        raise ValueError(
            f"the extension ({after.shape[2]}x{after.shape[1]} at {fps_after} fps, {rate_after} Hz) does not match "
            f"its source ({before.shape[2]}x{before.shape[1]} at {fps} fps, {rate} Hz)"
        )
    frames = np.concatenate([before, after[1:]])  # [N_s + N_e - 1, H, W, 3]
    if sound_before is None or sound_after is None:
        return encode_mp4(frames, fps)
    edge, end = round(len(before) * rate / fps), round(len(after) * rate / fps)  # in samples
    skip = round(rate / fps)  # the extension's first frame's time
    sound = np.concatenate([_span(sound_before, 0, edge), _span(sound_after, skip, end)], axis=1)
    return encode_mp4(frames, fps, sound, rate)


MAKERS: dict[str, Callable[[bytes], bytes]] = {"thumbnail": thumbnail, "spritesheet": spritesheet}
