"""Per-step cost of a caching pack whose documents skip or compute, against the same pack without a cache.

    python -m benchmarks.step_cache_step --quick [--json PATH]   # CPU
    python -m benchmarks.step_cache_step --gpu [--json PATH]     # CUDA, the released width (benchmarks/gpu_session.sh)

One pack of four T2VA documents on a MiniMax-H3 of random weights in the released block layout (at a CPU-sized
width with ``--quick``; with ``--gpu`` at the released width, 4 blocks, bf16 with diffusers' fp32 modules). The
same pack runs ``packed_forward`` without a cache, and with every document on F1B0 (the built-in tiers' shape:
the first block decides, the other blocks are the middle): all four computing, two skipping and two computing,
all four skipping. Each caching case first takes one warm-up forward (computed: residuals kept), then the cases
are interleaved rep by rep, so load drift hits them alike. Skipping or computing is forced (a policy that always
skips, one that never leaves its warm-up), so the table is the cost of what the decisions do, not of a tier.

From the four blocks measured here, the fixed cost (embeddings, text refiner, output heads) and one block's cost
follow (off = fixed + 4 blocks; all skipping = fixed + 1 block + the cached middles' adds); the table projects them
to the released depth of 50 blocks. Only h3serve/pipelines/ and torch are imported (no Ray): it runs on the lent GPU
machine.
"""

from __future__ import annotations

import functools

import torch

from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.step_cache import DocumentCache, PackCache, StepCachePolicy

from .harness import interleaved, machine, median, say, table, width_main
from .lora_step import model_and_pack

BLOCKS, RELEASED_BLOCKS = 4, 50
SKIPS = StepCachePolicy(threshold=1e9, warmup_steps=1, max_consecutive_skips=10**6)  # after its warm-up: always
COMPUTES = StepCachePolicy(threshold=0.0, warmup_steps=10**6)  # never leaves its warm-up: always computes
CASES: dict[str, tuple[StepCachePolicy, ...] | None] = {
    "off": None,
    "cached, 4 compute": (COMPUTES,) * 4,
    "cached, 2 skip + 2 compute": (SKIPS, SKIPS, COMPUTES, COMPUTES),
    "cached, 4 skip": (SKIPS,) * 4,
}


def run(quick: bool, gpu: bool = False, smoke: bool = False) -> dict:
    config, model, docs, pack, device, dtype = model_and_pack(quick, gpu, smoke, num_layers=BLOCKS)
    caches = {
        name: [DocumentCache(policy) for policy in policies] if policies else None for name, policies in CASES.items()
    }

    decisions: dict[str, list[bool]] = {}

    def step(name: str) -> None:
        """One forward of the pack in case ``name``; each document's decision (skipped) for the caching cases."""
        states = caches[name]
        with torch.no_grad():
            packed_forward(model, pack, cache=PackCache(states) if states else None)
        if gpu:
            torch.cuda.synchronize()  # the step's kernels are done before the clock stops
        decisions[name] = [state.skipped[-1] for state in states] if states else []

    for name in CASES:  # warm-up: every caching document computes and keeps residuals
        step(name)
    reps = 2 if smoke else 9
    times = interleaved({name: functools.partial(step, name) for name in CASES}, reps)

    ms = {name: median(v) for name, v in times.items()}
    block = (ms["off"] - ms["cached, 4 skip"]) / (BLOCKS - 1)  # a whole pack's block: what skipping every middle saves
    fixed = ms["off"] - BLOCKS * block
    skipping = {name: sum(d) / len(d) if d else 0.0 for name, d in decisions.items()}
    projected = {
        name: fixed + block + (RELEASED_BLOCKS - 1) * (ms[name] - fixed - block) / (BLOCKS - 1) for name in CASES
    }
    rows = [
        [name, skipping[name], ms[name], ms[name] / ms["off"], projected[name], projected[name] / projected["off"]]
        for name in CASES
    ]
    say(
        f"pack: {len(docs)} documents, {pack.total_rows} rows, hidden {config['hidden_size']}, {BLOCKS} blocks, "
        f"{torch.get_num_threads()} torch threads, {reps} interleaved reps, {device} {str(dtype).split('.')[-1]}"
    )
    table(
        ["pack", "documents skipping", "ms/step", "x off", f"ms/step at {RELEASED_BLOCKS} blocks", "x off"],
        rows,
        title=f"step caching, F1B0, forced decisions ({'CUDA, released width' if gpu else 'CPU'}); "
        f"{RELEASED_BLOCKS} blocks projected from fixed {fixed:.1f} ms + {block:.1f} ms a block",
    )
    expected = {name: [policy is SKIPS for policy in policies] if policies else [] for name, policies in CASES.items()}
    ok = decisions == expected  # every document decided as its forced policy says
    say(f"decisions as forced: {'YES' if ok else 'NO'}")
    return {
        "ok": ok,
        "machine": machine(),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "rows": pack.total_rows,
        "config": config,
        "fixed_ms": fixed,
        "block_ms": block,
        "cases": [
            {
                "case": name,
                "skipping": skipping[name],
                "median_ms": ms[name],
                "times_ms": times[name],
                "ratio": ms[name] / ms["off"],
                "projected_ms": projected[name],
                "projected_ratio": projected[name] / projected["off"],
            }
            for name in CASES
        ],
    }


WHAT_GPU_MEASURES = (
    "ms per packed forward of 4 T2VA documents (768x1344, 22 frames) at the released width (4 blocks, bf16): no "
    "cache, and F1B0 caching with 0, 2 and 4 documents skipping their middle blocks; projected to 50 blocks"
)


main = width_main(__doc__, "step_cache_step", WHAT_GPU_MEASURES, run, __name__)
