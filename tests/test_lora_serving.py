"""LoRA adapters wired end to end: the pack's per-document slots, the pipeline, step caching, the real engine.

Adapters are written by diffusers'/peft's own save functions (``tests/test_lora.py``); the reference for an
adapter is diffusers' ``load_lora_weights`` + ``fuse_lora`` on a copy of the base transformer, served alone.
"""

import asyncio
import collections
import copy

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from peft import LoraConfig

from h3serve.attention import get_backend
from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline, RequestError
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.lora import LoraSpec, LoraSpecs
from h3serve.pipelines.h3.step_cache import StepCachePolicy
from h3serve.replicas import Engine, EngineLimits, WorkerGroup
from tests.test_engine_faults import assert_same_media
from tests.test_lora import ADAPTERS, fused_reference, lora_state_dict, save
from tests.test_replicas import RESOLUTION, spec

# packed with other documents (or re-packed without some), GEMMs round differently per forward (<= 5e-7,
# tests/test_h3_forward.py); over a few steps of latents of magnitude ~1
ATOL = 1e-5
TURBO_STEPS, TURBO_SHIFT = 4, 5.0
STEPS = 12  # base and style requests: long enough to share packs with the others in the engine
ALWAYS_SKIP = StepCachePolicy(threshold=1e9, warmup_steps=1, max_consecutive_skips=10**6)


def clip(prompt: str, seed: int, steps: int | None = STEPS, **kwargs) -> GenerationRequest:
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    return GenerationRequest(prompt=prompt, width=64, height=64, seed=seed, **kwargs)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    from diffusers import MiniMaxH3Transformer3DModel

    return MiniMaxH3Transformer3DModel.from_pretrained(tiny_checkpoint / "transformer").eval()


