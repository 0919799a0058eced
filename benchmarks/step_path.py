"""The per-step data path of an SP replica (issue 38): bytes through Ray, and how long the event loop is blocked.

1. Bytes per step at the released size, from the real pack: 8 T2VA requests of 1344x768, 124 frames, laid out by
   diffusers' builders (``h3serve.pipelines.h3.shapes``), packed for sp=4. *Before* (to 72d41b8): rank 0 copied the pack
   to
   the host and ``ray.put`` it (its pickle, what the object store held); *after*: each worker gets a ``StepOrder``
   (the pack's layout, the step-cache mirror: host metadata), inlined in the call below Ray's 100 KiB inline limit,
   and the pack's tensors come by one broadcast over the group's own backend (NCCL on GPU).
2. The event loop's longest block per step on the tiny default (the default deploy args' engine, 8 requests of the
   model's own canvas and 16 steps in one pack) at sp=1 and sp=2: every callback the replica's loop runs
   while requests step is timed (``asyncio.Handle._run``): its wall time and the loop thread's own CPU time (the wall
   time of a callback also counts waiting for the GIL while the model thread runs Python). The engine code measured
   is whatever ``replicas`` imports: run with ``PYTHONPATH`` at an older tree (``git archive``) for *before*.

``python -m benchmarks.step_path [--bytes-only | --loop-only] [--smoke] [--json PATH]``
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import statistics
import time

from benchmarks.harness import cli, say

RELEASED_CLIP = (1344, 768, 124)
RELEASED_REQUESTS, RELEASED_SP = 8, 4
INLINE_LIMIT = 100 * 1024  # Ray's max_direct_call_object_size: smaller call arguments travel inline, not in the store


def step_bytes(smoke: bool = False) -> dict:
    """Ray bytes of one step at sp=4 for a pack of 8 released-size requests, before and after."""
    import torch

    from h3serve.pipelines.h3.packing import flatten_pack, pack_documents
    from h3serve.pipelines.h3.shapes import Clip, clip_document, transformer_config
    from h3serve.pipelines.h3.step_cache import BUILTIN_TIERS, CachedPack, CacheMirrorWriter, DocumentCache, PackCache
    from h3serve.replicas.worker_group import StepOrder

    config = transformer_config("tiny" if smoke else "full")
    width, height, frames = (64, 64, 124) if smoke else RELEASED_CLIP
    clip = Clip(width, height, frames)
    documents = [clip_document(config, clip, progress=(i + 1) / 10, seed=i) for i in range(RELEASED_REQUESTS)]
    for document in documents:  # as diffusers' text encoder leaves them on a GPU replica
        document.prompt_embeds = document.prompt_embeds.to(torch.bfloat16)
    pack = pack_documents(documents, row_multiple=RELEASED_SP)
    caches = PackCache([DocumentCache(BUILTIN_TIERS["medium"]) for _ in documents])
    cached = CachedPack.of(pack, caches)
    before = {
        "no caching": len(pickle.dumps(pack.to("cpu"), protocol=5)),
        "every request caching": len(
            pickle.dumps(CachedPack.of(pack.to("cpu"), mirror=CacheMirrorWriter().mirror(caches)), protocol=5)
        ),
    }
    layout, flat = flatten_pack(pack)
    after = {
        "no caching": StepOrder(1, layout, None, 30.0).nbytes,
        "every request caching": StepOrder(1, layout, CacheMirrorWriter().mirror(cached.step_cache), 30.0).nbytes,
    }
    workers = RELEASED_SP - 1
    result = {
        "clip": str(clip),
        "requests": RELEASED_REQUESTS,
        "sp": RELEASED_SP,
        "rows": pack.total_rows,
        "before_object_store_bytes": before,  # one ray.put per step, read by every worker
        "after_ray_bytes_per_worker": after,  # inlined in each worker's call: no object store at all
        "after_ray_bytes_per_step": {k: workers * v for k, v in after.items()},
        "after_broadcast_bytes": int(flat.numel()),  # over the group's backend, from rank 0
    }
    result["ok"] = all(v <= 64 * 1024 and v < INLINE_LIMIT for v in result["after_ray_bytes_per_step"].values())
    say(
        f"{RELEASED_REQUESTS} x {clip} at sp={RELEASED_SP} ({pack.total_rows:,} rows): before, the object store "
        f"got {before['no caching']:,} B a step ({before['every request caching']:,} B all caching); after, "
        f"{after['no caching']:,} B ({after['every request caching']:,} B) inline per worker, "
        f"{workers} workers, and {flat.numel():,} B broadcast over the group"
    )
    return result


class LoopBlocks:
    """Every callback the running loop runs, timed: wall seconds and the loop thread's CPU seconds."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.recording = False

    @contextlib.contextmanager
    def patched(self):
        handle = asyncio.events.Handle
        run = handle._run

        def timed(h):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return run(h)
            finally:
                if self.recording:
                    self.wall.append(time.perf_counter() - wall)
                    self.cpu.append(time.thread_time() - cpu)

        handle._run = timed  # type: ignore[method-assign]
        try:
            yield self
        finally:
            handle._run = run  # type: ignore[method-assign]


