"""Per-document First-Block-Cache inside one packed forward, on the tiny checkpoint.

References: h3serve without a cache (today's forward), and diffusers' own First-Block-Cache hook
(``diffusers.hooks.apply_first_block_cache``) on diffusers' own model forward for one request alone.
"""

import asyncio
import copy

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor, MiniMaxH3TransformerBlock
from pydantic import ValidationError

from h3serve.pipelines.h3 import GenerationRequest, RequestError
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.packing import Pack
from h3serve.pipelines.h3.step_cache import (
    BUILTIN_TIERS,
    CachedPack,
    DocumentCache,
    PackCache,
    StepCachePolicy,
    StepCacheTiers,
)
from tests.test_h3_forward import diffusers_forward

STEPS = 8
# Packed with other documents (or re-packed without some), GEMMs run over other row counts and round
# differently (tests/test_h3_forward.py measured <= 5e-7 per forward); over 8 steps of latents of magnitude ~1.
ATOL = 1e-5
# skips after warm-up until the first-blocks residual moved 8% from its last computed step, at most 2 in a row
SKIPPING = StepCachePolicy(threshold=0.08, warmup_steps=2, max_consecutive_skips=2)
ALWAYS_SKIP = StepCachePolicy(threshold=1e9, warmup_steps=1, max_consecutive_skips=10**6)

REQUESTS = [
    GenerationRequest(prompt="a red kite over the dunes", seed=1, num_inference_steps=STEPS),
    GenerationRequest(prompt="rain on a tin roof", width=64, height=64, seed=2, num_inference_steps=STEPS),
    GenerationRequest(prompt="a ferry horn in fog", width=64, height=128, seed=3, num_inference_steps=STEPS),
]


def run_together(pipeline, requests, policies):
    """Every request in one pack at every step; its final latents and cache states."""
    states = [pipeline.prepare(r, p) for r, p in zip(requests, policies, strict=True)]
    while not all(s.done for s in states):
        pipeline.step([s for s in states if not s.done])
    return states


def latents(state):
    return state.video_rows, state.audio_rows


def transformer(pipeline):
    return pipeline.denoiser.transformers["transformer"]


def test_without_a_policy_the_pack_and_its_forward_are_todays(tiny_pipeline):
    """Cache off: the pipeline builds the plain pack, and a cache input of all-off entries computes the same bits."""
    states = [tiny_pipeline.prepare(r) for r in REQUESTS[:2]]
    ((_, pack),) = tiny_pipeline.packs(states)
    assert type(pack) is Pack and all(s.step_cache is None for s in states)
    today = packed_forward(transformer(tiny_pipeline), pack)
    cache = PackCache([None, None])
    with_entries = packed_forward(transformer(tiny_pipeline), pack, cache=cache)
    assert today is not None and with_entries is not None
    assert torch.equal(today[0], with_entries[0]) and torch.equal(today[1], with_entries[1])
    blocks = len(transformer(tiny_pipeline).transformer_blocks)
    assert cache.skipped_block_rows == 0 and cache.block_rows == pack.total_rows * blocks
    assert today[0].abs().max() > 0.1  # a real signal


def test_threshold_zero_is_off_exactly(tiny_pipeline):
    """A policy with threshold 0 never skips, and every step's bits equal a run without caching."""
    never = StepCachePolicy(threshold=0.0, warmup_steps=1, max_consecutive_skips=10**6)
    off = run_together(tiny_pipeline, REQUESTS[:2], [None, None])
    zero = run_together(tiny_pipeline, REQUESTS[:2], [never, None])
    for a, b in zip(off, zero, strict=True):
        assert torch.equal(a.video_rows, b.video_rows) and torch.equal(a.audio_rows, b.audio_rows)
    assert zero[0].step_cache is not None and zero[0].step_cache.skipped == [False] * (STEPS - 1)


