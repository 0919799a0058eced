"""Safetensors checkpoints for any ``torch.nn.Module``: save, inspect, strict load.

Layout follows the Hugging Face convention: one ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``. The model config
travels inside the checkpoint (safetensors metadata and index metadata) so weights can be
checked against the model they are loaded into. Nothing here knows about any model class.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_KEY = "h3serve_config"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_GLOB = "model-*-of-*.safetensors"
_MAX_LISTED = 20
_ABSENT = object()


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model. The message names every offending key/field."""


# --------------------------------------------------------------------------- save


def save_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    directory: str | Path,
    config: Mapping[str, Any],
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``state_dict`` and ``config`` to ``directory``, replacing any checkpoint there.

    ``max_shard_bytes`` bounds the tensor bytes per shard (headers not counted); a single
    tensor larger than the bound gets a shard of its own.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    directory = Path(directory)
    # Validate everything before touching the disk: a bad value must not cost the old checkpoint.
    metadata = {"format": "pt", CONFIG_KEY: json.dumps(dict(config), sort_keys=True)}
    tensors = _cpu_tensors(state_dict)
    shards = _plan_shards(tensors, max_shard_bytes)

    directory.mkdir(parents=True, exist_ok=True)
    # Stage inside the target so the final renames stay on one filesystem (atomic).
    staging = Path(tempfile.mkdtemp(prefix=".h3serve-save-", dir=directory))
    try:
        if len(shards) == 1:
            marker = SINGLE_FILE
            save_file(shards[0], staging / SINGLE_FILE, metadata=metadata)
            _fsync(staging / SINGLE_FILE)
        else:
            marker = INDEX_FILE
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, staging / name, metadata=metadata)
                _fsync(staging / name)
                weight_map.update(dict.fromkeys(shard, name))
            index = {
                "metadata": {
                    "total_size": sum(t.nbytes for t in tensors.values()),
                    CONFIG_KEY: metadata[CONFIG_KEY],
                },
                "weight_map": dict(sorted(weight_map.items())),
            }
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            _fsync(staging / INDEX_FILE)
        _commit(staging, directory, marker)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _cpu_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key}: expected a torch.Tensor, got {type(value).__name__}")
        if value.is_meta or value.layout != torch.strided:
            raise ValueError(f"{key}: only dense tensors with data can be saved, got {value.layout} on {value.device}")
        tensor = value.detach().to("cpu")
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in storages and tensor.numel():
            # Tied/aliased weights: safetensors refuses shared storage, so each key gets its own copy.
            tensor = tensor.clone()
        storages.add(ptr)
        out[key] = tensor.contiguous()
    return out


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[dict[str, torch.Tensor]]:
    # Greedy in state-dict order, which keeps each layer's tensors together.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in tensors.items():
        if max_bytes is not None and shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += tensor.nbytes
    return shards


def _commit(staging: Path, directory: Path, marker: str) -> None:
    """Move staged files into ``directory``; the marker (single file or index) lands last.

    Old markers go first, so a crash midway leaves a directory that does not look like a
    checkpoint rather than an old index pointing at a mix of old and new shards.
    """
    (directory / INDEX_FILE).unlink(missing_ok=True)
    if marker == INDEX_FILE:
        (directory / SINGLE_FILE).unlink(missing_ok=True)
    for stale in directory.glob(_SHARD_GLOB):
        stale.unlink()
    for path in staging.iterdir():
        os.chmod(path, 0o644)  # shared caches and read-only volumes are read by other users
        if path.name != marker:
            os.replace(path, directory / path.name)
    os.replace(staging / marker, directory / marker)
    _fsync(directory)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- inspect


def _locate(directory: Path) -> Path:
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file() and index.is_file():
        raise CheckpointError(f"{directory}: both {SINGLE_FILE} and {INDEX_FILE} exist, so which is current is ambiguous")
    if single.is_file():
        return single
    if index.is_file():
        return index
    raise CheckpointError(f"{directory}: no checkpoint found, expected {SINGLE_FILE} or {INDEX_FILE}")


def _read_index(path: Path) -> dict:
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable index: {e}") from e
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: malformed index, expected a 'weight_map' object")
    return index


def read_config(directory: str | Path) -> dict:
    """The model config stored in the checkpoint in ``directory``."""
    path = _locate(Path(directory))
    if path.name == INDEX_FILE:
        metadata = _read_index(path).get("metadata")
        raw = metadata.get(CONFIG_KEY) if isinstance(metadata, dict) else None
    else:
        with safe_open(path, framework="pt") as f:
            raw = (f.metadata() or {}).get(CONFIG_KEY)
    if raw is None:
        raise CheckpointError(f"{path}: no {CONFIG_KEY!r} in the checkpoint metadata")
    try:
        config = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: {CONFIG_KEY!r} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: {CONFIG_KEY!r} is not a JSON object")
    return config


