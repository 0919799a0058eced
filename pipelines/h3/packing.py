"""Packed-sequence layout: many documents of any size and timestep in one varlen forward.

Each document is one request's CFG branch: its text rows, then video rows, then audio
rows, non-causal within the document and isolated from every other document. The pack
is padded with one trailing segment to a multiple of ``lcm(64, sp_degree)`` rows, so
Ulysses can split it evenly. ``cu_seqlens = (0, e0, e1, ..., used, total)``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .config import MODALITY_AUDIO, MODALITY_TEXT, MODALITY_VIDEO, H3Config

ALIGNMENT = 64


@dataclasses.dataclass
class Document:
    """One non-causal attention document at one timestep."""

    text: torch.Tensor  # [L, hidden] refined text features
    video: torch.Tensor | None  # [C, F, H, W] latent
    audio: torch.Tensor | None  # [A, C_audio] latent
    timestep: float


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Where one document's rows sit in the pack."""

    start: int
    text_len: int
    video_grid: tuple[int, int, int]  # (F, H, W) in patches; (0, 0, 0) when no video
    audio_len: int

    @property
    def video_len(self) -> int:
        return math.prod(self.video_grid)

    @property
    def length(self) -> int:
        return self.text_len + self.video_len + self.audio_len

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclasses.dataclass
class DocumentOutput:
    video: torch.Tensor | None  # [C, F, H, W] fp32
    audio: torch.Tensor | None  # [A, C_audio] fp32


@dataclasses.dataclass
class DiTInputs:
    """The rows one rank computes, plus the global attention metadata.

    Row-local tensors cover rows ``row_offset : row_offset + num_rows`` of the pack;
    ``cu_seqlens`` and ``timesteps`` are global.
    """

    row_offset: int
    num_rows: int
    modality: torch.Tensor  # [n] int64: 0 text, 1 video, 2 audio (padding rows: text)
    t_index: torch.Tensor  # [n] int64 index into timesteps
    positions: torch.Tensor  # [n, 3] float32 (t, h, w) for RoPE
    text_rows: torch.Tensor  # [n_text] int64 local row index
    text_x: torch.Tensor  # [n_text, hidden]
    video_rows: torch.Tensor
    video_x: torch.Tensor  # [n_video, video_patch_dim]
    audio_rows: torch.Tensor
    audio_x: torch.Tensor  # [n_audio, audio_channels]
    timesteps: torch.Tensor  # [n_docs] float32
    cu_seqlens: torch.Tensor  # [segments + 1] int32, global
    max_seqlen: int

    def to(self, device: torch.device | str) -> DiTInputs:
        moved = {
            f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor) else getattr(self, f.name)
            for f in dataclasses.fields(self)
        }
        return DiTInputs(**moved)


