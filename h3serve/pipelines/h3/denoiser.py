"""The denoiser every SP rank holds: the transformer partition(s) attending only through the admitted backend,
which a replica checks again (capable, and available on this node) rather than trust its spec."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from h3serve.attention import (
    AdmissionError,
    AttentionRequirements,
    BackendUnavailable,
    DeviceType,
    get_backend,
    parse_dtype,
    probe_platform,
)

from . import checkpoint as ckpt
from .attention_processor import SequenceParallel, install
from .config import TransformerGeometry, transformer_defaults
from .forward import packed_forward
from .lora import BASE_SLOT, LoraAdapter, LoraError, LoraSpec, LoraSpecs, adapter_bytes, load_partitions
from .packing import Pack
from .step_cache import CachedPack

logger = logging.getLogger(__name__)

# What H3 needs from attention: many documents packed into one [T, H, D] forward.
REQUIREMENTS = AttentionRequirements(packed_varlen=True)


def quiet_libraries() -> None:
    """No per-call progress bars in a server's log."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()


def check_capable(backend: str, model: str) -> None:
    """Fail closed unless the admitted backend can do what H3 needs (a fact of its code).

    The driver admitted it already; a replica checks again rather than trust its spec.
    """
    attention = get_backend(backend)
    missing = attention.unsupported_requirements(REQUIREMENTS)
    if missing:
        raise AdmissionError(
            f"Attention backend {attention.name!r} does not implement "
            f"{', '.join(AttentionRequirements.describe(m) for m in missing)}, which MiniMax-H3 "
            "requires; this replica refuses to build with it",
            backend=attention.name,
            model=model,
            missing=missing,
        )


def check_runs_here(backend: str, device: DeviceType, dtype: torch.dtype, head_dim: int, model: str) -> None:
    """Fail closed unless this node can run the admitted backend; it is never swapped for another."""
    attention = get_backend(backend)
    here = probe_platform(device)
    available = attention.availability(here, dtype=dtype, head_dim=head_dim)
    if not available or here.device_type != device:
        reason = available.reason or f"the node has no {device} device"
        raise BackendUnavailable(
            f"Attention backend {attention.name!r} cannot run on this node: {reason}",
            backend=attention.name,
            model=model,
        )


