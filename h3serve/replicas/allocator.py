"""The CUDA caching allocator's settings on every rank of a replica, and what a rank's device holds.

A pack's size changes from step to step (requests join and leave, step caches skip), so the activations of one
forward rarely fit the blocks a previous forward cut: the caching allocator's fixed segments fragment, and a rank
can run out of memory with enough free in total. Expandable segments map more pages into one segment instead
(PyTorch's "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). The setting is read when CUDA initializes in
the process, so each rank sets it before it loads anything, and an operator's own setting is kept as it is.

``measure_device``: a rank's device use after a forward (the warm-up at the row budget checks it against the plan).
"""

from __future__ import annotations

import logging
import os

import torch

from h3serve.pipelines.h3.memory import MeasuredUse

logger = logging.getLogger(__name__)

VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def cuda_allocator_defaults(device: str) -> str | None:
    """On ``device`` "cuda": ``PYTORCH_CUDA_ALLOC_CONF`` as the operator set it, else expandable segments; the
    setting in force (None elsewhere: the CPU has no caching allocator)."""
    if device != "cuda":
        return None
    if VARIABLE in os.environ:
        return os.environ[VARIABLE]
    os.environ[VARIABLE] = DEFAULT
    if torch.cuda.is_initialized():  # too late for this process: CUDA read the variable when it started
        logger.warning("%s=%s set after CUDA initialized here: it applies to new processes", VARIABLE, DEFAULT)
    return DEFAULT


def reset_peak(device: torch.device) -> None:
    """Start the allocator's peak count afresh (CUDA; nothing to count on the CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def measure_device(rank: int, device: torch.device) -> MeasuredUse | None:
    """``rank``'s device use now, once its queued work is done: ``torch.cuda.mem_get_info`` (the device as the driver
    sees it: tensors, the allocator's cache, the CUDA context, cuBLAS and NCCL buffers) and the tensors' peak since
    ``reset_peak``. None on the CPU, which has neither."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MeasuredUse(rank, free, total, torch.cuda.max_memory_allocated(device))
