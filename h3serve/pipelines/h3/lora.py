"""LoRA adapters for MiniMax-H3, several in one packed forward, over base weights that are never modified.

An adapter is a local directory in diffusers' LoRA format for MiniMax-H3 (what
``MiniMaxH3LoraLoaderMixin.save_lora_weights`` writes; the non-diffusers layouts its ``lora_state_dict``
converts load too). Ranks and alphas come from the adapter's own files exactly as diffusers derives
them when it loads the adapter into peft (``LoraConfig`` from the file's metadata, else
``get_peft_kwargs`` from the shapes: ``alpha == rank`` for alpha-less files). Every key must land on an
``nn.Linear`` of the served transformer with matching shapes, or the adapter is refused by name.

Several adapters in one pack, as vLLM's Punica path does for LLMs: ``adapting(model, adapters, slots)``
installs forward hooks around one packed forward. Every adapted linear layer computes its base
projection for all rows, then adds ``scale * B_a(A_a x)`` on the rows whose slot is adapter ``a``, for
each adapter present; slot 0 (``BASE_SLOT``) rows get no delta and cost nothing extra. Which rows a
layer sees depends on where it sits in ``packed_forward``, so each layer reads one stream of slots:

==============  ===========================================================  ==============================
stream          layers                                                       rows of the layer's input
==============  ===========================================================  ==============================
``rows``        ``transformer_blocks.*`` (attention, FFN)                    this rank's pack rows [T/W]
``text``        ``context_embedder``, ``token_refiner.*``                    every text row of the pack
``video``       ``proj_in``, ``proj_out``                                    this rank's video rows
``audio``       ``audio_proj_in``, ``audio_proj_out``                        this rank's audio rows
``timesteps``   ``time_embedder.*``, ``*.adaln_proj.linear``, ``norm_out``   the pack's distinct timesteps
==============  ===========================================================  ==============================

The timestep path computes one AdaLN table per distinct timestep, shared by every row at that
timestep. When an adapter of the pack targets it, the timestep axis is widened to (slot group,
timestep): ``time_proj``'s output is repeated once per slot group present, each group's copy gets
its own adapter's deltas, and every block's ``adaln_indices`` and ``norm_out``'s ``timestep_indices``
are shifted to the row's group. A pack whose adapters leave the timestep path alone runs it unchanged.

Why over 600 lines: reading an adapter (diffusers' key routing, peft's rank/alpha derivation, the checks naming the
module) and applying it (slots by stream, the hooks, the widened timestep path) share one type, ``LoraAdapter``, and
its layer naming; the torch-free half (specs, slots, limits, composition) is ``lora_spec.py`` already.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.models.transformers.transformer_minimax_h3 import MINIMAX_H3_MODALITY_NUM

from .lora_spec import BASE_SLOT, LoraError, LoraSpec, LoraSpecs, validate_lora_name
from .packing import Pack

# MiniMax-H3's transformer partitions (diffusers' LoRA-loadable ones)
LORA_PARTITIONS = ("transformer", "transformer_ref")
_LISTED = 5
_A_SUFFIX, _B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


def stream_of(module: str) -> str:
    """Which slots a linear layer's input rows carry (see the module docstring's table)."""
    if module.startswith("time_embedder.") or module == "norm_out.linear" or module.endswith(".adaln_proj.linear"):
        return "timesteps"
    if module.startswith("transformer_blocks."):
        return "rows"
    if module == "context_embedder" or module.startswith("token_refiner."):
        return "text"
    if module in ("proj_in", "proj_out"):
        return "video"
    if module in ("audio_proj_in", "audio_proj_out"):
        return "audio"
    raise LoraError(f"h3serve does not know which rows reach {module!r}, so it cannot adapt it")


_REPEATED_PREFIX = re.compile(r"^(?:[^.]+\.)*?\d+\.")  # up to the first index: "transformer_blocks.3."


def linear_kinds(model: torch.nn.Module) -> list[str]:
    """Every kind of ``nn.Linear`` in ``model``, in module order: each name with its repeated-block prefix dropped
    (``transformer_blocks.3.attn.to_q`` -> ``attn.to_q``; ``token_refiner.refiner_blocks.0.`` likewise).

    As peft's ``target_modules`` (which matches a name or its dotted suffix) they adapt every linear layer, the
    timestep path and the refiner included, as published few-step adapters do; derived from the model, so a
    diffusers release that adds a linear layer adds its kind. Works on the meta device.
    """
    kinds: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            kinds[_REPEATED_PREFIX.sub("", name, count=1)] = None
    return list(kinds)


@dataclasses.dataclass(frozen=True)
class LoraLayer:
    """One adapted linear layer: delta(x) = scaling * up(down(x))."""

    down: torch.Tensor  # [r, in_features] lora_A
    up: torch.Tensor  # [out_features, r] lora_B
    scaling: float  # peft's alpha / r (alpha / sqrt(r) with rsLoRA), the spec's scale not included

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """An adapter read from its directory and checked against one transformer partition."""

    name: str
    spec: LoraSpec
    partition: str  # "transformer" or "transformer_ref"
    layers: dict[str, LoraLayer]  # module name in the transformer -> its factors

    @property
    def directory(self) -> Path:
        return self.spec.path

    @property
    def ranks(self) -> dict[str, int]:
        return {module: layer.rank for module, layer in self.layers.items()}

    @classmethod
    def load(cls, name: str, spec: LoraSpec, transformer: torch.nn.Module, partition: str = "transformer"):
        """Read ``spec.path`` with diffusers' own ``lora_state_dict`` and check it against ``transformer``.

        ``partition`` is the transformer partition the adapter is served on; a file's ``transformer.``
        keys go to ``transformer_ref`` when that is the partition and the file names no other, as
        diffusers' ``load_into_transformer_ref`` routes them. Every key must serve this partition (for a
        deployment of several partitions, where a key may serve another, see ``load_partitions``).
        """
        state_dict, metadata = _read_adapter(name, spec)
        prefix = _source_prefix(partition, state_dict)
        others = sorted(k for k in state_dict if not k.startswith(f"{prefix}."))
        if others:
            raise LoraError(_listed(name, spec.path, f"keys outside the {partition!r} partition", others))
        return cls._checked(name, spec, partition, state_dict, metadata, transformer)

    @classmethod
    def _checked(
        cls, name: str, spec: LoraSpec, partition: str, state_dict: dict[str, torch.Tensor], metadata, transformer
    ) -> LoraAdapter:
        """The adapter's layers on ``partition`` (its source prefix's keys; none: an adapter with no layers)."""
        prefix = _source_prefix(partition, state_dict)
        ours = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
        if not ours:
            return cls(name=name, spec=spec, partition=partition, layers={})
        config = _lora_config(name, spec.path, ours, metadata, prefix)
        layers = _checked_layers(name, spec.path, ours, config, transformer)
        return cls(name=name, spec=spec, partition=partition, layers=layers)

    def placed_for(self, model: torch.nn.Module) -> LoraAdapter:
        """Factors on each adapted layer's own device and dtype (bf16 body, fp32 boundary modules)."""
        modules = dict(model.named_modules())
        return dataclasses.replace(
            self,
            layers={
                name: dataclasses.replace(layer, down=layer.down.to(weight), up=layer.up.to(weight))
                for name, layer in self.layers.items()
                for weight in [modules[name].weight]
            },
        )

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> LoraAdapter:
        return dataclasses.replace(
            self,
            layers={
                module: dataclasses.replace(layer, down=layer.down.to(device, dtype), up=layer.up.to(device, dtype))
                for module, layer in self.layers.items()
            },
        )


