"""**Projected**, not measured: seconds per step, per clip and end to end on H200s and H100s, from meta counts.

What the meta device counts exactly (``step``): each rank's GEMM and attention FLOPs of the real step
(``FlopCounterMode``, equal to ``shapes.forward_flops``), the bytes each rank sends through Ulysses' all-to-alls,
and the bytes eager elementwise ops read and write (norms, RoPE, AdaLN modulation, activations, residual adds,
copies: everything that is neither a matmul nor a view). What turns them into seconds is assumed, each assumption a
number a GPU run must replace (``ASSUMPTIONS``):

* GEMMs at 40 / 60 / 80% of the bf16 dense peak, 989 TFLOP/s on an H200 and on an H100 SXM (the same Hopper SMs
  and clocks; the H200 has more and faster memory);
* attention at FlashAttention-3's published bf16 forward throughput for head dim 128, non-causal: 620 TFLOP/s at
  16k tokens on an H100 (pytorch/benchmark's measurement, PR #2391; the paper's headline is 740, arXiv:2407.08608),
  the same on an H200;
* Ulysses' all-to-alls at 350 GB/s leaving each rank (NVLink 4 through NVSwitch), not overlapped with compute;
* elementwise ops at 70% of HBM bandwidth (H200 4.8 TB/s, H100 3.35 TB/s), unfused (eager);
* a step is the sum of the four (nothing overlaps); a clip of ``num_inference_steps`` 50 is 49 forwards
  (``MiniMaxH3Scheduler``: 50 sigma points, the last one terminal).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from h3serve.pipelines.h3.memory import DEFAULT_RESERVE_BYTES
from h3serve.pipelines.h3.shapes import Clip

from .hardware import BF16_DENSE_TFLOPS, FP32_TFLOPS, GPUS, H100, H200, TF32_TFLOPS, Gpu
from .stages import StageCount, bf16_video_decode, stage_counts
from .step import PACKS, Ask, MetaReplica, measure

GEMM_EFFICIENCIES = (0.4, 0.6, 0.8)
ATTENTION_TFLOPS = 620.0  # FlashAttention-3, bf16 forward, hdim 128, non-causal, 16k tokens, H100 (pytorch/benchmark)
ALL_TO_ALL_GBPS = 350.0  # per rank, leaving it
HBM_EFFICIENCY = 0.7
FORWARDS_PER_CLIP = 49  # num_inference_steps 50

ASSUMPTIONS = {
    "GEMM efficiency (40/60/80% of 989 TFLOP/s)": "gpu_pipeline's s/step less its attention time: the GEMMs' MFU",
    "attention 620 TFLOP/s (FlashAttention-3, 16k tokens)": "gpu_kernels Part 1: the admitted kernel's TFLOP/s on "
    "these documents (one 38k-row document, packs of several)",
    "all-to-all 350 GB/s per rank, not overlapped": "an sp=4/8 step's time less sp=1's per-rank compute (needs 4-8 "
    "GPUs: not the lent single H200)",
    "elementwise at 70% of HBM bandwidth, unfused": "gpu_pipeline's eager s/step against its compiled s/step, and a "
    "profile's non-GEMM kernel time",
    "no overlap, no host stalls": "a profile of one step: gaps between kernels (the listed host syncs)",
}


@dataclasses.dataclass(frozen=True)
class RankCounts:
    """One rank's share of one step, as the meta device counts it."""

    gemm_flops: int
    attention_flops: int
    all_to_all_bytes: int  # bytes this rank hands to all-to-alls (its own share included)
    memory_bytes: int  # bytes elementwise ops read and write
    sp_degree: int

    def seconds(self, gpu: Gpu, gemm_efficiency: float) -> dict[str, float]:
        """Each part's projected seconds and their sum."""
        leaving = self.all_to_all_bytes * (self.sp_degree - 1) / self.sp_degree  # 1/W of it stays on the rank
        parts = {
            "gemm": self.gemm_flops / (gemm_efficiency * BF16_DENSE_TFLOPS * 1e12),
            "attention": self.attention_flops / (ATTENTION_TFLOPS * 1e12),
            "all_to_all": leaving / (ALL_TO_ALL_GBPS * 1e9),
            "elementwise": self.memory_bytes / (HBM_EFFICIENCY * gpu.hbm_tbps * 1e12),
        }
        return {**parts, "total": sum(parts.values())}


def floor_seconds(total_flops: int, gpus: int, forwards: int = FORWARDS_PER_CLIP) -> float:
    """The physical floor: every FLOP of ``forwards`` steps at the bf16 dense peak of ``gpus`` GPUs."""
    return forwards * total_flops / (gpus * BF16_DENSE_TFLOPS * 1e12)


