"""H3Pipeline: text -> packed DiT steps -> decoded frames and audio.

``step`` advances any number of requests by one sampler step with a single packed
forward; ``generate`` is the one-request local loop built on it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn

from attention import AttentionRequirements, BackendUnavailable, get_backend, parse_dtype, probe_platform

from .config import H3Config, preset
from .decoders import AudioDecoder, VideoDecoder, resample_audio
from .dit import H3DiT
from .packing import DocumentOutput, PackedBatch, pack_documents
from .request import GenerationRequest, RequestError, RequestState
from .text_encoder import build_text_encoder
from .weights import load_into, read_config, save_checkpoint

# What H3 needs from attention: many documents packed into one [T, H, D] forward.
REQUIREMENTS = AttentionRequirements(packed_varlen=True)


class DiTRunner(Protocol):
    """Runs the DiT over a whole pack and returns all rows' outputs [T, out_dim] on rank 0."""

    world_size: int

    def __call__(self, packed: PackedBatch) -> torch.Tensor: ...


class LocalRunner:
    world_size = 1

    def __init__(self, dit: H3DiT, device: torch.device):
        self.dit, self.device = dit, device

    @torch.no_grad()
    def __call__(self, packed: PackedBatch) -> torch.Tensor:
        return self.dit(packed.inputs.to(self.device))


class H3Model(nn.Module):
    """Every module whose weights live in an H3 checkpoint, under these prefixes."""

    def __init__(self, config: H3Config, impl=None):
        super().__init__()
        self.dit = H3DiT(config, impl)
        self.text_encoder = build_text_encoder(config)
        self.video_decoder = VideoDecoder(config)
        self.audio_decoder = AudioDecoder(config)


@dataclasses.dataclass
class GeneratedMedia:
    frames: torch.Tensor  # uint8 [N, H, W, 3]
    audio: torch.Tensor | None  # float32 [S]
    fps: int
    sample_rate: int

    # media is imported on use: PyAV is needed to encode, not to build or run the model
    def png(self) -> bytes:
        from .media import encode_png

        return encode_png(self.frames[0])

    def mp4(self) -> bytes:
        from .media import encode_mp4

        return encode_mp4(self.frames, self.fps, self.audio, self.sample_rate)


@dataclasses.dataclass
class StepStats:
    requests: int
    documents: int
    rows: int
    padding_rows: int


def default_cache_dir() -> Path:
    return Path(os.environ.get("H3SERVE_CACHE", Path.home() / ".cache" / "h3serve"))


def ensure_checkpoint(model: str, checkpoint: str | Path | None = None) -> Path:
    """The checkpoint directory to load; for ``tiny`` without one, the deterministic cached weights."""
    if checkpoint is not None:
        return Path(checkpoint)
    if model != "tiny":
        raise ValueError(f"model {model!r} has no built-in weights; set checkpoint to a directory of safetensors")
    directory = default_cache_dir() / "h3-tiny-v1"
    if not (directory / "model.safetensors").exists():
        create_tiny_checkpoint(directory)
    return directory


def create_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """The tiny preset's weights, the same bytes on every machine for a given torch."""
    config = preset("tiny")
    torch.manual_seed(seed)
    model = H3Model(config)
    return save_checkpoint(model.state_dict(), directory, config.model_dump(mode="json"))


