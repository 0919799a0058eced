"""Admission reads the checkpoint's own geometry (issue 43): what a preset refuses, what ``model: auto`` serves, and
what no model may serve (a checkpoint inconsistent in itself). In process, no Ray: the platform is given, so the
checkpoint is read here as ``h3serve admit`` reads it. Refusals through the CLI, Serve and HTTP are in
tests/test_deploy_admission.py and tests/test_deploy_checkpoint.py."""

import re
import shutil
from pathlib import Path

import pytest
from diffusers import MiniMaxH3Transformer3DModel

from h3serve.attention import Platform
from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.driver.preflight import admit
from h3serve.pipelines.h3 import CheckpointMismatch, DeploymentConfigError, TransformerGeometry, preset
from h3serve.pipelines.h3.checkpoint import write_tiny_checkpoint
from tests.harness import FOREIGN_DIMS

FOREIGN = TransformerGeometry(num_heads=4, head_dim=24, num_layers=3, hidden_size=64)


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("geometry") / "foreign", with_ref=True, transformer=FOREIGN_DIMS
    )


def decide(**args):
    """admit() on this CPU, the checkpoint read here as `h3serve admit` reads it; one decision counted."""
    recorded: list[dict[str, str]] = []
    try:
        return admit(DeployArgs(api_key_env=None, **args), "preflight", Platform.cpu(), record=recorded.append)
    finally:
        assert [tags["stage"] for tags in recorded] == ["preflight"]


def with_transformer(foreign: Path, tmp_path: Path, partition: str, **config) -> Path:
    """A copy of ``foreign`` whose ``partition`` is another transformer, saved by diffusers' save_pretrained."""
    copy = tmp_path / "copy"
    shutil.copytree(foreign, copy)
    shutil.rmtree(copy / partition)
    tiny = {**preset("tiny").transformer, **FOREIGN_DIMS, **config}
    MiniMaxH3Transformer3DModel(**tiny).save_pretrained(copy / partition)
    return copy


def test_the_checkpoint_geometry_is_admitted_not_the_presets(foreign):
    admission = decide(model="auto", checkpoint=str(foreign))
    assert admission.geometry == FOREIGN and admission.checkpoint is not None
    assert admission.checkpoint.read_on == "the driver" and admission.checkpoint.partitions == (
        "transformer",
        "transformer_ref",
    )
    spec = DeployArgs(model="auto", checkpoint=str(foreign)).replica_spec(admission.resolution, admission.geometry)
    assert spec.geometry == FOREIGN and spec.model_name == "foreign"  # the directory's name: no preset's
    with pytest.raises(CheckpointMismatch) as refused:
        decide(model="tiny", checkpoint=str(foreign))
    assert refused.value.reason == "checkpoint"
    assert str(refused.value).startswith(
        f"model='tiny' names the minimax-h3-tiny architecture (4 heads x 32, 4 layers, "
        f"hidden 96), but checkpoint {foreign / 'transformer'} (read on the driver) "
        "has 4 heads x 24, 3 layers, hidden 64"
    )
    built_in = decide()  # model tiny on the built-in checkpoint, read like any other
    assert built_in.checkpoint is not None and built_in.geometry == preset("tiny").geometry()
    assert decide(model="auto", checkpoint=built_in.checkpoint.directory).geometry == built_in.geometry


def test_auto_sizes_the_sp_layout_and_the_step_cache_by_the_checkpoints_dims(foreign):
    with pytest.raises(DeploymentConfigError, match=r"sp_degree=3 must divide the transformer's 4 attention heads"):
        decide(model="auto", checkpoint=str(foreign), sp_degree=3)
    # fn_blocks 2 + bn_blocks 1 leave a block of the preset's 4, none of the checkpoint's 3
    tiers = {"engine": {"step_cache": {"tiers": {"deep": {"threshold": 0.1, "fn_blocks": 2, "bn_blocks": 1}}}}}
    DeployArgs(**tiers)  # valid for the tiny preset
    with pytest.raises(DeploymentConfigError, match=r"engine.step_cache.tiers.deep: .* transformer of 3 blocks"):
        decide(model="auto", checkpoint=str(foreign), **tiers)


@pytest.mark.parametrize(
    "partition, config, words",
    [
        (
            "transformer_ref",
            dict(attention_head_dim=32),
            "transformer_ref (read on the driver) has 4 heads x 32, 3 layers",
        ),
        ("transformer", dict(text_dim=48), "has text_dim=48, but its text_encoder text_config.hidden_size is 32"),
        ("transformer", dict(in_channels=4), "has in_channels=4, but its vae latent_channels is 8"),
    ],
    ids=["partitions disagree", "text width", "latent channels"],
)
def test_a_checkpoint_inconsistent_in_itself_is_refused_whatever_the_model(foreign, tmp_path, partition, config, words):
    copy = with_transformer(foreign, tmp_path, partition, **config)
    with pytest.raises(CheckpointMismatch, match=re.escape(words)) as refused:
        decide(model="auto", checkpoint=str(copy))
    assert str(copy / partition) in str(refused.value)


def test_an_unreadable_or_broken_checkpoint(foreign, tmp_path):
    """Not on this node and no probe ran: a preset is admitted for its own geometry (each replica checks its copy);
    auto has none to fall back on. On this node but broken: refused, naming what is missing."""
    nowhere = str(tmp_path / "nowhere")
    admission = decide(model="tiny", checkpoint=nowhere)
    assert admission.geometry == preset("tiny").geometry() and admission.checkpoint is None
    with pytest.raises(CheckpointMismatch, match="is not readable here and no platform probe read it"):
        decide(model="auto", checkpoint=nowhere)
    broken = tmp_path / "broken"
    shutil.copytree(foreign, broken)
    shutil.rmtree(broken / "vae")
    with pytest.raises(CheckpointMismatch, match=f"{broken / 'vae'} is missing"):
        decide(model="auto", checkpoint=str(broken))
    (broken / "transformer_ref" / "config.json").unlink()
    with pytest.raises(CheckpointMismatch, match=f"{broken / 'transformer_ref'} has no readable"):
        decide(model="tiny", checkpoint=str(broken))