def adapter_bytes(adapter: LoraAdapter) -> int:
    """The bytes of an adapter's factors as placed (each layer's dtype)."""
    return sum(t.numel() * t.element_size() for layer in adapter.layers.values() for t in (layer.down, layer.up))


def _read_adapter(name: str, spec: LoraSpec) -> tuple[dict[str, torch.Tensor], Any]:
    """The adapter's state dict (keys ``<partition>.<module>.lora_A/B.weight``) and metadata, read by diffusers'
    ``MiniMaxH3LoraLoaderMixin.lora_state_dict`` (non-diffusers layouts converted), or LoraError naming it."""
    from diffusers.loaders import MiniMaxH3LoraLoaderMixin

    validate_lora_name(name)
    directory = spec.path
    if not directory.is_dir():
        raise LoraError(f"adapter {name!r}: {directory} is not a directory")
    try:
        state_dict, metadata = MiniMaxH3LoraLoaderMixin.lora_state_dict(
            str(directory), return_lora_metadata=True, local_files_only=True
        )
    except (OSError, ValueError, RuntimeError) as e:
        raise LoraError(f"adapter {name!r}: {directory} cannot be read as a MiniMax-H3 LoRA: {e}") from None
    if not state_dict:
        raise LoraError(f"adapter {name!r}: {directory} holds no LoRA weights")
    return state_dict, metadata


