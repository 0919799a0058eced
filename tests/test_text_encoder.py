"""The tiny text encoder keeps prompts and tokens apart where H3 reads it (``hidden_states[50]``).

The library's initialisation collapsed them (per-position cosine of the two prompts 0.86 at layer 50
against 0.38 at the embeddings, a prompt's own tokens 0.79): ``keep_tokens_apart`` in the writer.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.pipelines.h3.checkpoint import CheckpointIndex, ImageOnlyQwen3VLProcessor, load_model, load_tokenizer
from h3serve.pipelines.h3.memory import TEXT_ENCODER_LAYER as READ_LAYER  # MiniMax-H3's text_encoder_layer, 50

PROMPT_A = "a red circle moving left with a high beep"  # benchmarks.text_encoder's two prompts
PROMPT_B = "a blue square moving right with a low hum"


def hidden_states(text_encoder, tokenizer, prompt: str, layer: int) -> torch.Tensor:
    """[tokens, width] hidden state ``layer`` of ``prompt``, through diffusers' H3 encoder call."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    token_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    processor = ImageOnlyQwen3VLProcessor(tokenizer, image_processor=None)  # only its token types are used
    with torch.no_grad():
        embeds = get_qwen3vl_prompt_embeds(
            text_encoder, processor, token_ids, {}, text_encoder_layer=layer, device=text_encoder.device
        )
    return embeds[0].float()


@pytest.fixture(scope="module")
def written(tiny_checkpoint):
    index = CheckpointIndex(tiny_checkpoint)
    return (
        load_model(index, "text_encoder", torch.float32, "cpu"),
        load_tokenizer(index),
        load_model(index, "transformer", torch.float32, "cpu"),
    )


@pytest.mark.slow  # a process of its own: the benchmark, as a user runs it
def test_layer_50_of_the_written_checkpoint_stays_as_far_apart_as_the_embeddings(tiny_checkpoint, tmp_path):
    """``python -m benchmarks.text_encoder --checkpoint`` (the cosines of six prompts) on the written checkpoint."""
    out = tmp_path / "text_encoder.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.text_encoder", "--checkpoint", str(tiny_checkpoint), "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    cosines = json.loads(out.read_text())["results"][f"checkpoint {tiny_checkpoint.name}"]
    embeddings, layer = cosines["embeddings"], cosines[f"layer {READ_LAYER}"]
    assert layer["per_position_mean"] < 0.6  # the library's initialisation: 0.86
    assert abs(layer["per_position_mean"] - embeddings["per_position_mean"]) < 0.05
    assert layer["pooled_max"] < 0.8  # 0.97
    assert layer["within_prompt"] < 0.2  # 0.79
    # what the transformer makes of it first: its context_embedder's bias no longer outweighs the tokens (0.98)
    assert cosines["context_embedder"]["per_position_mean"] < 0.6


def test_the_prompts_differ_where_their_words_do(written):
    text_encoder, tokenizer, _ = written
    a, b = (hidden_states(text_encoder, tokenizer, p, READ_LAYER) for p in (PROMPT_A, PROMPT_B))
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # [tokens], the two prompts' words align
    same_word = torch.tensor([x == y for x, y in zip(PROMPT_A.split(), PROMPT_B.split(), strict=True)])
    assert same_word.any() and (~same_word).any()
    assert cosine[~same_word].max() < 0.6  # red/blue, circle/square, left/right, high/low, beep/hum
    assert cosine[same_word].min() > 0.9  # "a", "moving", "with": the context changes them only a little


def test_the_text_encoder_stays_a_trainable_qwen3_vl_in_the_released_layout(written):
    text_encoder, _, _ = written
    assert type(text_encoder).__name__ == "Qwen3VLForConditionalGeneration"  # load_model read it strictly
    layers = text_encoder.model.language_model.layers
    assert len(layers) > READ_LAYER
    for layer in layers:
        for branch in (layer.self_attn.o_proj, layer.mlp.down_proj):  # small, never zero: gradients still flow
            assert 0 < branch.weight.std() < 0.2 * layer.self_attn.q_proj.weight.std()
    embeddings = text_encoder.model.language_model.embed_tokens.weight
    assert embeddings.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=1e-3)
