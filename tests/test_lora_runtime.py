"""LoRA adapters loaded and unloaded while the real engine serves (``Engine.load_adapter`` / ``unload_adapter``).

Adapters are made with peft's API and written by diffusers' ``save_lora_weights`` (``tests/test_lora.py``). A load is
checked against the checkpoint's geometry and the adapter budget; an unload refuses new requests at once and frees the
adapter only after the requests running on it finished, with their own output.
"""

import asyncio

import pytest
from diffusers import MiniMaxH3Transformer3DModel
from peft import LoraConfig

from h3serve.pipelines.h3 import GenerationRequest, RequestError
from h3serve.pipelines.h3.lora import LoraError, LoraSpec, LoraSpecs
from h3serve.pipelines.h3.lora_spec import LoraLimits
from h3serve.replicas import Engine, EngineLimits, WorkerGroup
from tests.harness import FOREIGN_DIMS
from tests.test_engine_faults import assert_same_media
from tests.test_lora import ADAPTERS, EVERY_LAYER, lora_state_dict, save
from tests.test_replicas import spec

STEPS = 8


def clip(prompt: str, seed: int, steps: int = STEPS) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, width=64, height=64, seed=seed, num_inference_steps=steps)


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return MiniMaxH3Transformer3DModel.from_pretrained(tiny_checkpoint / "transformer").eval()


@pytest.fixture(scope="module")
def files(base, tmp_path_factory) -> dict[str, LoraSpec]:
    """style (declared at deploy), detail (loaded at run time), and one made for another transformer's dims."""
    style_kwargs, _ = ADAPTERS["style"]
    detail = LoraConfig(r=4, lora_alpha=4, target_modules=EVERY_LAYER)
    out = {
        "style": LoraSpec(
            path=save(
                tmp_path_factory.mktemp("style"),
                lora_state_dict(base, LoraConfig(**style_kwargs), 0),
                LoraConfig(**style_kwargs),
            )
        ),
        "detail": LoraSpec(path=save(tmp_path_factory.mktemp("detail"), lora_state_dict(base, detail, 1), detail)),
    }
    from tests.test_h3_forward import CONFIG

    other = MiniMaxH3Transformer3DModel(**{**CONFIG, **FOREIGN_DIMS}).eval()
    config = LoraConfig(r=4, target_modules=["attn.to_q"])
    out["foreign"] = LoraSpec(path=save(tmp_path_factory.mktemp("foreign"), lora_state_dict(other, config, 2), config))
    return out


def test_an_adapter_loaded_while_requests_run_serves_the_next_ones_and_a_bad_one_is_refused(tiny_checkpoint, files):
    loras = LoraSpecs(loras={"style": files["style"]}, limits=LoraLimits(max_adapter_bytes=10**7))
    group = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras}))
    composed = "style@0.7,detail@-0.8"

    async def scenario():
        engine = Engine(group, EngineLimits(max_active=4))
        running = [engine.submit(clip("a red kite", 1)), engine.submit(clip("rain", 2), adapter="style")]
        with pytest.raises(RequestError, match="no adapter 'detail'"):
            engine.submit(clip("x", 3), adapter=composed)
        nbytes = await engine.load_adapter("detail", files["detail"])  # while the two step
        assert not any(t.future.done() for t in running)  # loaded between their steps, nothing dropped
        late = engine.submit(clip("ferry horn", 3), adapter=composed)
        with pytest.raises(LoraError, match="already served"):
            await engine.load_adapter("detail", files["detail"])
        with pytest.raises(LoraError, match=r"mismatched shapes.*transformer_blocks\.0\.attn\.to_q"):
            await engine.load_adapter("foreign", files["foreign"])
        media = await asyncio.gather(*(t.future for t in [*running, late]))
        await engine.close()
        return nbytes, media

    try:
        nbytes, media = asyncio.run(scenario())
        alone = group.pipeline.generate(clip("ferry horn", 3), adapter=composed)
    finally:
        group.shutdown()
    assert nbytes > 0
    assert_same_media(media[2], alone)


def test_a_load_past_the_adapter_budget_is_refused_and_changes_nothing(tiny_checkpoint, files):
    group = WorkerGroup.create(
        spec(1, tiny_checkpoint).model_copy(update={"loras": LoraSpecs(limits=LoraLimits(max_adapter_bytes=1000))})
    )

    async def scenario():
        engine = Engine(group, EngineLimits())
        with pytest.raises(LoraError, match=r"adapter 'detail' needs \d+ bytes .*max_adapter_bytes is 1000"):
            await engine.load_adapter("detail", files["detail"])
        await engine.close()

    try:
        asyncio.run(scenario())
        assert group.pipeline.denoiser.loras.loras == {} and group.pipeline.denoiser.adapters["transformer"] == {}
    finally:
        group.shutdown()