# -- a step, projected -----------------------------------------------------------------------------------------
def counts(result: dict) -> RankCounts:
    formula = result["formula"]
    return RankCounts(
        gemm_flops=formula["matmul"] + formula.get("lora", 0),
        attention_flops=formula["attention"],
        all_to_all_bytes=result["all_to_all_bytes"],
        memory_bytes=result["memory_bytes"],
        sp_degree=result["sp_degree"],
    )


def project(replica: MetaReplica, packs: dict[str, Sequence[Ask]], degrees: Sequence[int] = (1, 4, 8)) -> list[dict]:
    """Each pack at each Ulysses degree (rank 0, counted on meta), projected on each GPU at each GEMM efficiency."""
    rows = []
    for name, asks in packs.items():
        for sp in degrees:
            result = measure(replica, asks, sp, 0)
            rank = counts(result)
            plan = result["plan"]
            held = replica.weight_bytes + plan["activation_bytes"] + plan["request_bytes"] + DEFAULT_RESERVE_BYTES
            for gpu in GPUS:
                for efficiency in GEMM_EFFICIENCIES:
                    seconds = rank.seconds(gpu, efficiency)
                    rows.append(
                        dict(
                            pack=name, rows=result["rows"], requests=result["requests"], sp_degree=sp, gpu=gpu.name,
                            gemm_efficiency=efficiency, fits=held <= gpu.memory_bytes, **seconds,
                            clip_s=seconds["total"] * FORWARDS_PER_CLIP, pack_flops=result["pack_flops"],
                            floor_clip_s=floor_seconds(result["pack_flops"], sp), flops=result["flops"],
                            all_to_all_bytes=result["all_to_all_bytes"], memory_bytes=result["memory_bytes"],
                            weight_bytes=replica.weight_bytes, activation_bytes=plan["activation_bytes"],
                            request_bytes=plan["request_bytes"],
                        )
                    )  # fmt: skip
    return rows


# The peers' published figures (docs/BENCHMARKS.md cites them): seconds for one clip end to end
PEERS = [
    ("sglang, 8 H200, 1344x768 5 s, 50 steps (lossless)", 39.67, "one", 8, FORWARDS_PER_CLIP),
    ("sglang, 4 H200, the same", 75.10, "one", 4, FORWARDS_PER_CLIP),
    ("vLLM-Omni FastH3 (4-step LoRA), 4 H200, 209 frames, p50", 17.16, "fast", 4, 4),
]
PROJECTED_PACKS = {**PACKS, "fast": [Ask(Clip(1344, 768, 209))]}


