"""A decoding job's live clip (``h3serve.deploy.jobs.live``): every reader gets every byte from the first, in order,
as it comes; a reader that goes away takes nothing from the others; one that comes later starts over; a stream cut
short ends its readers with StreamBroken, never a clean end; a new attempt cuts the old one off."""

import asyncio

import pytest

from h3serve.deploy.jobs.live import LiveClip, LiveClips, StreamBroken


async def read_all(clip: LiveClip, got: list[bytes]) -> None:
    async for part in clip.read():
        got.append(part)


def test_readers_get_every_byte_in_order_and_a_leaving_reader_takes_nothing():
    async def run():
        clip = LiveClip()
        clip.append(b"head", 0)
        first, second = [], []
        readers = [asyncio.ensure_future(read_all(clip, got)) for got in (first, second)]
        leaving = clip.read()
        assert await anext(leaving) == b"head"
        await leaving.aclose()  # a reader that disconnects
        await asyncio.sleep(0)
        assert first == second == [b"head"]  # waiting for the next bytes, not polling
        clip.append(b"one", 17)
        clip.append(b"", 17)  # no bytes: only the count moves
        clip.append(b"two", 34)
        await asyncio.sleep(0)
        clip.end()
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        assert first == second == [b"head", b"one", b"two"] and clip.size == 10 and clip.frames == 34
        late = []
        await read_all(clip, late)  # one that comes after the end reads it all
        assert late == first
        with pytest.raises(RuntimeError, match="ended"):
            clip.append(b"more", 40)

    asyncio.run(run())


def test_a_stream_cut_short_breaks_its_readers_and_a_new_attempt_replaces_it():
    async def run():
        clips = LiveClips()
        clip = clips.start("video_1")
        clip.append(b"head", 0)
        got: list[bytes] = []
        reader = asyncio.ensure_future(read_all(clip, got))
        await asyncio.sleep(0)
        again = clips.start("video_1")  # the decode started over on another replica
        assert again is not clip and clips.get("video_1") is again
        with pytest.raises(StreamBroken, match="started again"):
            await asyncio.wait_for(reader, 5)
        assert got == [b"head"]
        clips.end("video_1", "the job ended before its video did (HTTP 499)")
        assert clips.get("video_1") is None
        with pytest.raises(StreamBroken, match="HTTP 499"):
            await read_all(again, [])
        clips.end("video_1")  # nothing left: a no-op

    asyncio.run(run())