def _source_prefix(partition: str, state_dict: Mapping[str, torch.Tensor]) -> str:
    """The key prefix that adapts ``partition``: its own, except that ``transformer_ref`` takes the ``transformer.``
    keys of a file that names no ``transformer_ref.`` key (diffusers' ``load_into_transformer_ref``)."""
    if partition == "transformer_ref" and not any(k.startswith("transformer_ref.") for k in state_dict):
        return "transformer"
    return partition


def load_partitions(name: str, spec: LoraSpec, transformers: Mapping[str, torch.nn.Module]) -> dict[str, LoraAdapter]:
    """The adapter on each transformer partition of a deployment (``transformers``: partition -> its model).

    Keys are routed as diffusers' ``load_lora_weights`` routes them on a pipeline holding these partitions:
    ``transformer_ref.`` keys adapt ``transformer_ref`` alone, ``transformer.`` keys adapt ``transformer``, and
    ``transformer_ref`` too when the file names no ``transformer_ref.`` key (h3serve's rule, as
    ``load_into_transformer_ref``). A partition the file leaves alone gets an adapter with no layers (a
    ``transformer_ref``-only adapter leaves ``transformer`` unadapted). Refused by name (LoraError): keys of no
    MiniMax-H3 partition, ``transformer_ref.`` keys on a checkpoint without that partition, and every key the
    partitions' own checks refuse (``LoraAdapter.load``).
    """
    unknown = sorted(set(transformers) - set(LORA_PARTITIONS))
    if unknown:
        raise ValueError(f"unknown transformer partitions {unknown}; MiniMax-H3's are {', '.join(LORA_PARTITIONS)}")
    state_dict, metadata = _read_adapter(name, spec)
    stray = sorted(k for k in state_dict if not k.startswith(tuple(f"{p}." for p in LORA_PARTITIONS)))
    if stray:
        raise LoraError(_listed(name, spec.path, "keys of no MiniMax-H3 transformer partition", stray))
    # a key is served when it adapts some served partition (`transformer.` keys adapt transformer_ref where the
    # file names no transformer_ref key, as diffusers' ref2va pipeline loads them)
    sources = {_source_prefix(partition, state_dict) for partition in transformers}
    unserved = sorted(k for k in state_dict if k.split(".", 1)[0] not in sources)
    if unserved:
        served = ", ".join(repr(p) for p in transformers)
        what = f"keys for a partition this checkpoint does not serve (it serves {served})"
        raise LoraError(_listed(name, spec.path, what, unserved))
    adapters = {}
    for partition, model in transformers.items():
        try:
            adapters[partition] = LoraAdapter._checked(name, spec, partition, state_dict, metadata, model)
        except LoraError as e:
            raise LoraError(f"{e} [checked against the {partition!r} transformer partition]") from None
    return adapters


@dataclasses.dataclass(frozen=True)
class AdapterFootprint:
    """What one adapter adds to every rank: its adapted layers and its factors' bytes, over every partition."""

    layers: int  # adapted layers, summed over the partitions
    bytes: int  # lora_A + lora_B at each layer's served dtype (fp32 in diffusers' _keep_in_fp32_modules)


def check_adapters(
    loras: LoraSpecs, transformer_configs: Mapping[str, dict[str, Any]], dtype: str | torch.dtype = "float32"
) -> dict[str, AdapterFootprint]:
    """Every adapter of ``loras`` against every partition's transformer, built on the meta device from its config.

    The driver's check before any replica starts: no weights are read or allocated, only the adapters' own
    files. Raises LoraError naming the adapter and key; returns each adapter's footprint at ``dtype``.
    """
    from diffusers import MiniMaxH3Transformer3DModel

    from .memory import served_itemsize

    models = {}
    for partition, config in transformer_configs.items():
        with torch.device("meta"):
            models[partition] = MiniMaxH3Transformer3DModel.from_config(config)
    layers: dict[str, int] = dict.fromkeys(loras.loras, 0)
    nbytes: dict[str, int] = dict.fromkeys(loras.loras, 0)
    for name, spec in loras.loras.items():
        for partition, adapter in load_partitions(name, spec, models).items():  # the replicas' own routing
            layers[name] += len(adapter.layers)
            nbytes[name] += sum(
                (layer.down.numel() + layer.up.numel()) * served_itemsize(models[partition], module, dtype)
                for module, layer in adapter.layers.items()
            )
    return {name: AdapterFootprint(layers[name], nbytes[name]) for name in loras.loras}


