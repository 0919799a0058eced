"""Step caching under Ulysses: sp=2 over real gloo equals sp=1 with caching on, on the tiny checkpoint.

Two harnesses, both real torch.distributed over gloo: the replica's own worker group (rank 0 in this process, rank
1 a Ray actor that keeps its own copy of each request's cache state), and two spawned processes running
``packed_forward`` directly, where forward hooks count the rows every block receives on each rank.
"""

import asyncio
import dataclasses
import itertools
import logging
import time

import pytest
import ray
import torch

from h3serve.pipelines.h3 import GenerationRequest
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.step_cache import CachedPack, DocumentCache, PackCache, StepCachePolicy, StepCacheTiers
from h3serve.replicas import Engine, EngineLimits, StepGate, WorkerGroup
from h3serve.replicas.faults import Fault
from tests import test_lora_serving
from tests.test_engine_faults import assert_same_media
from tests.test_h3_forward import DOCUMENTS, document
from tests.test_lora_serving import assert_same_latents, clip, run_together
from tests.test_replicas import spec

# its module fixtures, used here too: the two adapters (turbo: every layer kind, style: the blocks), sp=1 with them
base, loras, adapted = test_lora_serving.base, test_lora_serving.loras, test_lora_serving.adapted

pytestmark = [pytest.mark.ray, pytest.mark.usefixtures("ray_cluster")]

# Re-packed and split over ranks, fp32 GEMMs round differently (<= 5e-7 per forward, tests/test_h3_forward.py);
# over a few steps of latents of magnitude ~1, as tests/test_step_cache.py.
ATOL = 1e-5
HIGH = StepCachePolicy(threshold=0.08, warmup_steps=2, max_consecutive_skips=2)  # F1B0
LOW = StepCachePolicy(threshold=0.3, fn_blocks=2, bn_blocks=1, warmup_steps=2, max_consecutive_skips=3)  # F2B1
ALWAYS_SKIP = StepCachePolicy(threshold=1e9, warmup_steps=1, max_consecutive_skips=10**6)
NEVER = StepCachePolicy(threshold=0.0, warmup_steps=1, max_consecutive_skips=10**6)

# (request, policy, the step of the pack it joins at): one leaves at step 4, two join at steps 1 and 2, so the
# pack's composition, and where each document's rows fall between the two ranks, changes from step to step.
SCENARIO = [
    (GenerationRequest(prompt="a red kite over the dunes", seed=1, num_inference_steps=8), HIGH, 0),
    (GenerationRequest(prompt="rain on a tin roof", width=64, height=64, seed=2, num_inference_steps=5), None, 0),
    (GenerationRequest(prompt="a ferry horn in fog", width=64, height=128, seed=3, num_inference_steps=7), LOW, 1),
    (GenerationRequest(prompt="a lighthouse", width=96, height=64, seed=4, num_inference_steps=6), ALWAYS_SKIP, 2),
]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, loras):
    """Two ranks serving the base model and two adapters (one process group per process: one group here)."""
    group = WorkerGroup.create(spec(2, tiny_checkpoint).model_copy(update={"loras": loras}))
    yield group
    group.shutdown()


def worker_states(group: WorkerGroup) -> dict[int, int]:
    """Rank 1's step-cache states: key -> bytes of its residuals."""
    return ray.get(group.workers[0].step_cache_bytes.remote())


def residual_bytes(cache: DocumentCache) -> int:
    return sum(t.nbytes for t in (cache.first_residual, cache.middle_residual) if t is not None)


def ranks_of(pack, sp: int) -> list[set[int]]:
    """The ranks each document's rows fall on."""
    share = pack.total_rows // sp
    bounds = list(itertools.pairwise([0, *itertools.accumulate(pack.lengths)]))
    return [{r for r in range(sp) if a < (r + 1) * share and b > r * share} for a, b in bounds]


