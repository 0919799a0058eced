"""The released-size step on the meta device: every path a replica takes, its FLOPs, host syncs and memory.

The ``full`` transformer (diffusers' ``MiniMaxH3Transformer3DModel`` at the released config, 33.1B parameters, bf16
with diffusers' fp32 modules kept fp32) is built on the meta device inside a real ``H3Pipeline`` (its denoiser, the
released schedulers and model rules; conditioning and decoding belong to stages, as in the shipped GPU configs).
Requests are admitted from what a conditioner stage hands over (``shapes.clip_prepared``: diffusers' layout and
row-timestep builders), then stepped by ``H3Pipeline.packs``/``forward``/``apply``, the calls an engine step makes:
``pack_documents``, ``packed_forward`` through h3serve's attention processor, each request's two schedulers. Only the
attention kernel and the collectives stand in (``runtime``). Ulysses' group class is handed in by the caller
(``h3serve plan``, the tests): pipelines import nothing from ``replicas``.

Each pack runs one warm-up step (each scheduler finds its place in its schedule, each step cache takes its first
residuals) and one measured step, which reports: the FLOPs ``FlopCounterMode`` counts against
``shapes.forward_flops``; the host syncs, each with its line; the collectives and their bytes; the bytes live
before the step (the requests' own tensors on the device) and the step's peak above them, against
``h3serve/pipelines/h3/memory.py``'s plan for the same pack; which tensors ran in fp32. ``check`` holds a path to
its budgets (``SYNC_BUDGET``, the formula, the plan); ``projection`` turns the counts into **projected** seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.denoiser import H3Denoiser
from h3serve.pipelines.h3.handoff import PreparedState
from h3serve.pipelines.h3.lora import LoraAdapter, LoraLayer, LoraSpec, LoraSpecs
from h3serve.pipelines.h3.memory import activation_row_cost, request_row_cost
from h3serve.pipelines.h3.pipeline import H3Pipeline
from h3serve.pipelines.h3.request import GenerationRequest
from h3serve.pipelines.h3.request_state import RequestState
from h3serve.pipelines.h3.shapes import (
    AUDIO_SHIFT,
    VIDEO_SHIFT,
    Clip,
    build_transformer,
    clip_prepared,
    forward_flops,
    lora_flops,
    parameter_bytes,
    transformer_config,
)
from h3serve.pipelines.h3.step_cache import StepCachePolicy

from .runtime import MetaRun, MetaVarlenImpl, dtype_log, fake_group

# the Ulysses group: (sp_degree, rank, heads, device) -> h3serve.replicas.sequence_parallel.UlyssesGroup
UlyssesFactory = Callable[..., Any]

STEPS = 50  # the released serve configs' default_steps
LORA_RANK = 64
# step caching, First-Block-Cache F1B0: warmed after the warm-up step, a request skips its middle blocks at the
# measured one (meta has no residual to measure: it reads 0); one still warming up computes them
SKIPS = StepCachePolicy(threshold=0.1, warmup_steps=1, max_consecutive_skips=3)
COMPUTES = StepCachePolicy(threshold=0.1, warmup_steps=3, max_consecutive_skips=3)


@dataclasses.dataclass(frozen=True)
class Ask:
    """One request of a pack: its geometry, the step it is at, and what it runs with."""

    clip: Clip
    step: int = 25  # the measured step's index in its 50 (the warm-up step runs one before)
    cache: StepCachePolicy | None = None
    adapter: str | None = None


RELEASED = Clip(1344, 768, 124)  # the default 16:9 canvas, 5.17 s: 37,966 rows
PACKS: dict[str, list[Ask]] = {
    # (a) one released T2VA request
    "one": [Ask(RELEASED)],
    # (b) 8 mixed requests: stills (the images endpoint's shortest clip), 5 s and 10 s clips, an FL2VA, at their steps
    "mixed": [
        Ask(Clip(512, 512, 124), step=2),  # a still
        Ask(Clip(512, 512, 124), step=47),  # a still
        Ask(Clip(640, 384, 124), step=10),
        Ask(Clip(384, 640, 124), step=30),
        Ask(Clip(640, 384, 124, keyframes=("first", "last")), step=5),
        Ask(Clip(512, 256, 243), step=20),  # 10.1 s
        Ask(Clip(256, 384, 243), step=40),
        Ask(Clip(384, 640, 124), step=12),
    ],
    # (c) the H200 config's row budget: two released clips and a small one, 79,932 of 80,000 rows
    "budget": [Ask(RELEASED, step=5), Ask(RELEASED, step=33), Ask(Clip(320, 288, 124), step=18)],
}


# (d) step caching: every request caches; a still skips its middle blocks, the rest compute them (the plan's worst
# case is every row caching and computing, beside a sub-pack)
CACHED = [
    Ask(RELEASED, step=20, cache=COMPUTES),
    *(Ask(Clip(640, 384, 124), step=s, cache=COMPUTES) for s in (3, 20, 40)),
    Ask(Clip(640, 384, 124, keyframes=("first", "last")), step=8, cache=COMPUTES),
    Ask(Clip(256, 256, 124), step=30, cache=SKIPS),
]
# (e) LoRA: the mixed pack on the base model and two adapters (rank 64 on every linear layer), several per pack
ADAPTERS = ("turbo", "style")
ADAPTED = [dataclasses.replace(a, adapter=(None, *ADAPTERS)[i % 3]) for i, a in enumerate(PACKS["mixed"])]
# (f) composed LoRA (issue 57): the mixed pack on the base model and on two lists composing both adapters at their
# own weights (each adapter's GEMMs on its rows: twice (e)'s delta work on the adapted rows)
COMPOSED_LISTS = (None, "turbo@0.8,style@0.5", "style@-0.4,turbo@1.0")
COMPOSED = [dataclasses.replace(a, adapter=COMPOSED_LISTS[i % 3]) for i, a in enumerate(PACKS["mixed"])]


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, format="PNG")
    return buffer.getvalue()


class MetaReplica:
    """One rank's denoiser at the released size on meta, inside a real ``H3Pipeline``; ``run`` watches it.
    ``ulysses`` builds the SP group of a step over several ranks (None: sp_degree 1 only)."""

    def __init__(self, adapters: Sequence[str] = (), ulysses: UlyssesFactory | None = None):
        self.ulysses = ulysses
        from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler

        from h3serve.pipelines.h3.stages import H3Stages

        self.config = transformer_config("full")
        self.run = MetaRun(unknown=_measure_zero)
        self.model = build_transformer(self.config, "meta", torch.bfloat16)
        self.run.exclude(self.model)
        denoiser = H3Denoiser({"transformer": self.model}, "torch_sdpa", torch.device("meta"), Path("minimax-h3"))
        self.impl = MetaVarlenImpl(self.run)
        install(self.model, self.impl)  # in place of the admitted kernel: the only stand-in
        for slot, name in enumerate(adapters, 1):
            adapter = every_linear_adapter(self.model, name, LORA_RANK)
            self.run.exclude_tensors(t for layer in adapter.layers.values() for t in (layer.down, layer.up))
            denoiser.adapters["transformer"][slot] = adapter
        denoiser.loras = LoraSpecs(loras={name: _spec(name) for name in adapters})
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the audio VAE's weight_norm deprecation
            vaes = dict(vae=AutoencoderKLMiniMaxH3(), audio_vae=AutoencoderKLMiniMaxH3Audio())
        rules = H3Stages({"transformer": self.model, **vaes, "processor": None}, {}).rules()
        schedulers = {"scheduler": MiniMaxH3Scheduler(VIDEO_SHIFT), "audio_scheduler": MiniMaxH3Scheduler(AUDIO_SHIFT)}
        self.pipeline = H3Pipeline(denoiser, None, schedulers, None, "minimax-h3", rules)
        self.weight_bytes = parameter_bytes(self.model)

    @property
    def denoiser(self) -> H3Denoiser:
        return self.pipeline.denoiser

    def admit(self, ask: Ask, seed: int, prepared: PreparedState, start: int) -> RequestState:
        """A request as a denoiser with stages admits it (the conditioner's host tensors moved onto the device),
        at step ``start`` of its schedules, as a request resumed there."""
        clip = ask.clip
        png = _png()
        request = GenerationRequest(
            prompt="a meta-device request", width=clip.width, height=clip.height, num_frames=clip.num_frames,
            num_inference_steps=STEPS, seed=seed, first_frame=png if "first" in clip.keyframes else None,
            last_frame=png if "last" in clip.keyframes else None,
        )  # fmt: skip
        state = self.pipeline.admit(request, prepared, ask.cache, ask.adapter)
        state.step_index = start
        for scheduler in (state.video_scheduler, state.audio_scheduler):
            scheduler.set_begin_index(start)  # diffusers' way to start a schedule mid-way
        return state


@functools.lru_cache(maxsize=16)
def _prepared(config_name: str, clip: Clip, seed: int) -> PreparedState:
    """A conditioner stage's answer for ``clip`` (host tensors, never written: admitting copies them)."""
    return PreparedState(clip_prepared(transformer_config(config_name), clip, STEPS, seed))


def _measure_zero(kind: str, tensor: torch.Tensor):
    """The host value of data meta cannot give: the step cache's measures read 0 (every warmed cache skips)."""
    return 0.0 if kind == "item" else torch.zeros(tensor.shape, dtype=tensor.dtype)


def _spec(name: str) -> LoraSpec:
    return LoraSpec(path=Path(f"/meta/{name}"))


def every_linear_adapter(model: torch.nn.Module, name: str, rank: int) -> LoraAdapter:
    """An adapter on every ``nn.Linear`` of ``model`` (as a few-step adapter adapts the timestep path too), its
    factors on each layer's device and dtype (``LoraAdapter.placed_for``)."""
    layers = {
        module_name: LoraLayer(
            down=torch.empty(rank, module.in_features, device="meta"),
            up=torch.empty(module.out_features, rank, device="meta"),
            scaling=1.0,
        )
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    return LoraAdapter(name=name, spec=_spec(name), partition="transformer", layers=layers).placed_for(model)


def _forward_for(replica: MetaReplica, sp: Any):
    if sp is None:
        return replica.pipeline._forward_alone
    return lambda pack: replica.denoiser.forward(pack, sp)


def measure(replica: MetaReplica, asks: Sequence[Ask], sp_degree: int = 1, rank: int = 0) -> dict:
    """One measured step of ``asks`` on ``replica`` (at ``sp_degree``, this ``rank``'s share); a pack of caching
    requests first takes one warm-up step, which gives each its residuals to decide on."""
    run, pipeline = replica.run, replica.pipeline
    heads = replica.config["num_attention_heads"]
    warm_up = any(a.cache is not None for a in asks)
    prepared = [_prepared("full", ask.clip, seed) for seed, ask in enumerate(asks)]
    replica.impl.dtypes.clear()
    if sp_degree > 1 and replica.ulysses is None:
        raise ValueError(f"sp_degree {sp_degree} needs the replica's Ulysses group class (MetaReplica(ulysses=...))")
    with fake_group(rank, sp_degree) if sp_degree > 1 else contextlib.nullcontext(), run:
        sp = replica.ulysses(sp_degree, rank, heads, device="meta") if replica.ulysses and sp_degree > 1 else None
        pipeline.row_multiple = sp_degree
        forward = _forward_for(replica, sp)
        run.live = run.peak = 0
        with run.unchecked():
            states = [replica.admit(ask, seed, prepared[seed], ask.step - warm_up) for seed, ask in enumerate(asks)]
        resident = run.live

        def step(measured: bool):
            ((group, pack),) = pipeline.packs(states)
            out = forward(pack)
            if rank == 0:
                pipeline.apply(group, pack, out)
            return pack

        if warm_up:
            step(False)
        run.syncs.clear()
        run.collectives.clear()
        run.violations.clear()
        held = run.reset_peak()  # the requests' tensors and their step caches, live between steps
        started, ops, memory_bytes = time.perf_counter(), run.ops, run.memory_bytes
        run.matmuls = 0
        with FlopCounterMode(display=False) as counter, dtype_log(replica.model) as dtypes, run.fused(replica.model):
            pack = step(True)
        seconds = time.perf_counter() - started
        counted = counter.get_total_flops()
        skipped = [(state.step_cache.skipped[-1] if state.step_cache is not None else False) for state in states]
        host_pack = run_host(run, pack)
        result = dict(
            requests=len(asks),
            rows=pack.total_rows,
            padding_rows=pack.padding_rows,
            text_rows=int(pack.text_indices.numel()),
            video_rows=int(pack.video_indices.numel()),
            audio_rows=int(pack.audio_indices.numel()),
            timesteps=int(pack.timestep.numel()),
            sp_degree=sp_degree,
            rank=rank,
            skipped=skipped,
            flops=counted,
            syncs=[str(s) for s in run.syncs],
            sync_sites=[s.site for s in run.syncs],
            sync_kinds=_count(s.kind for s in run.syncs),
            mid_forward_syncs=sum(s.mid_forward for s in run.syncs),
            collectives=_count(c.op for c in run.collectives),
            collective_bytes=sum(c.bytes for c in run.collectives),
            all_to_all_bytes=sum(c.bytes for c in run.collectives if c.op.startswith("alltoall")),
            memory_bytes=run.memory_bytes - memory_bytes,
            violations=list(run.violations),
            resident_bytes=resident,
            held_bytes=held,
            step_peak_bytes=run.peak - held,
            activation_peak_bytes=run.peak - resident,  # the plan's activations: step caches' residuals included
            peak_at=run.peak_where,
            fp32_linears=sorted({n.split(".")[0] for n, (x, w) in dtypes.items() if w == torch.float32}),
            mismatched_linears=sorted(n for n, (x, w) in dtypes.items() if x != w),
            attention_dtypes=sorted(str(d) for d in replica.impl.dtypes),
            ops=run.ops - ops,
            seconds=seconds,
        )
    skipped_blocks = _skipped_blocks(replica, asks, skipped)
    if sp_degree == 1 or not any(skipped_blocks):  # a sub-pack under Ulysses is padded and split: not in the formula
        formula = forward_flops(replica.config, host_pack, sp_degree, rank, skipped_blocks)
        formula["lora"] = lora_flops(replica.config, host_pack, _adapter_shapes(replica)) if sp_degree == 1 else 0
        formula["total"] += formula["lora"]
        result["formula"], result["flops_ratio"] = formula, result["flops"] / formula["total"]
    whole = forward_flops(replica.config, host_pack)  # every rank's work together, no step skipped: the floor's
    result["pack_flops"] = whole["total"] + lora_flops(replica.config, host_pack, _adapter_shapes(replica))
    result["plan"] = plan_for(replica.config, result, asks)
    return result


def _adapter_shapes(replica: MetaReplica) -> dict[int, dict[str, tuple[int, int, int]]]:
    """slot -> {module: (in_features, out_features, rank)} of the adapters the replica serves."""
    return {
        slot: {name: (layer.down.shape[1], layer.up.shape[0], layer.rank) for name, layer in adapter.layers.items()}
        for slot, adapter in replica.denoiser.adapters["transformer"].items()
    }


def _skipped_blocks(replica: MetaReplica, asks: Sequence[Ask], skipped: list[bool]) -> list[int]:
    """Blocks each document left out: its middle blocks when it skipped (F1B0: all but the first)."""
    blocks = replica.config["num_layers"]
    return [
        blocks - a.cache.fn_blocks - a.cache.bn_blocks if s and a.cache else 0
        for a, s in zip(asks, skipped, strict=True)
    ]


def run_host(run: MetaRun, pack):
    """``pack`` with its index tensors' host values (what ``forward_flops`` reads)."""
    fields = {}
    for f in dataclasses.fields(pack):
        value = getattr(pack, f.name)
        if isinstance(value, torch.Tensor):
            fields[f.name] = run.host.get(value, value)
    return dataclasses.replace(pack, **fields)


def plan_for(config: dict, result: dict, asks: Sequence[Ask]) -> dict:
    """``h3serve/pipelines/h3/memory.py``'s plan for the measured pack, by modality: its activations on this rank,
    and the requests' own tensors (rank 0)."""
    policies = [a.cache for a in asks if a.cache is not None]
    cost = activation_row_cost(
        config,
        torch.bfloat16,
        sp_degree=result["sp_degree"],
        step_cache=bool(policies),
        late_decisions=len({p.fn_blocks for p in policies}) > 1,
    )
    rows, text = result["rows"] - result["padding_rows"], result["text_rows"]
    activations = cost.bytes_for(rows, result["sp_degree"], text)
    requests = request_row_cost(config, torch.bfloat16, STEPS).bytes_for(rows, text)
    return dict(
        activation_bytes=activations,
        request_bytes=requests,
        activation_ratio=result["activation_peak_bytes"] / activations,
        request_ratio=result["resident_bytes"] / requests,
    )


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


# -- what CI holds every path to ---------------------------------------------------------------------------------
# The host syncs one step makes, by site, as measured: on CUDA the host waits for the device at each ("mid-forward":
# after the forward's first matmul, so the device also idles until the host queues more). A path's budget is the sum
# of its parts'; tests/test_meta_step.py holds every path to exactly these sites and counts.
SYNC_BUDGET: dict[str, dict[str, int]] = {
    "pack": {  # before the forward: the pack's distinct timesteps, its two bounds vectors copied to the device
        "unique at h3serve/pipelines/h3/packing.py (pack_documents)": 1,
        "host-to-device copy at h3serve/pipelines/h3/packing.py (pack_documents)": 2,
    },
    "ulysses": {  # this rank's text, video and audio rows, by boolean masks (their nonzero): 3 indices, 3 row sets
        "boolean mask at h3serve/pipelines/h3/forward.py (_local)": 6,
        # mid-forward: the agreement's per-rank flags read back (every rank leaves a failed prologue there together)
        "device-to-host copy at h3serve/replicas/sequence_parallel.py (agree)": 1,
    },
    "step cache": {  # mid-forward: the decisions read back, the computing documents' sub-pack bounds sent
        "device-to-host copy at h3serve/pipelines/h3/step_cache.py (_decide)": 1,
        "host-to-device copy at h3serve/pipelines/h3/step_cache.py (of)": 1,
    },
    "ulysses step cache": {  # mid-forward: each decision's vector sent to rank 0's broadcast and read back
        "host-to-device copy at h3serve/replicas/sequence_parallel.py (follow_rank0)": 1,
        "device-to-host copy at h3serve/replicas/sequence_parallel.py (follow_rank0)": 1,
        # after the gather, where the step's end waits for the device anyway: the outcome's agreement (no rank
        # commits a cache step another rank failed, out of memory)
        "device-to-host copy at h3serve/replicas/sequence_parallel.py (agree)": 1,
    },
    "lora": {  # before the forward: each row's slot, the slot groups, and each stream's runs of one slot
        "host-to-device copy at h3serve/pipelines/h3/lora.py (pack_slots)": 2,
        "repeat_interleave at h3serve/pipelines/h3/lora.py (pack_slots)": 1,
        "unique at h3serve/pipelines/h3/lora.py (pack_slots)": 1,
        "device-to-host copy at h3serve/pipelines/h3/lora.py (adapting)": 1,
        "nonzero at h3serve/pipelines/h3/lora.py (_runs)": 5,
        "device-to-host copy at h3serve/pipelines/h3/lora.py (_runs)": 10,
        "host-to-device copy at h3serve/pipelines/h3/lora.py (_runs)": 5,
    },
}
SYNC_BUDGET_ULYSSES_LORA = {"boolean mask at h3serve/pipelines/h3/lora.py (local)": 2}  # pack_slots' own row filter


def sync_budget(parts: Sequence[str]) -> dict[str, int]:
    budget: dict[str, int] = {}
    for part in parts:
        for site, n in SYNC_BUDGET[part].items():
            budget[site] = budget.get(site, 0) + n
    return budget


@dataclasses.dataclass(frozen=True)
class StepPath:
    """One way a replica steps a pack: the pack, the Ulysses degree and rank, and the parts its syncs come from."""

    asks: tuple[Ask, ...]
    sp_degree: int = 1
    rank: int = 0
    parts: tuple[str, ...] = ("pack",)


PATHS: dict[str, StepPath] = {
    "(a) one 1344x768x124": StepPath(tuple(PACKS["one"])),
    "(b) 8 mixed": StepPath(tuple(PACKS["mixed"])),
    "(c) H200 row budget": StepPath(tuple(PACKS["budget"])),
    "(d) step cache": StepPath(tuple(CACHED), parts=("pack", "step cache")),
    "(e) LoRA, 2 adapters": StepPath(tuple(ADAPTED), parts=("pack", "lora")),
    "(f) LoRA, composed lists": StepPath(tuple(COMPOSED), parts=("pack", "lora")),
    "(c) sp=4, rank 0": StepPath(tuple(PACKS["budget"]), 4, 0, ("pack", "ulysses")),
    "(c) sp=4, rank 3": StepPath(tuple(PACKS["budget"]), 4, 3, ("pack", "ulysses")),
    "(d) sp=4, rank 0": StepPath(tuple(CACHED), 4, 0, ("pack", "ulysses", "step cache", "ulysses step cache")),
}
TOLERANCE = 0.10  # measured / planned memory, and FLOPs counted / formula (1%: FLOP_TOLERANCE)
FLOP_TOLERANCE = 0.01


def measure_path(replica: MetaReplica, path: StepPath) -> dict:
    return measure(replica, path.asks, path.sp_degree, path.rank)


def check(name: str, result: dict) -> list[str]:
    """What is wrong with one measured path against its budgets and the plan (empty: nothing)."""
    path = PATHS[name]
    problems = []
    if result["violations"]:
        problems.append(f"tensors off the device: {result['violations']}")
    sites = _count(s for s in result["sync_sites"])
    if sites != sync_budget(path.parts):
        problems.append(f"host syncs {sites} != budget {sync_budget(path.parts)}")
    if result.get("flops_ratio") is not None and abs(result["flops_ratio"] - 1) > FLOP_TOLERANCE:
        problems.append(f"FLOPs {result['flops_ratio']:.4f} x the formula")
    for what in ("activation_ratio", "request_ratio"):
        if abs(result["plan"][what] - 1) > TOLERANCE:
            problems.append(f"{what} {result['plan'][what]:.3f}")
    return problems
