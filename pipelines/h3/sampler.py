"""Flow-matching Euler sampler with timestep shift, and classifier-free guidance."""

from __future__ import annotations

import torch


class FlowMatchEuler:
    """x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v, with sigmas shifted toward noise.

    The model predicts the velocity v = noise - data at timestep 1000 * sigma.
    """

    def __init__(self, steps: int, shift: float = 5.0):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        self.steps = steps
        s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
        self.sigmas = shift * s / (1 + (shift - 1) * s)

    def timestep(self, i: int) -> float:
        return float(self.sigmas[i] * 1000)

    def step(self, x: torch.Tensor, velocity: torch.Tensor, i: int) -> torch.Tensor:
        return x + float(self.sigmas[i + 1] - self.sigmas[i]) * velocity


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Classifier-free guidance; with no unconditional branch the condition passes through."""
    return cond if uncond is None else uncond + scale * (cond - uncond)