def run_scenario(pipeline, check=None):
    """Every step one pack of the requests that joined and are not done; each request's final state, the stats."""
    states: dict[int, object] = {}
    stats = []
    for step in itertools.count():
        for k, (request, policy, joins) in enumerate(SCENARIO):
            if joins == step:
                states[k] = pipeline.prepare(request, policy)
        active = [k for k in sorted(states) if not states[k].done]
        if not active:
            break
        ((group, pack),) = pipeline.packs([states[k] for k in active])
        stats.append(pipeline.apply(group, pack, pipeline.forward(pack)))
        if check is not None:
            check(active, pack, states)
    return [states[k] for k in range(len(SCENARIO))], stats


def test_a_changing_mixed_pack_decides_and_ends_as_on_one_rank(pair, tiny_pipeline):
    """HIGH (F1B0), LOW (F2B1), ALWAYS_SKIP and off, joining and leaving: every document's decisions, every pack's
    skipped rows and every output at sp=2 equal sp=1; rank 1 holds the same states, full rows, freed with rank 0."""
    placements: list[dict[int, frozenset[int]]] = []

    def check(active, pack, states):
        placements.append({k: frozenset(r) for k, r in zip(active, ranks_of(pack, 2), strict=True)})
        held = worker_states(pair)
        assert sorted(held) == pair.step_cache_mirror.told  # rank 1 holds exactly what rank 0 told it
        for k in active:
            cache = states[k].step_cache
            if cache is None:
                continue
            assert cache.key in held
            if cache.cached:  # rank 1 holds the full rows' residuals, as rank 0: 2 x [S, hidden] fp32
                assert held[cache.key] == residual_bytes(cache) == 2 * states[k].rows * 96 * 4

    two, two_stats = run_scenario(pair.pipeline, check)
    one, one_stats = run_scenario(tiny_pipeline)
    assert [s.skipped_block_rows for s in two_stats] == [s.skipped_block_rows for s in one_stats]
    assert [s.padding_rows for s in two_stats] != [0] * len(two_stats)  # packs padded for two ranks
    for (_, policy, _), a, b in zip(SCENARIO, two, one, strict=True):
        if policy is not None:
            assert a.step_cache.skipped == b.step_cache.skipped
            assert a.step_cache.skipped_block_rows == b.step_cache.skipped_block_rows
        torch.testing.assert_close(a.video_rows, b.video_rows, rtol=0, atol=ATOL)
        torch.testing.assert_close(a.audio_rows, b.audio_rows, rtol=0, atol=ATOL)
    for k in (0, 2, 3):  # every policy skipped some steps, and HIGH and LOW computed again after skipping
        assert any(two[k].step_cache.skipped)
    assert not all(two[0].step_cache.skipped[2:]) and not all(two[2].step_cache.skipped[2:])
    # a document's rows moved between the ranks as others joined and left
    moved = {k for k in range(len(SCENARIO)) if len({p[k] for p in placements if k in p}) > 1}
    assert moved, placements

    # every scenario request finished: rank 0 freed them all; rank 1 drops them before the next pack
    assert all(residual_bytes(s.step_cache) == 0 for s in two if s.step_cache is not None)
    extra = pair.pipeline.prepare(GenerationRequest(prompt="x", width=64, height=64, num_inference_steps=3), HIGH)
    pair.pipeline.step([extra])
    assert worker_states(pair) == {extra.step_cache.key: residual_bytes(extra.step_cache)}
    pair.pipeline.step([extra])  # its last step: rank 0 frees it ...
    assert residual_bytes(extra.step_cache) == 0
    other = pair.pipeline.prepare(GenerationRequest(prompt="y", width=64, height=64, num_inference_steps=2))
    pair.pipeline.step([other])  # ... and rank 1 with the next pack, which caches nothing
    assert worker_states(pair) == {}


