"""The CUDA caching allocator's settings on every rank of a replica.

A pack's size changes from step to step (requests join and leave, step caches skip), so the activations of one
forward rarely fit the blocks a previous forward cut: the caching allocator's fixed segments fragment, and a rank
can run out of memory with enough free in total. Expandable segments map more pages into one segment instead
(PyTorch's "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"). The setting is read when CUDA initializes in
the process, so each rank sets it before it loads anything, and an operator's own setting is kept as it is.
"""

from __future__ import annotations

import logging
import os

import torch

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