def _listed(name: str, directory: Path, what: str, keys: Sequence[str]) -> str:
    more = f" and {len(keys) - _LISTED} more" if len(keys) > _LISTED else ""
    return f"adapter {name!r} ({directory}) has {what}: {', '.join(keys[:_LISTED])}{more}"


def _lora_config(name: str, directory: Path, state_dict: dict[str, torch.Tensor], metadata, prefix: str):
    """peft's ``LoraConfig`` as diffusers' ``load_lora_adapter`` builds it for this state dict."""
    from diffusers.utils.peft_utils import get_peft_kwargs
    from peft import LoraConfig

    if metadata is not None:
        kwargs = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
    else:
        # the same rank dict diffusers passes (`^`-anchored lora_B keys); alpha == rank for alpha-less files
        rank = {f"^{k}": v.shape[1] for k, v in state_dict.items() if "lora_B" in k and v.ndim > 1}
        kwargs = get_peft_kwargs(rank, network_alpha_dict=None, peft_state_dict=state_dict)
    try:
        config = LoraConfig(**kwargs)
    except (TypeError, ValueError) as e:
        raise LoraError(f"adapter {name!r} ({directory}): its LoRA config is not a peft LoraConfig: {e}") from None
    for flag in ("use_dora", "lora_bias"):
        if getattr(config, flag, False):
            raise LoraError(f"adapter {name!r} ({directory}) sets {flag}; h3serve serves plain LoRA only")
    return config


def _checked_layers(
    name: str, directory: Path, state_dict: dict[str, torch.Tensor], config, transformer: torch.nn.Module
) -> dict[str, LoraLayer]:
    from peft.utils.other import get_pattern_key

    modules = dict(transformer.named_modules())
    unexpected = sorted(k for k in state_dict if not k.endswith((_A_SUFFIX, _B_SUFFIX)))
    if unexpected:
        raise LoraError(_listed(name, directory, "keys that are not lora_A/lora_B weights", unexpected))
    targets = sorted({k.removesuffix(_A_SUFFIX).removesuffix(_B_SUFFIX) for k in state_dict})
    unknown = [
        k
        for k in sorted(state_dict)
        if not isinstance(modules.get(k.removesuffix(_A_SUFFIX).removesuffix(_B_SUFFIX)), torch.nn.Linear)
    ]
    if unknown:
        raise LoraError(_listed(name, directory, "unexpected keys (no nn.Linear of the transformer)", unknown))
    missing = [k for t in targets for k in (t + _A_SUFFIX, t + _B_SUFFIX) if k not in state_dict]
    if missing:
        raise LoraError(_listed(name, directory, "missing keys (each adapted layer needs lora_A and lora_B)", missing))

    layers, mismatched = {}, []
    for target in targets:
        linear = modules[target]
        down, up = state_dict[target + _A_SUFFIX], state_dict[target + _B_SUFFIX]
        # down [r, in_features], up [out_features, r]
        if down.ndim != 2 or down.shape[1] != linear.in_features:
            mismatched.append(f"{target}{_A_SUFFIX} {tuple(down.shape)} (expected [r, {linear.in_features}])")
            continue
        r = down.shape[0]
        if up.shape != (linear.out_features, r):
            mismatched.append(f"{target}{_B_SUFFIX} {tuple(up.shape)} (expected {(linear.out_features, r)})")
            continue
        # peft's own resolution of this module's rank and alpha from the config's patterns
        declared_r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), target), config.r)
        alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), target), config.lora_alpha)
        if declared_r != r:
            mismatched.append(f"{target}{_A_SUFFIX} rank {r} (its config declares rank {declared_r})")
            continue
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        layers[target] = LoraLayer(down=down, up=up, scaling=float(scaling))
    if mismatched:
        raise LoraError(_listed(name, directory, "mismatched shapes", mismatched))
    for target in layers:
        stream_of(target)  # refuses a layer whose rows h3serve cannot attribute
    return layers


# ----------------------------------------------------------------------------- several adapters in one pack


