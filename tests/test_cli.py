"""The local command, as a user runs it: `h3serve generate`, `weights`, `probe` (no Ray)."""

import json

import pytest

from pipelines.h3.media import probe_media
from serving import h3serve


def test_generate_writes_a_real_png(tmp_path):
    out = tmp_path / "fox.png"
    result = h3serve("generate", "a red fox in the snow", "-o", str(out), "--size", "128x64", "--steps", "3")
    assert result.returncode == 0, result.stderr
    assert "3/3" in result.stderr  # the progress bar ran to the end
    info = probe_media(out.read_bytes())
    assert (info.container, info.width, info.height) == ("png", 128, 64)


def test_generate_writes_a_real_mp4_with_sound(tmp_path):
    out = tmp_path / "surf.mp4"
    result = h3serve("generate", "surf", "-o", str(out), "--size", "64x64", "--seconds", "1.5", "--fps", "8",
                     "--steps", "2")
    assert result.returncode == 0, result.stderr
    info = probe_media(out.read_bytes())
    assert (info.width, info.height, info.frames) == (64, 64, 12)
    assert info.video_codec == "h264" and info.audio_codec == "aac"
    assert info.audio_duration_s == pytest.approx(1.5, abs=0.05)


def test_generate_refuses_an_incapable_backend(tmp_path):
    result = h3serve("generate", "x", "-o", str(tmp_path / "x.png"), "--backend", "sage_attn")
    assert result.returncode == 2
    assert "does not implement packed varlen attention" in result.stderr and "Traceback" not in result.stderr


def test_generate_names_the_bad_field(tmp_path):
    result = h3serve("generate", "x", "-o", str(tmp_path / "x.png"), "--size", "100x64")
    assert result.returncode == 2 and "width=100 must be a multiple of 32" in result.stderr


def test_generate_rejects_an_unknown_output_type(tmp_path):
    result = h3serve("generate", "x", "-o", str(tmp_path / "x.gif"))
    assert result.returncode == 2 and "--output must end in .png" in result.stderr


def test_weights_and_probe(tmp_path):
    result = h3serve("weights", "--output", str(tmp_path / "w"))
    assert result.returncode == 0 and (tmp_path / "w" / "model.safetensors").is_file()
    probed = json.loads(h3serve("probe").stdout)
    assert probed["source"] == "probed" and probed["device_type"] in ("cpu", "cuda")
