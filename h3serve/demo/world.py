"""The procedural world a tiny MiniMax-H3 can be trained and judged on: one shape, one motion, one sound.

A scene is a shape (circle, square, triangle) of one of six named colours on a plain dark background,
moving left, right, up or down across the clip or staying still, with a soundtrack the prompt names:
a low hum, a high beep, or silence. Its prompt comes from one of a few templates over the tiny
tokenizer's whole-word vocabulary (``h3serve.pipelines.h3.checkpoint.TOKENIZER_CORPUS``).

Rendering follows the checkpoint's own rules (``h3serve.pipelines.h3.ModelRules``): frame rate, canvas and
clip length of the video, sample rate of the stereo audio. Everything is deterministic: a scene
renders to the same arrays every time, and the scene lists are fixed or drawn from a seeded generator.

The held-out split: of the 6 x 3 x 5 = 90 colour-shape-motion combinations, the 18 where
``(colour index + 2 * shape index) % 5 == motion index`` are held out (``HELD_OUT``). Each
colour-shape pair has exactly one held-out motion, and every colour, shape and motion appears in both
parts, so a held-out clip asks for a combination never seen as a whole, of parts all seen. The
transformer never trains on them; the autoencoders, which learn pixels and waveforms rather than
prompts, train on every combination (the shapes must all be in their vocabulary). The soundtrack is
not part of the split: every sound goes with every combination.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Iterator

import numpy as np
from PIL import Image, ImageDraw

from h3serve.pipelines.h3 import ModelRules

# Six hues 60 degrees apart at full saturation: no two are confusable after a lossy decoder.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "yellow": (230, 220, 40),
    "green": (40, 200, 60),
    "cyan": (40, 210, 220),
    "blue": (50, 70, 230),
    "magenta": (220, 50, 210),
}
BACKGROUND = (30, 30, 30)  # plain, dark and grey: any named colour stands out from it
SHAPES = ("circle", "square", "triangle")
MOTIONS = ("left", "right", "up", "down", "still")
SOUNDS = ("low hum", "high beep", "silence")
# The tones' fundamental frequencies (Hz), far apart on either side of the detectors' boundary and low
# enough for the tiny 8 kHz audio VAE (Nyquist 4 kHz) as for the released 32 kHz one. Each fits a whole
# number of cycles in one audio latent (200 samples at 8 kHz, 800 at 32 kHz): a steady tone's latents are
# then the same at every position, and a decoder learns one code per sound.
TONE_HZ = {"low hum": 160.0, "high beep": 1000.0}
TONE_AMPLITUDE = 0.3
# Size and travel as fractions of the canvas: the shape's half-extent is SIZE * the short edge; a moving
# shape's centre crosses TRAVEL of the canvas's width (left/right) or height (up/down) over the clip. At 0.25 a
# shape spans two of the video VAE's 16-pixel latent blocks on the 64-pixel edge: at 0.18 (1.5 blocks) its round
# trip kept the colour but lost circle from square (docs/BENCHMARKS.md section 8).
SIZE = 0.25
TRAVEL = 0.4

# {colour} {shape} {motion} {sound}: the motion is "moving left" or "still"; the sound "a low hum" or "silence"
TEMPLATES = (
    "a {colour} {shape} {motion} with {sound}",
    "{sound} and a {colour} {shape} {motion}",
    "a {shape} in {colour} {motion} with {sound}",
)


@dataclasses.dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    motion: str
    sound: str
    template: int = 0

    def __post_init__(self):
        for field, value, allowed in (
            ("colour", self.colour, tuple(COLOURS)),
            ("shape", self.shape, SHAPES),
            ("motion", self.motion, MOTIONS),
            ("sound", self.sound, SOUNDS),
        ):
            if value not in allowed:
                raise ValueError(f"{field} must be one of {', '.join(allowed)}, got {value!r}")
        if not 0 <= self.template < len(TEMPLATES):
            raise ValueError(f"template must be an index below {len(TEMPLATES)}, got {self.template}")

    @property
    def combination(self) -> tuple[str, str, str]:
        return self.colour, self.shape, self.motion

    @property
    def held_out(self) -> bool:
        return self.combination in HELD_OUT

    @property
    def prompt(self) -> str:
        motion = "still" if self.motion == "still" else f"moving {self.motion}"
        sound = "silence" if self.sound == "silence" else f"a {self.sound}"
        return TEMPLATES[self.template].format(colour=self.colour, shape=self.shape, motion=motion, sound=sound)

    def attributes(self) -> dict[str, str]:
        """What the detectors should find: attribute -> class name."""
        return {"colour": self.colour, "shape": self.shape, "motion": self.motion, "sound": self.sound}


def _held_out() -> frozenset[tuple[str, str, str]]:
    colours = list(COLOURS)
    return frozenset(
        (colour, shape, MOTIONS[(colours.index(colour) + 2 * SHAPES.index(shape)) % len(MOTIONS)])
        for colour, shape in itertools.product(colours, SHAPES)
    )


HELD_OUT = _held_out()  # 18 (colour, shape, motion) combinations the transformer never trains on
COMBINATIONS = tuple(itertools.product(COLOURS, SHAPES, MOTIONS))


def held_out_scenes(n: int, seed: int = 0) -> list[Scene]:
    """``n`` held-out scenes: the held-out combinations in a seeded order, cycled, each with a sound and a
    template in turn (so any n >= 18 covers every combination, and the sounds and templates evenly)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    combinations = sorted(HELD_OUT)
    random.Random(seed).shuffle(combinations)
    return [
        Scene(*combinations[i % len(combinations)], sound=SOUNDS[i % len(SOUNDS)], template=i % len(TEMPLATES))
        for i in range(n)
    ]


