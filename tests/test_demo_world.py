"""The demo world and its analytic judges: every scene renders as the checkpoint's rules say and is judged
right; noise, an empty canvas and ambiguous clips are judged unknown (None), never a confident wrong class."""

import numpy as np
import pytest

from h3serve.demo import detectors
from h3serve.demo.world import (
    COLOURS,
    COMBINATIONS,
    HELD_OUT,
    MOTIONS,
    SHAPES,
    SOUNDS,
    ClipFormat,
    Scene,
    all_scenes,
    held_out_scenes,
    render,
    render_audio,
    render_video,
    training_scenes,
)

SMALL = ClipFormat(width=64, height=64, num_frames=22, fps=24, sample_rate=8000)


@pytest.mark.slow  # the demo's tooling, ~4 s: `make test-fast` (the four packages' layers) leaves it out
def test_every_scene_is_judged_right_at_a_small_size():
    scenes = all_scenes()
    assert len(scenes) == len(COLOURS) * len(SHAPES) * len(MOTIONS) * len(SOUNDS) == 270
    wrong = []
    for scene in scenes:
        frames, audio = render(scene, SMALL)
        verdict = detectors.judge(frames, audio, SMALL.sample_rate)
        if verdict != scene.attributes():
            wrong.append((scene, verdict))
    assert not wrong, wrong[:5]


@pytest.mark.parametrize("width,height", [(128, 64), (64, 128)])
def test_scenes_are_judged_right_on_wide_and_tall_canvases(width, height):
    fmt = ClipFormat(width=width, height=height, num_frames=39, fps=24, sample_rate=32000)
    for scene in all_scenes()[::7]:  # every motion, shape, colour and sound appears in the stride
        frames, audio = render(scene, fmt)
        assert detectors.judge(frames, audio, fmt.sample_rate) == scene.attributes(), scene


def test_rendering_follows_the_checkpoint_rules(tiny_pipeline):
    rules = tiny_pipeline.rules
    fmt = ClipFormat.of(rules)
    assert (fmt.width, fmt.height) == rules.default_canvas
    assert (fmt.num_frames, fmt.fps, fmt.sample_rate) == (rules.min_frames, rules.fps, rules.sample_rate)
    scene = Scene("red", "circle", "left", "high beep")
    frames, audio = render(scene, fmt)
    assert frames.dtype == np.uint8 and frames.shape == (fmt.num_frames, fmt.height, fmt.width, 3)
    assert audio.dtype == np.float32 and audio.shape == (
        rules.audio_channels,
        round(fmt.num_frames / fmt.fps * fmt.sample_rate),
    )
    with pytest.raises(ValueError, match="multiples of"):
        ClipFormat.of(rules, width=100, height=64)
    with pytest.raises(ValueError, match="num_frames must be"):
        ClipFormat.of(rules, num_frames=100)


def test_rendering_is_deterministic_and_moves_the_named_way():
    scene = Scene("blue", "triangle", "up", "low hum")
    a, b = render(scene, SMALL), render(scene, SMALL)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    mask = detectors.segment(a[0])
    first_row, last_row = (np.nonzero(mask[i])[0].mean() for i in (0, -1))
    assert last_row < first_row - 0.2 * SMALL.height  # up: towards row 0
    assert not render_audio(Scene("blue", "triangle", "up", "silence"), SMALL).any()


def test_prompts_name_every_attribute_in_every_template():
    for template in range(3):
        prompt = Scene("magenta", "square", "still", "silence", template).prompt
        assert all(word in prompt for word in ("magenta", "square", "still", "silence")), prompt
    assert Scene("red", "circle", "left", "high beep").prompt == "a red circle moving left with a high beep"
    with pytest.raises(ValueError, match="colour must be one of red, yellow"):
        Scene("mauve", "circle", "left", "silence")


def test_the_held_out_split_is_fixed_and_balanced():
    assert len(HELD_OUT) == 18 and HELD_OUT < set(COMBINATIONS)
    pairs = {(c, s) for c, s, _ in HELD_OUT}
    assert len(pairs) == len(COLOURS) * len(SHAPES)  # one held-out motion per colour-shape pair
    assert {m for *_, m in HELD_OUT} == set(MOTIONS)
    assert ("red", "circle", "left") in HELD_OUT  # the README's example prompt is never trained on
    scenes = held_out_scenes(36, seed=3)
    assert scenes == held_out_scenes(36, seed=3) and scenes != held_out_scenes(36, seed=4)
    assert all(s.held_out for s in scenes) and {s.combination for s in scenes[:18]} == HELD_OUT
    stream = training_scenes(seed=0)
    assert not any(next(stream).held_out for _ in range(500))


def test_noise_and_empty_clips_are_unknown_not_a_confident_class():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (22, 64, 64, 3), dtype=np.uint8)
    white_noise = rng.normal(0, 0.3, (2, 8000)).astype(np.float32)
    assert detectors.judge(noise, white_noise, 8000) == dict.fromkeys(("colour", "shape", "motion", "sound"))
    empty = np.full((22, 64, 64, 3), 30, dtype=np.uint8)
    assert detectors.judge(empty, np.zeros((2, 8000), np.float32), 8000) == {
        "colour": None,
        "shape": None,
        "motion": None,
        "sound": "silence",
    }


def test_grey_objects_and_two_colours_have_no_colour():
    frames = render_video(Scene("red", "square", "still", "silence"), SMALL)
    grey = frames.copy()
    grey[(frames != frames[0, 0, 0]).any(-1)] = (160, 160, 160)
    assert detectors.detect_colour(grey) is None
    halves = frames.copy()
    object_pixels = (frames != frames[0, 0, 0]).any(-1)
    object_pixels[..., : SMALL.width // 2] = False
    halves[object_pixels] = COLOURS["blue"]
    assert detectors.detect_colour(halves) is None
    assert detectors.detect_shape(frames) == "square"


def test_a_diagonal_move_has_no_direction():
    down = render_video(Scene("green", "circle", "down", "silence"), SMALL)
    shifts = np.linspace(-0.2, 0.2, SMALL.num_frames) * SMALL.width  # and right by as much as it moves down
    diagonal = np.stack([np.roll(frame, round(dx), axis=1) for frame, dx in zip(down, shifts, strict=True)])
    assert detectors.detect_motion(down) == "down"
    assert detectors.detect_motion(diagonal) is None


def test_two_tones_at_once_and_off_grid_pitches():
    fmt = ClipFormat(64, 64, 22, 24, 8000)
    low = render_audio(Scene("red", "circle", "left", "low hum"), fmt)
    high = render_audio(Scene("red", "circle", "left", "high beep"), fmt)
    assert detectors.detect_sound(low, 8000) == "low hum" and detectors.detect_sound(high, 8000) == "high beep"
    assert detectors.detect_sound(low + high, 8000) is None  # neither tone holds the energy
    with pytest.raises(ValueError, match="no samples"):
        detectors.detect_sound(np.zeros((2, 0)), 8000)


def test_a_clear_tone_far_from_both_pitches_is_unknown():
    t = np.arange(8000) / 8000
    assert detectors.detect_sound(0.3 * np.sin(2 * np.pi * 175 * t), 8000) == "low hum"  # a little off pitch
    assert detectors.detect_sound(0.3 * np.sin(2 * np.pi * 3900 * t), 8000) is None  # a decoder's Nyquist whine
    assert detectors.detect_sound(0.3 * np.sin(2 * np.pi * 400 * t), 8000) is None  # between the two