@pytest.fixture(scope="module")
def loras(base, tmp_path_factory) -> LoraSpecs:
    """turbo: every layer kind (timestep path included), 4 steps at shift 5; style: the main blocks only."""
    out = {}
    for seed, (name, (kwargs, scale)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(**kwargs)
        directory = save(tmp_path_factory.mktemp(name), lora_state_dict(base, config, seed), config)
        fields = dict(steps=TURBO_STEPS, shift=TURBO_SHIFT) if name == "turbo" else {}
        out[name] = LoraSpec(path=directory, scale=scale, **fields)
    return LoraSpecs(loras=out)


@pytest.fixture(scope="module")
def adapted(tiny_checkpoint, loras):
    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa", loras=loras)


def run_together(pipeline, requests, adapters, policies=None):
    """Every request in one pack at every step (each leaves when its schedule is done); their final states."""
    policies = policies or [None] * len(requests)
    states = [
        pipeline.prepare(pipeline.with_adapter(r, a), p, a)
        for r, a, p in zip(requests, adapters, policies, strict=True)
    ]
    while not all(s.done for s in states):
        pipeline.step([s for s in states if not s.done])
    return states


def assert_same_latents(got, want, atol=ATOL):
    torch.testing.assert_close(got.video_rows, want.video_rows, rtol=0, atol=atol)
    torch.testing.assert_close(got.audio_rows, want.audio_rows, rtol=0, atol=atol)


def test_adapters_take_slots_in_declaration_order_and_every_partition_holds_them(adapted, loras):
    assert loras.slots == {"turbo": 1, "style": 2}
    for partition, by_slot in adapted.denoiser.adapters.items():
        assert {slot: a.name for slot, a in by_slot.items()} == {1: "turbo", 2: "style"}
        assert all(a.partition == partition for a in by_slot.values())
    states = [adapted.prepare(adapted.with_adapter(clip("a", 1, 4), a), None, a) for a in (None, "style", "turbo")]
    ((_, pack),) = adapted.packs(states)
    # each document's composition id in the pack, and each id's (adapter slot, weight): style, then turbo at its 0.7
    assert pack.document_slots == [0, 1, 2] and pack.adapted
    assert pack.compositions == {1: ((2, 1.0),), 2: ((1, 0.7),)}


def test_base_requests_on_a_deployment_with_adapters_run_exactly_todays_forward(tiny_pipeline, adapted):
    """No adapter in the pack: the same bits as a deployment without adapters, and no hook is ever installed."""
    requests = [clip("a red kite", 1, 3), clip("rain on tin", 2, 3)]
    seen_hooks = []
    model = adapted.denoiser.transformers["transformer"]
    probe = model.transformer_blocks[0].attn.to_q.register_forward_hook(
        lambda m, *_: seen_hooks.append(len(m._forward_hooks))
    )
    try:
        ours = run_together(adapted, requests, [None, None])
    finally:
        probe.remove()
    assert seen_hooks and set(seen_hooks) == {1}  # only the probe: the adapting hooks stayed out
    for got, want in zip(ours, run_together(tiny_pipeline, requests, [None, None]), strict=True):
        assert torch.equal(got.video_rows, want.video_rows) and torch.equal(got.audio_rows, want.audio_rows)


def test_a_few_step_adapter_brings_its_steps_and_shift(adapted):
    request = adapted.with_adapter(clip("a", 1, steps=None), "turbo")
    assert request.num_inference_steps == TURBO_STEPS
    state = adapted.prepare(request, None, "turbo")
    expected = MiniMaxH3Scheduler(shift=TURBO_SHIFT)
    expected.set_timesteps(TURBO_STEPS)
    assert state.video_scheduler.shift == TURBO_SHIFT and torch.equal(
        state.video_scheduler.timesteps, expected.timesteps
    )
    assert state.audio_scheduler.shift == 3.0  # the audio schedule keeps the checkpoint's own
    # the pipeline's own scheduler is put back: a base request after it plans with the released shift
    assert adapted.prepare(clip("a", 1, 3)).video_scheduler.shift == adapted._schedulers["scheduler"].shift == 12.0
    with pytest.raises(RequestError, match="distilled for 4 steps; the request asks for 12") as e:
        adapted.with_adapter(clip("a", 1), "turbo")
    assert e.value.field == "num_inference_steps"
    assert adapted.with_adapter(clip("a", 1, steps=None), "style").num_inference_steps == 50  # no steps declared
    with pytest.raises(RequestError, match="no adapter 'anime' on this deployment; its adapters: style, turbo") as e:
        adapted.with_adapter(clip("a", 1), "anime")
    assert e.value.field == "model"


def test_adapters_inside_a_step_cache_sub_pack_stay_on_their_documents_rows(adapted):
    """A base document skipping its middle blocks leaves a sub-pack of the adapted documents' rows: each
    adapted document (caching or not) ends exactly as it does alone, with the same skip decisions."""
    skipping = StepCachePolicy(threshold=0.08, warmup_steps=2, max_consecutive_skips=2)
    requests = [clip("a red kite", 1, 8), clip("rain on tin", 2, steps=None), clip("ferry horn", 3, 8)]
    adapters, policies = [None, "turbo", "style"], [ALWAYS_SKIP, None, skipping]
    together = run_together(adapted, requests, adapters, policies)
    assert together[0].step_cache is not None and any(together[0].step_cache.skipped)  # sub-packs did run
    for request, adapter, policy, packed in zip(requests, adapters, policies, together, strict=True):
        (alone,) = run_together(adapted, [request], [adapter], [policy])
        if policy is not None:
            assert packed.step_cache is not None and alone.step_cache is not None
            assert packed.step_cache.skipped == alone.step_cache.skipped
        assert_same_latents(packed, alone)


class MaxPack:
    """An EngineObserver keeping the largest pack the engine stepped, the adapters it serves and the documents
    of every forward by adapter (deploy's EngineMetrics exports the last two)."""

    def __init__(self):
        self.requests = 0
        self.served: tuple[str, ...] | None = None
        self.documents: collections.Counter[str | None] = collections.Counter()

    def on_step(self, stats, seconds):
        self.requests = max(self.requests, stats.requests)

    def on_adapters(self, served):
        self.served = tuple(served)

    def on_adapter_documents(self, documents):
        self.documents.update(documents)

    def __getattr__(self, name):  # the other reports are not needed here
        return lambda *args: None


def test_a_pack_of_base_and_two_adapters_in_the_engine_gives_each_request_its_own_output(tiny_checkpoint, base, loras):
    group = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras}))
    requests = [clip("a red kite", 1), clip("rain on tin", 2), clip("ferry horn", 3, steps=None)]
    adapters = [None, "style", "turbo"]  # turbo without steps: its own 4

    async def serve(batch):
        observer = MaxPack()
        engine = Engine(group, EngineLimits(max_active=4), observer)
        tickets = [engine.submit(r, adapter=a) for r, a in batch]
        await asyncio.gather(*(t.future for t in tickets))
        await engine.close()
        return [t.prepared for t in tickets], observer

    try:
        together, observer = asyncio.run(serve(list(zip(requests, adapters, strict=True))))
        assert observer.requests == 3  # all three shared at least one packed forward
        assert observer.served == ("turbo", "style")  # the deployment's adapters, in declaration order
        # one document per request in each of its forwards, by adapter (None: the base model)
        assert observer.documents == {None: STEPS - 1, "style": STEPS - 1, "turbo": TURBO_STEPS - 1}
        assert together[2].steps == TURBO_STEPS - 1  # model evaluations of a 4-point grid
        for pair, packed in zip(zip(requests, adapters, strict=True), together, strict=True):
            (alone,), _ = asyncio.run(serve([pair]))
            assert_same_latents(packed, alone)
    finally:
        group.shutdown()

    # diffusers alone: the style adapter loaded and fused into the base transformer, no adapter path at all
    reference = H3Pipeline.load(tiny_checkpoint, "torch_sdpa")
    (plain,) = run_together(reference, [requests[1]], [None])
    fused = fused_reference(base, loras.loras["style"])
    install(fused, get_backend("torch_sdpa").make_impl())
    reference.denoiser.transformers["transformer"] = fused
    (expected,) = run_together(reference, [requests[1]], [None])
    assert_same_latents(together[1], expected)
    assert (expected.video_rows - plain.video_rows).abs().max() > 1e-2  # the adapter's effect dwarfs the tolerance


