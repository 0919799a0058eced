"""Every tensor h3serve's own code makes lives on its data's device, checked without a GPU.

On a GPU replica the data (layouts, latents, the model) is on ``cuda`` while torch's default device
stays the CPU: a tensor made with ``torch.zeros(n)`` instead of ``torch.zeros(n, device=data.device)``
lands on the CPU, and the first ``cat``/index with the data fails — every step would. On a CPU-only
machine both devices are the CPU, so the mistake is invisible to every other test. Here a
``TorchFunctionMode`` records each tensor factory call that h3serve's packages (``attention``,
``pipelines``, ``replicas``) make without an explicit device, while real requests (mixed sizes, steps,
a request joining, FL2VA with a keyframe) are prepared, stepped in packs with a padding document, and
decoded — at sp=1 and at sp=2 (two processes, torch.distributed over gloo, Ulysses all-to-alls and the
output gather). Any recorded call site fails the test. ``*_like`` and ``Tensor.new_*`` inherit their
source's device and are not factories here; diffusers' own code is not h3serve's to fix and is not
recorded.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch.overrides import TorchFunctionMode

from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
from h3serve.pipelines.h3.denoiser import H3Denoiser
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.replicas.sequence_parallel import UlyssesGroup
from tests.harness import free_port
from tests.test_h3_forward import DOCUMENTS, document

H3SERVE_PACKAGES = ("h3serve.attention", "h3serve.pipelines", "h3serve.replicas")
# Functions that make a tensor on the default device unless given one.
FACTORIES = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.scalar_tensor,
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.empty_strided,
        torch.full,
        torch.arange,
        torch.range,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
    }
)


def _h3serve_call_site(frame) -> str | None:
    """The first caller outside torch, as ``module:line (function)`` when it is one of h3serve's packages."""
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == "torch":
        frame = frame.f_back
    if frame is None:
        return None
    module = frame.f_globals.get("__name__", "")
    if ".".join(module.split(".")[:2]) not in H3SERVE_PACKAGES:
        return None
    return f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"


class DefaultDeviceFactories(TorchFunctionMode):
    """Records the call sites in h3serve's packages that make a tensor without ``device=``."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        copies_a_tensor = func is torch.as_tensor and isinstance(args[0], torch.Tensor)  # keeps its device
        if func in FACTORIES and kwargs.get("device") is None and not copies_a_tensor:
            site = _h3serve_call_site(sys._getframe(1))
            if site is not None:
                self.sites.append(f"torch.{func.__name__} at {site}")
        return func(*args, **kwargs)


def keyframe_png(width: int = 64, height: int = 64) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 20)).save(out, format="PNG")
    return out.getvalue()


def mixed_requests() -> list[GenerationRequest]:
    """Different canvases, clip lengths, step counts and tasks (as tests/test_replicas.py mixes them)."""
    return [
        GenerationRequest(prompt="a small red boat", num_inference_steps=3, seed=1),  # the model's own canvas
        GenerationRequest(prompt="waves", width=64, height=64, num_frames=141, num_inference_steps=2, seed=2),
        GenerationRequest(
            prompt="a red door", width=64, height=64, num_inference_steps=2, seed=3, first_frame=keyframe_png()
        ),
    ]


JOINER = GenerationRequest(prompt="a lighthouse", width=64, height=128, num_inference_steps=2, seed=4)
ROW_MULTIPLE = 8  # every pack gets a padding document (unless its rows happen to be a multiple of 8)


@dataclasses.dataclass
class Outcome:
    sites: list[str]  # h3serve call sites that made a tensor without device=
    rows: list[tuple[torch.Tensor, torch.Tensor]]  # each request's final (video, audio) latent rows
    frames: list[tuple[int, ...]]  # each decoded clip's [F, H, W, 3]
    padding_rows: int  # padding rows over every pack stepped
    forwards: int  # packed forwards run


def serve_requests(pipeline: H3Pipeline, forward, recorder: DefaultDeviceFactories, decode: bool = True) -> Outcome:
    """Prepare, step in shared packs (a request joins after the first step), decode: the engine's life cycle."""
    padding = forwards = 0
    with recorder:
        states = [pipeline.prepare(r) for r in mixed_requests()]
        first = True
        while any(not s.done for s in states):
            active = [s for s in states if not s.done]
            for group, pack in pipeline.packs(active):
                padding += pack.padding_rows
                forwards += 1
                pipeline.apply(group, pack, forward(pack))
            if first:
                states.append(pipeline.prepare(JOINER))
                first = False
        media = [pipeline.decode(s) for s in states] if decode else []
    rows = [(s.video_rows.clone(), s.audio_rows.clone()) for s in states]
    return Outcome(recorder.sites, rows, [m.frames.shape for m in media], padding, forwards)


