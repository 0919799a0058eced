"""The released-size step on the meta device: every path a replica takes, its FLOPs, host syncs and memory.

    python -m benchmarks.meta_step [--json PATH]      # every path, the plan check, the projection (~1 min)
    python -m benchmarks.meta_step --session           # the projection of gpu_pipeline's packs on one H200
    python -m benchmarks.meta_step --session --smoke   # its single request only (gpu_session.sh --cpu-dry-run)

The ``full`` transformer (diffusers' ``MiniMaxH3Transformer3DModel`` at the released config, 33.1B parameters, bf16
with diffusers' fp32 modules kept fp32) is built on the meta device inside a real ``H3Pipeline`` (its denoiser, the
released schedulers and model rules; conditioning and decoding belong to stages, as in the shipped GPU configs).
Requests are admitted from what a conditioner stage hands over (``shapes.clip_prepared``: diffusers' layout and
row-timestep builders), then stepped by ``H3Pipeline.packs``/``forward``/``apply``, the calls an engine step makes:
``pack_documents``, ``packed_forward`` through h3serve's attention processor, each request's two schedulers. Only the
attention kernel and the collectives stand in (``benchmarks.meta_device``).

Each pack runs one warm-up step (each scheduler finds its place in its schedule, each step cache takes its first
residuals) and one measured step, which reports: the FLOPs ``FlopCounterMode`` counts against
``shapes.forward_flops``; the host syncs, each with its line; the collectives and their bytes; the bytes live
before the step (the requests' own tensors on the device) and the step's peak above them, against
``h3serve/pipelines/h3/memory.py``'s plan for the same pack; which tensors ran in fp32.

Over 600 lines: the released step's paths, their budgets (syncs, FLOPs, memory), the check, the projection and its
tables; the meta-device runtime itself is ``benchmarks/meta_device.py``, the seconds' assumptions
``benchmarks/projection.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.denoiser import H3Denoiser
from h3serve.pipelines.h3.handoff import PreparedState
from h3serve.pipelines.h3.lora import LoraAdapter, LoraLayer, LoraSpec, LoraSpecs
from h3serve.pipelines.h3.memory import DEFAULT_RESERVE_BYTES, GiB, activation_row_cost, request_row_cost
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
from h3serve.replicas.sequence_parallel import UlyssesGroup

from .harness import cli, say, table
from .meta_device import MetaRun, MetaVarlenImpl, dtype_log, fake_group
from .projection import (
    ALL_TO_ALL_GBPS,
    ASSUMPTIONS,
    ATTENTION_TFLOPS,
    BF16_DENSE_TFLOPS,
    FORWARDS_PER_CLIP,
    GEMM_EFFICIENCIES,
    GPUS,
    HBM_EFFICIENCY,
    RankCounts,
    floor_seconds,
)

STEPS = 50  # the released serve configs' default_steps
BUDGET_ROWS, BUDGET_SP = 80000, 4  # h3serve/deploy/serve_config.gpu.yaml (H200): max_rows_per_step, sp_degree
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


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buffer, format="PNG")
    return buffer.getvalue()


class MetaReplica:
    """One rank's denoiser at the released size on meta, inside a real ``H3Pipeline``; ``run`` watches it."""

    def __init__(self, adapters: Sequence[str] = ()):
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
        keyframes = {f"{anchor}_frame": _png() for anchor in clip.keyframes}
        request = GenerationRequest(
            prompt="a meta-device request", width=clip.width, height=clip.height, num_frames=clip.num_frames,
            num_inference_steps=STEPS, seed=seed, **keyframes,
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


def _adapters(denoiser: H3Denoiser) -> list[LoraAdapter]:
    return [a for by_slot in denoiser.adapters.values() for a in by_slot.values()]


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


def _forward_for(replica: MetaReplica, sp: UlyssesGroup | None):
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
    with fake_group(rank, sp_degree) if sp_degree > 1 else _nothing(), run:
        sp = UlyssesGroup(sp_degree, rank, heads, device="meta") if sp_degree > 1 else None
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
    """``h3serve/pipelines/h3/memory.py``'s plan for the measured pack, by modality: its activations on this rank, and
    the
    requests' own tensors (rank 0)."""
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


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


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
    "(c) sp=4, rank 0": StepPath(tuple(PACKS["budget"]), 4, 0, ("pack", "ulysses")),
    "(c) sp=4, rank 3": StepPath(tuple(PACKS["budget"]), 4, 3, ("pack", "ulysses")),
    "(d) sp=4, rank 0": StepPath(tuple(CACHED), 4, 0, ("pack", "ulysses", "step cache", "ulysses step cache")),
}
TOLERANCE = 0.10  # measured / planned memory, and FLOPs counted / formula (1%: FLOP_TOLERANCE)
FLOP_TOLERANCE = 0.01


def measure_path(replica: MetaReplica, path: StepPath) -> dict:
    return measure(replica, path.asks, path.sp_degree, path.rank)