@dataclasses.dataclass(frozen=True)
class PackSlots:
    """Each row's adapter slot, per stream, as this rank's modules see them (``BASE_SLOT`` = no adapter)."""

    rows: torch.Tensor  # [T/W] int64 slot of each of this rank's pack rows (padding rows: BASE_SLOT)
    text: torch.Tensor  # [N_text] every text row of the pack, in the pack's text order
    video: torch.Tensor  # [n_video here] this rank's video rows, in the pack's video order
    audio: torch.Tensor  # [n_audio here]
    groups: torch.Tensor  # [G] the distinct slots of the whole pack, sorted: the widened timestep axis
    row_groups: torch.Tensor  # [T/W] index into `groups` of each of this rank's rows
    timesteps: int  # K, the pack's distinct timesteps
    # every pack row's slot and group [T]: a step-cache sub-pack runs pack rows from anywhere (under Ulysses too)
    pack_rows: torch.Tensor
    pack_row_groups: torch.Tensor

    def stream(self, name: str) -> torch.Tensor:
        if name == "timesteps":  # [G*K]: group g's copy of every timestep
            return self.groups.repeat_interleave(self.timesteps)
        return getattr(self, name)


def pack_slots(pack: Pack, document_slots: Sequence[int], rank: int = 0, world: int = 1) -> PackSlots:
    """The slots of ``pack``'s rows from each document's slot; the rows rank ``rank`` of ``world`` computes.

    Every row of a document (text, condition, audio, video) carries the document's slot.
    """
    if len(document_slots) != len(pack.lengths):
        raise ValueError(
            f"document_slots has {len(document_slots)} entries for a pack of {len(pack.lengths)} documents"
        )
    if any(s < 0 for s in document_slots):
        raise ValueError(f"document_slots must be >= 0 (0 is the base model), got {list(document_slots)}")
    device = pack.position_ids.device
    lengths = torch.tensor(pack.lengths + [pack.padding_rows], dtype=torch.long, device=device)
    slots = torch.tensor(list(document_slots) + [BASE_SLOT], dtype=torch.long, device=device)
    rows = slots.repeat_interleave(lengths)  # [T]
    lo, hi = rank * pack.total_rows // world, (rank + 1) * pack.total_rows // world

    def local(indices: torch.Tensor) -> torch.Tensor:  # the filter packed_forward's `_local` applies
        if world == 1:  # every row: no mask, whose nonzero would make the host wait
            return rows[indices]
        return rows[indices[(indices >= lo) & (indices < hi)]]

    groups = torch.unique(rows, sorted=True)  # [G]
    row_groups = torch.searchsorted(groups, rows)  # [T]
    return PackSlots(
        rows=rows[lo:hi],
        text=rows[pack.text_indices],
        video=local(pack.video_indices),
        audio=local(pack.audio_indices),
        groups=groups,
        row_groups=row_groups[lo:hi],
        timesteps=int(pack.timestep.numel()),
        pack_rows=rows,
        pack_row_groups=row_groups,
    )


@dataclasses.dataclass(frozen=True)
class _Target:
    """Where one adapter layer's delta lands: a module and the columns of its output."""

    module: torch.nn.Module
    columns: slice  # the whole output, or the to_q / to_k / to_v third of a fused to_qkv


def _resolve(model: torch.nn.Module, modules: Mapping[str, torch.nn.Module], name: str) -> tuple[str, _Target]:
    """The module the forward actually calls for ``name``: fused attention runs to_qkv, not to_q/k/v."""
    parent_name, _, leaf = name.rpartition(".")
    parent = modules.get(parent_name)
    if leaf in ("to_q", "to_k", "to_v") and getattr(parent, "fused_projections", False):
        fused = modules[f"{parent_name}.to_qkv"]
        width = int(modules[name].out_features)  # type: ignore[arg-type]  # an nn.Linear, checked at load
        third = ("to_q", "to_k", "to_v").index(leaf)
        return f"{parent_name}.to_qkv", _Target(fused, slice(third * width, (third + 1) * width))
    return name, _Target(modules[name], slice(None))


_ACTIVE = "_h3serve_adapting"
# the pack rows a block runs on when it runs on some documents only (step caching's sub-pack), else None
_ROW_SUBSET: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("h3serve_row_subset", default=None)


