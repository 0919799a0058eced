"""Real encode/decode round trips for h3serve.pipelines.h3.media (no mocks)."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

from h3serve.pipelines.h3.media import MediaError, MediaInfo, encode_mp4, encode_png, probe_media

FPS, SR, N_FRAMES, SIZE = 8, 16000, 17, 256
AUDIO_S = N_FRAMES / FPS  # 2.125 s, same as the video


def _frames(n=N_FRAMES, h=SIZE, w=SIZE, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def _tone(seconds=AUDIO_S, sr=SR, amp=0.5, channels=None):
    t = np.arange(round(seconds * sr)) / sr
    wave = (amp * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return wave if channels is None else np.stack([wave] * channels)


@pytest.fixture(scope="module")
def clip() -> bytes:
    return encode_mp4(_frames(), FPS, audio=_tone(), sample_rate=SR)


def _decode_video(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as inp:
        return np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])


def _decode_audio(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as inp:
        return np.concatenate([f.to_ndarray() for f in inp.decode(audio=0)], axis=-1)


def test_png_round_trip_is_pixel_exact():
    image = _frames(n=1, h=37, w=53)[0]  # odd sizes are fine for PNG
    data = encode_png(image)
    with Image.open(io.BytesIO(data)) as img:
        assert img.format == "PNG" and img.mode == "RGB" and img.size == (53, 37)
        np.testing.assert_array_equal(np.asarray(img), image)
    assert probe_media(data) == MediaInfo("png", 53, 37, 1, None, None, None, None, None, None, None, None)


def test_mp4_round_trip_probe(clip):
    info = probe_media(clip)
    assert (info.container, info.width, info.height, info.frames) == ("mp4", SIZE, SIZE, N_FRAMES)
    assert info.fps == pytest.approx(FPS)
    assert info.duration_s == pytest.approx(N_FRAMES / FPS, abs=1 / FPS)
    assert (info.video_codec, info.pixel_format) == ("h264", "yuv420p")
    assert (info.audio_codec, info.audio_sample_rate, info.audio_channels) == ("aac", SR, 1)
    assert info.audio_duration_s == pytest.approx(AUDIO_S, abs=0.1)


def test_mp4_encode_is_deterministic(clip):
    assert encode_mp4(_frames(), FPS, audio=_tone(), sample_rate=SR) == clip


def test_mp4_solid_colour_survives():
    colour = np.array([200, 40, 90], dtype=np.uint8)
    frames = np.broadcast_to(colour, (5, 64, 96, 3))
    decoded = _decode_video(encode_mp4(frames, 4))
    assert decoded.shape == (5, 64, 96, 3)
    np.testing.assert_allclose(decoded.reshape(-1, 3).mean(axis=0), colour, atol=6)


def test_mp4_without_audio_has_no_audio_stream():
    data = encode_mp4(_frames(n=3, h=32, w=48), 24)
    info = probe_media(data)
    assert (info.frames, info.width, info.height) == (3, 48, 32)
    assert info.audio_codec is info.audio_sample_rate is info.audio_channels is info.audio_duration_s is None
    with av.open(io.BytesIO(data)) as inp:
        assert len(inp.streams.audio) == 0


def test_stereo_audio_clipping_and_duration_mismatch():
    # Amplitude 3 is out of range: clipped, not rejected. The audio (1 s) outlasts
    # the video (0.5 s): both streams are kept as given.
    audio = _tone(1.0, 24000, amp=3.0, channels=2)
    data = encode_mp4(_frames(n=4, h=32, w=32), 8, audio=audio, sample_rate=24000)
    info = probe_media(data)
    assert (info.audio_channels, info.audio_sample_rate) == (2, 24000)
    assert info.duration_s == pytest.approx(0.5)
    assert info.audio_duration_s == pytest.approx(1.0, abs=0.1)
    peak = np.abs(_decode_audio(data)).max()
    assert 0.7 < peak < 1.2  # AAC rings a little around the clipped edges


def test_accepts_torch_tensors():
    torch = pytest.importorskip("torch")
    image = torch.from_numpy(_frames(n=1, h=16, w=16)[0])
    with Image.open(io.BytesIO(encode_png(image))) as img:
        np.testing.assert_array_equal(np.asarray(img), image.numpy())
    frames = torch.from_numpy(_frames(n=2, h=16, w=16))
    audio = torch.from_numpy(_tone(0.25)).to(torch.bfloat16)  # numpy has no bfloat16
    info = probe_media(encode_mp4(frames, 8, audio=audio))
    assert (info.frames, info.audio_codec) == (2, "aac")


def _bad_audio(value):
    wave = _tone(0.25)
    wave[100] = value
    return wave


def _small_mp4(frames=None, fps=8, **kwargs):
    return encode_mp4(_frames(n=2, h=16, w=16) if frames is None else frames, fps, **kwargs)


def _case(call, field, expect, id):
    return pytest.param(call, field, expect, id=id)


@pytest.mark.parametrize(
    "call, field, expect",
    [
        _case(lambda: _small_mp4(_frames(n=0, h=16, w=16)), "frames", "got 0", "zero-frames"),
        _case(lambda: _small_mp4(_frames(n=2, h=16, w=17)), "width", "even", "odd-width"),
        _case(lambda: _small_mp4(_frames(n=2, h=15, w=16)), "height", "got 15", "odd-height"),
        _case(lambda: _small_mp4(fps=0), "fps", "positive integer", "fps-zero"),
        _case(lambda: _small_mp4(fps=7.5), "fps", "7.5", "fps-float"),
        _case(lambda: _small_mp4(crf=99), "crf", "[0, 51]", "crf-range"),
        _case(lambda: _small_mp4(audio=_bad_audio(np.nan)), "audio", "NaN", "nan-audio"),
        _case(lambda: _small_mp4(audio=_bad_audio(np.inf)), "audio", "inf", "inf-audio"),
        _case(lambda: _small_mp4(audio=_tone(0.25), sample_rate=44000), "sample_rate", "44100", "bad-rate"),
        _case(lambda: _small_mp4(audio=_tone(0.25), sample_rate=16000.0), "sample_rate", "16000", "float-rate"),
        _case(lambda: _small_mp4(sample_rate=96000), "sample_rate", "48000", "bad-rate-no-audio"),
        _case(lambda: _small_mp4(audio=_tone(0.25, channels=3)), "audio", "[C, S]", "audio-3-channels"),
        _case(lambda: _small_mp4(audio=_tone(0.25)[:, None]), "audio", "[S]", "audio-samples-first"),
        _case(lambda: _small_mp4(audio=np.zeros(4000, np.int16)), "audio", "int16", "audio-int-dtype"),
        _case(lambda: _small_mp4(_frames(n=2, h=16, w=16).astype(np.float32)), "frames", "uint8", "frames-dtype"),
        _case(lambda: _small_mp4(_frames(n=2, h=16, w=16)[..., 0]), "frames", "[F, H, W, 3]", "frames-3d"),
        _case(lambda: _small_mp4(np.zeros((2, 16, 16, 4), np.uint8)), "frames", "[F, H, W, 3]", "frames-rgba"),
        _case(lambda: encode_png(_frames(n=1, h=16, w=16)[0].astype(np.int32)), "image", "uint8", "png-dtype"),
        _case(lambda: encode_png(_frames(n=1, h=16, w=16)), "image", "[H, W, 3]", "png-shape"),
        _case(lambda: encode_png(np.zeros((0, 16, 3), np.uint8)), "image", "> 0", "png-empty"),
    ],
)
def test_bad_input_names_the_field(call, field, expect):
    with pytest.raises(MediaError) as exc:
        call()
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}:") and expect in str(exc.value)


@pytest.mark.parametrize(
    "data",
    [b"", b"not media at all" * 64, b"\x89PNG\r\n\x1a\n" + b"\0" * 64, b"\0\0\0 ftypisom" + b"\0" * 64],
    ids=["empty", "garbage", "png-signature-only", "mp4-header-only"],
)
def test_probe_rejects_garbage(data):
    with pytest.raises(MediaError) as exc:
        probe_media(data)
    assert exc.value.field == "data"


def test_probe_rejects_truncated_mp4(clip):
    with pytest.raises(MediaError, match="^data:"):
        probe_media(clip[: len(clip) // 3])


def _png_of_size(width: int, height: int) -> bytes:
    """A blank 1-bit PNG: a few KB on the wire, width x height pixels once decoded."""
    buf = io.BytesIO()
    Image.new("1", (width, height)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    "width, height, expect",
    [(5000, 5000, "5000x5000 pixels; images may have at most"), (20000, 20000, "too large to decode")],
    ids=["over-h3serve-bound", "pil-decompression-bomb"],
)
def test_an_oversized_keyframe_is_refused_by_field_before_decoding(width, height, expect):
    from h3serve.pipelines.h3.request import RequestError
    from h3serve.pipelines.h3.stages import decode_image

    data = _png_of_size(width, height)
    assert len(data) < 200_000  # small on the wire: only the declared size gives it away
    with pytest.raises(RequestError, match=expect) as refused:
        decode_image(data, "first_frame")
    assert refused.value.field == "first_frame"


def test_a_keyframe_within_the_bound_decodes_to_rgb():
    from h3serve.pipelines.h3.stages import decode_image

    image = decode_image(_png_of_size(640, 360), "last_frame")
    assert image.mode == "RGB" and image.size == (640, 360)


def _encoded(fmt: str, size=(256, 128)) -> bytes:
    """A noisy RGB image (its pixel data is most of the file) in ``fmt``."""
    import numpy as np

    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def test_the_header_check_catches_truncated_and_corrupted_pngs_and_jpegs_without_decoding():
    """What the ingress can tell from a header and cheap reads (PNG chunk CRCs, a JPEG's 1/8-scale draft); a PNG
    whose chunks are intact but whose deflate stream is broken passes it and is refused where it is decoded."""
    import zlib

    from h3serve.pipelines.h3.request import RequestError
    from h3serve.pipelines.h3.stages import decode_image
    from h3serve.pipelines.h3.uploads import image_problem

    png, jpeg = _encoded("PNG"), _encoded("JPEG")
    assert image_problem(png) is None and image_problem(jpeg) is None
    assert "not a decodable image" in image_problem(png[: len(png) * 2 // 3])
    assert "not a decodable image" in image_problem(png[:-12])  # only IEND missing
    assert "not a decodable image" in image_problem(jpeg[: len(jpeg) * 2 // 3])
    flipped = bytearray(png)
    flipped[len(png) // 2] ^= 0xFF  # inside IDAT: its CRC no longer matches
    assert "not a decodable image" in image_problem(bytes(flipped))
    assert "not a decodable image" in image_problem(b"") and "not a decodable image" in image_problem(b"GIF89a")
    assert image_problem(png, max_pixels=256 * 128 - 1) == "is 256x128 pixels; images may have at most 32767 pixels"
    # intact chunks (CRCs recomputed) around a broken deflate stream: only decoding finds it
    start = png.index(b"IDAT") - 4
    length = int.from_bytes(png[start : start + 4], "big")
    body = b"IDAT" + bytes(length)  # zeros are not a deflate stream
    forged = png[:start] + png[start : start + 4] + body + zlib.crc32(body).to_bytes(4, "big")
    forged += png[start + 12 + length :]
    assert image_problem(forged) is None
    with pytest.raises(RequestError, match="first_frame is not a decodable image"):
        decode_image(forged, "first_frame")
