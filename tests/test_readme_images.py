"""``make readme-images``: the README's example prompts as the default server answers them."""

import io

import numpy as np
import pytest
from PIL import Image

from tools.readme_images import EXAMPLES, GAP, ZOOM, DefaultServer, frame_strip, write_images


def test_the_default_server_is_read_from_the_serve_config():
    server = DefaultServer.of("h3serve/deploy/serve_config.yaml")
    assert server.checkpoint is None  # the built-in tiny checkpoint
    assert server.steps == 16  # the config's limits.default_steps, not RequestLimits' own default
    assert (server.device, server.dtype) == ("cpu", "float32")
    gpu = DefaultServer.of("h3serve/deploy/serve_config.gpu.yaml")
    assert (gpu.device, gpu.dtype) == ("cuda", "bfloat16") and gpu.checkpoint  # the released model's directory


def test_a_strip_holds_evenly_spaced_frames_first_to_last():
    frames = np.zeros((124, 4, 6, 3), dtype=np.uint8)
    frames[:, :, :, 0] = np.arange(124, dtype=np.uint8)[:, None, None]  # each frame's red channel is its index
    strip = frame_strip(frames, count=5)
    tile = 6 * ZOOM + GAP
    assert strip.shape == (4 * ZOOM, 5 * tile - GAP, 3)
    assert [int(strip[0, k * tile, 0]) for k in range(5)] == [0, 31, 62, 92, 123]
    assert not strip[:, 6 * ZOOM : tile].any()  # the gap


@pytest.mark.slow
def test_the_readme_prompts_make_a_strip_and_a_still(tmp_path):
    written = write_images("h3serve/deploy/serve_config.yaml", tmp_path, threads=1)
    assert [p.name for p in written] == [name for name, _, _ in EXAMPLES]
    strip, still = (np.asarray(Image.open(io.BytesIO(p.read_bytes()))) for p in written)
    assert still.shape == (64, 128, 3)  # the default canvas's middle frame
    assert strip.shape == (64 * ZOOM, 8 * (128 * ZOOM + GAP) - GAP, 3)
