"""Many requests in one packed sequence: each request is one attention document, laid out as released.

A document is exactly what diffusers' layout blocks build for one request — rows
``[text | condition | audio | video]`` with their ``(t, h, w)`` positions, modality tags (video 0,
text 1, audio 2), and per-row indices into the document's distinct timesteps. A pack concatenates
documents (any sizes, tasks and steps), offsets their row indices, merges their timesteps into one
``timestep`` vector, and describes the document bounds with ``cu_seqlens``. Padding rows exist only
where sequence parallelism needs ``T % sp_degree == 0``; they form one trailing document of their own.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

FLAT_ALIGN = 16  # bytes: every tensor of a flat pack starts on this boundary, so a byte view can take any dtype


@dataclasses.dataclass
class Document:
    """One request's packed sequence at one denoising step (S rows)."""

    prompt_embeds: torch.Tensor  # [n_text, text_dim] conditioning hidden states
    video_rows: torch.Tensor  # [n_video, C*pt*ph*pw] patchified latents, conditioning rows first
    audio_rows: torch.Tensor  # [n_audio, C_audio] channel-major stereo latents, reference rows first
    position_ids: torch.Tensor  # [S, 3] float64 (t, h, w)
    token_tags: torch.Tensor  # [S] int64: 0 video, 1 text, 2 audio
    video_indices: torch.Tensor  # [n_video] int64 positions in the document
    audio_indices: torch.Tensor  # [n_audio]
    text_indices: torch.Tensor  # [n_text]
    timestep: torch.Tensor  # [k] float32 distinct timesteps of this document, clean-time in [0, 1]
    timestep_indices: torch.Tensor  # [S] int64 index into `timestep`

    @property
    def length(self) -> int:
        return int(self.position_ids.shape[0])