# -- the projection ---------------------------------------------------------------------------------------------
# The peers' published figures (docs/BENCHMARKS.md cites them): seconds for one clip end to end
PEERS = [
    ("sglang, 8 H200, 1344x768 5 s, 50 steps (lossless)", 39.67, "one", 8, FORWARDS_PER_CLIP),
    ("sglang, 4 H200, the same", 75.10, "one", 4, FORWARDS_PER_CLIP),
    ("vLLM-Omni FastH3 (4-step LoRA), 4 H200, 209 frames, p50", 17.16, "fast", 4, 4),
]
PROJECTED_PACKS = {
    "one": PACKS["one"],
    "mixed": PACKS["mixed"],
    "budget": PACKS["budget"],
    "fast": [Ask(Clip(1344, 768, 209))],
}


def counts(result: dict) -> RankCounts:
    formula = result["formula"]
    return RankCounts(
        gemm_flops=formula["matmul"] + formula.get("lora", 0),
        attention_flops=formula["attention"],
        all_to_all_bytes=result["all_to_all_bytes"],
        memory_bytes=result["memory_bytes"],
        sp_degree=result["sp_degree"],
    )


def project(replica: MetaReplica, packs: dict[str, list[Ask]], degrees=(1, 4, 8)) -> list[dict]:
    """Each pack at each Ulysses degree (rank 0, counted on meta), projected on each GPU at each GEMM efficiency."""
    rows = []
    for name, asks in packs.items():
        for sp in degrees:
            result = measure(replica, asks, sp, 0)
            rank = counts(result)
            fits = {
                gpu.name: replica.weight_bytes + result["plan"]["activation_bytes"] + result["plan"]["request_bytes"]
                + DEFAULT_RESERVE_BYTES <= gpu.memory_bytes
                for gpu in GPUS
            }  # fmt: skip
            for gpu in GPUS:
                for efficiency in GEMM_EFFICIENCIES:
                    seconds = rank.seconds(gpu, efficiency)
                    rows.append(
                        dict(
                            pack=name, rows=result["rows"], requests=result["requests"], sp_degree=sp, gpu=gpu.name,
                            gemm_efficiency=efficiency, fits=fits[gpu.name], **seconds,
                            clip_s=seconds["total"] * FORWARDS_PER_CLIP, pack_flops=result["pack_flops"],
                            floor_clip_s=floor_seconds(result["pack_flops"], sp),
                        )
                    )  # fmt: skip
    return rows


def _report_measured(results: dict[str, dict]) -> None:
    table(
        ["path", "rows (text)", "TFLOP counted", "/ formula", "syncs (mid-fwd)", "collectives", "activations GiB",
         "/ plan", "requests' tensors MiB", "/ plan", "eager s"],
        [
            [
                name, f"{r['rows']} ({r['text_rows']})", r["flops"] / 1e12,
                f"{r['flops_ratio']:.4f}" if r.get("flops_ratio") is not None else "-",
                f"{len(r['syncs'])} ({r['mid_forward_syncs']})",
                ", ".join(f"{n} {op.split('.')[0]}" for op, n in r["collectives"].items()) or "-",
                r["activation_peak_bytes"] / GiB, f"{r['plan']['activation_ratio']:.3f}", r["resident_bytes"] / 2**20,
                f"{r['plan']['request_ratio']:.3f}", r["seconds"],
            ]
            for name, r in results.items()
        ],
        title="== measured on meta: one step of the released transformer (bf16, fp32 where diffusers keeps it)",
    )  # fmt: skip
    for name, r in results.items():
        say(f"-- {name}: host syncs (kind, op, shape, before/mid-forward, where)")
        for line in r["syncs"]:
            say(f"   {line}")


def _report_projection(rows: list[dict], efficiency: float = 0.6) -> None:
    chosen = [r for r in rows if r["gemm_efficiency"] == efficiency]
    table(
        ["pack", "rows", "GPUs (sp)", "GPU", "fits", "GEMM s", "attention s", "all-to-all s", "elementwise s",
         "s / step", "s / clip (49 fwd)", "floor s / clip"],
        [
            [r["pack"], r["rows"], r["sp_degree"], r["gpu"], r["fits"], r["gemm"], r["attention"], r["all_to_all"],
             r["elementwise"], r["total"], r["clip_s"], r["floor_clip_s"]]
            for r in chosen
        ],
        title=f"== PROJECTED (not measured): GEMMs at {efficiency:.0%} of {BF16_DENSE_TFLOPS:g} TFLOP/s, attention at "
        f"{ATTENTION_TFLOPS:g} TFLOP/s (FlashAttention-3), all-to-all {ALL_TO_ALL_GBPS:g} GB/s, elementwise at "
        f"{HBM_EFFICIENCY:.0%} of HBM, nothing overlapped",
    )  # fmt: skip
    by = {(r["pack"], r["sp_degree"], r["gpu"], r["gemm_efficiency"]): r for r in rows}
    table(
        ["pack", "GPUs (sp)", *(f"H200 s/clip @{e:.0%}" for e in GEMM_EFFICIENCIES)],
        [[p, sp, *(by[(p, sp, "H200", e)]["clip_s"] for e in GEMM_EFFICIENCIES)] for p, sp, g, e in by
         if g == "H200" and e == GEMM_EFFICIENCIES[0]],
        title="== PROJECTED: seconds per clip of the whole pack (49 forwards) on H200s at each GEMM efficiency",
    )  # fmt: skip