@contextlib.contextmanager
def rows_subset(index: torch.Tensor) -> Iterator[None]:
    """Blocks called inside run on the pack rows ``index`` [T_sub] only (in this order), not on this rank's T/W rows.

    ``index`` holds pack positions (0..T-1), wherever they are under Ulysses: a step-cache sub-pack's share.

    ``step_cache`` wraps its sub-pack blocks in it, so that an active ``adapting`` adds each adapter's delta on
    the sub-pack's rows of its documents; without ``adapting`` it changes nothing.
    """
    token = _ROW_SUBSET.set(index)
    try:
        yield
    finally:
        _ROW_SUBSET.reset(token)


def _runs(values: torch.Tensor) -> list[tuple[int, int, int]]:
    """(value, first, end) of each run of equal values of ``values`` [n]: one small host read per stream."""
    n = values.numel()
    if n == 0:
        return []
    starts = (torch.nonzero(values[1:] != values[:-1]).squeeze(1) + 1).tolist()  # [runs - 1]
    firsts = [0, *starts]
    run_values = values[torch.tensor(firsts, device=values.device)].tolist()
    return [(int(v), a, b) for v, a, b in zip(run_values, firsts, [*starts, n], strict=True) if v != BASE_SLOT]


class _RowRuns:
    """Each stream's adapter runs for this pack, and the ``rows`` stream's for each sub-pack seen (cached)."""

    def __init__(self, slots: PackSlots):
        self.slots = slots
        # stream -> [(slot, first row, end row)]: every document's rows are one run of its stream, so each
        # adapter's rows are a few slices (one per document), found once per pack, not once per layer
        self.whole = {stream: _runs(slots.stream(stream)) for stream in ("rows", "text", "video", "audio", "timesteps")}
        self.sizes = {stream: int(slots.stream(stream).numel()) for stream in self.whole}
        self._subsets: dict[int, tuple[torch.Tensor, list[tuple[int, int, int]]]] = {}

    def of(self, stream: str) -> tuple[list[tuple[int, int, int]], int]:
        """(runs, rows) of ``stream`` for the layer being called now."""
        subset = _ROW_SUBSET.get()
        if stream != "rows" or subset is None:
            return self.whole[stream], self.sizes[stream]
        key = id(subset)
        if key not in self._subsets:  # keeps ``subset`` alive, so its id is never reused within the pack
            self._subsets[key] = (subset, _runs(self.slots.pack_rows.index_select(0, subset)))
        return self._subsets[key][1], int(subset.numel())


# a pack's composition id -> the (adapter slot, weight) it runs; weight None: the adapter's spec scale
Compositions = Mapping[int, Sequence[tuple[int, float | None]]]


