"""Text encoders. ``tiny`` ships a small byte-level one whose weights live in the checkpoint.

A real encoder plugs in by implementing ``TextEncoder``: prompts in, one
``[L, text_dim]`` feature tensor per prompt out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn

from .config import H3Config

BOS = 256  # byte values are 0..255


@runtime_checkable
class TextEncoder(Protocol):
    dim: int
    max_tokens: int

    def count_tokens(self, prompt: str) -> int: ...

    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]: ...


class PromptTooLong(ValueError):
    def __init__(self, tokens: int, max_tokens: int):
        super().__init__(f"prompt is {tokens} tokens, the model takes at most {max_tokens}")
        self.tokens, self.max_tokens = tokens, max_tokens


class ByteTextEncoder(nn.Module):
    """BOS + UTF-8 bytes -> embeddings + learned positions -> a few residual MLP layers."""

    def __init__(self, config: H3Config):
        super().__init__()
        self.dim, self.max_tokens = config.text_dim, config.text_max_tokens
        self.tokens = nn.Embedding(BOS + 1, config.text_dim)
        self.positions = nn.Embedding(config.text_max_tokens, config.text_dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(config.text_dim), nn.Linear(config.text_dim, 2 * config.text_dim), nn.GELU(),
                          nn.Linear(2 * config.text_dim, config.text_dim))
            for _ in range(config.text_encoder_layers)
        )
        self.norm = nn.LayerNorm(config.text_dim)

    def tokenize(self, prompt: str) -> list[int]:
        ids = [BOS, *prompt.encode("utf-8")]
        if len(ids) > self.max_tokens:
            raise PromptTooLong(len(ids), self.max_tokens)
        return ids

    def count_tokens(self, prompt: str) -> int:
        return 1 + len(prompt.encode("utf-8"))

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        device = self.tokens.weight.device
        out = []
        for prompt in prompts:
            ids = torch.tensor(self.tokenize(prompt), device=device)
            x = self.tokens(ids) + self.positions(torch.arange(len(ids), device=device))
            for layer in self.layers:
                x = x + layer(x)
            out.append(self.norm(x))
        return out


def build_text_encoder(config: H3Config) -> ByteTextEncoder:
    if config.text_encoder != "byte":
        raise ValueError(f"text_encoder {config.text_encoder!r} is not one of: byte")
    return ByteTextEncoder(config)