def test_threshold_zero_is_off_exactly_over_two_ranks(pair):
    """A policy that never skips gives every step's bits of a run without caching, gathers and all."""

    def run(policies):
        requests = [r for r, _, _ in SCENARIO[:2]]
        states = [pair.pipeline.prepare(r, p) for r, p in zip(requests, policies, strict=True)]
        while not all(s.done for s in states):
            pair.pipeline.step([s for s in states if not s.done])
        return states

    off, zero = run([None, None]), run([NEVER, None])
    for a, b in zip(off, zero, strict=True):
        assert torch.equal(a.video_rows, b.video_rows) and torch.equal(a.audio_rows, b.audio_rows)
    assert zero[0].step_cache.skipped == [False] * len(zero[0].step_cache.skipped)


def test_every_rank_follows_rank_0s_decisions_when_one_rank_decides_otherwise(pair, tiny_pipeline):
    """A disagreement injected into one rank's own decisions (as a NaN or a non-deterministic reduction there would
    make): that rank follows rank 0 (its states record rank 0's choices, no sub-pack differs, nothing hangs), and the
    output is sp=1's. Injected into rank 0's, every rank follows rank 0's inverted choice alike."""
    request = GenerationRequest(prompt="a red kite", width=64, height=64, num_inference_steps=6, seed=1)
    policy = HIGH

    def run(fault):
        state = pair.pipeline.prepare(request, policy)
        disagreed = ray.get(pair.workers[0].disagreements.remote())
        for step in range(state.steps):
            if step == policy.warmup_steps:  # the first step whose decision a measure makes
                pair.arm(fault)
            pair.pipeline.step([state])
        held = ray.get(pair.workers[0].step_cache_skipped.remote())  # rank 1's states (freed ones: gone)
        return state, ray.get(pair.workers[0].disagreements.remote()) - disagreed, held

    alone = tiny_pipeline.prepare(request, policy)
    while not alone.done:
        tiny_pipeline.step([alone])
    worker, disagreements, held = run(Fault(1, "step_cache_decision", "disagree"))
    assert disagreements == 1  # rank 1 decided otherwise once, and followed rank 0
    assert held[worker.step_cache.key] == worker.step_cache.skipped == alone.step_cache.skipped
    assert any(worker.step_cache.skipped)
    assert_same_latents(worker, alone)

    leader, disagreements, held = run(Fault(0, "step_cache_decision", "disagree"))
    assert disagreements == 1  # rank 0 inverted its own: rank 1's arithmetic disagreed with it, and it followed
    assert held[leader.step_cache.key] == leader.step_cache.skipped  # every rank ran rank 0's choice
    at = policy.warmup_steps
    assert leader.step_cache.skipped[at] != alone.step_cache.skipped[at]  # the inverted one


def test_a_failed_step_commits_no_rank_and_the_retry_decides_the_same(pair):
    """A pack whose data fails on every rank before the agreement (PackFailed) leaves every rank's state as it was:
    the retry decides the same. (A failure past the agreement breaks the group: tests/test_sp_fault_matrix.py.)"""
    from h3serve.replicas import PackFailed

    request = GenerationRequest(prompt="a red kite", width=64, height=64, num_inference_steps=5, seed=1)
    state = pair.pipeline.prepare(request, ALWAYS_SKIP)
    pair.pipeline.step([state])
    ((_, pack),) = pair.pipeline.packs([state])
    assert isinstance(pack, CachedPack)
    # prompt embeddings one column short: every rank's context embedder refuses them, and all leave at the agreement
    broken = dataclasses.replace(pack, prompt_embeds=pack.prompt_embeds[:, :-1])
    with pytest.raises(PackFailed) as failed:
        pair(broken)
    assert set(failed.value.errors) == {0, 1}, failed.value.errors
    assert state.step_cache.steps == 1 and state.step_cache.skipped == [False]
    pair.pipeline.step([state])  # rank 1 agrees with rank 0's state, or it would refuse the pack
    assert state.step_cache.skipped == [False, True]