def training_scenes(seed: int = 0, combinations: Iterable[tuple[str, str, str]] = COMBINATIONS) -> Iterator[Scene]:
    """An endless seeded stream of scenes outside the held-out set (what the transformer trains on), of
    ``combinations`` (default: the whole world)."""
    rng = random.Random(seed)
    seen = [c for c in combinations if c not in HELD_OUT]
    if not seen:
        raise ValueError("no combination outside the held-out set to train on")
    while True:
        yield Scene(*rng.choice(seen), sound=rng.choice(SOUNDS), template=rng.randrange(len(TEMPLATES)))


def all_scenes() -> list[Scene]:
    """Every colour x shape x motion x sound (the autoencoders' world, and the detectors' test)."""
    return [Scene(c, s, m, sound) for (c, s, m), sound in itertools.product(COMBINATIONS, SOUNDS)]


@dataclasses.dataclass(frozen=True)
class ClipFormat:
    """The frames and samples of one clip, in the model's rules."""

    width: int
    height: int
    num_frames: int
    fps: int
    sample_rate: int

    @classmethod
    def of(
        cls, rules: ModelRules, width: int | None = None, height: int | None = None, num_frames: int | None = None
    ) -> ClipFormat:
        """The checkpoint's format: its default canvas and shortest clip unless given (and checked)."""
        if (width is None) != (height is None):
            raise ValueError("give both width and height, or neither")
        if width is None or height is None:
            width, height = rules.default_canvas
        rules.check_canvas(width, height)
        num_frames = num_frames or rules.min_frames
        rules.check_frames(num_frames)
        return cls(width, height, num_frames, rules.fps, rules.sample_rate)

    @property
    def num_samples(self) -> int:
        return round(self.num_frames / self.fps * self.sample_rate)


def centre_track(scene: Scene, fmt: ClipFormat) -> np.ndarray:
    """[F, 2] float (x, y) pixel centre of the shape in every frame: linear from start to end."""
    w, h = fmt.width, fmt.height
    progress = np.linspace(0.0, 1.0, fmt.num_frames)  # [F]
    start, end = 0.5 - TRAVEL / 2, 0.5 + TRAVEL / 2
    x = np.full_like(progress, 0.5 * w)
    y = np.full_like(progress, 0.5 * h)
    if scene.motion in ("left", "right"):
        x = w * (start + (end - start) * (progress if scene.motion == "right" else 1 - progress))
    elif scene.motion in ("up", "down"):  # image rows grow downwards
        y = h * (start + (end - start) * (progress if scene.motion == "down" else 1 - progress))
    return np.stack([x, y], axis=1)


def _draw(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill: tuple[int, int, int]):
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:  # an upright isosceles triangle filling the same box: half of it
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)


def render_video(scene: Scene, fmt: ClipFormat) -> np.ndarray:
    """uint8 [F, H, W, 3]: the scene's frames."""
    radius = SIZE * min(fmt.width, fmt.height)
    frames = np.empty((fmt.num_frames, fmt.height, fmt.width, 3), dtype=np.uint8)
    for i, (cx, cy) in enumerate(centre_track(scene, fmt)):
        image = Image.new("RGB", (fmt.width, fmt.height), BACKGROUND)
        _draw(ImageDraw.Draw(image), scene.shape, float(cx), float(cy), radius, COLOURS[scene.colour])
        frames[i] = np.asarray(image)
    return frames


def render_audio(scene: Scene, fmt: ClipFormat) -> np.ndarray:
    """float32 [2, S] stereo in [-1, 1]: the named tone on both channels, or zeros for silence."""
    if scene.sound == "silence":
        return np.zeros((2, fmt.num_samples), dtype=np.float32)
    hz = TONE_HZ[scene.sound]
    if hz >= fmt.sample_rate / 2:
        raise ValueError(f"a {hz:g} Hz tone cannot be sampled at {fmt.sample_rate} Hz")
    t = np.arange(fmt.num_samples) / fmt.sample_rate  # [S] seconds
    tone = TONE_AMPLITUDE * np.sin(2 * math.pi * hz * t)
    return np.stack([tone, tone]).astype(np.float32)


def render(scene: Scene, fmt: ClipFormat) -> tuple[np.ndarray, np.ndarray]:
    """(frames uint8 [F, H, W, 3], audio float32 [2, S]) of the scene in ``fmt``."""
    return render_video(scene, fmt), render_audio(scene, fmt)