def run(session: bool = False, smoke: bool = False, self_test: bool = False) -> dict:
    say(__doc__.split("\n\n")[0])
    replica = MetaReplica(adapters=() if session else ADAPTERS)
    say(f"built the released transformer on meta: {replica.weight_bytes / GiB:.1f} GiB of weights (adapters included)")
    if session:  # the packs benchmarks.gpu_pipeline measures on one H200, projected for it
        from .gpu_pipeline import LENGTHS

        packs = {
            f"{n} request{'s' * (n > 1)}": [Ask(Clip(1344, 768, f), step=20 + j) for j, f in enumerate(LENGTHS[:n])]
            for n in range(1, 2 if smoke else len(LENGTHS) + 1)
        }
        rows = project(replica, packs, degrees=(1,))
        _report_projection([r for r in rows if r["gpu"] == "H200"])
        return {"ok": True, "projection": rows, "assumptions": ASSUMPTIONS}
    results = {name: measure_path(replica, path) for name, path in PATHS.items()}
    _report_measured(results)
    rows = project(replica, PROJECTED_PACKS)
    _report_projection(rows)
    peers = []
    for label, seconds, pack, gpus, forwards in PEERS:
        ours = next(
            r for r in rows if (r["pack"], r["sp_degree"], r["gpu"], r["gemm_efficiency"]) == (pack, gpus, "H200", 0.6)
        )
        peers.append(dict(peer=label, published_s=seconds, projected_denoise_s=ours["total"] * forwards,
                          floor_s=floor_seconds(ours["pack_flops"], gpus, forwards)))  # fmt: skip
    table(["published", "s", "projected denoise s (60%)", "floor s"],
          [[p["peer"], p["published_s"], p["projected_denoise_s"], p["floor_s"]] for p in peers],
          title="== the peers' published seconds per clip beside h3serve's PROJECTED denoising time")  # fmt: skip
    for assumption, replaced_by in ASSUMPTIONS.items():
        say(f"  assumed {assumption}: a GPU run replaces it with {replaced_by}")
    checks = {name: check(name, r) for name, r in results.items()}
    model = replica.model
    result = {
        "ok": all(problems == [] for problems in checks.values()),
        "checks": checks,
        "paths": results,
        "sync_budgets": {name: sync_budget(path.parts) for name, path in PATHS.items()},
        "model": {
            "keep_in_fp32_modules": sorted(model._keep_in_fp32_modules or []),
            "rope_inv_freq_dtype": str(model.rope.inv_freq.dtype),
            "parameter_bytes": parameter_bytes(model),
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "projection": rows,
        "peers": peers,
        "assumptions": ASSUMPTIONS,
    }
    if self_test:
        result["self_test"] = run_self_test(replica)
        say(f"self-test: {result['self_test']}")
    return result


def run_self_test(replica: MetaReplica) -> dict:
    """The run catches what it exists for (``--self-test``), each as the exception it raised (its class and bases):

    - ``planted_cpu_zeros``: the padding document made on the CPU (``torch.zeros`` without ``device=``, as the pack
      path once had it); a 37,966-row pack over 4 ranks needs 2 padding rows. Also the run's last violation.
    - ``stand_in_kernel``: the stand-in attention kernel given CPU tensors.
    """
    from h3serve.pipelines.h3 import packing

    class CpuZeros:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, device=None, **kwargs):  # drops the device: made on torch's default device, the CPU
            return torch.zeros(*size, **kwargs)

    def raised(fn) -> dict:
        try:
            fn()
        except Exception as e:
            return {"raised": [c.__name__ for c in type(e).__mro__], "message": str(e)}  # the class and its bases
        return {"raised": [], "message": None}

    real, packing.torch = packing.torch, CpuZeros()  # type: ignore[assignment]
    try:
        planted = raised(lambda: measure(replica, PATHS["(a) one 1344x768x124"].asks, sp_degree=4))
    finally:
        packing.torch = real
    planted["last_violation"] = replica.run.violations[-1] if replica.run.violations else None
    q = torch.zeros(4, 2, 8)
    kernel = MetaVarlenImpl(MetaRun())
    stand_in = raised(
        lambda: kernel.forward_varlen(q, q, q, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32), max_seqlen=4)
    )
    return {"planted_cpu_zeros": planted, "stand_in_kernel": stand_in}


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


def options(ap: argparse.ArgumentParser) -> None:  # --smoke: with --session, its single request only (CI)
    ap.add_argument("--session", action="store_true", help="only the projection of gpu_pipeline's packs on one H200")
    ap.add_argument("--self-test", action="store_true", help="also show the checks catch a planted CPU tensor")


main = cli(__doc__, lambda args: run(args.session, args.smoke, args.self_test), options)


if __name__ == "__main__":
    raise SystemExit(main())