def test_the_engine_serves_a_cached_request_over_two_ranks_as_on_one(pair, tiny_pipeline):
    """A request naming a tier is served at sp_degree 2, beside one that caches nothing, and ends as at sp=1."""
    limits = EngineLimits(step_cache=StepCacheTiers(tiers={"fast": HIGH}))
    cached = GenerationRequest(prompt="a red kite", width=64, height=64, num_inference_steps=8, seed=1, cache="fast")
    plain = GenerationRequest(prompt="rain", width=64, height=96, num_inference_steps=6, seed=2)

    async def scenario():
        engine = Engine(pair, limits)
        tickets = [engine.submit(cached), engine.submit(plain)]
        media = await asyncio.gather(*(t.future for t in tickets))
        await engine.close()
        return tickets, media

    tickets, (cached_media, plain_media) = asyncio.run(scenario())
    cache = tickets[0].prepared.step_cache
    assert cache is not None and any(cache.skipped) and cache.first_residual is None
    stats: list = []
    assert_same_media(cached_media, tiny_pipeline.generate(cached, step_cache=HIGH, stats=stats))
    assert sum(s.skipped_block_rows for s in stats) == cache.skipped_block_rows
    assert_same_media(plain_media, tiny_pipeline.generate(plain))


def test_adapters_follow_their_rows_into_a_sub_pack_over_two_ranks(pair, adapted):
    """A base document skipping its middle blocks leaves a sub-pack of adapted documents' rows, split over two
    ranks: each adapter's deltas (turbo's on the timestep path too) land on its rows in each rank's share, and
    every document ends as at sp=1 with the same decisions."""
    requests = [clip("a red kite", 1, 8), clip("rain on tin", 2, steps=None), clip("ferry horn", 3, 8)]
    adapters, policies = [None, "turbo", "style"], [ALWAYS_SKIP, None, HIGH]
    two = run_together(pair.pipeline, requests, adapters, policies)
    one = run_together(adapted, requests, adapters, policies)
    assert any(two[0].step_cache.skipped)  # sub-packs of the adapted documents did run
    for policy, a, b in zip(policies, two, one, strict=True):
        if policy is not None:
            assert a.step_cache.skipped == b.step_cache.skipped
        assert_same_latents(a, b)


# --- the rows each rank's blocks receive: two spawned gloo processes ---------------------------------------


def _counting_rank(rank: int, world: int, init_file: str, checkpoint, pack, out_file: str) -> None:
    """Two forwards of ``pack`` (the first document on ALWAYS_SKIP): the rows every block received, this rank."""
    import torch.distributed as dist
    from diffusers import MiniMaxH3Transformer3DModel

    from h3serve.attention import get_backend
    from h3serve.pipelines.h3.attention_processor import install
    from h3serve.replicas.sequence_parallel import UlyssesGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint / "transformer").eval()
        install(model, get_backend("torch_sdpa").make_impl())
        sp = UlyssesGroup(world, rank, model.config.num_attention_heads) if world > 1 else None
        seen: dict[int, list[int]] = {b: [] for b in range(len(model.transformer_blocks))}
        for b, block in enumerate(model.transformer_blocks):
            block.register_forward_pre_hook(lambda _, args, b=b: seen[b].append(args[0].shape[1]))
        caches = [DocumentCache(ALWAYS_SKIP), None]
        first = PackCache(caches)
        packed_forward(model, pack, sp, first)  # warm-up: every document computes
        warmup = {b: list(rows) for b, rows in seen.items()}
        for rows in seen.values():
            rows.clear()
        second = PackCache(caches)
        out = packed_forward(model, pack, sp, second)  # the first document skips the middle blocks
        result = dict(
            warmup=warmup,
            seen=seen,
            block_rows=[first.block_rows, second.block_rows],
            skipped_block_rows=second.skipped_block_rows,
            skipped=caches[0].skipped,
            residual_shapes=[tuple(caches[0].first_residual.shape), tuple(caches[0].middle_residual.shape)],
            out=out,
        )
        torch.save(result, f"{out_file}.{rank}")
    finally:
        dist.destroy_process_group()


