"""``h3serve eval``: generate held-out scenes through the serving path and judge every clip analytically.

The path is the server's: a ``replicas.WorkerGroup`` builds rank 0's pipeline from the checkpoint with the
attention backend admission resolves for this node, and a ``replicas.Engine`` packs up to ``pack`` requests
into each forward, as a replica does. At ``sp`` 1 no Ray is needed; over more Ulysses ranks the group's
workers are Ray actors on a local cluster started for the eval (or the one already connected). The clips are
``n`` held-out scenes of ``h3serve.demo.world`` (combinations the transformer never trains on) in the checkpoint's own
format (default canvas, shortest clip, frame rate, sample rate), request ``i`` seeded ``seed + i``. Each clip is
judged by ``h3serve.demo.detectors``; a verdict of None (unknown) counts as wrong.

``oracle=True`` judges the world's own rendering of the same scenes in the same format instead of
generated clips: 100% by construction of the detectors, the ceiling any checkpoint is measured against.

Everything is deterministic for a checkpoint, seed, size, steps and pack: the scenes, the requests'
seeds and diffusers' schedules. Any checkpoint in the released layout runs; random tiny weights
report their (low) accuracy like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from h3serve.pipelines.h3 import GeneratedMedia, GenerationRequest, RequestError
from h3serve.pipelines.h3.step_cache import OFF, StepCacheTiers

from .detectors import judge
from .world import ClipFormat, Scene, held_out_scenes, render

if TYPE_CHECKING:  # replicas imports Ray, which `h3serve eval --help` need not load
    from h3serve.replicas import WorkerGroup

ATTRIBUTES = ("colour", "shape", "motion", "sound")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    checkpoint: str | None = None  # None: the built-in tiny checkpoint
    n: int = 18  # clips; 18 covers every held-out combination once
    seed: int = 0
    steps: int = 50  # num_inference_steps, as `h3serve generate`
    pack: int = 8  # requests per packed forward at most (the engine's max_active)
    width: int | None = None  # None with height: the checkpoint's default canvas
    height: int | None = None
    num_frames: int | None = None  # None: the checkpoint's shortest clip
    oracle: bool = False
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str | None = None  # None: h3serve.pipelines.h3.default_dtype(device)
    backend: str = "auto"
    cache: str = OFF  # every clip's step-cache tier: "off" or a built-in tier (StepCacheTiers' defaults)
    sp: int = 1  # Ulysses ranks of the worker group (more than 1: Ray actors on this node, a CPU each)

    def __post_init__(self):
        for field, value, least in (
            ("n", self.n, 1),
            ("pack", self.pack, 1),
            ("steps", self.steps, 2),
            ("sp", self.sp, 1),
        ):
            if value < least:
                raise RequestError(field, f"{field} must be at least {least}, got {value}")
        StepCacheTiers().policy(self.cache)  # RequestError("cache") naming the tiers


@dataclasses.dataclass(frozen=True)
class ClipVerdict:
    index: int
    scene: Scene
    seed: int
    detected: dict[str, str | None]

    @property
    def correct(self) -> dict[str, bool]:
        expected = self.scene.attributes()
        return {a: self.detected[a] == expected[a] for a in ATTRIBUTES}

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "prompt": self.scene.prompt,
            "seed": self.seed,
            "expected": self.scene.attributes(),
            "detected": self.detected,
            "correct": self.correct,
            "all_correct": all(self.correct.values()),
        }


def _row(correct: int, unknown: int, clips: int) -> dict[str, float]:
    return {"correct": correct, "unknown": unknown, "clips": clips, "accuracy": correct / clips}


def summarize(verdicts: list[ClipVerdict]) -> dict[str, dict[str, float]]:
    """Per attribute and for whole clips (every attribute right): correct, unknown, clips and accuracy."""
    out = {
        attribute: _row(
            sum(v.correct[attribute] for v in verdicts),
            sum(v.detected[attribute] is None for v in verdicts),
            len(verdicts),
        )
        for attribute in ATTRIBUTES
    }
    out["all four"] = _row(sum(all(v.correct.values()) for v in verdicts), 0, len(verdicts))
    return out


def format_table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'attribute':<10} {'correct':>7} {'unknown':>7} {'clips':>5} {'accuracy':>8}", "-" * 41]
    for name, row in summary.items():
        lines.append(
            f"{name:<10} {row['correct']:>7} {row['unknown']:>7} {row['clips']:>5} {100 * row['accuracy']:>7.1f}%"
        )
    return "\n".join(lines)


def requests_for(scenes: list[Scene], fmt: ClipFormat, settings: EvalSettings) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt=scene.prompt,
            width=fmt.width,
            height=fmt.height,
            num_frames=fmt.num_frames,
            num_inference_steps=settings.steps,
            seed=settings.seed + i,
            cache=settings.cache,
        )
        for i, scene in enumerate(scenes)
    ]


def checked_geometry(settings: EvalSettings):
    """The checkpoint's directory and transformer geometry, the degree ``settings.sp`` checked against its heads."""
    from h3serve.pipelines.h3 import TransformerGeometry
    from h3serve.pipelines.h3.checkpoint import resolve_checkpoint

    directory = resolve_checkpoint(settings.checkpoint)
    geometry = TransformerGeometry.from_checkpoint(directory)
    geometry.check_sp_degree(settings.sp)
    return directory, geometry


