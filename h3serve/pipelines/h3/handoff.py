"""What crosses between the denoiser and its stages: a conditioner's prepared state, a decoder's hand-off and the
media it returns, each with the bytes it moves (host tensors, so each crosses the Ray object store once)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch
from diffusers.modular_pipelines import PipelineState

from .stages import PREPARED_KEYS

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class GeneratedMedia:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray  # float32 [2, S] stereo
    fps: int
    sample_rate: int
    # the MP4 already made of these frames and sound while they decoded (``media.Mp4Stream``): ``mp4`` returns it
    encoded_mp4: bytes | None = dataclasses.field(default=None, repr=False)

    # media is imported on use: PyAV is needed to encode, not to build or run the model
    def png(self) -> bytes:
        """A still: the middle frame of the clip."""
        from .media import encode_png

        return encode_png(self.frames[len(self.frames) // 2])

    def mp4(self) -> bytes:
        from .media import encode_mp4

        if self.encoded_mp4 is not None:
            return self.encoded_mp4
        return encode_mp4(self.frames, self.fps, self.audio, self.sample_rate)


@dataclasses.dataclass
class EncodedMedia:
    """A decoder stage's answer when asked for an encoding: the PNG or MP4 bytes, never the raw frames."""

    kind: str  # "png" | "mp4"
    data: bytes


def move_tensors(value: Any, device: torch.device | str) -> Any:
    """``value`` with every tensor in it (through tuples and lists: the row-timestep plan) on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(move_tensors(v, device) for v in value)
    return value


def payload_bytes(value: Any) -> int:
    """The bytes of the tensors, arrays and byte strings in ``value``: what a stage hand-off moves."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict):
        return sum(payload_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(payload_bytes(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(payload_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


@dataclasses.dataclass
class PreparedState:
    """A conditioner stage's answer: the values of diffusers' pipeline state that ``RequestState`` reads
    (``PREPARED_KEYS``), every tensor on the host, so it crosses the Ray object store once."""

    values: dict[str, Any]

    @classmethod
    def of(cls, state: PipelineState) -> PreparedState:
        return cls({key: move_tensors(state.get(key), "cpu") for key in PREPARED_KEYS})

    def pipeline_state(self, device: torch.device) -> PipelineState:
        """A diffusers ``PipelineState`` holding these values on ``device`` (the denoiser's)."""
        state = PipelineState()
        for key, value in self.values.items():
            state.set(key, move_tensors(value, device))
        return state

    @property
    def nbytes(self) -> int:
        return payload_bytes(self.values)


@dataclasses.dataclass
class DecodeHandoff:
    """What a decoder stage needs of a finished request: its rows after the last step and the layout sizes."""

    video_rows: torch.Tensor  # [n_video, C*p] fp32 on the host, conditioning rows first
    audio_rows: torch.Tensor  # [n_audio, C_audio] fp32 on the host
    layout: dict[str, Any]  # DECODE_KEYS

    @property
    def nbytes(self) -> int:
        return payload_bytes([self.video_rows, self.audio_rows])