def patchify(video: torch.Tensor, patch: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[C, F, H, W] -> ([F/pf * H/ph * W/pw, C*pf*ph*pw], grid)."""
    C, F, H, W = video.shape
    pf, ph, pw = patch
    if F % pf or H % ph or W % pw:
        raise ValueError(f"latent shape {(F, H, W)} is not divisible by patch_size {patch}")
    grid = (F // pf, H // ph, W // pw)
    x = video.reshape(C, grid[0], pf, grid[1], ph, grid[2], pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)  # grid dims first, then the patch's own channels
    return x.reshape(math.prod(grid), C * pf * ph * pw), grid


def unpatchify(rows: torch.Tensor, grid: tuple[int, int, int], channels: int, patch: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of patchify: [n, C*pf*ph*pw] -> [C, F, H, W]."""
    pf, ph, pw = patch
    x = rows.reshape(*grid, channels, pf, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(channels, grid[0] * pf, grid[1] * ph, grid[2] * pw)


def _positions(layout: DocumentLayout) -> torch.Tensor:
    """RoPE positions: text at t = 0..L-1; video after the text at t = L + f; audio at t = L + a."""
    L = layout.text_len
    text = torch.zeros(L, 3)
    text[:, 0] = torch.arange(L)
    f, h, w = layout.video_grid
    grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)
    video = grid.reshape(-1, 3).float()
    video[:, 0] += L
    audio = torch.zeros(layout.audio_len, 3)
    audio[:, 0] = L + torch.arange(layout.audio_len)
    return torch.cat([text, video, audio])


@dataclasses.dataclass
class PackedBatch:
    """A whole pack, built on the host. ``shard`` cuts the rows for one SP rank."""

    layouts: list[DocumentLayout]
    total_rows: int
    padding_rows: int
    inputs: DiTInputs  # all rows
    doc_id: torch.Tensor  # [T] int32, -1 for padding
    video_channels: int
    audio_channels: int
    patch_size: tuple[int, int, int]

    @property
    def used_rows(self) -> int:
        return self.total_rows - self.padding_rows

    @property
    def padding_fraction(self) -> float:
        return self.padding_rows / self.total_rows if self.total_rows else 0.0

    def shard(self, rank: int, world_size: int) -> DiTInputs:
        if self.total_rows % world_size:
            raise ValueError(f"pack of {self.total_rows} rows does not split over {world_size} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if world_size == 1:
            return self.inputs
        n = self.total_rows // world_size
        lo, hi = rank * n, (rank + 1) * n
        full = self.inputs

        def local(rows: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            keep = (rows >= lo) & (rows < hi)
            return rows[keep] - lo, x[keep]

        text_rows, text_x = local(full.text_rows, full.text_x)
        video_rows, video_x = local(full.video_rows, full.video_x)
        audio_rows, audio_x = local(full.audio_rows, full.audio_x)
        return DiTInputs(
            row_offset=lo,
            num_rows=n,
            modality=full.modality[lo:hi],
            t_index=full.t_index[lo:hi],
            positions=full.positions[lo:hi],
            text_rows=text_rows,
            text_x=text_x,
            video_rows=video_rows,
            video_x=video_x,
            audio_rows=audio_rows,
            audio_x=audio_x,
            timesteps=full.timesteps,
            cu_seqlens=full.cu_seqlens,
            max_seqlen=full.max_seqlen,
        )

    def unpack(self, out: torch.Tensor) -> list[DocumentOutput]:
        """Per-document latents from the DiT's [T, out_dim] output rows."""
        if out.shape[0] != self.total_rows:
            raise ValueError(f"expected {self.total_rows} output rows, got {out.shape[0]}")
        patch_dim = self.video_channels * math.prod(self.patch_size)
        results = []
        for layout in self.layouts:
            v0 = layout.start + layout.text_len
            a0 = v0 + layout.video_len
            video = None
            if layout.video_len:
                video = unpatchify(out[v0:a0, :patch_dim], layout.video_grid, self.video_channels, self.patch_size)
            audio = out[a0 : a0 + layout.audio_len, : self.audio_channels] if layout.audio_len else None
            results.append(DocumentOutput(video=video, audio=audio))
        return results


def pack_documents(docs: list[Document], config: H3Config, sp_degree: int = 1) -> PackedBatch:
    """Lay documents out back to back and pad the tail to a multiple of lcm(64, sp_degree)."""
    if not docs:
        raise ValueError("cannot pack zero documents")
    align = math.lcm(ALIGNMENT, sp_degree)
    layouts, text_rows, text_x, video_rows, video_x, audio_rows, audio_x = [], [], [], [], [], [], []
    modality, positions, doc_ids, t_index = [], [], [], []
    start = 0
    for i, doc in enumerate(docs):
        if doc.text.dim() != 2 or doc.text.shape[1] != config.hidden_size:
            raise ValueError(f"document {i}: text must be [L, {config.hidden_size}], got {tuple(doc.text.shape)}")
        if doc.video is None:
            patches, grid = torch.zeros(0, config.video_patch_dim), (0, 0, 0)
        else:
            if doc.video.dim() != 4 or doc.video.shape[0] != config.video_channels:
                raise ValueError(f"document {i}: video must be [{config.video_channels}, F, H, W], got {tuple(doc.video.shape)}")
            patches, grid = patchify(doc.video, config.patch_size)
        audio = doc.audio if doc.audio is not None else torch.zeros(0, config.audio_channels)
        if audio.dim() != 2 or audio.shape[1] != config.audio_channels:
            raise ValueError(f"document {i}: audio must be [A, {config.audio_channels}], got {tuple(audio.shape)}")
        layout = DocumentLayout(start, doc.text.shape[0], grid, audio.shape[0])
        if layout.length == 0:
            raise ValueError(f"document {i} is empty")
        layouts.append(layout)
        v0 = start + layout.text_len
        a0 = v0 + layout.video_len
        text_rows.append(torch.arange(start, v0))
        video_rows.append(torch.arange(v0, a0))
        audio_rows.append(torch.arange(a0, layout.end))
        text_x.append(doc.text)
        video_x.append(patches)
        audio_x.append(audio)
        modality.append(
            torch.cat([
                torch.full((layout.text_len,), MODALITY_TEXT),
                torch.full((layout.video_len,), MODALITY_VIDEO),
                torch.full((layout.audio_len,), MODALITY_AUDIO),
            ])
        )
        positions.append(_positions(layout))
        doc_ids.append(torch.full((layout.length,), i, dtype=torch.int32))
        t_index.append(torch.full((layout.length,), i))
        start = layout.end

    used = start
    total = -(-used // align) * align
    pad = total - used
    bounds = [0] + [layout.end for layout in layouts] + ([total] if pad else [])
    seg_lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    inputs = DiTInputs(
        row_offset=0,
        num_rows=total,
        modality=torch.cat(modality + [torch.full((pad,), MODALITY_TEXT)]).long(),
        t_index=torch.cat(t_index + [torch.zeros(pad, dtype=torch.long)]).long(),
        positions=torch.cat(positions + [torch.zeros(pad, 3)]),
        text_rows=torch.cat(text_rows).long(),
        text_x=torch.cat(text_x),
        video_rows=torch.cat(video_rows).long(),
        video_x=torch.cat(video_x).float(),
        audio_rows=torch.cat(audio_rows).long(),
        audio_x=torch.cat(audio_x).float(),
        timesteps=torch.tensor([float(d.timestep) for d in docs], dtype=torch.float32),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(seg_lengths),
    )
    return PackedBatch(
        layouts=layouts,
        total_rows=total,
        padding_rows=pad,
        inputs=inputs,
        doc_id=torch.cat(doc_ids + [torch.full((pad,), -1, dtype=torch.int32)]),
        video_channels=config.video_channels,
        audio_channels=config.audio_channels,
        patch_size=config.patch_size,
    )
