"""Analytic judges of a generated clip: which colour, shape, motion and sound it shows (no learned model).

Each detector returns a class name of ``h3serve.demo.world`` or None, "unknown": a clip that does not look like
a scene of the world (noise, several colours, no object, an object filling the frame, no clear tone)
gets None rather than a confident wrong class. The picture detectors share one segmentation: the
background is the clip's median colour (the shape covers a small part of the canvas), and the object
is every pixel that differs from it by more than ``FOREGROUND_DIFF`` in some channel.

- colour: the hue of each saturated object pixel, named by the nearest of the world's six hues; the
  winning name must hold ``MIN_VOTE`` of the votes.
- motion: the object's centroid track, the median of its last quarter of frames minus its first
  quarter's, in fractions of the canvas; below ``STILL_BELOW`` on both axes it is still, otherwise one
  axis must dominate the other.
- shape: how much of its bounding box the object fills (square 1, circle pi/4, triangle 1/2), per frame,
  the box trimmed to the 1st-99th percentile of the object's pixels so stray pixels do not stretch it;
  the frames vote.
- sound: RMS below ``SILENCE_RMS`` is silence; otherwise the spectral peak of the mono mix must hold
  ``MIN_TONALITY`` of the energy (a tone, not noise) and lie within a factor ``PITCH_TOLERANCE`` of one
  of the world's tones (``world.TONE_HZ``); a clear tone elsewhere (a decoder's Nyquist whine) is unknown.
"""

from __future__ import annotations

import numpy as np

from .world import COLOURS, TONE_HZ

FOREGROUND_DIFF = 48  # uint8 levels from the background colour, in any channel
MIN_OBJECT_SHARE, MAX_OBJECT_SHARE = 0.003, 0.35  # of a frame's pixels: the shapes cover 7-13% at 128x64, to 27% square
MIN_SATURATION, MIN_VALUE = 0.35, 0.25
MIN_VOTE = 0.6  # the winning class's share of the votes (pixels or frames)
STILL_BELOW, MOVING_ABOVE = 0.06, 0.12  # centroid displacement, fractions of the canvas (the world moves 0.3)
# fill ratio of the trimmed bounding box; the world's rasterised shapes: square 1.0, circle 0.78, triangle 0.58-0.61
SQUARE_ABOVE, CIRCLE_ABOVE, TRIANGLE_ABOVE = 0.9, 0.69, 0.45
TRIM_PERCENT = 1.0
SILENCE_RMS = 0.01  # the world's tones have RMS 0.21
MIN_TONALITY = 0.6  # the spectral peak's share of the energy: one clear tone (two equal tones hold 0.5 each)
PITCH_TOLERANCE = 1.5  # the peak's frequency ratio to the nearest tone at most (about 7 semitones either way)
LOWEST_HZ = 40.0  # below: DC and drift, not a pitch


def _hue_saturation_value(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, 3] uint8 RGB -> hue in degrees [0, 360), saturation and value in [0, 1], each [N]."""
    x = rgb.astype(np.float64) / 255.0
    high, low = x.max(axis=1), x.min(axis=1)
    chroma = high - low
    safe = np.where(chroma > 0, chroma, 1.0)
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    hue = np.where(high == r, ((g - b) / safe) % 6, np.where(high == g, (b - r) / safe + 2, (r - g) / safe + 4))
    saturation = np.where(high > 0, chroma / np.where(high > 0, high, 1.0), 0.0)
    return hue * 60.0, saturation, high


_NAMES = tuple(COLOURS)
_HUES = _hue_saturation_value(np.array(list(COLOURS.values()), dtype=np.uint8))[0]  # [colours] degrees


def segment(frames: np.ndarray) -> np.ndarray:
    """bool [F, H, W]: the object's pixels, those far from the clip's median (background) colour."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    background = np.median(frames.reshape(-1, 3), axis=0)  # [3]
    return (np.abs(frames.astype(np.int16) - background.astype(np.int16)) > FOREGROUND_DIFF).any(axis=-1)


def _object_frames(mask: np.ndarray) -> np.ndarray:
    """Indices of the frames whose object covers a plausible share of the canvas."""
    share = mask.mean(axis=(1, 2))  # [F]
    return np.flatnonzero((share >= MIN_OBJECT_SHARE) & (share <= MAX_OBJECT_SHARE))


def _vote(names: list[str | None]) -> str | None:
    counted = [n for n in names if n is not None]
    if not names or not counted:
        return None
    values, counts = np.unique(counted, return_counts=True)
    best = int(counts.argmax())
    return str(values[best]) if counts[best] >= MIN_VOTE * len(names) else None


