"""**Projected**, not measured: seconds per step and per clip on H200s and H100s, from what a meta-device step counts.

What the meta device counts exactly (``benchmarks.meta_step``): each rank's GEMM and attention FLOPs of the real step
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

BF16_DENSE_TFLOPS = 989.4  # H100 SXM5 and H200 SXM, NVIDIA's datasheets (dense, no sparsity)
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
class Gpu:
    name: str
    hbm_tbps: float
    memory_bytes: int  # what nvidia-smi reports, as h3serve/deploy/platforms/ states it


H200 = Gpu("H200", 4.8, 143771 * 2**20)
H100 = Gpu("H100", 3.35, 81559 * 2**20)
GPUS = (H200, H100)


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