def test_warm_up_runs_a_forward_through_each_adapter_and_leaves_the_requests_alone(tiny_checkpoint, loras):
    group = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras}))
    request = clip("after warm-up", 5, steps=None)  # turbo's own 4 steps

    async def scenario():
        engine = Engine(group, EngineLimits())
        engine.warm_up()
        seeded = engine.expected_step_s
        media = await engine.generate(request, adapter="turbo")
        await engine.close()
        return engine, seeded, media

    try:
        engine, seeded, media = asyncio.run(scenario())
        alone = group.pipeline.generate(request, adapter="turbo")
    finally:
        group.shutdown()
    assert list(engine.warmup_s) == [None, "turbo", "style"] and all(s > 0 for s in engine.warmup_s.values())
    assert seeded == engine.warmup_s[None]  # the watchdog is seeded by the base forward
    assert_same_media(media, alone)


def test_a_replica_refuses_an_adapter_that_does_not_fit(tiny_checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    bad = LoraSpecs(loras={"broken": LoraSpec(path=tmp_path / "empty")})
    with pytest.raises(ValueError, match="adapter 'broken'.*cannot be read as a MiniMax-H3 LoRA"):
        WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": bad}))


# ----------------------------------------------------------------------------- the driver's admission


def write_adapter_config(tmp_path, loras: dict) -> str:
    from tests.harness import default_config, free_port, write_config

    config = copy.deepcopy(default_config())
    config["applications"][0]["args"]["loras"] = loras
    return str(write_config(tmp_path, config, free_port(), "loras.yaml"))


@pytest.mark.slow  # two `h3serve admit` commands, each imports the model libraries (`make test-fast` leaves it out)
def test_admission_checks_adapters_against_the_served_transformer_before_any_replica(loras, base, tmp_path):
    """`h3serve admit` (the driver's own check, no replica): good adapters pass; one key of the wrong shape is
    refused naming the adapter and the key, and counted as an admission failure with reason "lora"."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.harness import h3serve

    good = {
        name: {"path": str(s.path), "scale": s.scale, "steps": s.steps, "shift": s.shift}
        for name, s in loras.loras.items()
    }
    result = h3serve("admit", write_adapter_config(tmp_path, good))
    assert result.returncode == 0, result.stderr
    assert "lora turbo" in result.stdout and "lora style" in result.stdout  # in the memory plan's weights

    state_dict = lora_state_dict(base, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]), seed=5)
    state_dict["transformer_blocks.1.attn.to_v.lora_B.weight"] = torch.zeros(95, 4)
    bad = save(tmp_path / "bad", state_dict, None)
    textfile = tmp_path / "admission.prom"
    result = h3serve(
        "admit", write_adapter_config(tmp_path, {**good, "wide": {"path": str(bad)}}), "--textfile", str(textfile)
    )
    assert result.returncode == 2, result
    assert "adapter 'wide'" in result.stderr and "transformer_blocks.1.attn.to_v.lora_B.weight (95, 4)" in result.stderr
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    failures = families["h3serve_admission_failures"].samples
    assert [(s.labels["reason"], s.value) for s in failures if s.name.endswith("_total")] == [("lora", 1.0)]


def test_the_memory_plan_holds_every_adapter_on_every_rank(loras, tiny_checkpoint):
    """An adapter's bytes are its lora_A and lora_B tensors as read from its file (float32 here), on each rank."""
    from safetensors.torch import load_file

    from h3serve.deploy.common.args import DeployArgs
    from h3serve.deploy.driver.preflight import deployment_memory_plan

    fields = {name: {"path": str(s.path), "scale": s.scale} for name, s in loras.loras.items()}
    args = DeployArgs(checkpoint=str(tiny_checkpoint), sp_degree=2, loras=fields)
    plan, bare = deployment_memory_plan(args), deployment_memory_plan(args.model_copy(update={"loras": {}}))
    stored = {
        name: sum(t.numel() * 4 for t in load_file(next(adapter.path.glob("*.safetensors"))).values())
        for name, adapter in loras.loras.items()
    }
    for name, nbytes in stored.items():
        assert [rank.weights[f"lora {name}"] for rank in plan.ranks] == [nbytes, nbytes]
    added = sum(stored.values())
    assert [p.weight_bytes - b.weight_bytes for p, b in zip(plan.ranks, bare.ranks, strict=True)] == [added, added]


def test_deploy_args_check_adapter_names_and_fields(tmp_path):
    from pydantic import ValidationError

    from h3serve.deploy.common.args import DeployArgs

    args = DeployArgs(loras={"turbo-4": {"path": str(tmp_path), "steps": 4, "shift": 5.0}})
    assert args.replica_spec(RESOLUTION).loras.slots == {"turbo-4": 1}
    with pytest.raises(ValidationError, match="adapter name 'Turbo 4' is not allowed"):
        DeployArgs(loras={"Turbo 4": {"path": str(tmp_path)}})
    with pytest.raises(ValidationError, match=r"loras\.turbo\.steps"):
        DeployArgs(loras={"turbo": {"path": str(tmp_path), "steps": 0}})


def _sp_rank(rank: int, world: int, init_file: str, checkpoint, loras, pack, out_file: str) -> None:
    """One Ulysses rank over gloo: the denoiser with the deployment's adapters, this rank's rows of the pack."""
    import torch.distributed as dist

    from h3serve.pipelines.h3 import H3Denoiser
    from h3serve.replicas.sequence_parallel import UlyssesGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        denoiser = H3Denoiser.load(checkpoint, "torch_sdpa", loras=loras)
        sp = UlyssesGroup(world, rank, denoiser.transformers["transformer"].config.num_attention_heads)
        result = denoiser.forward(pack, sp)
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes, each builds the tiny model (`make test-fast` leaves it out)
def test_the_packs_slots_follow_each_ranks_rows_under_ulysses(adapted, tiny_checkpoint, loras, tmp_path):
    """A pack of base, turbo and style documents through the denoiser: sp=2 over gloo equals sp=1."""
    import torch.multiprocessing as mp

    requests = [clip("a red kite", 1, 4), clip("rain on tin", 2, steps=None), clip("ferry horn", 3, 4)]
    adapters = [None, "turbo", "style"]
    states = [adapted.prepare(adapted.with_adapter(r, a), None, a) for r, a in zip(requests, adapters, strict=True)]
    adapted.row_multiple = 2  # as a worker group of two ranks sets it
    try:
        ((_, pack),) = adapted.packs(states)
    finally:
        adapted.row_multiple = 1
    assert pack.document_slots == [0, 1, 2] and pack.padding_rows in (0, 1)
    expected_video, expected_audio = adapted.denoiser.forward(pack)
    out_file = tmp_path / "rank0.pt"
    mp.spawn(_sp_rank, args=(2, str(tmp_path / "init"), tiny_checkpoint, loras, pack, str(out_file)), nprocs=2)
    video, audio = torch.load(out_file)
    torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
    torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)