def build_group(settings: EvalSettings) -> WorkerGroup:
    """A worker group of ``settings.sp`` ranks on this node with the backend admission resolves for the checkpoint
    (over several ranks, Ray must be initialised: ``local_ray``)."""
    from h3serve.attention import probe_platform, resolve
    from h3serve.pipelines.h3 import REQUIREMENTS, default_dtype
    from h3serve.replicas import ReplicaSpec, WorkerGroup

    directory, geometry = checked_geometry(settings)
    dtype = settings.dtype or default_dtype(settings.device)
    resolution = resolve(
        REQUIREMENTS,
        settings.backend,
        probe_platform(settings.device),
        model=str(directory),
        dtype=dtype,
        head_dim=geometry.head_dim,
    )
    spec = ReplicaSpec(
        resolution=resolution,
        checkpoint=str(directory),
        model_name=directory.name,
        num_heads=geometry.num_heads,
        head_dim=geometry.head_dim,
        num_layers=geometry.num_layers,
        hidden_size=geometry.hidden_size,
        device=settings.device,
        dtype=dtype,
        sp_degree=settings.sp,
        rank_resources={"CPU": 1.0} if settings.device == "cpu" else {"CPU": 1.0, "GPU": 1.0},
    )
    return WorkerGroup.create(spec)


@contextlib.contextmanager
def local_ray(sp: int) -> Iterator[None]:
    """Over several ranks the workers are Ray actors: a local cluster for the eval unless one is connected."""
    if sp == 1:
        yield
        return
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(num_cpus=sp, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


async def generate_all(group: WorkerGroup, requests: list[GenerationRequest], pack: int) -> list[GeneratedMedia]:
    from h3serve.replicas import Engine, EngineLimits

    # the whole set is submitted at once: the engine holds `pack` in the forward and the rest in its queue
    engine = Engine(group, EngineLimits(max_active=pack, max_queue=len(requests)))
    try:
        return list(await asyncio.gather(*(engine.generate(r, request_id=f"eval-{i}") for i, r in enumerate(requests))))
    finally:
        await engine.close("eval finished")


def evaluate(settings: EvalSettings) -> dict[str, Any]:
    """Generate (or, for the oracle, render) and judge; returns the JSON document ``--json`` writes."""
    checked_geometry(settings)  # a degree the checkpoint's heads cannot split is refused before a cluster starts
    with local_ray(settings.sp):
        return _evaluate(settings)


def _evaluate(settings: EvalSettings) -> dict[str, Any]:
    group = build_group(settings)
    try:
        rules = group.pipeline.rules
        fmt = ClipFormat.of(rules, settings.width, settings.height, settings.num_frames)
        scenes = held_out_scenes(settings.n, settings.seed)
        requests = requests_for(scenes, fmt, settings)
        for request in requests:
            group.pipeline.validate(request)
        if settings.oracle:
            clips = [render(scene, fmt) + (fmt.sample_rate,) for scene in scenes]
        else:
            media = asyncio.run(generate_all(group, requests, settings.pack))
            clips = [(m.frames, m.audio, m.sample_rate) for m in media]
        checkpoint = str(group.pipeline.denoiser.directory)
    finally:
        group.shutdown()
    verdicts = [
        ClipVerdict(i, scene, request.seed, judge(*clip))
        for i, (scene, request, clip) in enumerate(zip(scenes, requests, clips, strict=True))
    ]
    return {
        "checkpoint": checkpoint,
        "oracle": settings.oracle,
        "settings": dataclasses.asdict(settings),
        "format": dataclasses.asdict(fmt),
        "summary": summarize(verdicts),
        "clips": [v.to_json() for v in verdicts],
    }


def write_json(result: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