def test_one_request_equals_diffusers_first_block_cache(tiny_pipeline):
    """F1B0 without warm-up or a skip bound is diffusers' First-Block-Cache: same decisions, same latents each step."""
    policy = StepCachePolicy(threshold=0.05, fn_blocks=1, bn_blocks=0, warmup_steps=1, max_consecutive_skips=10**6)
    reference = copy.deepcopy(transformer(tiny_pipeline))
    reference.set_attn_processor(MiniMaxH3AttnProcessor())  # diffusers' own attention
    # diffusers registers the blocks its hooks know; H3's block returns its hidden states alone
    TransformerBlockRegistry.register(MiniMaxH3TransformerBlock, TransformerBlockMetadata())
    apply_first_block_cache(reference, FirstBlockCacheConfig(threshold=policy.threshold))
    ours, theirs = tiny_pipeline.prepare(REQUESTS[0], policy), tiny_pipeline.prepare(REQUESTS[0])
    while not ours.done:
        doc = theirs.document()
        with reference.cache_context("fbc"):
            video, audio = diffusers_forward(reference, doc)
        theirs.advance(video, audio)
        tiny_pipeline.step([ours])
        torch.testing.assert_close(ours.video_rows, theirs.video_rows, rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.audio_rows, theirs.audio_rows, rtol=0, atol=1e-6)
    assert ours.step_cache is not None
    skipped = ours.step_cache.skipped
    assert any(skipped) and not all(skipped[1:])  # it skipped, and it computed again after skipping
    off = run_together(tiny_pipeline, REQUESTS[:1], [None])[0]
    # skipping really changed the output (alone, computed steps are bit-identical to off: the gap is the skips')
    assert (off.video_rows - ours.video_rows).abs().max() > 1e-5


def test_a_mixed_pack_gives_each_request_its_own_decisions_and_output(tiny_pipeline):
    """One request caching, one off, one with another Fn/Bn: each decides and ends as it does alone."""
    other = StepCachePolicy(threshold=0.1, fn_blocks=2, bn_blocks=1, warmup_steps=2, max_consecutive_skips=3)
    policies = [SKIPPING, None, other]
    together = run_together(tiny_pipeline, REQUESTS, policies)
    for request, policy, packed in zip(REQUESTS, policies, together, strict=True):
        (alone,) = run_together(tiny_pipeline, [request], [policy])
        if policy is not None:
            assert packed.step_cache is not None and alone.step_cache is not None
            assert packed.step_cache.skipped == alone.step_cache.skipped
            assert any(alone.step_cache.skipped)  # the test exercises skipping
        torch.testing.assert_close(packed.video_rows, alone.video_rows, rtol=0, atol=ATOL)
        torch.testing.assert_close(packed.audio_rows, alone.audio_rows, rtol=0, atol=ATOL)


def test_skipped_documents_leave_the_middle_blocks(tiny_pipeline):
    """Rows a block receives, counted by hooks on the blocks: a skipped document's rows are not among them."""
    blocks = transformer(tiny_pipeline).transformer_blocks
    seen: dict[int, list[int]] = {b: [] for b in range(len(blocks))}
    handles = [
        block.register_forward_pre_hook(lambda _, args, b=b: seen[b].append(args[0].shape[1]))
        for b, block in enumerate(blocks)
    ]
    try:
        states = [tiny_pipeline.prepare(r, p) for r, p in zip(REQUESTS[:2], [ALWAYS_SKIP, None], strict=True)]
        rows = [s.rows for s in states]
        tiny_pipeline.step(states)  # warm-up: everyone computes everything
        assert all(seen[b] == [sum(rows)] for b in seen)
        for b in seen:
            seen[b].clear()
        ((_, pack),) = tiny_pipeline.packs(states)
        assert isinstance(pack, CachedPack) and pack.step_cache is not None
        tiny_pipeline.apply(states, pack, tiny_pipeline.forward(pack))  # the first request skips
        assert seen[0] == [sum(rows)]  # the first block decides: every row
        assert all(seen[b] == [rows[1]] for b in range(1, len(blocks)))  # then only the computing request's rows
        middle = len(blocks) - 1
        assert pack.step_cache.skipped_block_rows == middle * rows[0]
        assert pack.step_cache.block_rows == len(blocks) * sum(rows) - middle * rows[0]
        assert states[0].step_cache is not None and states[0].step_cache.skipped == [False, True]

        for b in seen:
            seen[b].clear()
        tiny_pipeline.step(states[:1])  # alone and skipping: no middle block runs at all
        assert seen[0] == [rows[0]] and all(seen[b] == [] for b in range(1, len(blocks)))
    finally:
        for handle in handles:
            handle.remove()


