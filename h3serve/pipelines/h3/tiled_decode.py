"""One clip's video decode split into its tiles, decoded anywhere, and blended by diffusers' own code.

diffusers' ``AutoencoderKLMiniMaxH3._decode`` cuts the latents into temporal chunks, ``_decode_clip`` cuts each chunk
into spatial tiles (``_split_tiles``), runs ``decoder(post_quant_conv(tile))`` on each, and ``_stitch_tiles`` /
``_blend`` cross-fade the overlaps. A tile's decode reads its tile alone: the ViT decoder attends within it. So the
tiles (every chunk's, every tile of it) are independent units of work, and only the blend needs them all.

``decode`` runs diffusers' ``_decode`` twice on a view of the VAE (``_VaeView``: the VAE's own methods and geometry,
with its two per-tile modules swapped): first recording each tile and answering with a shape-only ``meta`` tensor
(nothing is decoded, the blend of meta tensors costs nothing), then replaying the decoded tiles in the same order.
Between the two passes ``run_tiles`` decodes the recorded tiles wherever it likes (``decode_tiles``: the decoder
stage's replicas). The blend is diffusers' code on the same tensors, so the frames are the serial decode's bit for
bit whenever each tile is decoded the same way (same weights, same kernels); ``tests/test_parallel_decode.py``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from diffusers.models.modeling_utils import get_parameter_dtype

# decoded tiles, in the order given: [1, C, t, h, w] latents -> [1, 3, t', h', w'] pixels each
TileRunner = Callable[[list[torch.Tensor]], Sequence[torch.Tensor]]


def _unchanged(tile: torch.Tensor) -> torch.Tensor:
    return tile


class _VaeView:
    """``vae``'s attributes, with diffusers' methods of its class bound to this view, so that they call
    ``decode_tile`` where the VAE runs ``decoder(post_quant_conv(tile))``. The VAE itself is never modified: other
    threads may be decoding with it."""

    def __init__(self, vae: Any, decode_tile: Callable[[torch.Tensor], torch.Tensor]):
        self._vae = vae
        self.post_quant_conv = _unchanged
        self.decoder = decode_tile

    def __getattr__(self, name: str) -> Any:
        method = inspect.getattr_static(type(self._vae), name, None)
        if inspect.isfunction(method):
            return types.MethodType(method, self)
        return getattr(self._vae, name)


def _output_shape(vae: Any, tile: torch.Tensor) -> tuple[int, ...]:
    """What ``decoder`` makes of a latent tile [B, C, t, h, w]: [B, 3, t * patch_t, h * patch, w * patch]."""
    decoder = vae.decoder
    b, _, t, h, w = tile.shape
    return (b, decoder.out_channels, t * decoder.patch_size_t, h * decoder.patch_size, w * decoder.patch_size)


def latents_for_decoder(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """``latents`` in the dtype ``vae.decode`` gives its first module (diffusers' ``decode`` does the same)."""
    return latents.to(get_parameter_dtype(vae.post_quant_conv))


def tiles_of(vae: Any, latents: torch.Tensor) -> list[torch.Tensor]:
    """Every tile diffusers' ``_decode`` of ``latents`` (``latents_for_decoder``'s) decodes, in its order:
    contiguous copies of the latent tiles [1, C, t, h, w]."""
    tiles: list[torch.Tensor] = []
    out_dtype = get_parameter_dtype(vae.decoder.proj_out)

    def record(tile: torch.Tensor) -> torch.Tensor:
        tiles.append(tile.contiguous())
        return torch.empty(_output_shape(vae, tile), dtype=out_dtype, device="meta")

    type(vae)._decode(_VaeView(vae, record), latents)
    return tiles


@torch.no_grad()
def decode_tiles(vae: Any, tiles: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What diffusers' tiled decode runs on each tile: ``decoder(post_quant_conv(tile))``, here on ``vae``'s device."""
    device = vae.post_quant_conv.weight.device
    return [vae.decoder(vae.post_quant_conv(tile.to(device))) for tile in tiles]


def blend(vae: Any, latents: torch.Tensor, decoded: Sequence[torch.Tensor]) -> torch.Tensor:
    """diffusers' ``_decode`` of ``latents`` with its tiles' decodes taken from ``decoded`` (``tiles_of``'s order):
    the clip [1, 3, F, H, W], every overlap blended by diffusers' own ``_stitch_tiles`` and ``_blend``."""
    answers: Iterator[torch.Tensor] = iter(decoded)
    device = latents.device

    def replay(tile: torch.Tensor) -> torch.Tensor:
        out = next(answers).to(device)
        if tuple(out.shape) != _output_shape(vae, tile):
            raise ValueError(f"a decoded tile is {tuple(out.shape)}, the blend expects {_output_shape(vae, tile)}")
        return out

    clip = type(vae)._decode(_VaeView(vae, replay), latents)
    if next(answers, None) is not None:
        raise ValueError("more decoded tiles than the clip has")
    return clip


@torch.no_grad()
def decode(vae: Any, latents: torch.Tensor, run_tiles: TileRunner) -> torch.Tensor:
    """``vae.decode(latents, return_dict=False)[0]`` with the tiles decoded by ``run_tiles``: [1, 3, F, H, W]."""
    if latents.shape[0] != 1:
        raise ValueError(f"a tiled decode takes one clip's latents, got a batch of {latents.shape[0]}")
    latents = latents_for_decoder(vae, latents)
    tiles = tiles_of(vae, latents)
    decoded = list(run_tiles(tiles))
    if len(decoded) != len(tiles):
        raise ValueError(f"{len(tiles)} tiles were sent out, {len(decoded)} came back")
    return blend(vae, latents, decoded)


def split(tiles: Sequence[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """``tiles`` in ``parts`` consecutive runs of sizes differing by at most one (concatenated: ``tiles``)."""
    size, extra = divmod(len(tiles), parts)
    runs, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        runs.append(list(tiles[start:end]))
        start = end
    return runs
