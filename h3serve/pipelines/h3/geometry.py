"""diffusers' MiniMax-H3 clip and canvas geometry, restated without importing diffusers (and so torch).

The ingress validates requests against a checkpoint's ``ModelRules`` and must start without torch; diffusers'
``modular_pipelines.minimax_h3`` cannot be imported without it. These are the same functions and constants as
``diffusers/modular_pipelines/minimax_h3/modular_pipeline.py`` (0.42), and tests/test_ingress_imports.py holds them
equal to diffusers' own over a grid of inputs, so a diffusers release that changes them fails there.
"""

from __future__ import annotations

MINIMAX_H3_MIN_ASPECT_RATIO = 1 / 4
MINIMAX_H3_MAX_ASPECT_RATIO = 4
MINIMAX_H3_FPS = 24
MINIMAX_H3_AUDIO_LATENTS_PER_SECOND = 40


def resolve_canvas_size(
    aspect_width: float,
    aspect_height: float,
    canvas_multiple: int,
    short_edge: int,
    max_pixels: int,
    min_aspect_ratio: float = MINIMAX_H3_MIN_ASPECT_RATIO,
    max_aspect_ratio: float = MINIMAX_H3_MAX_ASPECT_RATIO,
) -> tuple[int, int]:
    """(height, width) of the canvas at this aspect: short edge ``short_edge``, area capped at ``max_pixels``,
    both axes rounded to ``canvas_multiple``."""
    if aspect_width <= 0 or aspect_height <= 0:
        raise ValueError(f"The aspect ratio must be positive, got {aspect_width}:{aspect_height}.")
    ratio = aspect_width / aspect_height
    if not min_aspect_ratio <= ratio <= max_aspect_ratio:
        raise ValueError(
            f"MiniMax-H3 supports aspect ratios from 1:{1 / min_aspect_ratio:g} to {max_aspect_ratio:g}:1, got "
            f"{aspect_width}:{aspect_height} ({ratio:g})."
        )
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        width, height = width * scale, height * scale
    multiple = canvas_multiple
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def align_num_frames(num_frames: int, frames_per_chunk: int, latents_per_chunk: int) -> int:
    """``num_frames`` snapped up to the next ``frames_per_chunk * n + latents_per_chunk``."""
    if num_frames < 1:
        raise ValueError(f"`num_frames` must be positive, got {num_frames}.")
    while num_frames % frames_per_chunk != latents_per_chunk:
        num_frames += 1
    return num_frames


def video_latent_num_frames(num_frames: int, frames_per_chunk: int, latents_per_chunk: int) -> int:
    """Latent frames of an aligned clip: 17n+5 frames -> 5n+2."""
    if num_frames % frames_per_chunk != latents_per_chunk:
        raise ValueError(
            f"`num_frames` must be of the form {frames_per_chunk} * n + {latents_per_chunk}, got {num_frames}."
        )
    return (num_frames - latents_per_chunk) // frames_per_chunk * latents_per_chunk + 2


def audio_latent_num_frames(
    num_frames: int, fps: float = MINIMAX_H3_FPS, latents_per_second: int = MINIMAX_H3_AUDIO_LATENTS_PER_SECOND
) -> int:
    """Audio latents covering ``num_frames`` video frames at ``fps``."""
    return int(round(num_frames / fps * latents_per_second))