def checkpoint_files(directory: str | Path) -> dict[str, Path]:
    """Map each checkpoint key to the file that holds it."""
    directory = Path(directory)
    path = _locate(directory)
    if path.name == SINGLE_FILE:
        with safe_open(path, framework="pt") as f:
            return dict.fromkeys(f.keys(), path)
    files: dict[str, Path] = {}
    bad: set[str] = set()
    for key, name in _read_index(path)["weight_map"].items():
        # Shard names are plain file names; anything else could point outside the checkpoint.
        if not isinstance(name, str) or Path(name).name != name or not (directory / name).is_file():
            bad.add(str(name))
        files[key] = directory / str(name)
    if bad:
        raise CheckpointError(f"{path}: shard files missing or invalid: {', '.join(sorted(bad))}")
    return files


# --------------------------------------------------------------------------- load


def load_into(
    module: torch.nn.Module,
    directory: str | Path,
    *,
    device: torch.device | str = "cpu",
    expected_config: Mapping[str, Any] | None = None,
    prefix: str = "",
) -> None:
    """Strictly load the checkpoint keys under ``prefix`` (e.g. ``"dit."``) into ``module``.

    ``module`` may live on the meta device. Tensors are memory-mapped straight onto ``device``
    and cast to the dtype of the module's own parameter/buffer. All problems (config fields,
    missing/unexpected keys, shapes) are reported together in one ``CheckpointError``.
    """
    directory = Path(directory)
    device = torch.device(device)
    problems: list[str] = []
    if expected_config is not None:
        # JSON round trip so tuples/lists and other encodings compare as they were stored.
        expected = json.loads(json.dumps(dict(expected_config), sort_keys=True))
        problems += _section("config mismatches", _config_diff(read_config(directory), expected))

    wanted = module.state_dict()  # persistent entries only; their dtypes are the module's choice
    available = {k[len(prefix):]: path for k, path in checkpoint_files(directory).items() if k.startswith(prefix)}
    missing = [prefix + k for k in wanted if k not in available]
    unexpected = [prefix + k for k in available if k not in wanted]
    problems += _section("missing keys", missing)
    if missing and not available and prefix:
        problems.append(f"  (no checkpoint key starts with {prefix!r})")
    problems += _section("unexpected keys", unexpected)

    with ExitStack() as stack:
        handles = {
            path: stack.enter_context(safe_open(path, framework="pt", device=str(device)))
            for path in {available[k] for k in wanted if k in available}
        }
        mismatched = []
        for key, target in wanted.items():
            if key in available:
                shape = tuple(handles[available[key]].get_slice(prefix + key).get_shape())
                if shape != tuple(target.shape):
                    mismatched.append(f"{prefix + key}: checkpoint {shape} vs model {tuple(target.shape)}")
        problems += _section("shape mismatches", mismatched)
        if problems:
            where = f" (prefix {prefix!r})" if prefix else ""
            header = f"{directory}: checkpoint does not fit {type(module).__name__}{where}:"
            raise CheckpointError("\n".join([header, *problems]))
        # Same dtype -> .to() is a no-op, so CPU loads stay views of the mapped file.
        tensors = {k: handles[available[k]].get_tensor(prefix + k).to(t.dtype) for k, t in wanted.items()}

    module.load_state_dict(tensors, strict=True, assign=True)
    # Guards against modules whose state_dict() does not cover all their parameters.
    on_meta = [n for n, p in module.named_parameters() if p.is_meta]
    on_meta += [n for n, t in module.state_dict().items() if t.is_meta and n not in on_meta]
    if on_meta:
        header = f"{directory}: left on the meta device after loading:"
        raise CheckpointError("\n".join([header, *_section("tensors", on_meta)]))


def _config_diff(stored: Mapping[str, Any], expected: Mapping[str, Any], path: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(stored) | set(expected)):
        a, b = stored.get(key, _ABSENT), expected.get(key, _ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _config_diff(a, b, f"{path}{key}.")
        elif a is _ABSENT or b is _ABSENT or json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            diffs.append(f"{path}{key}: checkpoint {_show(a)}, expected {_show(b)}")
    return diffs


def _show(value: Any) -> str:
    return "<absent>" if value is _ABSENT else json.dumps(value, sort_keys=True)


def _section(title: str, items: list[str]) -> list[str]:
    if not items:
        return []
    lines = [f"  {title} ({len(items)}):"] + [f"    {item}" for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        lines.append(f"    ... and {len(items) - _MAX_LISTED} more")
    return lines