def test_skipped_rows_reach_no_block_on_either_rank(tiny_checkpoint, tmp_path):
    """Hooks on each rank's blocks: a skipped document's rows are in no middle block on any rank, each rank runs
    its half of the computing document's (padded) rows, and rank 0's outputs equal one rank's."""
    import torch.multiprocessing as mp

    docs = [document(**DOCUMENTS[0]), document(**DOCUMENTS[1])]
    rows = [d.length for d in docs]
    assert rows[1] % 2  # the computing document alone is padded to split over two ranks
    out_file = str(tmp_path / "rows")
    mp.spawn(_counting_rank, args=(1, str(tmp_path / "init1"), tiny_checkpoint, pack_documents(docs), out_file))
    pack = pack_documents(docs, row_multiple=2)
    mp.spawn(_counting_rank, args=(2, str(tmp_path / "init2"), tiny_checkpoint, pack, out_file + ".sp"), nprocs=2)
    alone = torch.load(f"{out_file}.0", weights_only=False)
    ranks = [torch.load(f"{out_file}.sp.{rank}", weights_only=False) for rank in (0, 1)]
    blocks = len(alone["seen"])
    half, sub_half = pack.total_rows // 2, (rows[1] + 1) // 2
    for result in ranks:
        assert result["warmup"] == {b: [half] for b in range(blocks)}  # warm-up: every rank its own half
        assert result["seen"][0] == [half]  # the first block decides: every row
        assert all(result["seen"][b] == [sub_half] for b in range(1, blocks))  # then half the computing rows
        assert result["block_rows"] == [blocks * half, half + (blocks - 1) * sub_half]
        assert result["skipped_block_rows"] == alone["skipped_block_rows"] == (blocks - 1) * rows[0]
        assert result["skipped"] == alone["skipped"] == [False, True]
        assert result["residual_shapes"] == alone["residual_shapes"] == [(rows[0], 96)] * 2  # full rows, each rank
    assert ranks[1]["out"] is None
    for got, want in zip(ranks[0]["out"], alone["out"], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)


# --- out of memory in a step-caching step (issue 53) --------------------------------------------------------------
# One document skips its middle blocks (SKIPPING, once it has a residual), the other computes them (NEVER): blocks 1-3
# run on a sub-pack of the computing document's rows, and the step's all-gathers are 0 (the blocks' input), 1 (the
# decision before block 1) and 2 (the middle's end). Each fault fires once, on one rank, in the step named.
SKIPPING = StepCachePolicy(threshold=1e9, warmup_steps=1, max_consecutive_skips=10**6)
OOM_BOUND_S = 20.0  # the pair's submit to both answers, the failed pack and its halves included (2 shared cores)
OOM_CASES = [
    # in a step that reuses a cached residual: inside the sub-pack's block 1 (where its SwiGLU runs, or between its
    # attention's all-to-alls), and making the gather buffer of the decision's transition, on either rank
    (Fault(1, "after_attention", "oom", block=1), 1),
    (Fault(0, "between_all_to_alls", "oom", block=1), 1),
    (Fault(1, "all_gather", "oom", block=1), 2),
    (Fault(0, "all_gather", "oom", block=2), 2),
    # after the blocks: the output rows' gather, then the outcome's agreement, drained
    (Fault(1, "final_gather", "oom"), 2),
    # in a step that fills the cache (the first: both documents compute and keep their residuals)
    (Fault(1, "all_gather", "oom", block=0), 0),
    (Fault(1, "after_attention", "oom", block=2), 0),
]
CACHED_PAIR = [
    GenerationRequest(prompt="a red kite", width=64, height=64, num_inference_steps=4, seed=1, cache="skip"),
    GenerationRequest(prompt="rain on a roof", width=64, height=96, num_inference_steps=4, seed=2, cache="never"),
]


