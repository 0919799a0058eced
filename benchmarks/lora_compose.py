"""Per-step cost of composed LoRA requests (issue 57): several adapters per request at their own weights, co-batched.

    python -m benchmarks.lora_compose [--quick | --smoke] [--json PATH]   # CPU; --smoke: CI's seconds

One pack of four T2VA documents on a MiniMax-H3 of random weights in the released block layout at a CPU-sized width
(``benchmarks.lora_step``'s model and pack, fp32, one torch thread by default), three rank-16 adapters of every block
linear. Interleaved rep by rep, so load drift hits every case alike:

  base only            the pack without adapters
  single adapters      one document on the base model, three each on one adapter (today's one adapter per request)
  composed lists       the same pack, the three documents each composing two of the adapters at their own weights
                       (``adapting(..., compositions)``: each adapter's GEMMs on its rows, twice the delta work)
  merged per request   what a user does by hand without composition: for each document, its adapters' deltas fused
                       into the weights (W += w * scaling * B @ A on every adapted layer), the document run alone,
                       the weights restored from a copy; four forwards and three merge/restore rounds per step

Each composed document's output is compared with its merged-per-request output (max |diff|, fp32). Only
h3serve/pipelines/ and torch are imported.
"""

from __future__ import annotations

import argparse
import functools

import torch

from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.lora import BASE_SLOT, LoraAdapter, adapting, pack_slots
from h3serve.pipelines.h3.packing import pack_documents

from .harness import cli, interleaved, machine, median, say, table, torch_threads
from .lora_step import model_and_pack, random_adapter

RANK = 16
# the three adapted documents' lists: (adapter slot, weight); document 0 is on the base model
COMPOSED = (((1, 0.8), (2, 0.5)), ((2, 1.0), (3, -0.6)), ((1, 0.4), (3, 1.2)))
SINGLE = (((1, 0.8),), ((2, 1.0),), ((3, 1.2),))


def merged(model: torch.nn.Module, adapters: dict[int, LoraAdapter], uses) -> dict[str, torch.Tensor]:
    """Fuse ``uses``' deltas into ``model``'s weights; returns the originals to restore."""
    modules = dict(model.named_modules())
    saved: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for slot, weight in uses:
            for name, layer in adapters[slot].layers.items():
                w = modules[name].weight  # [out, in]
                saved.setdefault(name, w.detach().clone())
                w.add_(layer.up @ layer.down, alpha=weight * layer.scaling)  # [out, r] @ [r, in]
    return saved


def restore(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, weight in saved.items():
            modules[name].weight.copy_(weight)


def run(quick: bool = True, smoke: bool = False) -> dict:
    config, model, docs, pack, _, _ = model_and_pack(quick or smoke, gpu=False, smoke=smoke)
    adapters = {s: random_adapter(model, RANK, seed=100 + s) for s in (1, 2, 3)}
    slots = pack_slots(pack, [BASE_SLOT, 1, 2, 3])  # document i + 1 runs composition i + 1
    single = {i: uses for i, uses in enumerate(SINGLE, 1)}
    composed = {i: uses for i, uses in enumerate(COMPOSED, 1)}
    alone = [pack_documents([doc]) for doc in docs]

    def packed(compositions) -> list:
        with torch.no_grad():
            if compositions is None:
                return pack.split(*packed_forward(model, pack))
            with adapting(model, adapters, slots, compositions):
                return pack.split(*packed_forward(model, pack))

    def by_hand() -> list:
        outputs = []
        with torch.no_grad():
            for doc_pack, uses in zip(alone, ((), *COMPOSED), strict=True):
                saved = merged(model, adapters, uses)
                try:
                    outputs.append(doc_pack.split(*packed_forward(model, doc_pack))[0])
                finally:
                    restore(model, saved)
        return outputs

    cases = {
        "base only": functools.partial(packed, None),
        "single adapters (1 a request)": functools.partial(packed, single),
        "composed lists (2 a request)": functools.partial(packed, composed),
        "composed, merged per request by hand": by_hand,
    }
    for case in cases.values():  # warm-up
        case()
    reps = 3 if smoke else 7
    times = interleaved(cases, reps)

    # the co-batched composition against the user's own merge, document by document
    together, one_by_one = packed(composed), by_hand()
    diffs = [
        max((a - b).abs().max().item() for a, b in zip(x, y, strict=True))
        for x, y in zip(together, one_by_one, strict=True)
    ]
    base_ms = median(times["base only"])
    rows, results = [], []
    for label, ts in times.items():
        ms = median(ts)
        rows.append([label, ms, ms / base_ms, min(ts)])
        results.append({"case": label, "median_ms": ms, "min_ms": min(ts), "ratio": ms / base_ms, "times_ms": ts})
    say(
        f"pack: {len(docs)} documents, {pack.total_rows} rows, hidden {config['hidden_size']}, "
        f"{config['num_layers']} blocks, rank {RANK} adapters of every block linear, {torch.get_num_threads()} torch "
        f"threads, {reps} interleaved reps, cpu float32"
    )
    table(
        ["pack", "ms/step (median)", "x base-only", "ms/step (min)"],
        rows,
        title="Composed LoRA requests: one packed step (CPU)",
    )
    say(f"composed co-batched vs merged by hand, max |diff| per document: {', '.join(f'{d:.1e}' for d in diffs)}")
    return {
        "ok": max(diffs) < 1e-3,
        "machine": machine(),
        "rows": pack.total_rows,
        "config": config,
        "cases": results,
        "max_diff_vs_merged": diffs,
    }


def options(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="hidden 512 (else 1024)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")


def run_args(args: argparse.Namespace) -> dict:
    with torch_threads(args.threads):
        return run(args.quick, args.smoke)


main = cli(__doc__, run_args, options, __name__)