def test_a_failed_forward_leaves_the_cache_state_untouched(tiny_pipeline):
    """State is committed only when the forward succeeded: a pack retried in halves decides the same again."""
    state = tiny_pipeline.prepare(REQUESTS[0], ALWAYS_SKIP)
    tiny_pipeline.step([state])
    cache = state.step_cache
    assert cache is not None
    before = (cache.steps, list(cache.skipped), cache.first_residual, cache.middle_residual)

    def fail(*_):
        raise RuntimeError("a block failed")

    handle = transformer(tiny_pipeline).norm_out.register_forward_pre_hook(fail)  # after every block ran
    try:
        with pytest.raises(RuntimeError, match="a block failed"):
            tiny_pipeline.step([state])
    finally:
        handle.remove()
    assert (cache.steps, cache.skipped) == before[:2]
    assert cache.first_residual is before[2] and cache.middle_residual is before[3]
    assert state.step_index == 1
    tiny_pipeline.step([state])
    assert cache.skipped == [False, True]


def test_a_finished_request_frees_its_residuals(tiny_pipeline):
    (state,) = run_together(tiny_pipeline, REQUESTS[:1], [SKIPPING])
    assert state.step_cache is not None and state.step_cache.steps == STEPS - 1
    assert state.step_cache.first_residual is None and state.step_cache.middle_residual is None


