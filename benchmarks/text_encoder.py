"""How far apart the tiny text encoder keeps prompts and tokens where H3 reads it (``hidden_states[50]``).

    python -m benchmarks.text_encoder [--checkpoint DIR] [--seed S] [--json PATH]

Side by side in one run: the tiny Qwen3-VL as transformers initialises it (the writer before
``keep_tokens_apart``, built in memory for the same seed) and the text encoder of a checkpoint on disk
(default: the built-in tiny one that ``h3serve weights`` writes; any checkpoint in the released layout).
Each goes through diffusers' own ``get_qwen3vl_prompt_embeds``, the call H3's encoder block makes, at
layer 0 (the token embeddings) and layer 50. Numbers, all cosines:

- per-position: prompt A's token i against prompt B's token i (mean, min, max over positions);
- pooled: the mean over tokens of A against B's, and the range over every pair of a few prompts;
- within-prompt: every pair of different positions of one prompt (mean over the prompts);
- and the per-position and within-prompt cosines after the checkpoint transformer's ``context_embedder``,
  the first thing H3 does with the text (its bias is shared by every token).

A collapsed encoder shows layer-50 cosines near 1 while the embeddings' are far below. ``ok`` is
false when the checkpoint's layer-50 per-position cosine of A and B exceeds its embeddings' by more
than 0.1.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from .harness import cli, say, table

PROMPT_A = "a red circle moving left with a high beep"
PROMPT_B = "a blue square moving right with a low hum"
PROMPTS = (
    PROMPT_A,
    PROMPT_B,
    "a green triangle moving up with silence",
    "a yellow square still with a low hum",
    "a lighthouse at dusk with waves",
    "a red fox",
)
READ_LAYER = 50  # MiniMax-H3's text_encoder_layer
MAX_DRIFT = 0.1  # ok: layer 50's per-position cosine of A and B at most this much above the embeddings'


def hidden_states(text_encoder, tokenizer, prompt: str, layer: int) -> torch.Tensor:
    """[tokens, width] hidden state ``layer`` of ``prompt``, through diffusers' H3 encoder call."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    from h3serve.pipelines.h3.checkpoint import ImageOnlyQwen3VLProcessor

    token_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    processor = ImageOnlyQwen3VLProcessor(tokenizer, image_processor=None)  # only its token types are used
    with torch.no_grad():
        embeds = get_qwen3vl_prompt_embeds(
            text_encoder, processor, token_ids, {}, text_encoder_layer=layer, device=text_encoder.device
        )
    return embeds[0].float()


def within_prompt(x: torch.Tensor) -> float:
    """Mean cosine between different positions of one prompt's [tokens, width] states."""
    unit = F.normalize(x, dim=-1)
    gram = unit @ unit.T  # [tokens, tokens]
    n = x.shape[0]
    return float((gram.sum() - gram.diagonal().sum()) / (n * n - n))


def similarities(states: dict[str, torch.Tensor]) -> dict[str, float]:
    """The cosines of one layer's states of PROMPTS (by prompt)."""
    a, b = states[PROMPT_A], states[PROMPT_B]
    n = min(a.shape[0], b.shape[0])
    per_position = F.cosine_similarity(a[:n], b[:n], dim=-1)  # [n]
    pooled = [
        float(F.cosine_similarity(states[p].mean(0), states[q].mean(0), dim=0))
        for p, q in itertools.combinations(PROMPTS, 2)
    ]
    return {
        "per_position_mean": float(per_position.mean()),
        "per_position_min": float(per_position.min()),
        "per_position_max": float(per_position.max()),
        "pooled_ab": float(F.cosine_similarity(a.mean(0), b.mean(0), dim=0)),
        "pooled_min": min(pooled),
        "pooled_max": max(pooled),
        "within_prompt": sum(within_prompt(s) for s in states.values()) / len(states),
    }


def measure(text_encoder, tokenizer, context_embedder) -> dict[str, dict[str, float]]:
    embeddings = {p: hidden_states(text_encoder, tokenizer, p, 0) for p in PROMPTS}
    read = {p: hidden_states(text_encoder, tokenizer, p, READ_LAYER) for p in PROMPTS}
    with torch.no_grad():  # what H3's transformer makes of layer 50 first: [tokens, hidden]
        projected = {p: context_embedder(x.to(context_embedder.weight.dtype)) for p, x in read.items()}
    return {
        "embeddings": similarities(embeddings),
        f"layer {READ_LAYER}": similarities(read),
        "context_embedder": similarities(projected),
    }


def run(checkpoint: str | None = None, seed: int = 0) -> dict:
    from h3serve.pipelines.h3.checkpoint import (
        CheckpointIndex,
        load_model,
        load_tokenizer,
        random_tiny_checkpoint,
        tiny_components,
    )

    directory = Path(checkpoint) if checkpoint else random_tiny_checkpoint(seed)
    index = CheckpointIndex(directory)
    served_transformer = load_model(index, "transformer", torch.float32, "cpu")
    library = tiny_components(seed, library_text_init=True)
    encoders = {
        f"library init (seed {seed})": (library["text_encoder"].eval(), library["tokenizer"]),
        f"checkpoint {directory.name}": (
            load_model(index, "text_encoder", torch.float32, "cpu"),
            load_tokenizer(index),
        ),
    }
    results = {
        name: measure(encoder, tokenizer, served_transformer.context_embedder)
        for name, (encoder, tokenizer) in encoders.items()
    }
    say(f"A = {PROMPT_A!r}\nB = {PROMPT_B!r}\npooled range over every pair of {len(PROMPTS)} prompts: {PROMPTS}")
    rows = [
        [
            name,
            where,
            s["per_position_mean"],
            s["per_position_min"],
            s["per_position_max"],
            s["pooled_ab"],
            f"{s['pooled_min']:.2f}-{s['pooled_max']:.2f}",
            s["within_prompt"],
        ]
        for name, by_layer in results.items()
        for where, s in by_layer.items()
    ]
    table(
        ["text encoder", "where", "A/B pos mean", "min", "max", "A/B pooled", "pooled range", "within prompt"],
        rows,
        title="cosine similarities (1 = indistinguishable)",
    )
    served = results[f"checkpoint {directory.name}"]
    drift = served[f"layer {READ_LAYER}"]["per_position_mean"] - served["embeddings"]["per_position_mean"]
    ok = drift <= MAX_DRIFT
    say(
        f"checkpoint: layer {READ_LAYER} per-position cosine is {drift:+.3f} from the embeddings' -> "
        + ("ok" if ok else "COLLAPSED")
    )
    return {"benchmark": "text_encoder", "checkpoint": str(directory), "seed": seed, "results": results, "ok": ok}


def options(ap) -> None:
    ap.add_argument("--checkpoint", help="checkpoint directory (default: the built-in tiny one)")
    ap.add_argument("--seed", type=int, default=0, help="the tiny writer's seed (library init and default checkpoint)")


main = cli(__doc__, lambda args: run(args.checkpoint, args.seed), options, __name__)
