"""The clip handed out while it decodes (issue 58, item 3), in process.

``chunked_decode.chunks`` yields diffusers' decode in final temporal pieces: concatenated they equal ``vae.decode``
bit for bit (clips whose latents fill whole chunks and clips whose tail is padded and cut). The fragmented MP4 made
as the frames come decodes to the frames given (within H.264's loss, as the whole MP4 does), a prefix of it already
decodes, and the finished file muxed again from its packets holds them: the same frames and sound. A decode with a sink
hands over the sound first, then the frames in order: the clip's own.
"""

import io
import threading
import time

import av
import numpy as np
import pytest
import torch

from h3serve.pipelines.h3 import GenerationRequest, chunked_decode
from h3serve.pipelines.h3.media import FragmentedMp4, MediaError, Mp4Stream, encode_mp4, probe_media


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "latent_shape",
    [
        (1, 8, 37, 4, 8),  # the default 128x64 5 s clip: 7 temporal chunks
        (1, 8, 12, 20, 20),  # 2x2 spatial tiles, 2 chunks
        (1, 8, 9, 4, 8),  # a tail padded with repeated latents and cut again
        (1, 8, 3, 4, 8),  # shorter than one chunk
    ],
)
def test_the_chunks_concatenated_are_diffusers_decode_bit_for_bit(vaes, dtype, latent_shape):
    vae = vaes[dtype]
    latents = torch.randn(latent_shape, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = vae.decode(latents, return_dict=False)[0]
    pieces = list(chunked_decode.chunks(vae, latents))
    assert all(p.shape[2] > 0 for p in pieces)
    streamed = torch.cat(pieces, dim=2)
    assert streamed.dtype == whole.dtype and streamed.shape == whole.shape
    assert torch.equal(streamed, whole)
    if latent_shape[2] == 37:  # the default clip comes in pieces, the first long before the end
        assert len(pieces) >= 6 and pieces[0].shape[2] <= whole.shape[2] // 5


def _clip(frames: int = 61, height: int = 64, width: int = 96):
    t = np.arange(frames)[:, None, None, None]
    x = np.arange(width)[None, None, :, None]
    noise = np.random.default_rng(0).integers(0, 40, (frames, height, width, 3))
    video = (np.sin(t / 5 + x / 9) * 90 + 120 + noise).clip(0, 255).astype(np.uint8)
    audio = (0.3 * np.sin(np.arange(2 * (16000 * frames // 24)).reshape(2, -1) / 7)).astype(np.float32)
    return video, audio


def _decoded(data: bytes):
    with av.open(io.BytesIO(data)) as c:
        video = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    with av.open(io.BytesIO(data)) as c:
        packets = [bytes(p) for p in c.demux(audio=0) if p.size]
    return video, packets


def test_the_fragmented_mp4_plays_from_a_prefix_and_its_remux_is_the_same_frames_and_sound():
    video, audio = _clip()
    writer = FragmentedMp4(96, 64, 24, 16000)
    parts = [writer.start(audio)]
    for first in range(0, len(video), 17):
        parts.append(writer.add(video[first : first + 17]))
    parts.append(writer.finish())
    assert all(parts[:-1]) and parts[-1]
    streamed = b"".join(parts)
    assert streamed[4:8] == b"ftyp" and b"moof" in streamed and b"mvex" in streamed  # fragmented
    frames, sound = _decoded(streamed)
    # H.264 at crf 23 as the whole MP4 encodes it: the frames given, within its loss
    reference, _ = _decoded(encode_mp4(video, 24, audio, 16000))
    assert frames.shape == video.shape
    assert np.abs(frames.astype(int) - video).mean() < 12 and np.abs(reference.astype(int) - video).mean() < 12
    whole = writer.whole()
    assert b"moof" not in whole
    whole_frames, whole_sound = _decoded(whole)
    assert np.array_equal(frames, whole_frames) and sound == whole_sound  # frame-exact, the same AAC packets
    info = probe_media(whole)
    assert (info.frames, info.fps, info.audio_codec, info.audio_channels) == (61, 24.0, "aac", 2)
    with av.open(io.BytesIO(b"".join(parts[:3]))) as c:  # the header and two chunks' bytes already decode
        early = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert 0 < len(early) < len(video)
    assert np.array_equal(np.stack(early), whole_frames[: len(early)])


def test_a_fragmented_mp4_refuses_what_the_whole_one_refuses():
    with pytest.raises(MediaError, match="width"):
        FragmentedMp4(95, 64, 24)
    writer = FragmentedMp4(96, 64, 24)
    with pytest.raises(RuntimeError, match="before start"):
        writer.add(np.zeros((1, 64, 96, 3), np.uint8))
    writer.start(None)
    with pytest.raises(MediaError, match="frames: must be 64x96"):
        writer.add(np.zeros((1, 32, 96, 3), np.uint8))


def test_the_streams_encoder_thread_emits_in_order_raises_its_error_on_the_decoder_and_closes():
    """Mp4Stream encodes on its own thread: every run is emitted, in order, before ``finish`` returns; an encode error
    (a chunk of another size) is raised on the decoding thread (the next ``frames`` or ``finish``); ``close`` ends the
    thread of a decode that failed before ``finish``."""
    emitted: list[tuple[bytes, int, str]] = []
    stream = Mp4Stream(24, lambda data, frames: emitted.append((data, frames, threading.current_thread().name)))
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 255, (17, 64, 96, 3), dtype=np.uint8) for _ in range(4)]
    for chunk in chunks:
        stream.frames(chunk)
    stream.finish()
    assert [frames for _, frames, _ in emitted] == sorted(frames for _, frames, _ in emitted)
    assert emitted[-1][1] == 68 and {name for _, _, name in emitted[:-1]} == {"h3serve-mp4-stream"}  # finish's: here
    assert probe_media(stream.mp4()).frames == 68 and not stream._encoder.is_alive()

    broken = Mp4Stream(24, lambda data, frames: None)
    broken.frames(chunks[0])
    broken.frames(np.zeros((17, 32, 96, 3), np.uint8))  # another size: the encoder thread fails
    with pytest.raises(MediaError, match="frames: must be 64x96"):
        for _ in range(50):  # raised at the first call after the thread failed
            broken.frames(chunks[1])
            time.sleep(0.05)
        broken.finish()
    broken.close()
    assert not broken._encoder.is_alive()

    failed = Mp4Stream(24, lambda data, frames: None)
    failed.frames(chunks[0])  # then the decode raised: no finish
    failed.close()
    assert not failed._encoder.is_alive()


def test_a_decode_with_a_sink_hands_over_the_sound_then_the_clips_own_frames(tiny_pipeline):
    state = tiny_pipeline.prepare(GenerationRequest(prompt="a red circle moving left", num_inference_steps=2, seed=3))
    while not state.done:
        tiny_pipeline.step([state])
    calls: list[tuple[str, np.ndarray]] = []

    class Sink:
        def audio(self, audio, sample_rate):
            calls.append(("audio", audio))

        def frames(self, frames):
            calls.append(("frames", frames))

    streamed = tiny_pipeline.decode(state, sink=Sink())
    whole = tiny_pipeline.decode(state)
    assert calls[0][0] == "audio" and np.array_equal(calls[0][1], whole.audio)
    kinds = [kind for kind, _ in calls[1:]]
    assert kinds == ["frames"] * len(kinds) and len(kinds) > 1
    assert np.array_equal(np.concatenate([f for _, f in calls[1:]]), whole.frames)
    assert np.array_equal(streamed.frames, whole.frames)

    emitted: list[tuple[bytes, int]] = []
    stream = Mp4Stream(whole.fps, lambda data, frames: emitted.append((data, frames)))
    tiny_pipeline.decode(state, sink=stream)
    stream.finish()
    counts = [frames for _, frames in emitted]
    assert counts == sorted(counts) and counts[-1] == len(whole.frames) and len(emitted) > 2
    frames, sound = _decoded(b"".join(data for data, _ in emitted))
    whole_frames, whole_sound = _decoded(stream.mp4())
    assert np.array_equal(frames, whole_frames) and sound == whole_sound
    assert probe_media(stream.mp4()).frames == len(whole.frames)


def test_a_decode_split_over_ranks_is_not_streamed_and_says_so_before_it_starts(tiny_pipeline):
    """``decode_on_ranks`` and the stream are exclusive (``TiledVideoDecodeStep``): the replica's stages say so before
    the decode (its ``decoding`` event's ``streamed``, which the ingress opens a live clip on), and a decode given both
    an emitter and a tile runner sends the tiles and emits nothing, the serial decode's frames."""
    import asyncio

    import torch

    from h3serve.pipelines.h3 import tiled_decode
    from h3serve.replicas.requests import Ticket
    from h3serve.replicas.stage_worker import LocalStages, StageWorker

    state = tiny_pipeline.prepare(GenerationRequest(prompt="a kite", num_inference_steps=2, seed=5))
    while not state.done:
        tiny_pipeline.step([state])
    whole = tiny_pipeline.decode(state)
    vae = tiny_pipeline._local_stages("decode").after.vae
    runs: list[int] = []

    def two_way(tiles):  # as two ranks would: two separate runs
        runs.append(len(tiles))
        return [t for run in tiled_decode.split(tiles, 2) for t in tiled_decode.decode_tiles(vae, run)]

    worker = StageWorker(torch.device("cpu"))
    try:
        runner: list = [None]
        stages = LocalStages(tiny_pipeline, worker, tiles=lambda: runner[0])
        assert stages.streams()  # no group to split over: streamed
        runner[0] = two_way
        assert not stages.streams()

        async def decode():
            ticket = Ticket("r", state.request, 1, asyncio.get_running_loop(), None)
            ticket.state = state
            emitted: list[bytes] = []
            return await stages.decode(ticket, lambda data, frames: emitted.append(data)), emitted

        media, emitted = asyncio.run(decode())
    finally:
        worker.shutdown()
    assert emitted == [] and runs, (len(emitted), runs)
    assert np.array_equal(media.frames, whole.frames)
