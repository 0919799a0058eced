"""The clip streamed while it decodes (issue 58): time to its first playable byte and first frame against time to
the finished file, streamed and not.

In process (the decoder's side, one torch thread), on the default 128x64 5 s canvas (a real 2-step request's
latents) and on a larger 640x384 one (the tiny VAE at a canvas the tiny model cannot generate: random latents, as
``benchmarks/parallel_decode.py``): ``streamed`` is the decode with its sink (``media.Mp4Stream``: the sound first,
each temporal chunk's frames encoded as a fragmented MP4 as soon as final, the finished MP4 muxed from the same
packets); ``whole`` is the decode then ``encode_mp4`` (what a job without a stream does: a plain MP4's first frame is
playable only once the whole file is there). First byte: the first bytes emitted (the header and the first chunk's
encoded frames); first frame: the first prefix of the stream PyAV decodes a frame from.

Served (``--served``): the default config over real HTTP, the client's view: POST, the events until ``decoding``,
then ``GET /content`` streamed (first byte, first frame parsed as it arrives, end) against the job's completion and
the finished MP4's download, from the ``decoding`` event.

    python -m benchmarks.stream_decode [--smoke] [--reps N] [--served] [--json PATH]
"""

from __future__ import annotations

import argparse
import io
import queue
import statistics
import time

import av
import torch

from benchmarks import parallel_decode
from benchmarks.harness import cli, say, table


class Arriving(io.RawIOBase):
    """A file PyAV reads while the bytes arrive: ``read`` waits for the next chunk; ``None`` put ends it."""

    def __init__(self):
        self.chunks: queue.Queue[bytes | None] = queue.Queue()
        self.buffer, self.ended = b"", False

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        while not self.buffer and not self.ended:
            chunk = self.chunks.get()
            self.ended, self.buffer = chunk is None, self.buffer + (chunk or b"")
        size = len(self.buffer) if size is None or size < 0 else size
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


def first_frame_at(marks: list[tuple[float, bytes]]) -> float:
    """When the stream's bytes so far first decoded to a frame: the time of the first prefix PyAV makes one of."""
    data = b""
    for at, part in marks:
        data += part
        try:
            with av.open(io.BytesIO(data), "r", format="mp4") as container:
                for _ in container.decode(video=0):
                    return at
        except av.FFmpegError:
            continue
    raise RuntimeError("no prefix of the stream decodes a frame")


def handoffs(smoke: bool) -> tuple[str, dict]:
    """The tiny checkpoint and ``parallel_decode``'s handoffs: the default canvas's, and the larger one's."""
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint

    return str(random_tiny_checkpoint()), parallel_decode.handoffs(smoke)


def in_process(smoke: bool, reps: int) -> dict:
    from diffusers.modular_pipelines import PipelineState

    from h3serve.pipelines.h3 import H3StageModels
    from h3serve.pipelines.h3.media import Mp4Stream, encode_mp4

    torch.set_num_threads(1)
    checkpoint, work = handoffs(smoke)
    decoder = H3StageModels.load("decoder", checkpoint)
    stages, fps = decoder.stages, decoder.rules.fps
    rows, out = [], {}
    for canvas, handoff in work.items():
        layout = PipelineState()
        for key, value in handoff.layout.items():
            layout.set(key, value)

        def whole(layout=layout, handoff=handoff) -> dict:
            started = time.perf_counter()
            frames, audio, rate = stages.finish(layout, handoff.video_rows, handoff.audio_rows)
            encode_mp4(frames, fps, audio, rate)
            done = time.perf_counter() - started
            return {"first_byte_s": done, "first_frame_s": done, "finished_s": done}

        def streamed(layout=layout, handoff=handoff) -> dict:
            marks: list[tuple[float, bytes]] = []
            stream = Mp4Stream(fps, lambda data, frames: marks.append((time.perf_counter(), data)))
            started = time.perf_counter()
            stages.finish(layout, handoff.video_rows, handoff.audio_rows, sink=stream)
            stream.finish()
            stream.mp4()
            done = time.perf_counter()
            return {
                "first_byte_s": marks[0][0] - started,
                "first_frame_s": first_frame_at(marks) - started,
                "finished_s": done - started,
                "fragments": len(marks),
            }

        whole(), streamed()  # first-call costs
        runs: dict[str, list[dict]] = {"whole": [], "streamed": []}
        for _ in range(reps):  # interleaved, so both see the same machine
            runs["whole"].append(whole())
            runs["streamed"].append(streamed())
        out[canvas] = {}
        for mode, results in runs.items():
            med = {k: statistics.median(r[k] for r in results) for k in ("first_byte_s", "first_frame_s", "finished_s")}
            out[canvas][mode] = med
            rows.append([canvas, mode, med["first_byte_s"], med["first_frame_s"], med["finished_s"]])
    table(
        ["canvas", "mode", "first byte s", "first frame s", "finished file s"],
        rows,
        f"decode to media in process, 1 torch thread, median of {reps}",
    )
    return out