def test_the_recorder_sees_a_default_device_factory_in_h3serve_code_only():
    recorder = DefaultDeviceFactories()
    planted = "def pad(n):\n    return torch.zeros(n, 3, dtype=torch.float64)\n"
    ours, theirs = (
        {"torch": torch, "__name__": "h3serve.pipelines.h3.planted"},
        {"torch": torch, "__name__": "elsewhere"},
    )
    exec(planted, ours)
    exec(planted, theirs)
    with recorder:
        ours["pad"](2)
        theirs["pad"](2)  # not h3serve's code
        torch.zeros(2, device="cpu")  # explicit
        torch.as_tensor(torch.ones(2))  # keeps its source's device
    assert recorder.sites == ["torch.zeros at h3serve.pipelines.h3.planted:2 (pad)"]


def test_a_pack_lives_on_its_documents_device():
    docs = [document(**spec) for spec in DOCUMENTS]
    recorder = DefaultDeviceFactories()
    with recorder:
        pack = pack_documents(docs, row_multiple=64)
    assert pack.padding_rows > 0, "the padding document is what this checks"
    assert recorder.sites == []
    tensors = {f.name: getattr(pack, f.name) for f in dataclasses.fields(pack)}
    assert {t.device for t in tensors.values() if isinstance(t, torch.Tensor)} == {docs[0].position_ids.device}


def test_a_pack_refuses_documents_on_two_devices():
    docs = [document(**spec) for spec in DOCUMENTS[:2]]
    docs[1] = dataclasses.replace(docs[1], video_rows=docs[1].video_rows.to("meta"))
    with pytest.raises(ValueError, match=r"every document of a pack must be on cpu; document 1: video_rows on meta"):
        pack_documents(docs)


@pytest.fixture(scope="module")
def single_rank(tiny_pipeline) -> Outcome:
    tiny_pipeline.row_multiple = ROW_MULTIPLE
    try:
        return serve_requests(tiny_pipeline, tiny_pipeline.forward, DefaultDeviceFactories())
    finally:
        tiny_pipeline.row_multiple = 1


def test_serving_at_sp1_makes_every_tensor_on_the_datas_device(single_rank):
    assert single_rank.sites == [], "tensors made on the default device, not the data's:\n" + "\n".join(
        sorted(set(single_rank.sites))
    )
    assert single_rank.padding_rows > 0
    assert len(single_rank.frames) == 4 and all(len(shape) == 4 and shape[-1] == 3 for shape in single_rank.frames)


def _rank_main(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    """One SP rank in its own process: rank 0 drives the requests and broadcasts each pack; rank 1 follows."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )
    try:
        recorder = DefaultDeviceFactories()
        if rank == 0:
            pipeline = H3Pipeline.load(checkpoint, "torch_sdpa")
            pipeline.row_multiple = ROW_MULTIPLE
            heads = pipeline.denoiser.transformers["transformer"].config.num_attention_heads
            sp = UlyssesGroup(2, 0, heads)

            def forward(pack):
                dist.broadcast_object_list([pack], src=0)
                out = pipeline.denoiser.forward(pack, sp)
                assert out is not None
                return out

            outcome = serve_requests(
                pipeline, forward, recorder, decode=False
            )  # decoding is rank 0's alone, as at sp=1
            dist.broadcast_object_list([None], src=0)  # no more packs
            torch.save(dataclasses.asdict(outcome), Path(out_dir) / "rank0.pt")
        else:
            denoiser = H3Denoiser.load(checkpoint, "torch_sdpa")
            sp = UlyssesGroup(2, 1, denoiser.transformers["transformer"].config.num_attention_heads)
            forwards = 0
            while True:
                message = [None]
                dist.broadcast_object_list(message, src=0)
                if message[0] is None:
                    break
                with recorder:
                    assert denoiser.forward(message[0], sp) is None  # only rank 0 gets the rows back
                forwards += 1
            torch.save({"sites": recorder.sites, "forwards": forwards}, Path(out_dir) / "rank1.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes, each builds the tiny model (`make test-fast` leaves it out)
def test_serving_at_sp2_over_gloo_makes_every_tensor_on_the_datas_device(tiny_checkpoint, single_rank, tmp_path):
    mp.spawn(_rank_main, args=(free_port(), str(tiny_checkpoint), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    sites = rank0["sites"] + rank1["sites"]
    assert sites == [], "tensors made on the default device, not the data's:\n" + "\n".join(sorted(set(sites)))
    assert rank0["padding_rows"] > 0 and rank1["forwards"] == rank0["forwards"] == single_rank.forwards >= 2
    # the same requests at sp=2 end where they end at sp=1 (rank 0 gathered every rank's projected rows)
    for (video, audio), (video1, audio1) in zip(rank0["rows"], single_rank.rows, strict=True):
        torch.testing.assert_close(video, video1, atol=1e-4, rtol=0)
        torch.testing.assert_close(audio, audio1, atol=1e-4, rtol=0)