class ArmAtStep(StepGate):
    """The pair steps together; before the forward of step ``at`` of both, ``fault`` is armed on its rank."""

    def __init__(self, group: WorkerGroup, fault: Fault | None, at: int):
        self.group, self.fault, self.at = group, fault, at
        self.cached: list[bool] | None = None  # each document held a computed step's residuals when it was armed

    def candidates(self, boundary):
        return () if boundary.waiting else boundary.prepared

    def before_forward(self, batch):
        caches = [t.prepared.step_cache for t in batch]
        if self.fault is not None and self.cached is None and len(batch) == 2 and caches[0].steps == self.at:
            self.cached = [c.cached for c in caches]
            self.group.arm(self.fault)


def serve_cached_pair(group: WorkerGroup, fault: Fault | None, at: int):
    limits = EngineLimits(step_cache=StepCacheTiers(tiers={"skip": SKIPPING, "never": NEVER}), max_active=4)
    gate = ArmAtStep(group, fault, at)

    async def scenario():
        engine = Engine(group, limits, gate=gate)
        started = time.monotonic()
        tickets = [engine.submit(r, request_id=f"cached-{i}") for i, r in enumerate(CACHED_PAIR)]
        media = await asyncio.gather(*(t.future for t in tickets), return_exceptions=True)
        answered = time.monotonic() - started
        await engine.close()
        return engine, tickets, media, answered

    return (*asyncio.run(scenario()), gate)


@pytest.fixture(scope="module")
def cached_baseline(pair):
    _, tickets, media, _, _ = serve_cached_pair(pair, None, 0)
    return media, [t.prepared.step_cache.skipped for t in tickets]


@pytest.mark.parametrize("fault, at", OOM_CASES, ids=[f"{f}-in-step-{at}".replace(" ", "-") for f, at in OOM_CASES])
def test_out_of_memory_in_a_step_caching_pack_fails_the_pack_not_the_group(pair, cached_baseline, fault, at, caplog):
    """The rank out of memory goes on hollow (every collective its peer enters, with scratch buffers, by rank 0's
    decisions) and the step ends with an agreement on its outcome: no rank commits it, the pack of two fails once
    (PackFailed) and each half runs that step alone with the same cache state, on the same group, never rebuilt."""
    media, skipped = cached_baseline
    with caplog.at_level(logging.INFO, logger="h3serve"):
        engine, tickets, got, answered, gate = serve_cached_pair(pair, fault, at)
    assert gate.cached == [at > 0, at > 0]  # step `at` reused the residuals kept before it (or, step 0, fills them)
    assert answered < OOM_BOUND_S, answered
    for result, want in zip(got, media, strict=True):  # both complete, as without the fault
        assert not isinstance(result, BaseException), result
        assert_same_media(result, want)
    assert [t.prepared.step_cache.skipped for t in tickets] == skipped  # the retried halves decided the same
    assert any(skipped[0]) and not any(skipped[1])  # the skipping one did skip: sub-packs ran
    # the group is the one it was: not broken, not replaced; the pack of two failed once, on the OOM, then halved
    assert engine.stats.group_replacements == 0 and not engine.supervisor.history and engine.group is pair
    assert engine.stats.failed_steps == 1 and engine.stats.failed_requests == {}
    logs = [r.getMessage() for r in caplog.records]
    assert not [m for m in logs if "SP group broken" in m]
    halved = [m for m in logs if "retrying them in halves" in m]
    assert len(halved) == 1 and f"rank {fault.rank}: OutOfMemoryError" in halved[0], halved
    if fault.rank == 0:  # the hollow rank's own account of it (rank 1's goes to its actor's log)
        assert [m for m in logs if "out of memory in a step-caching step" in m]
    # rank 1 holds exactly the states rank 0 told it of (a commit on one rank only would refuse the next pack)
    assert sorted(worker_states(pair)) == pair.step_cache_mirror.told