def served(reps: int) -> dict:
    """The default config over HTTP: from the ``decoding`` event, the stream's first byte and first frame (parsed as
    it arrives) and the finished MP4 downloaded once the job completes."""
    import threading

    from benchmarks.harness import ServedDefault
    from h3serve.client import H3Client

    results = []
    with ServedDefault() as server, H3Client(server.url) as api:
        for rep in range(reps + 1):  # the first warms the server
            video_id = api.create_video({"prompt": "a red circle moving left", "seed": rep})["id"]
            for event in api.follow(video_id):
                if event["event"] == "decoding":
                    break
            decoding = time.perf_counter()
            arriving, first_frame = Arriving(), []

            def parse(arriving=arriving, first_frame=first_frame) -> None:
                with av.open(arriving, "r", format="mp4") as container:
                    for _ in container.decode(video=0):
                        first_frame.append(time.perf_counter())
                        break
                    for _ in container.demux():  # read on to the end
                        pass

            thread = threading.Thread(target=parse)
            thread.start()
            first_byte = None
            with api.http.stream("GET", f"/v1/videos/{video_id}/content") as response:
                streamed = response.headers.get("x-h3serve-stream") == "fragmented-mp4"
                for chunk in response.iter_bytes():
                    first_byte = first_byte or time.perf_counter()
                    arriving.chunks.put(chunk)
            arriving.chunks.put(None)
            thread.join(60)
            stream_end = time.perf_counter()
            api.wait_video(video_id, poll_s=0.02)
            api.content(video_id)
            finished = time.perf_counter()
            api.delete(video_id)
            if rep and first_byte is not None and first_frame:
                results.append(
                    {
                        "streamed": streamed,
                        "first_byte_s": first_byte - decoding,
                        "first_frame_s": first_frame[0] - decoding,
                        "stream_end_s": stream_end - decoding,
                        "finished_file_s": finished - decoding,
                    }
                )
    keys = ("first_byte_s", "first_frame_s", "stream_end_s", "finished_file_s")
    med = {k: statistics.median(r[k] for r in results) for k in keys}
    table(
        ["canvas", "first byte s", "first frame s", "stream end s", "finished MP4 downloaded s"],
        [["128x64 (served default)", *(med[k] for k in keys)]],
        f"over HTTP from the job's decoding event, median of {len(results)} (all streamed: "
        f"{all(r['streamed'] for r in results)})",
    )
    return {"median": med, "runs": results}


def run(args: argparse.Namespace) -> dict:
    reps = 1 if args.smoke else args.reps
    result = {"in_process": in_process(args.smoke, reps)}
    if args.served:
        result["served"] = served(reps)
    say()
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--served", action="store_true", help="also over HTTP on the default config")


main = cli(__doc__, run, add_args, __name__)