class H3Denoiser:
    """The transformer partition(s) of a checkpoint, attending only through the admitted backend.

    With LoRA adapters (``load_adapters``), every partition holds each adapter in its slot, placed on the
    partition's device and dtype; base weights are never modified.
    """

    def __init__(self, transformers: dict[str, torch.nn.Module], backend: str, device: torch.device, directory: Path):
        self.transformers, self.backend, self.device, self.directory = transformers, backend, device, directory
        for model in transformers.values():
            install(model, get_backend(backend).make_impl())
        self.loras = LoraSpecs()
        self.adapters: dict[str, dict[int, LoraAdapter]] = {partition: {} for partition in transformers}
        self.retiring: dict[str, int] = {}  # adapters being unloaded: their slots, held by requests still running

    def load_adapters(self, loras: LoraSpecs) -> None:
        """Read every adapter onto every partition (``load_partitions``: a file's keys routed as diffusers routes
        them; refused by name and key unless it fits). A partition an adapter leaves alone holds it with no layers."""
        adapters: dict[str, dict[int, LoraAdapter]] = {partition: {} for partition in self.transformers}
        for name, spec in loras.loras.items():
            for partition, adapter in load_partitions(name, spec, self.transformers).items():
                adapters[partition][loras.slots[name]] = adapter.placed_for(self.transformers[partition])
        self.loras, self.adapters = loras, adapters
        if loras.loras:
            logger.info("LoRA adapters served in slots %s", loras.slots)

    # -- adapters at run time (``Engine.load_adapter`` / ``unload_adapter``) --------------------------------------
    def stage_adapter(self, name: str, spec: LoraSpec, max_bytes: int | None = None) -> tuple[LoraSpecs, int, int]:
        """Read adapter ``name`` onto every partition in a fresh slot, not yet served: (the specs that serve it, its
        slot, its bytes on this rank). ``serve_staged`` then serves it (once the SP workers hold it and a warm-up
        forward ran on its slot), or ``drop_staged`` frees it.

        Checked as a deploy-time adapter is (``load_partitions``: LoraError naming the mismatched module), and its
        bytes with every adapter's against ``max_bytes`` (``LoraLimits.max_adapter_bytes``: LoraError when over).
        The tables are replaced whole, never changed in place: a forward on another thread reads one or the other.
        """
        if name in self.loras.loras or name in self.retiring:
            raise LoraError(
                f"adapter {name!r} is already served" + (" (being unloaded)" if name in self.retiring else "")
            )
        placed = {
            partition: adapter.placed_for(self.transformers[partition])
            for partition, adapter in load_partitions(name, spec, self.transformers).items()
        }
        added = sum(adapter_bytes(adapter) for adapter in placed.values())
        held = sum(adapter_bytes(a) for by_slot in self.adapters.values() for a in by_slot.values())
        if max_bytes is not None and held + added > max_bytes:
            raise LoraError(
                f"adapter {name!r} needs {added} bytes on each rank beside the {held} its adapters hold; "
                f"lora_limits.max_adapter_bytes is {max_bytes}"
            )
        held_slots = {slot for by_slot in self.adapters.values() for slot in by_slot}
        slot = max([BASE_SLOT, *self.loras.slots.values(), *self.retiring.values(), *held_slots]) + 1
        self.adapters = {p: {**by_slot, slot: placed[p]} for p, by_slot in self.adapters.items()}
        return self.loras.adding(name, spec, slot), slot, added

    def serve_staged(self, loras: LoraSpecs, slot: int, nbytes: int) -> None:
        """Requests may name the adapter ``stage_adapter`` put in ``slot`` from now (``loras``: what it returned)."""
        (name,) = [n for n, s in loras.slots.items() if s == slot]
        self.loras = loras  # the caller changes nothing else in between (``RuntimeAdapters``: one change at a time)
        logger.info("LoRA adapter %s loaded at run time in slot %d (%d bytes)", name, slot, nbytes)

    def drop_staged(self, slot: int) -> None:
        """Free the factors ``stage_adapter`` put in ``slot`` (it was never served)."""
        self.adapters = {p: {s: a for s, a in by_slot.items() if s != slot} for p, by_slot in self.adapters.items()}

    def add_adapter(self, name: str, spec: LoraSpec, max_bytes: int | None = None) -> int:
        """``stage_adapter`` then ``serve_staged`` at once (one rank, no warm-up); returns its bytes on this rank."""
        loras, slot, nbytes = self.stage_adapter(name, spec, max_bytes)
        self.serve_staged(loras, slot, nbytes)
        return nbytes

    def retire_adapter(self, name: str) -> None:
        """New requests on ``name`` are refused from now (it leaves ``loras``); its factors stay for the requests
        that hold its slot, until ``release_retired``."""
        if name not in self.loras.loras:
            served = ", ".join(sorted(self.loras.loras)) or "none"
            raise LoraError(f"no adapter {name!r} on this deployment; its adapters: {served}")
        self.retiring[name] = self.loras.slots[name]
        self.loras = self.loras.removing(name)

    def release_retired(self, held_slots: Iterable[int]) -> list[str]:
        """Free the factors of retired adapters no held request uses (``held_slots``); returns their names."""
        held = set(held_slots)
        gone = {name: slot for name, slot in self.retiring.items() if slot not in held}
        if gone:
            self.adapters = {
                p: {s: a for s, a in by_slot.items() if s not in gone.values()} for p, by_slot in self.adapters.items()
            }
            for name in gone:
                del self.retiring[name]
            logger.info("LoRA adapters unloaded: %s", ", ".join(gone))
        return list(gone)

    def mirror_adapters(self, loras: LoraSpecs, retiring: Mapping[str, int]) -> list[str]:
        """An SP worker's adapters made rank 0's: ``loras`` served and ``retiring`` kept, in rank 0's slots (a pack
        names slots, so every rank must hold the same factors in the same one); an adapter new here is read and
        checked (LoraError naming the module, nothing changed), one rank 0 freed is freed. The names read."""
        keep = {*loras.slots.values(), *retiring.values()}
        have = {*self.loras.slots.items(), *self.retiring.items()}  # (name, slot): a freed slot may be reused
        new = {name: slot for name, slot in loras.slots.items() if (name, slot) not in have}
        adapters = {
            p: {s: a for s, a in by_slot.items() if s in keep and s not in new.values()}
            for p, by_slot in self.adapters.items()
        }
        for name, slot in new.items():
            for partition, adapter in load_partitions(name, loras.loras[name], self.transformers).items():
                adapters[partition][slot] = adapter.placed_for(self.transformers[partition])
        self.adapters, self.loras, self.retiring = adapters, loras, dict(retiring)
        return list(new)

    def rank_of(self, slots: Iterable[int]) -> int:
        """The sum of the adapters' ranks (each its largest layer's, on any partition): what a pack's deltas cost."""
        return sum(
            max(
                (r for by_slot in self.adapters.values() if slot in by_slot for r in by_slot[slot].ranks.values()),
                default=0,
            )
            for slot in set(slots)
        )

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None,
        backend: str,
        *,
        device: DeviceType = "cpu",
        dtype: str | torch.dtype = "float32",
        expected: TransformerGeometry | None = None,
        loras: LoraSpecs | None = None,
    ) -> H3Denoiser:
        """Build with exactly ``backend`` (the driver's choice); never re-resolve.

        ``checkpoint`` None is the built-in tiny checkpoint. Raises AdmissionError for an incapable
        backend (before reading anything), BackendUnavailable when this node cannot run it,
        CheckpointError when the checkpoint does not fit or is not what the deployment was admitted for,
        LoraError for an adapter of ``loras`` that does not fit a partition.
        """
        check_capable(backend, str(checkpoint or "the built-in checkpoint"))
        quiet_libraries()
        directory = ckpt.resolve_checkpoint(checkpoint)
        index = ckpt.CheckpointIndex(directory)
        geometries = {
            partition: TransformerGeometry.of(
                {**transformer_defaults(), **ckpt.load_component_config(index, partition)}
            )
            for partition in index.partitions()
        }
        for partition, found in geometries.items():  # the driver read them too, but this node's copy may differ
            if expected is not None and found != expected:
                raise ckpt.CheckpointError(
                    f"{directory / partition} has {found.describe()}, but the deployment was admitted for "
                    f"{expected.describe()} ({'; '.join(expected.differences(found))})"
                )
        geometry = geometries["transformer"]
        torch_dtype = parse_dtype(dtype)
        check_runs_here(backend, device, torch_dtype, geometry.head_dim, str(directory))
        models = {p: ckpt.load_model(index, p, torch_dtype, device) for p in index.partitions()}
        denoiser = cls(models, backend, torch.device(device), directory)
        if loras is not None:
            denoiser.load_adapters(loras)
        return denoiser

    def forward(self, pack: Pack, sp: SequenceParallel | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's share of one packed forward; rank 0 gets every row's velocity back.

        A ``CachedPack`` carries its documents' step caches into the forward (under Ulysses each rank its own).
        """
        cache = pack.step_cache if isinstance(pack, CachedPack) else None
        adapters = self.adapters[pack.partition] if pack.adapted else None
        return packed_forward(self.transformers[pack.partition], pack.to(self.device), sp, cache, adapters)