@dataclasses.dataclass
class Pack:
    """Documents concatenated into T rows (the last ``padding_rows`` belong to no request)."""

    partition: str  # which transformer checkpoint partition serves these documents
    lengths: list[int]  # rows of each document
    video_counts: list[int]  # video rows of each document
    audio_counts: list[int]
    padding_rows: int
    prompt_embeds: torch.Tensor  # [N_text, text_dim]
    video_rows: torch.Tensor  # [N_video, C*p]
    audio_rows: torch.Tensor  # [N_audio, C_audio]
    position_ids: torch.Tensor  # [T, 3] float64
    token_tags: torch.Tensor  # [T] int64
    video_indices: torch.Tensor  # [N_video] int64 positions in the pack
    audio_indices: torch.Tensor  # [N_audio]
    text_indices: torch.Tensor  # [N_text]
    timestep: torch.Tensor  # [K] float32 distinct timesteps of the pack
    timestep_indices: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [D+1] int32 document bounds (the padding document included)
    max_seqlen: int
    text_cu_seqlens: torch.Tensor  # [n_docs+1] int32 bounds of each document's text rows, for the token refiner
    text_max_seqlen: int
    # each document's LoRA adapter slot (``h3serve.pipelines.h3.lora``), 0 the base model; empty: every document on the
    # base
    document_slots: list[int] = dataclasses.field(default_factory=list)
    # with several adapters a document: its document_slots entry is a composition id, and this maps each id to the
    # (adapter slot, weight) it runs (``lora.adapting``); empty: document_slots are adapter slots
    compositions: dict[int, tuple[tuple[int, float | None], ...]] = dataclasses.field(default_factory=dict)

    @property
    def adapted(self) -> bool:
        """Whether any document of the pack runs with an adapter (else the forward is exactly the base one)."""
        return any(self.document_slots)

    @property
    def total_rows(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def used_rows(self) -> int:
        return self.total_rows - self.padding_rows

    def to(self, device: torch.device | str) -> Pack:
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    def split(self, video_out: torch.Tensor, audio_out: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-document (video, audio) outputs from rows in the order of video_indices / audio_indices."""
        return list(zip(video_out.split(self.video_counts), audio_out.split(self.audio_counts), strict=True))


def pack_documents(
    documents: list[Document],
    partition: str = "transformer",
    row_multiple: int = 1,
    document_slots: list[int] | None = None,
) -> Pack:
    """Concatenate documents; pad with one padding document to a multiple of ``row_multiple`` rows.

    ``document_slots``: each document's adapter slot (None: every document on the base model).

    Every tensor of the pack lives on the documents' device (diffusers' layout blocks put them on the
    execution device): nothing here is created on torch's default device, which is the CPU even when
    the data is on a GPU.
    """
    if not documents:
        raise ValueError("cannot pack zero documents")
    if row_multiple < 1:
        raise ValueError(f"row_multiple must be >= 1, got {row_multiple}")
    document_slots = [0] * len(documents) if document_slots is None else list(document_slots)
    if len(document_slots) != len(documents) or any(s < 0 for s in document_slots):
        raise ValueError(
            f"document_slots must give a slot >= 0 to each of {len(documents)} documents: {document_slots}"
        )
    device = documents[0].position_ids.device
    elsewhere = {
        f"document {i}: {f.name} on {t.device}"
        for i, d in enumerate(documents)
        for f in dataclasses.fields(d)
        if (t := getattr(d, f.name)).device != device
    }
    if elsewhere:
        raise ValueError(f"every document of a pack must be on {device}; {', '.join(sorted(elsewhere))}")
    lengths = [d.length for d in documents]
    offsets = [0, *itertools.accumulate(lengths)][:-1]  # host ints: each document's first row in the pack
    used = sum(lengths)
    padding = -used % row_multiple

    # The pack's timesteps: every document's distinct values, merged; each row re-indexed into them.
    timestep, inverse = torch.unique(
        torch.cat([d.timestep.float() for d in documents]), sorted=True, return_inverse=True
    )
    remapped, start = [], 0
    for d in documents:
        remapped.append(inverse[start : start + d.timestep.numel()][d.timestep_indices])
        start += d.timestep.numel()

    def shifted(name: str) -> torch.Tensor:
        return torch.cat([getattr(d, name) + off for d, off in zip(documents, offsets, strict=True)])

    # The padding document's rows: position (0, 0, 0), video tag, the pack's first timestep.
    pad = dict(
        position_ids=torch.zeros(padding, 3, dtype=torch.float64, device=device),
        token_tags=torch.zeros(padding, dtype=torch.long, device=device),
        timestep_indices=torch.zeros(padding, dtype=torch.long, device=device),
    )
    bounds = [0, *itertools.accumulate(lengths)] + ([used + padding] if padding else [])
    text_lengths = [d.text_indices.numel() for d in documents]
    return Pack(
        partition=partition,
        lengths=lengths,
        video_counts=[d.video_indices.numel() for d in documents],
        audio_counts=[d.audio_indices.numel() for d in documents],
        padding_rows=padding,
        prompt_embeds=torch.cat([d.prompt_embeds for d in documents]),
        video_rows=torch.cat([d.video_rows for d in documents]),
        audio_rows=torch.cat([d.audio_rows for d in documents]),
        position_ids=torch.cat([d.position_ids.to(torch.float64) for d in documents] + [pad["position_ids"]]),
        token_tags=torch.cat([d.token_tags for d in documents] + [pad["token_tags"]]),
        video_indices=shifted("video_indices"),
        audio_indices=shifted("audio_indices"),
        text_indices=shifted("text_indices"),
        timestep=timestep,
        timestep_indices=torch.cat(remapped + [pad["timestep_indices"]]),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),  # [D+1]
        max_seqlen=max(b - a for a, b in itertools.pairwise(bounds)),
        text_cu_seqlens=torch.tensor([0, *itertools.accumulate(text_lengths)], dtype=torch.int32, device=device),
        text_max_seqlen=max(text_lengths),
        document_slots=document_slots,
    )


# --- a pack as host metadata and one flat buffer: how it reaches the other Ulysses ranks ---------------------------


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one tensor field of a pack lies in its flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "float32"
    offset: int  # bytes, a multiple of FLAT_ALIGN
    nbytes: int


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """A pack's host fields (document lengths, counts, slots: O(documents)) and its tensors' places in one flat
    buffer; with the buffer, ``unflatten`` rebuilds the pack. No tensor data: what crosses Ray per step."""

    fields: dict[str, Any]
    tensors: tuple[TensorSlot, ...]
    nbytes: int

    def unflatten(self, flat: torch.Tensor) -> Pack:
        """The pack whose tensors are views of ``flat`` ([nbytes] uint8, on any device)."""
        if flat.dtype != torch.uint8 or flat.numel() != self.nbytes:
            raise ValueError(f"a flat pack needs {self.nbytes} uint8 bytes, got {flat.numel()} {flat.dtype}")
        tensors = {
            slot.name: flat[slot.offset : slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)
            for slot in self.tensors
        }
        return Pack(**self.fields, **tensors)  # type: ignore[arg-type]  # the fields dataclasses.fields(Pack) names


def _pack_tensors(pack: Pack) -> dict[str, torch.Tensor]:
    return {f.name: t for f in dataclasses.fields(Pack) if isinstance(t := getattr(pack, f.name), torch.Tensor)}


def pack_layout(pack: Pack) -> PackLayout:
    """``pack``'s layout (host work only: shapes and dtypes, no device sync)."""
    slots, offset = [], 0
    for name, tensor in _pack_tensors(pack).items():
        nbytes = tensor.numel() * tensor.element_size()
        slots.append(TensorSlot(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset, nbytes))
        offset += -(-nbytes // FLAT_ALIGN) * FLAT_ALIGN
    fields = {
        f.name: getattr(pack, f.name)
        for f in dataclasses.fields(Pack)
        if not isinstance(getattr(pack, f.name), torch.Tensor)
    }
    return PackLayout(fields, tuple(slots), offset)


def flatten_pack(pack: Pack) -> tuple[PackLayout, torch.Tensor]:
    """``pack``'s layout and its tensors' bytes in one [nbytes] uint8 buffer on the pack's device (one copy)."""
    layout = pack_layout(pack)
    tensors = _pack_tensors(pack)
    flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=pack.position_ids.device)
    for slot in layout.tensors:
        source = tensors[slot.name].contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        flat[slot.offset : slot.offset + slot.nbytes].copy_(source)
    return layout, flat
