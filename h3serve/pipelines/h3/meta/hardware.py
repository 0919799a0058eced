"""The GPUs projections are made for, as their datasheets state them (torch-free: the GPU scripts import it too)."""

from __future__ import annotations

import dataclasses

BF16_DENSE_TFLOPS = 989.4  # H100 SXM5 and H200 SXM, NVIDIA's datasheets (dense, no sparsity): the same Hopper SMs
TF32_TFLOPS = 494.7  # the same GPUs' dense TF32 tensor cores (allow_tf32 where fp32 remains: issue 56 item 1)
FP32_TFLOPS = 66.9  # the same GPUs' fp32 without tensor cores: the VAEs as h3serve runs them before issue 56


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    hbm_tbps: float
    memory_bytes: int  # what nvidia-smi reports, as h3serve/deploy/platforms/ states it


H200 = Gpu("H200", 4.8, 143771 * 2**20)
H100 = Gpu("H100", 3.35, 81559 * 2**20)
GPUS = (H200, H100)
