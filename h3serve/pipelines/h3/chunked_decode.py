"""A clip's video decode handed out temporal chunk by temporal chunk, as soon as each chunk's frames are final.

diffusers' ``AutoencoderKLMiniMaxH3._decode`` decodes the latents in temporal chunks (``_decode_clip`` each) and
cross-fades chunk k's first ``frame_overlap`` frames with the tail that chunk k-1's decode left behind; nothing later
touches chunk k again, except that the last ``pad_frames`` frames of the whole clip (made from repeated latent frames)
are cut off at the end. ``chunks`` runs the same loop with the VAE's own ``_decode_clip`` and ``_blend`` and yields
each piece once it is final, holding back only what the end may cut: concatenated, the pieces are ``vae.decode``'s
clip bit for bit (``tests/test_stream_decode.py`` asserts ``torch.equal``). The loop is diffusers' ``_decode`` line
for line; a diffusers release that changes it fails that test.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from diffusers.models.modeling_utils import get_parameter_dtype


def _pad_frames(vae: Any, num_latents: int, pad_tokens: int) -> int:
    """The trailing pixel frames ``_decode`` cuts: those of the ``pad_tokens`` repeated latent frames (a chunk's last
    latent frame covers ``clip_length % temporal_ratio`` pixel frames, the others ``temporal_ratio``)."""
    ratio, tokens_chunk_size = vae.temporal_compression_ratio, vae.tokens_chunk_size
    intra_tail = vae.config.clip_length % ratio
    return sum(
        intra_tail if intra_tail and (num_latents + k) % tokens_chunk_size == 0 else ratio for k in range(pad_tokens)
    )


@torch.no_grad()
def chunks(vae: Any, z: torch.Tensor) -> Iterator[torch.Tensor]:
    """``vae.decode(z, return_dict=False)[0]`` ([1, 3, F, H, W]) in final pieces along F, in order."""
    if z.shape[0] != 1:
        raise ValueError(f"a chunked decode takes one clip's latents, got a batch of {z.shape[0]}")
    z = z.to(get_parameter_dtype(vae.post_quant_conv))  # as ``decode`` does
    tokens_chunk_size = vae.tokens_chunk_size
    token_drop = vae.config.token_drop
    chunk_num_frames = tokens_chunk_size * vae.temporal_compression_ratio

    num_latents = z.shape[2]
    num_tokens = num_latents + token_drop
    pad_tokens = (-num_tokens) % tokens_chunk_size
    num_chunks = (num_tokens + pad_tokens) // tokens_chunk_size - int(token_drop > 0)
    if pad_tokens > 0:
        z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad_tokens, 1, 1)], dim=2)
    held_back = _pad_frames(vae, num_latents, pad_tokens)  # the end cuts these: never handed out

    pending: list[torch.Tensor] = []  # final pieces not yet handed out, fewer than ``held_back`` frames beyond

    def release(final: bool) -> Iterator[torch.Tensor]:
        """What of ``pending`` is sure to stay: all but its last ``held_back`` frames (the end drops those)."""
        frames = torch.cat(pending, dim=2) if len(pending) > 1 else pending[0]
        pending.clear()
        cut = frames.shape[2] - held_back
        if final and cut < 0:
            raise AssertionError(f"the decode's last {held_back} frames were cut, but only {frames.shape[2]} are left")
        if cut > 0:
            yield frames[:, :, :cut]
        if not final and held_back:
            pending.append(frames[:, :, max(cut, 0) :])

    overlap = None
    for i in range(num_chunks):
        start = i * tokens_chunk_size
        clip = vae._decode_clip(z[:, :, start : start + tokens_chunk_size + vae.token_overlap])
        for j in range(int(token_drop > 0) + 1):
            frame_start = j * chunk_num_frames
            chunk = clip[:, :, frame_start : frame_start + chunk_num_frames]
            chunk = chunk[:, :, vae.frame_pre_padding :]
            if j == 0:
                if overlap is not None:
                    chunk = vae._blend(overlap, chunk, vae.frame_overlap, dim=-3)
                pending.append(chunk)
                yield from release(final=False)
            else:
                overlap = chunk
    if overlap is not None:
        pending.append(overlap)
    if pending:
        yield from release(final=True)
