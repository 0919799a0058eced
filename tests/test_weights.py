"""Safetensors checkpoints: round trips, sharding, strict loading, atomic saves. Real files, no mocks."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from pipelines.h3.weights import (
    CONFIG_KEY,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    checkpoint_files,
    load_into,
    read_config,
    save_checkpoint,
)

CONFIG = {"hidden_size": 16, "attn": {"heads": 2, "window": [4, 4]}, "dtype": "bf16"}


class Net(nn.Module):
    """bf16-able body with an fp32 output head, one persistent and one non-persistent buffer."""

    def __init__(self, hidden: int = 16, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = nn.Linear(8, hidden, dtype=dtype)
        self.body = nn.Linear(hidden, hidden, dtype=dtype)
        self.head = nn.Linear(hidden, 4, dtype=torch.float32)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden, dtype=dtype))
        self.register_buffer("freqs", torch.arange(hidden, dtype=torch.float32), persistent=False)


def make_net(hidden: int = 16, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(hidden)


def meta_net(**kwargs) -> Net:
    with torch.device("meta"):
        return Net(**kwargs)


def assert_same_state(loaded: nn.Module, source: nn.Module) -> None:
    got, want = loaded.state_dict(), source.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert torch.equal(got[key], want[key]), key


def error_for(module: nn.Module, directory: Path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as info:
        load_into(module, directory, **kwargs)
    return str(info.value)


# --------------------------------------------------------------------------- round trips


def test_round_trip_fp32_is_exact(tmp_path):
    source = make_net()
    assert save_checkpoint(source.state_dict(), tmp_path, CONFIG) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]

    net = meta_net()
    load_into(net, tmp_path, expected_config=CONFIG)

    assert_same_state(net, source)
    assert not any(p.is_meta for p in net.parameters())
    assert all(p.requires_grad for p in net.parameters())
    assert read_config(tmp_path) == CONFIG
    with safe_open(tmp_path / SINGLE_FILE, framework="pt") as f:
        assert f.metadata() == {"format": "pt", CONFIG_KEY: json.dumps(CONFIG, sort_keys=True)}


def test_tensors_are_cast_to_the_modules_dtypes(tmp_path):
    source = make_net()
    save_checkpoint(source.state_dict(), tmp_path, CONFIG)

    net = meta_net(dtype=torch.bfloat16)
    load_into(net, tmp_path)

    state = net.state_dict()
    for key, want in source.state_dict().items():
        expected_dtype = torch.float32 if key.startswith("head.") else torch.bfloat16
        assert state[key].dtype == expected_dtype, key
        assert torch.equal(state[key], want.to(expected_dtype)), key


def test_non_persistent_buffers_are_kept(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path, CONFIG)

    on_cpu = Net()
    freqs = on_cpu.freqs
    load_into(on_cpu, tmp_path)
    assert on_cpu.freqs is freqs

    on_meta = meta_net()
    load_into(on_meta, tmp_path)  # a meta non-persistent buffer is the module's business, not an error
    assert on_meta.freqs.is_meta


def test_loaded_cpu_tensors_are_views_of_the_mapped_file(tmp_path):
    # Zero-copy check without memory measurements: each loaded parameter owns a storage of
    # exactly its own size (no shared blob), and on Linux that storage lies inside a mapping of
    # the checkpoint file, i.e. it was not copied out of the mmap.
    source = make_net()
    save_checkpoint(source.state_dict(), tmp_path, CONFIG)
    net = meta_net()
    load_into(net, tmp_path)
    assert_same_state(net, source)

    file = str((tmp_path / SINGLE_FILE).resolve())
    maps = Path("/proc/self/maps")
    ranges = []
    if maps.exists():
        for line in maps.read_text().splitlines():
            if line.endswith(file):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((start, end))
    assert ranges or not maps.exists()
    for name, param in net.named_parameters():
        assert param.untyped_storage().nbytes() == param.nbytes, name
        if maps.exists():
            assert any(start <= param.data_ptr() < end for start, end in ranges), name

    # The mapping is private: training or in-place edits must never write through to the checkpoint.
    with torch.no_grad():
        net.body.weight.add_(1.0)
    assert torch.equal(load_file(tmp_path / SINGLE_FILE)["body.weight"], source.body.weight)


# --------------------------------------------------------------------------- sharding


def test_sharded_checkpoint_uses_the_hf_index_layout(tmp_path):
    source = make_net()
    state = source.state_dict()
    save_checkpoint(state, tmp_path, CONFIG, max_shard_bytes=600)

    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3
    n = len(shards)
    assert [s.name for s in shards] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (tmp_path / SINGLE_FILE).exists()

    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert set(index) == {"metadata", "weight_map"}
    assert index["metadata"] == {
        "total_size": sum(t.nbytes for t in state.values()),
        CONFIG_KEY: json.dumps(CONFIG, sort_keys=True),
    }
    assert set(index["weight_map"]) == set(state)
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt", CONFIG_KEY: json.dumps(CONFIG, sort_keys=True)}
            assert all(index["weight_map"][key] == shard.name for key in f.keys())

    assert checkpoint_files(tmp_path) == {k: tmp_path / name for k, name in index["weight_map"].items()}
    assert read_config(tmp_path) == CONFIG
    net = meta_net()
    load_into(net, tmp_path, expected_config=CONFIG)
    assert_same_state(net, source)


def test_small_state_dict_under_the_shard_limit_is_a_single_file(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path, CONFIG, max_shard_bytes=1 << 20)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]


def test_missing_shard_file_is_named(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path, CONFIG, max_shard_bytes=600)
    gone = sorted(tmp_path.glob("model-*-of-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(CheckpointError, match=gone.name):
        checkpoint_files(tmp_path)


# --------------------------------------------------------------------------- strictness


def test_missing_key_is_named(tmp_path):
    state = make_net().state_dict()
    del state["body.bias"]
    save_checkpoint(state, tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path)
    assert "missing keys (1)" in message
    assert "body.bias" in message


def test_unexpected_key_is_named(tmp_path):
    state = make_net().state_dict()
    state["extra.weight"] = torch.zeros(3)
    save_checkpoint(state, tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path)
    assert "unexpected keys (1)" in message
    assert "extra.weight" in message


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    state = make_net().state_dict()
    state["body.weight"] = torch.zeros(16, 12)
    save_checkpoint(state, tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path)
    assert "body.weight: checkpoint (16, 12) vs model (16, 16)" in message


def test_all_problems_are_reported_in_one_error(tmp_path):
    state = make_net().state_dict()
    del state["embed.weight"], state["scale"]
    state["head.weight"] = torch.zeros(5, 16)
    state["ghost"] = torch.zeros(1)
    save_checkpoint(state, tmp_path, CONFIG)
    net = meta_net()
    message = error_for(net, tmp_path, expected_config={**CONFIG, "hidden_size": 32})
    for needle in ("embed.weight", "scale", "ghost", "head.weight: checkpoint (5, 16) vs model (4, 16)",
                   "hidden_size: checkpoint 16, expected 32"):
        assert needle in message
    assert all(p.is_meta for p in net.parameters())  # nothing was assigned


def test_long_problem_lists_are_truncated(tmp_path):
    save_checkpoint({f"junk.{i}": torch.zeros(1) for i in range(30)} | make_net().state_dict(), tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path)
    assert "unexpected keys (30)" in message
    assert "... and 10 more" in message


# --------------------------------------------------------------------------- config


def test_config_mismatch_names_each_field_with_both_values(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path, CONFIG)
    expected = {**CONFIG, "hidden_size": 32, "attn": {"heads": 4, "window": (4, 4)}}
    message = error_for(meta_net(), tmp_path, expected_config=expected)
    assert "hidden_size: checkpoint 16, expected 32" in message
    assert "attn.heads: checkpoint 2, expected 4" in message
    assert "window" not in message  # a tuple matches the stored JSON list


def test_config_field_absent_on_one_side_is_reported(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path, expected_config={**CONFIG, "patch": 2})
    assert "patch: checkpoint <absent>, expected 2" in message


def test_checkpoint_without_config_is_rejected(tmp_path):
    save_file(make_net().state_dict(), tmp_path / SINGLE_FILE)
    with pytest.raises(CheckpointError, match=CONFIG_KEY):
        read_config(tmp_path)


# --------------------------------------------------------------------------- prefix


def test_prefix_loads_modules_from_one_checkpoint_separately(tmp_path):
    a, b = make_net(hidden=16, seed=1), make_net(hidden=24, seed=2)
    state = {f"a.{k}": v for k, v in a.state_dict().items()} | {f"b.{k}": v for k, v in b.state_dict().items()}
    save_checkpoint(state, tmp_path, CONFIG)

    net_a, net_b = meta_net(hidden=16), meta_net(hidden=24)
    load_into(net_a, tmp_path, prefix="a.")
    load_into(net_b, tmp_path, prefix="b.")
    assert_same_state(net_a, a)
    assert_same_state(net_b, b)


def test_prefix_scopes_unexpected_keys_and_names_full_keys(tmp_path):
    state = {f"a.{k}": v for k, v in make_net().state_dict().items()}
    state["a.stray"] = torch.zeros(1)
    state["other.thing"] = torch.zeros(1)
    del state["a.body.bias"]
    save_checkpoint(state, tmp_path, CONFIG)
    message = error_for(meta_net(), tmp_path, prefix="a.")
    assert "a.body.bias" in message and "a.stray" in message
    assert "other.thing" not in message

    message = error_for(meta_net(), tmp_path, prefix="c.")
    assert "no checkpoint key starts with 'c.'" in message


# --------------------------------------------------------------------------- directories and atomicity


@pytest.mark.parametrize("exists", [True, False])
def test_no_checkpoint_names_the_expected_files(tmp_path, exists):
    directory = tmp_path / "ckpt"
    if exists:
        directory.mkdir()
    for call in (read_config, checkpoint_files, lambda d: load_into(meta_net(), d)):
        with pytest.raises(CheckpointError) as info:
            call(directory)
        assert SINGLE_FILE in str(info.value) and INDEX_FILE in str(info.value)


def test_single_file_and_index_together_are_ambiguous(tmp_path):
    save_checkpoint(make_net().state_dict(), tmp_path / "sharded", CONFIG, max_shard_bytes=600)
    save_checkpoint(make_net().state_dict(), tmp_path / "sharded" / "x", CONFIG)
    os.replace(tmp_path / "sharded" / "x" / SINGLE_FILE, tmp_path / "sharded" / SINGLE_FILE)
    with pytest.raises(CheckpointError, match="ambiguous"):
        read_config(tmp_path / "sharded")


def test_save_replaces_an_existing_checkpoint_cleanly(tmp_path):
    (tmp_path / "README.md").write_text("not ours")
    save_checkpoint(make_net(seed=1).state_dict(), tmp_path, CONFIG, max_shard_bytes=600)
    assert (tmp_path / INDEX_FILE).exists()

    newer = make_net(seed=2)
    save_checkpoint(newer.state_dict(), tmp_path, {**CONFIG, "step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", SINGLE_FILE]
    net = meta_net()
    load_into(net, tmp_path, expected_config={**CONFIG, "step": 2})
    assert_same_state(net, newer)

    # And back to shards: the single file must go, or the directory would be ambiguous.
    save_checkpoint(newer.state_dict(), tmp_path, CONFIG, max_shard_bytes=600)
    assert not (tmp_path / SINGLE_FILE).exists()
    assert read_config(tmp_path) == CONFIG
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_save_writes_nothing(tmp_path):
    state = dict(make_net().state_dict(), step=3)
    with pytest.raises(TypeError, match="step"):
        save_checkpoint(state, tmp_path / "fresh", CONFIG)
    assert not (tmp_path / "fresh" / SINGLE_FILE).exists()

    old = make_net(seed=1)
    save_checkpoint(old.state_dict(), tmp_path / "old", CONFIG)
    with pytest.raises(TypeError):
        save_checkpoint(state, tmp_path / "old", CONFIG)
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [SINGLE_FILE]
    net = meta_net()
    load_into(net, tmp_path / "old")
    assert_same_state(net, old)


def test_failed_write_leaves_no_staging_behind(tmp_path):
    with pytest.raises(TypeError):  # safetensors itself rejects the key, mid-write
        save_checkpoint({5: torch.zeros(2)}, tmp_path, CONFIG)
    with pytest.raises(TypeError):
        save_checkpoint({"w": torch.zeros(2)}, tmp_path, {"not json": object()})
    with pytest.raises(ValueError, match="meta"):
        save_checkpoint({"w": torch.zeros(2, device="meta")}, tmp_path, CONFIG)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        save_checkpoint({"w": torch.zeros(2)}, tmp_path, CONFIG, max_shard_bytes=0)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- shared tensors


def test_shared_and_non_contiguous_tensors_are_saved_as_copies(tmp_path):
    weight = torch.arange(24.0).reshape(4, 6)
    state = {"tied.a": weight, "tied.b": weight, "view": weight[:2], "transposed": weight.t()}
    save_checkpoint(state, tmp_path, {})
    loaded = load_file(tmp_path / SINGLE_FILE)
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    assert os.path.getsize(tmp_path / SINGLE_FILE) > 3 * weight.nbytes