def detect_colour(frames: np.ndarray, mask: np.ndarray | None = None) -> str | None:
    mask = segment(frames) if mask is None else mask
    valid = _object_frames(mask)
    if len(valid) < len(frames) / 2:
        return None
    pixels = frames[valid][mask[valid]]  # [N, 3]
    hue, saturation, value = _hue_saturation_value(pixels)
    coloured = (saturation >= MIN_SATURATION) & (value >= MIN_VALUE)
    if coloured.mean() < MIN_VOTE:  # mostly grey object pixels: no named colour
        return None
    distance = np.abs(hue[coloured, None] - _HUES[None, :])  # [N, colours] degrees
    nearest = np.minimum(distance, 360 - distance).argmin(axis=1)
    counts = np.bincount(nearest, minlength=len(_NAMES))
    best = int(counts.argmax())
    return _NAMES[best] if counts[best] >= MIN_VOTE * coloured.sum() else None


def detect_motion(frames: np.ndarray, mask: np.ndarray | None = None) -> str | None:
    mask = segment(frames) if mask is None else mask
    valid = _object_frames(mask)
    if len(valid) < max(4, len(frames) / 2):
        return None
    height, width = mask.shape[1:]
    ys, xs = np.mgrid[0:height, 0:width]
    weights = mask[valid].astype(np.float64)  # [V, H, W]
    counts = weights.sum(axis=(1, 2))
    track = np.stack(
        [(weights * xs).sum(axis=(1, 2)) / counts / width, (weights * ys).sum(axis=(1, 2)) / counts / height], axis=1
    )  # [V, 2] (x, y) fractions
    quarter = max(1, len(valid) // 4)
    dx, dy = np.median(track[-quarter:], axis=0) - np.median(track[:quarter], axis=0)
    if max(abs(dx), abs(dy)) < STILL_BELOW:
        return "still"
    major, minor = (dx, dy) if abs(dx) >= abs(dy) else (dy, dx)
    if abs(major) < MOVING_ABOVE or abs(minor) > abs(major) / 2:
        return None  # moving, but not clearly along one axis
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"  # image rows grow downwards


def _frame_shape(mask: np.ndarray) -> str | None:
    ys, xs = np.nonzero(mask)
    x0, x1 = np.percentile(xs, [TRIM_PERCENT, 100 - TRIM_PERCENT])
    y0, y1 = np.percentile(ys, [TRIM_PERCENT, 100 - TRIM_PERCENT])
    box = (x1 - x0 + 1) * (y1 - y0 + 1)
    inside = ((xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)).sum()
    fill = inside / box
    if fill >= SQUARE_ABOVE:
        return "square"
    if fill >= CIRCLE_ABOVE:
        return "circle"
    return "triangle" if fill >= TRIANGLE_ABOVE else None


def detect_shape(frames: np.ndarray, mask: np.ndarray | None = None) -> str | None:
    mask = segment(frames) if mask is None else mask
    valid = _object_frames(mask)
    if len(valid) < len(frames) / 2:
        return None
    return _vote([_frame_shape(mask[i]) for i in valid])


def detect_sound(audio: np.ndarray, sample_rate: int) -> str | None:
    """float [2, S] (or [S]) audio -> "silence", "low hum", "high beep" or None."""
    mono = np.asarray(audio, dtype=np.float64)
    mono = mono.mean(axis=0) if mono.ndim == 2 else mono  # [S]
    if mono.size == 0:
        raise ValueError("audio has no samples")
    if np.sqrt(np.mean(mono**2)) < SILENCE_RMS:
        return "silence"
    power = np.abs(np.fft.rfft(mono * np.hanning(mono.size))) ** 2  # [S/2 + 1]
    hz = np.fft.rfftfreq(mono.size, 1 / sample_rate)
    power[hz < LOWEST_HZ] = 0.0
    peak = int(power.argmax())
    near = np.abs(hz - hz[peak]) <= max(0.05 * hz[peak], 2 * hz[1])  # the peak and its window's spread
    if power[near].sum() < MIN_TONALITY * power.sum():
        return None
    ratios = {name: max(hz[peak] / tone, tone / hz[peak]) for name, tone in TONE_HZ.items()}
    nearest = min(ratios, key=ratios.__getitem__)
    return nearest if ratios[nearest] <= PITCH_TOLERANCE else None


def judge(frames: np.ndarray, audio: np.ndarray, sample_rate: int) -> dict[str, str | None]:
    """Every attribute of a clip: {"colour", "shape", "motion", "sound"} -> class name or None."""
    mask = segment(frames)
    return {
        "colour": detect_colour(frames, mask),
        "shape": detect_shape(frames, mask),
        "motion": detect_motion(frames, mask),
        "sound": detect_sound(audio, sample_rate),
    }