# -- the whole clip, projected ---------------------------------------------------------------------------------
CONV_EFFICIENCY = 0.4  # of the peak in the VAEs' dtype: cuDNN's conv3d and the decoder's ViT, short tiles
# libx264 "veryfast" at 1344x768 on 2 shared cores, moving gradients (easy to code: natural video costs more):
# benchmarks/results/cpu-2core-2026-12-05/mp4_rate.json
MP4_FRAMES_PER_S = 33.7
H2D_GBPS = {"pageable": 1.8, "pinned": 20.0}  # host-to-GPU copies (vLLM-Omni RFC #4896: 1.8 GB/s vs 20-50 pinned)
HOST_READ_GBPS = 0.92  # safetensors, a cold 1 GiB file to host memory here (cpu-2core-2026-12-05/load_rate.json)
E2E_ASSUMPTIONS = {
    f"stages at {CONV_EFFICIENCY:.0%} of the peak (bf16 989, TF32 {TF32_TFLOPS}, fp32 {FP32_TFLOPS} TFLOP/s), or "
    "their weights read at 70% of HBM, whichever is longer": "the decoder stage's decode of one released clip's "
    "latents, serial and by tiles, bf16 and fp32 (gpu_session.sh, issue 56 item 2); the conditioner's prefill",
    "the bf16 decode spread by whole tiles over the decoder GPUs with no loss (8 on 8 H200s, 4 on 4, the H100 "
    "config's 2 decoder replicas)": "the same decode over 2-8 GPUs",
    f"MP4 at {MP4_FRAMES_PER_S} frames/s (libx264 veryfast, measured on this CPU)": "the decoder node's encode",
    "stages run one after another for one request, the audio decode beside the video decode": "a traced request",
    f"start: each process reads its bytes at {HOST_READ_GBPS} GB/s from storage, then copies at "
    f"{H2D_GBPS['pageable']} GB/s (pageable) or {H2D_GBPS['pinned']} GB/s (pinned), processes in parallel": ""
    "benchmarks/cold_start.py on the GPU node: each component's load and warm-up",
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a clip runs: the denoiser's Ulysses degree and GPU, and how many GPUs decode."""

    name: str
    gpu: Gpu
    sp_degree: int
    decoders: int


PLACEMENTS = (
    Placement("8 H200 (sp=8, decode on 8)", H200, 8, 8),  # peers decode over the whole group
    Placement("4 H200 (sp=4, decode on 4)", H200, 4, 4),
    Placement("H100 staged (sp=4, 2 decoders)", H100, 4, 2),  # serve_config.h100.yaml: 2 decoder replicas
)


def stage_seconds(count: StageCount, gpu: Gpu, peak_tflops: float) -> float:
    """One stage on one GPU: its FLOPs at ``CONV_EFFICIENCY`` of ``peak_tflops``, or its weights read from HBM at
    ``HBM_EFFICIENCY``, whichever is longer."""
    compute = count.flops / (CONV_EFFICIENCY * peak_tflops * 1e12)
    return max(compute, count.weight_bytes / (HBM_EFFICIENCY * gpu.hbm_tbps * 1e12))


# the stages of one request: (name, which count, peak TFLOP/s, spread over the decoder GPUs)
TODAY, RELEASED_WAY = "today (fp32 VAEs, one decoder GPU)", "as released (bf16 video VAE by tiles, TF32 audio)"


def end_to_end(replica: MetaReplica, clip: Clip, efficiency: float = 0.6) -> list[dict]:
    """Every stage of one request of ``clip`` (counted on meta) and its **projected** seconds on each placement,
    the VAEs as h3serve runs them today and as released (issue 56 items 1 and 2)."""
    conditioning, video, audio = stage_counts(clip)
    bf16 = bf16_video_decode(video)
    frames_bytes = clip.num_frames * clip.width * clip.height * 3  # uint8 RGB the encoder reads
    rows = []
    for place in PLACEMENTS:
        step = measure(replica, [Ask(clip)], place.sp_degree, 0)
        gpu = place.gpu
        stages = {  # name: (FLOPs, bytes read as weights or frames, projected seconds)
            "conditioning": (conditioning.flops, conditioning.weight_bytes,
                             stage_seconds(conditioning, gpu, BF16_DENSE_TFLOPS)),
            "denoising": (step["pack_flops"] * FORWARDS_PER_CLIP, replica.weight_bytes,
                          counts(step).seconds(gpu, efficiency)["total"] * FORWARDS_PER_CLIP),
            "video decode fp32, 1 GPU": (video.flops, video.weight_bytes, stage_seconds(video, gpu, FP32_TFLOPS)),
            "video decode bf16, by tiles": (
                bf16.flops, bf16.weight_bytes, stage_seconds(bf16, gpu, BF16_DENSE_TFLOPS) / place.decoders),
            "audio decode fp32": (audio.flops, audio.weight_bytes, stage_seconds(audio, gpu, FP32_TFLOPS)),
            "audio decode TF32": (audio.flops, audio.weight_bytes, stage_seconds(audio, gpu, TF32_TFLOPS)),
            "mp4": (0, frames_bytes, clip.num_frames / MP4_FRAMES_PER_S),
        }  # fmt: skip
        s = {name: seconds for name, (_, _, seconds) in stages.items()}
        both = s["conditioning"] + s["denoising"] + s["mp4"]  # the audio decode runs beside the video decode
        video_bf16 = s["video decode bf16, by tiles"]  # over the placement's decoder GPUs
        rows.append(dict(
            placement=place.name, clip=str(clip), gpu=gpu.name, gemm_efficiency=efficiency,
            stages={name: dict(flops=f, bytes=b, s=sec) for name, (f, b, sec) in stages.items()},
            totals={TODAY: both + max(s["video decode fp32, 1 GPU"], s["audio decode fp32"]),
                    RELEASED_WAY: both + max(video_bf16, s["audio decode TF32"])},
        ))  # fmt: skip
    return rows


def start_seconds(weight_bytes: dict[str, int], warm_up_s: float) -> dict[str, float]:
    """A deployment's **projected** start: the largest process's bytes read then copied, in parallel, plus a
    warm-up step at the served resolution."""
    largest = max(weight_bytes.values())
    read = largest / (HOST_READ_GBPS * 1e9)
    return {f"{kind} s": read + largest / (rate * 1e9) + warm_up_s for kind, rate in H2D_GBPS.items()} | {
        "largest process GB": largest / 1e9,
        "warm-up s": warm_up_s,
    }
