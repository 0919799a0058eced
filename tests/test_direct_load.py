"""Every component is read straight onto its device, never built on the host and moved; Qwen3-VL only through the
layer H3 reads. The ``meta`` device tells them apart on a CPU machine: a direct load puts every weight there
without a move, a load-then-move would make a host copy first and move it (the spy below sees the move)."""

import pytest
import torch

from h3serve.pipelines.h3 import checkpoint as ckpt
from h3serve.pipelines.h3.stage_models import load_stage_components
from h3serve.pipelines.h3.stages import text_encoder_layers


@pytest.fixture
def moves(monkeypatch):
    """Every ``nn.Module.to`` that changed a parameter's device: (class name, from devices, to devices)."""
    seen: list[tuple[str, set[str], set[str]]] = []
    real_to = torch.nn.Module.to

    def spying_to(module, *args, **kwargs):
        before = {p.device.type for p in module.parameters()}
        out = real_to(module, *args, **kwargs)
        after = {p.device.type for p in module.parameters()}
        if before != after:
            seen.append((type(module).__name__, before, after))
        return out

    monkeypatch.setattr(torch.nn.Module, "to", spying_to)
    return seen


def test_the_spy_sees_a_load_then_move(moves, tiny_checkpoint):
    model = ckpt.load_model(ckpt.CheckpointIndex(tiny_checkpoint), "vae", torch.float32, "cpu")
    model.to("meta")
    assert moves == [("AutoencoderKLMiniMaxH3", {"cpu"}, {"meta"})]


@pytest.mark.parametrize("name", ["transformer", "vae", "audio_vae", "text_encoder"])
def test_every_model_component_loads_straight_onto_its_device(moves, tiny_checkpoint, name):
    model = ckpt.load_model(ckpt.CheckpointIndex(tiny_checkpoint), name, torch.bfloat16, "meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert moves == []


def test_a_stage_loads_every_model_straight_onto_its_device_and_qwen_only_to_the_layer_h3_reads(moves, tiny_checkpoint):
    index = ckpt.CheckpointIndex(tiny_checkpoint)
    components = load_stage_components(index, "meta", "bfloat16", "bfloat16", text_encoder=True)
    models = {n: m for n, m in components.items() if isinstance(m, torch.nn.Module)}
    assert set(models) == {"vae", "audio_vae", "text_encoder"}
    assert all({p.device.type for p in m.parameters()} == {"meta"} for m in models.values())
    assert moves == []
    assert len(models["text_encoder"].model.language_model.layers) == text_encoder_layers() == 51


def test_qwen_built_to_a_layer_equals_the_whole_stack_at_that_layer(tiny_checkpoint):
    """The later layers are never built (nor read), and the hidden state H3 would read is the same bits."""
    index = ckpt.CheckpointIndex(tiny_checkpoint)
    whole = ckpt.load_model(index, "text_encoder", torch.float32, "cpu")
    short = ckpt.load_model(index, "text_encoder", torch.float32, "cpu", text_layers=3)
    assert len(short.model.language_model.layers) == short.config.text_config.num_hidden_layers == 3
    assert len(whole.model.language_model.layers) > 3
    ids = torch.tensor([[3, 5, 7, 9]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_hidden_states=True)
    with torch.no_grad():
        kwargs["mm_token_type_ids"] = torch.zeros_like(ids)
        theirs, ours = (m.model(**kwargs).hidden_states[2] for m in (whole, short))
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
    with pytest.raises(ValueError, match="text encoder"):
        ckpt.load_model(index, "vae", torch.float32, "cpu", text_layers=3)