def test_the_memory_plan_counts_the_residuals_a_caching_request_holds(tiny_pipeline):
    """The plan's per-row step-cache cost is what a running request's DocumentCache holds between steps."""
    from h3serve.pipelines.h3.memory import activation_row_cost, memory_plan

    states = [tiny_pipeline.prepare(r, SKIPPING) for r in REQUESTS]
    tiny_pipeline.step(states)  # every document computes its first step (warm-up) and keeps both residuals
    held = sum(s.step_cache.first_residual.nbytes + s.step_cache.middle_residual.nbytes for s in states)
    rows = sum(s.rows for s in states)
    config = transformer(tiny_pipeline).config
    assert activation_row_cost(config, "float32", step_cache=True).step_cache * rows == held
    for state in states:
        state.free_step_cache()

    plans = [
        memory_plan(model="tiny", checkpoint=None, dtype="float32", sp_degree=1, max_rows=1024, step_cache=cached)
        for cached in (False, True)
    ]
    # held residuals in both phases, the forward's working tensors beside them in the block phase
    working = activation_row_cost(config, "float32", step_cache=True).step_cache_working
    assert plans[1].ranks[0].activation_bytes - plans[0].ranks[0].activation_bytes == 1024 * (held // rows + working)
    assert any("keeps its step cache" in note for note in plans[1].notes)


def test_a_deployment_plans_step_caches_only_where_a_request_can_cache():
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.deploy.driver.preflight import deployment_memory_plan
    from h3serve.pipelines.h3.memory import STEP_CACHE_GATHERED_ROWS, STEP_CACHE_GATHERED_ROWS_ONE_DECISION

    offered = deployment_memory_plan(DeployArgs()).row_cost.step_cache
    assert offered > 0  # the built-in tiers are offered by default
    assert deployment_memory_plan(DeployArgs(engine={"step_cache": {"tiers": {}}})).row_cost.step_cache == 0
    assert deployment_memory_plan(DeployArgs()).row_cost.step_cache_gathers == 0  # one rank gathers nothing
    # over two ranks a deployment offers the tiers it lists, none by default (its plan is as without caching)
    assert deployment_memory_plan(DeployArgs(sp_degree=2)).row_cost.step_cache == 0
    listed = DeployArgs(sp_degree=2, engine={"step_cache": {"tiers": {"high": BUILTIN_TIERS["high"].model_dump()}}})
    sharded = deployment_memory_plan(listed).row_cost
    # every rank holds the full rows' residuals, and the rows gathered at the cache's transitions: one [T, hidden]
    # beside a block when every tier decides at the same block, two when a later decision keeps h_0 gathered
    assert sharded.step_cache == offered
    assert sharded.step_cache_gathers == offered * STEP_CACHE_GATHERED_ROWS_ONE_DECISION / 2
    late = {"high": BUILTIN_TIERS["high"].model_dump(), "f2": {"threshold": 0.1, "fn_blocks": 2}}
    mixed = deployment_memory_plan(DeployArgs(sp_degree=2, engine={"step_cache": {"tiers": late}})).row_cost
    assert mixed.step_cache_gathers == offered * STEP_CACHE_GATHERED_ROWS / 2


def test_policies_that_leave_no_block_to_skip_are_refused(tiny_pipeline):
    blocks = len(transformer(tiny_pipeline).transformer_blocks)
    with pytest.raises(ValueError, match="leave no block to skip"):
        tiny_pipeline.prepare(REQUESTS[0], StepCachePolicy(threshold=0.1, fn_blocks=blocks - 1, bn_blocks=1))


def test_tiers_name_the_allowed_values():
    tiers = StepCacheTiers()
    assert tiers.names == ["off", "high", "low", "medium"] and tiers.policy(None) is None
    assert tiers.policy("high") == BUILTIN_TIERS["high"]
    with pytest.raises(RequestError, match="cache must be one of off, high, low, medium, got 'ultra'") as e:
        tiers.policy("ultra")
    assert e.value.field == "cache"
    with pytest.raises(ValidationError, match="not 'off' or one of the tiers"):
        StepCacheTiers(default="ultra")
    with pytest.raises(ValidationError, match="'off' is not a tier name"):
        StepCacheTiers(tiers={"off": StepCachePolicy(threshold=0.1)})
    assert StepCacheTiers(default="medium").policy(None) == BUILTIN_TIERS["medium"]


def test_document_cache_computes_in_warmup_and_after_max_skips():
    cache = DocumentCache(StepCachePolicy(threshold=1.0, warmup_steps=2, max_consecutive_skips=1))
    cache.first_residual = cache.middle_residual = torch.zeros(1, device="cpu")
    assert cache.must_compute()  # step 0 of 2 warm-up steps
    cache.steps = 2
    assert not cache.must_compute()
    cache.consecutive_skips = 1
    assert cache.must_compute()


# --- the per-request policy: deploy args, request bodies, the engine ------------------------------


def test_deploy_args_offer_the_tiers_and_refuse_those_that_cannot_run():
    from h3serve.deploy.common.args import DeployArgs

    assert DeployArgs().cache_tiers == ["off", "high", "low", "medium"]
    assert DeployArgs().engine.step_cache.default == "off"  # off unless a deployment sets it
    # over several ranks (tests/test_step_cache_sp.py) a deployment offers the tiers it lists, none by default
    assert DeployArgs(sp_degree=2).cache_tiers == ["off"] and DeployArgs(sp_degree=2).engine.step_cache.tiers == {}
    listed = {"tiers": {"fast": {"threshold": 0.2}}, "default": "fast"}
    assert DeployArgs(sp_degree=2, engine={"step_cache": listed}).cache_tiers == ["off", "fast"]
    with pytest.raises(ValidationError, match=r"engine.step_cache.default='high' with sp_degree=2 needs engine.step"):
        DeployArgs(sp_degree=2, engine={"step_cache": {"default": "high"}})
    with pytest.raises(ValidationError, match=r"engine.step_cache.tiers.deep: fn_blocks=3 \+ bn_blocks=1 leave no"):
        DeployArgs(engine={"step_cache": {"tiers": {"deep": {"threshold": 0.1, "fn_blocks": 3, "bn_blocks": 1}}}})


def test_a_body_names_an_offered_tier_or_gets_a_400_naming_them():
    from h3serve.deploy.common.args import RequestLimits
    from h3serve.deploy.common.errors import invalid
    from h3serve.deploy.ingress.bodies import ImagesBody, VideosBody

    context = {"limits": RequestLimits(), "cache": ["off", "high", "low"]}
    body = VideosBody.model_validate({"prompt": "x", "cache": "high"}, context=context)
    assert body.generation()["cache"] == "high"
    assert "cache" not in ImagesBody.model_validate({"prompt": "x"}, context=context).generation()  # the default
    with pytest.raises(ValidationError) as info:
        ImagesBody.model_validate({"prompt": "x", "cache": "ultra"}, context=context)
    error = invalid(info.value)
    assert (error.status, error.param) == (400, "cache")
    assert "must be one of off, high, low, got 'ultra'" in error.message


@pytest.fixture(scope="module")
def solo(tiny_checkpoint):
    from h3serve.replicas import WorkerGroup
    from tests.test_replicas import spec

    group = WorkerGroup.create(spec(1, tiny_checkpoint))
    yield group
    group.shutdown()


def test_the_engine_runs_each_request_with_its_own_tier(solo):
    """Two requests in one engine's packs, one caching and one off: each ends as it does alone."""
    from h3serve.replicas import Engine, EngineLimits
    from tests.test_engine_faults import assert_same_media

    limits = EngineLimits(step_cache=StepCacheTiers(tiers={"fast": ALWAYS_SKIP}))
    cached = GenerationRequest(prompt="a red kite", width=64, height=64, num_inference_steps=6, seed=1, cache="fast")
    plain = GenerationRequest(prompt="rain", width=64, height=64, num_inference_steps=6, seed=2)

    async def scenario():
        engine = Engine(solo, limits)
        with pytest.raises(RequestError, match="cache must be one of off, fast, got 'ultra'") as error:
            engine.submit(cached.model_copy(update={"cache": "ultra"}))
        assert error.value.field == "cache"
        tickets = [engine.submit(cached), engine.submit(plain)]
        media = await asyncio.gather(*(t.future for t in tickets))
        await engine.close()
        return tickets, media, engine.stats

    tickets, (cached_media, plain_media), stats = asyncio.run(scenario())
    state = tickets[0].prepared
    assert state.step_cache is not None and state.step_cache.skipped == [False] + [True] * 4
    assert state.step_cache.first_residual is None  # freed when its schedule finished
    assert tickets[1].prepared.step_cache is None
    assert stats.skipped_block_rows == state.step_cache.skipped_block_rows > 0
    assert_same_media(cached_media, solo.pipeline.generate(cached, step_cache=ALWAYS_SKIP))
    assert_same_media(plain_media, solo.pipeline.generate(plain))


def test_a_cancelled_request_frees_its_cache_at_the_next_step_boundary(solo):
    from h3serve.replicas import Engine, EngineLimits

    limits = EngineLimits(step_cache=StepCacheTiers(default="fast", tiers={"fast": ALWAYS_SKIP}))
    long = GenerationRequest(prompt="a long one", width=64, height=64, num_inference_steps=40)

    async def scenario():
        engine = Engine(solo, limits)
        ticket = engine.submit(long)  # no `cache`: the deployment's default tier
        while ticket.state is None or ticket.state.progress[0] < 2:
            ticket.changed.clear()
            await ticket.changed.wait()
        cache = ticket.prepared.step_cache
        assert cache is not None and cache.middle_residual is not None
        engine.cancel(ticket)
        for _ in range(200):  # the forward in flight ends, then the boundary frees it
            if cache.middle_residual is None:
                break
            await asyncio.sleep(0.05)
        await engine.close()
        return cache

    cache = asyncio.run(scenario())
    assert cache.first_residual is None and cache.middle_residual is None and cache.skipped[:2] == [False, True]