def test_a_transformer_ref_only_adapter_is_admitted_and_refuses_requests_of_the_other_partition(tmp_path):
    """A file naming transformer_ref alone (diffusers' ``transformer_ref_lora_layers``) adapts that partition and
    leaves ``transformer`` the base model: admitted, served in its slot, and a T2VA request on it is refused."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines import MiniMaxH3ModularPipeline

    from h3serve.pipelines.h3.checkpoint import write_tiny_checkpoint
    from h3serve.pipelines.h3.lora import LoraError, check_adapters

    checkpoint = write_tiny_checkpoint(tmp_path / "with-ref", with_ref=True)
    ref = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint / "transformer_ref").eval()
    config = LoraConfig(r=4, lora_alpha=4, target_modules=["attn.to_q", "ff.net.2"])
    directory = tmp_path / "ref-style"
    MiniMaxH3ModularPipeline.save_lora_weights(
        directory, transformer_ref_lora_layers=lora_state_dict(ref, config, seed=3)
    )
    loras = LoraSpecs(loras={"ref-style": LoraSpec(path=directory)})
    layers = sum(name.endswith(("attn.to_q", "ff.net.2")) for name, _ in ref.named_modules())

    configs = {
        p: dict(MiniMaxH3Transformer3DModel.load_config(checkpoint / p)) for p in ("transformer", "transformer_ref")
    }
    assert check_adapters(loras, configs)["ref-style"].layers == layers  # transformer_ref's alone
    with pytest.raises(LoraError, match=r"does not serve \(it serves 'transformer'\)"):
        check_adapters(loras, {"transformer": configs["transformer"]})

    pipeline = H3Pipeline.load(checkpoint, "torch_sdpa", loras=loras)
    adapters = pipeline.denoiser.adapters
    assert adapters["transformer"][1].layers == {} and len(adapters["transformer_ref"][1].layers) == layers
    request = pipeline.with_adapter(clip("a kite", 1, steps=3), "ref-style")
    with pytest.raises(RequestError, match=r"adapts only the 'transformer_ref' partition; a t2va request") as e:
        pipeline.prepare(request, None, "ref-style")
    assert e.value.field == "model"