@contextlib.contextmanager
def adapting(
    model: torch.nn.Module,
    adapters_by_slot: Mapping[int, LoraAdapter],
    slots: PackSlots,
    compositions: Compositions | None = None,
) -> Iterator[None]:
    """For the forward inside, every adapted linear adds each adapter's delta on its own rows only.

    ``adapters_by_slot`` maps slot numbers (>= 1) to adapters already placed on the model
    (``LoraAdapter.placed_for``: each layer's device and dtype); slots of the pack with no adapter listed
    are refused. Base weights are never written: the deltas are added
    to the layers' outputs by forward hooks, removed on exit. Blocks run under ``rows_subset`` (a
    step-cache sub-pack) adapt the sub-pack's rows.

    ``compositions`` (None: each row's value is an adapter slot at its spec's scale): the rows' values are composition
    ids, each running several adapters at their own weights, as diffusers' ``set_adapters(names, weights)`` does:
    delta = sum_a weight_a * scaling_a * B_a(A_a x), each adapter's own GEMMs on the composition's rows.
    """
    if BASE_SLOT in adapters_by_slot:
        raise ValueError(f"slot {BASE_SLOT} is the base model; adapters take slots >= 1")
    present = [int(s) for s in slots.groups.tolist() if s != BASE_SLOT]
    if compositions is None:
        compositions = {s: ((s, None),) for s in present}
    missing = [s for s in present if s not in compositions]
    if missing:
        raise ValueError(f"the pack uses compositions {missing} that are not given: {sorted(compositions)}")
    unknown = sorted({slot for s in present for slot, _ in compositions[s] if slot not in adapters_by_slot})
    if unknown:
        raise ValueError(f"the pack uses adapter slots {unknown} with no adapter; known: {sorted(adapters_by_slot)}")
    if getattr(model, _ACTIVE, False):
        raise RuntimeError("adapting() is already active on this model; packs run one at a time")

    modules = dict(model.named_modules())
    row_runs = _RowRuns(slots)
    # module actually called -> (module, its stream, slot -> [(layer, scale, columns)]) for each adapter present on it
    work: dict[str, tuple[torch.nn.Module, str, dict[int, list[tuple[LoraLayer, float, slice]]]]] = {}
    widen = False
    for group in present:
        for slot, weight in compositions[group]:
            adapter = adapters_by_slot[slot]
            for name, layer in adapter.layers.items():
                stream = stream_of(name)
                widen |= stream == "timesteps"
                called, target = _resolve(model, modules, name)
                scale = (adapter.spec.scale if weight is None else weight) * layer.scaling
                entry = work.setdefault(called, (target.module, stream, {}))
                entry[2].setdefault(group, []).append((layer, scale, target.columns))

    def add_deltas(stream: str, by_slot: dict[int, list[tuple[LoraLayer, float, slice]]]):
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            x = args[0].reshape(-1, args[0].shape[-1])  # [n, in_features]
            out = output.view(-1, output.shape[-1])  # [n, out_features], the same storage as output
            runs, expected_rows = row_runs.of(stream)
            if x.shape[0] != expected_rows:
                raise RuntimeError(
                    f"an adapted layer saw {x.shape[0]} rows where the pack's slots have {expected_rows}"
                )
            for slot, first, end in runs:
                for layer, scale, columns in by_slot.get(slot, ()):
                    down = x[first:end].to(layer.down.dtype) @ layer.down.T  # [rows of the run, r]
                    # out[run, columns] += scale * down @ up^T, in place, the add fused into the GEMM
                    out[first:end, columns].addmm_(down.to(out.dtype), layer.up.T.to(out.dtype), alpha=scale)
            return output

        return hook

    handles = []
    try:
        setattr(model, _ACTIVE, True)
        for module, stream, by_slot in work.values():
            handles.append(module.register_forward_hook(add_deltas(stream, by_slot)))
        if widen:
            handles.extend(_widen_timesteps(model, slots))
        yield
    finally:
        for handle in handles:
            handle.remove()
        setattr(model, _ACTIVE, False)


def _widen_timesteps(model: Any, slots: PackSlots) -> list[Any]:
    """Give every slot group its own copy of the timestep path; point each row at its group's copy."""
    k, groups = slots.timesteps, slots.groups.numel()
    adaln_shift = slots.row_groups * (k * MINIMAX_H3_MODALITY_NUM)  # [T/W] table rows are (g*K + t)*3 + tag
    norm_shift = slots.row_groups * k  # [T/W] norm_out's table rows are g*K + t
    pack_adaln_shift = slots.pack_row_groups * (k * MINIMAX_H3_MODALITY_NUM)  # [T]: a sub-pack's rows index it
    pack_norm_shift = slots.pack_row_groups * k  # [T]

    def repeat_timesteps(module, args, output: torch.Tensor) -> torch.Tensor:
        if output.shape[0] != k:
            raise RuntimeError(f"time_proj saw {output.shape[0]} timesteps where the pack has {k}")
        return output.repeat(groups, 1)  # [K, freq] -> [G*K, freq]

    def shifted(position: int, name: str, whole: torch.Tensor, pack_whole: torch.Tensor):
        def pre_hook(module, args: tuple[Any, ...], kwargs: dict[str, Any]):
            subset = _ROW_SUBSET.get()  # a step-cache sub-pack: its rows' shifts, in its order
            shift = whole if subset is None else pack_whole.index_select(0, subset)
            if name in kwargs:
                kwargs = {**kwargs, name: kwargs[name] + shift}
            else:
                args = (*args[:position], args[position] + shift, *args[position + 1 :])
            return args, kwargs

        return pre_hook

    handles = [model.time_proj.register_forward_hook(repeat_timesteps)]
    for block in model.transformer_blocks:
        handles.append(
            block.register_forward_pre_hook(
                shifted(2, "adaln_indices", adaln_shift, pack_adaln_shift), with_kwargs=True
            )
        )
    handles.append(
        model.norm_out.register_forward_pre_hook(
            shifted(2, "timestep_indices", norm_shift, pack_norm_shift), with_kwargs=True
        )
    )
    return handles