def loop_blocks(sp: int, smoke: bool = False) -> dict:
    """The loop's callbacks while 8 default requests step on an sp-rank group (the engine's model thread busy)."""
    from benchmarks.harness import tiny_spec
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.pipelines.h3 import GenerationRequest
    from h3serve.replicas import Engine, WorkerGroup

    group = WorkerGroup.create(tiny_spec(sp=sp, rank_cpus=0.5))
    limits = DeployArgs().engine.model_copy(update={"max_active": 8})
    steps = 4 if smoke else 16
    requests = [
        GenerationRequest(prompt=f"a coloured shape, take {i}", seed=i, num_inference_steps=steps) for i in range(8)
    ]
    blocks = LoopBlocks()

    async def scenario() -> tuple[int, float]:
        engine = Engine(group, limits)
        engine.warm_up()
        tickets = [engine.submit(r) for r in requests]
        while not any(t.forwards for t in tickets):
            await asyncio.sleep(0.001)
        blocks.recording = True  # from the first step on: prepares are on the stage worker's thread already
        started = engine.stats.forwards
        await asyncio.gather(*(t.future for t in tickets))
        blocks.recording = False
        return engine.stats.forwards - started, engine.stats.forward_s

    try:
        with blocks.patched():
            forwards, _ = asyncio.run(scenario())
    finally:
        group.shutdown()
    wall_ms, cpu_ms = [1e3 * s for s in blocks.wall], [1e3 * s for s in blocks.cpu]
    result = {
        "sp": sp,
        "forwards": forwards,
        "callbacks": len(wall_ms),
        "longest_wall_ms": max(wall_ms),
        "longest_cpu_ms": max(cpu_ms),
        "p99_wall_ms": statistics.quantiles(wall_ms, n=100)[98],
        "p99_cpu_ms": statistics.quantiles(cpu_ms, n=100)[98],
    }
    say(
        f"sp={sp}: {forwards} forwards, {len(wall_ms)} loop callbacks; longest {result['longest_wall_ms']:.2f} ms wall "
        f"({result['longest_cpu_ms']:.2f} ms loop-thread CPU), p99 {result['p99_wall_ms']:.2f} ms "
        f"({result['p99_cpu_ms']:.2f} ms)"
    )
    return result


def options(ap) -> None:
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--bytes-only", action="store_true")
    what.add_argument("--loop-only", action="store_true")


def run_args(args) -> dict:
    from h3serve import replicas

    say(f"replicas from {replicas.__file__}")
    result: dict = {"ok": True}
    if not args.loop_only:
        result["bytes"] = step_bytes(args.smoke)
        result["ok"] = result["bytes"]["ok"]
    if not args.bytes_only:
        import ray

        own_ray = not ray.is_initialized()  # else --address's cluster
        if own_ray:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            result["loop"] = [loop_blocks(sp, args.smoke) for sp in (1, 2)]
        finally:
            if own_ray:
                ray.shutdown()
    return result


main = cli(__doc__, run_args, options, __name__)