class H3Pipeline:
    requirements = REQUIREMENTS

    def __init__(self, config: H3Config, model: H3Model, device: torch.device, runner: DiTRunner | None = None):
        self.config, self.model, self.device = config, model, device
        self.runner: DiTRunner = runner or LocalRunner(model.dit, device)

    @classmethod
    def build(
        cls,
        config: H3Config,
        backend: str,
        *,
        checkpoint: str | Path,
        device: str = "cpu",
        dtype: str | torch.dtype = "float32",
    ) -> H3Pipeline:
        """Build with exactly ``backend`` (the driver's choice); never re-resolve.

        Raises BackendUnavailable when this node cannot run it.
        """
        torch_dtype = parse_dtype(dtype)
        attention = get_backend(backend)
        here = probe_platform(device)
        available = attention.availability(here, dtype=torch_dtype, head_dim=config.head_dim)
        if not available or here.device_type != device:
            reason = available.reason or f"the node has no {device} device"
            raise BackendUnavailable(f"Attention backend {attention.name!r} cannot run on this node: {reason}",
                                     backend=attention.name, model=config.name)
        with torch.device("meta"):
            model = H3Model(config, attention.make_impl())
        model.dit.to_serving_dtype(torch_dtype)
        load_into(model, checkpoint, device=device, expected_config=config.model_dump(mode="json"))
        model.eval()
        return cls(config, model, torch.device(device))

    # -- one request at a time, or many per step ---------------------------------------
    @torch.no_grad()
    def prepare(self, request: GenerationRequest) -> RequestState:
        request.check(self.config)
        encoder, dit = self.model.text_encoder, self.model.dit
        prompts = [request.prompt] + ([request.negative_prompt] if request.uses_cfg else [])
        texts = [t.float().cpu() for t in dit.refine_text(encoder.encode(prompts))]
        return RequestState(request, self.config, texts[0], texts[1] if len(texts) > 1 else None)

    def validate(self, request: GenerationRequest) -> int:
        """Check a request without running anything; returns the rows it adds to a pack."""
        request.check(self.config)
        encoder = self.model.text_encoder
        prompts = {"prompt": request.prompt}
        if request.uses_cfg:
            prompts["negative_prompt"] = request.negative_prompt
        text_rows = 0
        for field, text in prompts.items():
            tokens = encoder.count_tokens(text)
            if tokens > encoder.max_tokens:
                raise RequestError(field, f"{field} is {tokens} tokens, the model takes at most {encoder.max_tokens}")
            text_rows += tokens
        video, audio = request.latent_shapes(self.config)
        per_doc = math.prod(video[1:]) // math.prod(self.config.patch_size) + (audio[0] if audio else 0)
        return text_rows + len(prompts) * per_doc

    def pack(self, states: Sequence[RequestState]) -> PackedBatch:
        docs = [d for s in states for d in s.documents()]
        return pack_documents(docs, self.config, self.runner.world_size)

    def apply(self, states: Sequence[RequestState], packed: PackedBatch, out: torch.Tensor) -> StepStats:
        """Advance every state by one sampler step from the DiT output of their pack."""
        outputs = packed.unpack(out.cpu())
        i = 0
        for state in states:
            n = len(state.texts())
            state.advance(outputs[i : i + n])
            i += n
        return StepStats(len(states), len(outputs), packed.total_rows, packed.padding_rows)

    @torch.no_grad()
    def step(self, states: Sequence[RequestState]) -> StepStats:
        """Advance every state by one sampler step with one packed forward."""
        packed = self.pack(states)
        return self.apply(states, packed, self.runner(packed))

    @torch.no_grad()
    def decode(self, state: RequestState) -> GeneratedMedia:
        request = state.request
        frames = self.model.video_decoder(state.video.to(self.device)).cpu()
        audio = None
        if state.audio is not None:
            wave = self.model.audio_decoder(state.audio.to(self.device)).cpu()
            audio = resample_audio(wave, round(request.duration_s * self.config.audio_sample_rate))
        return GeneratedMedia(frames[: request.frames_out], audio, request.fps, self.config.audio_sample_rate)

    def generate(self, request: GenerationRequest,
                 progress: Callable[[int, int], None] | None = None) -> GeneratedMedia:
        state = self.prepare(request)
        while not state.done:
            self.step([state])
            if progress:
                progress(*state.progress)
        return self.decode(state)


def load_pipeline(model: str = "tiny", backend: str = "torch_sdpa", *, checkpoint: str | Path | None = None,
                  device: str = "cpu", dtype: str = "float32") -> H3Pipeline:
    """Build a pipeline from a preset name, fetching the built-in tiny weights when needed."""
    config = preset(model)
    directory = ensure_checkpoint(model, checkpoint)
    stored = read_config(directory)
    if stored.get("name") != config.name:
        raise ValueError(f"checkpoint {directory} holds {stored.get('name')!r}, not the {model!r} preset ({config.name})")
    return H3Pipeline.build(config, backend, checkpoint=directory, device=device, dtype=dtype)


__all__ = ["DocumentOutput", "GeneratedMedia", "H3Pipeline", "REQUIREMENTS", "load_pipeline"]
