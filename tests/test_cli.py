"""The local command, as a user runs it: `h3serve generate`, `weights`, `probe` (no Ray)."""

import json
import re

import pytest

from h3serve.pipelines.h3.media import probe_media
from tests.harness import h3serve, h3serve_inline

# the command in a process of its own (which imports torch and diffusers), as users run it; its refusals of bad
# fields, which start nothing, run in this process (``h3serve_inline``)
pytestmark = pytest.mark.slow


def test_generate_writes_an_mp4_with_17n_plus_5_frames_and_stereo_aac(tmp_path, tiny_checkpoint):
    out = tmp_path / "lighthouse.mp4"
    result = h3serve(
        "generate", "a lighthouse at dusk", "-o", str(out), "--steps", "3", "--checkpoint", str(tiny_checkpoint)
    )
    assert result.returncode == 0, result.stderr
    assert "2/2" in result.stderr  # the progress bar ran to the end (3 grid points: 2 model evaluations)
    info = probe_media(out.read_bytes())
    assert (info.width, info.height, info.frames, info.fps) == (128, 64, 124, 24.0)
    assert (info.frames - 5) % 17 == 0
    assert (info.video_codec, info.audio_codec, info.audio_channels, info.audio_sample_rate) == ("h264", "aac", 2, 8000)
    assert info.audio_duration_s == pytest.approx(124 / 24, abs=0.05)


def test_generate_writes_a_still_png(tmp_path, tiny_checkpoint):
    out = tmp_path / "fox.png"
    result = h3serve(
        "generate", "a red fox", "-o", str(out), "--size", "64x64", "--steps", "2", "--checkpoint", str(tiny_checkpoint)
    )
    assert result.returncode == 0, result.stderr
    info = probe_media(out.read_bytes())
    assert (info.container, info.width, info.height) == ("png", 64, 64)


def test_generate_refuses_an_incapable_backend(tmp_path, tiny_checkpoint):
    result = h3serve(
        "generate", "x", "-o", str(tmp_path / "x.mp4"), "--backend", "sage_attn", "--checkpoint", str(tiny_checkpoint)
    )
    assert result.returncode == 2
    assert "does not implement packed varlen attention" in result.stderr and "Traceback" not in result.stderr


def test_generate_with_a_step_cache_tier_skips_block_rows(tmp_path, tiny_checkpoint):
    out = tmp_path / "cached.png"
    result = h3serve(
        "generate", "a red fox", "-o", str(out), "--size", "64x64", "--steps", "12", "--cache", "low",
        "--checkpoint", str(tiny_checkpoint),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert probe_media(out.read_bytes()).container == "png"
    line = next(x for x in result.stdout.splitlines() if "step cache" in x)
    skipped, ran = (int(v) for v in re.search(r"skipped (\d+) of (\d+) block-rows", line).groups())
    assert 0 < skipped < ran, line


@pytest.mark.parametrize(
    "args,message",
    [
        (["--cache", "fast"], "cache must be one of off, high, low, medium, got 'fast'"),
        (["--size", "100x64"], "multiples of 32"),
        (["--seconds", "3"], "seconds=3 is outside what the model generates: 5.16667 to 14.375 s"),
        (["-o", "x.gif"], "--output must end in .mp4"),
    ],
)
def test_generate_names_the_bad_field(tmp_path, tiny_checkpoint, args, message):
    result = h3serve_inline("generate", "x", "-o", str(tmp_path / "x.mp4"), "--checkpoint", str(tiny_checkpoint), *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_weights_writes_the_released_layout_and_probe(tmp_path):
    result = h3serve("weights", "--output", str(tmp_path / "w"), "--with-ref")
    assert result.returncode == 0, result.stderr
    index = json.loads((tmp_path / "w" / "modular_model_index.json").read_text())
    assert index["transformer_ref"][:2] == ["diffusers", "MiniMaxH3Transformer3DModel"]
    assert (tmp_path / "w" / "transformer_ref" / "config.json").is_file()
    probed = json.loads(h3serve("probe").stdout)
    assert probed["source"] == "probed" and probed["device_type"] in ("cpu", "cuda")