def test_an_unload_lets_running_requests_finish_with_the_adapter_and_refuses_new_ones(tiny_checkpoint, files):
    loras = LoraSpecs(loras={"style": files["style"], "detail": files["detail"]})
    group = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras}))
    request = clip("rain on tin", 2, steps=12)

    async def scenario():
        engine = Engine(group, EngineLimits(max_active=4))
        running = engine.submit(request, adapter="style@0.9,detail")
        other = engine.submit(clip("a bell", 4), adapter="detail")
        while not running.forwards:  # it runs on the adapter
            await asyncio.sleep(0.01)
        unloading = asyncio.create_task(engine.unload_adapter("style"))
        await asyncio.sleep(0.05)
        assert not unloading.done()  # waits for the request that runs on it
        with pytest.raises(RequestError, match="no adapter 'style' on this deployment; its adapters: detail"):
            engine.submit(clip("late", 5), adapter="style")
        finished = await running.future  # with the adapter, to its end
        await unloading
        assert "style" not in group.pipeline.denoiser.loras.loras and not group.pipeline.denoiser.retiring
        assert sorted(group.pipeline.denoiser.adapters["transformer"]) == [2]  # detail's slot alone
        await other.future
        # the slot is never reused: a new adapter takes a fresh one
        await engine.load_adapter("style-2", files["style"])
        assert group.pipeline.denoiser.loras.slots == {"detail": 2, "style-2": 3}
        await engine.close()
        return finished

    try:
        finished = asyncio.run(scenario())
    finally:
        group.shutdown()
    reference = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras}))
    try:
        assert_same_media(finished, reference.pipeline.generate(request, adapter="style@0.9,detail"))
    finally:
        reference.shutdown()


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_an_adapter_loaded_at_run_time_reaches_every_sp_rank_and_a_restarted_worker(tiny_checkpoint, files):
    """sp_degree 2: the worker rank reads the run-time adapter into rank 0's slot, a warm-up forward runs on it, and
    a request on it equals sp_degree 1's; after rank 1 is killed (SIGKILL) its replacement loads it too."""
    loras = LoraSpecs(loras={"style": files["style"]})
    group = WorkerGroup.create(spec(2, tiny_checkpoint, timeout=30.0).model_copy(update={"loras": loras}))
    composed, request = "style@0.7,detail@-0.8", clip("ferry horn", 3)

    async def scenario():
        engine = Engine(group, EngineLimits(max_active=4))
        engine.warm_up()
        await engine.load_adapter("detail", files["detail"])
        assert engine.group.spec.loras.slots == {"style": 1, "detail": 2}  # what a restarted worker loads
        first = await engine.submit(request, adapter=composed).future
        engine.group.kill(1)
        with pytest.raises(Exception, match="SP worker did not answer"):
            await asyncio.to_thread(engine.check_health)
        again = await engine.submit(request, adapter=composed).future  # on the replaced group
        assert [r.started for r in engine.supervisor.history] == [(1,)]
        await engine.unload_adapter("detail")
        with pytest.raises(RequestError, match="no adapter 'detail'"):
            engine.submit(request, adapter=composed)
        assert engine.group.spec.loras.slots == {"style": 1}
        await engine.close()
        return first, again

    try:
        first, again = asyncio.run(scenario())
    finally:
        group.shutdown()
    both = LoraSpecs(loras={"style": files["style"], "detail": files["detail"]})
    reference = WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": both}))
    try:
        alone = reference.pipeline.generate(request, adapter=composed)
    finally:
        reference.shutdown()
    assert_same_media(first, alone)
    assert_same_media(again, alone)


def test_two_replicas_reconcile_against_one_registry(tiny_checkpoint, files, tmp_path):
    """Two replicas' engines over one job store (``adapter_sync.ReplicaAdapters``, what each H3Replica runs): an
    adapter registered once is loaded by the other before its first request on it, with the same output; one it
    cannot load is refused there by name; a deletion is unloaded at its next reconcile."""
    from h3serve.deploy.jobs.adapter_registry import AdapterRegistry
    from h3serve.deploy.jobs.media_store import MediaStore
    from h3serve.deploy.model_server.adapter_sync import ReplicaAdapters

    store = MediaStore(str(tmp_path / "store"))
    admin = AdapterRegistry(store)
    loras = LoraSpecs(loras={"style": files["style"]})
    groups = [WorkerGroup.create(spec(1, tiny_checkpoint).model_copy(update={"loras": loras})) for _ in range(2)]
    request, composed = clip("ferry horn", 3), "style@0.7,detail@-0.8"

    async def scenario():
        engines = [Engine(group, EngineLimits(max_active=4)) for group in groups]
        for engine in engines:
            engine.warm_up()
        a, b = (ReplicaAdapters(engine, AdapterRegistry(store, ttl_s=60.0)) for engine in engines)
        await engines[0].load_adapter("detail", files["detail"])  # the replica the POST reached
        admin.change(lambda specs: {**specs, "detail": files["detail"], "foreign": files["foreign"]})
        await b.ensure(composed)  # read fresh although its cache is young
        assert "detail" in groups[1].pipeline.denoiser.loras.loras
        with pytest.raises(RequestError, match=r"adapter 'foreign' could not be loaded on this replica: .*to_q"):
            await b.ensure("foreign")
        outputs = [await engine.submit(request, adapter=composed).future for engine in engines]
        admin.change(lambda specs: {n: s for n, s in specs.items() if n != "detail"})
        await b.reconcile(fresh=True)
        assert "detail" not in groups[1].pipeline.denoiser.loras.loras and a.deploy_time == {"style"}
        for engine in engines:
            await engine.close()
        return outputs

    try:
        first, second = asyncio.run(scenario())
    finally:
        for group in groups:
            group.shutdown()
    assert_same_media(first, second)
