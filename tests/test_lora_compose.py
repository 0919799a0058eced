"""Several LoRA adapters composed on one request, each at its own weight, in packs beside other compositions, single
adapters and the base model: against diffusers' own ``set_adapters(names, weights)`` + ``fuse_lora`` per request.

Adapters are made with peft's own API (``LoraConfig`` through diffusers' ``add_adapter``) and written by diffusers'
``save_lora_weights`` (``tests/test_lora.py``); the reference loads each with ``load_lora_weights``.
"""

import copy

import pytest
import torch
from diffusers.modular_pipelines import MiniMaxH3Blocks
from peft import LoraConfig

from h3serve.pipelines.h3 import GenerationRequest, H3Pipeline
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.lora import LoraAdapter, LoraSpec, LoraSpecs, adapting, pack_slots
from h3serve.pipelines.h3.lora_spec import LoraLimits, composition_key, parse_composition
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.request import RequestError
from tests.test_h3_forward import DOCUMENTS, diffusers_forward, document
from tests.test_lora import ATOL, EVERY_LAYER, base, lora_state_dict, save, served  # noqa: F401  (fixtures)

# name -> (peft config, deploy-time scale, steps): the few-step adapter adapts every layer (the timestep path too)
COMPOSABLE = {
    "turbo": (dict(r=4, lora_alpha=8, target_modules=EVERY_LAYER, rank_pattern={"adaln_proj.linear": 2}), 0.7, 4),
    "style": (  # the main blocks' attention and FFN only
        dict(
            r=8,
            lora_alpha=4,
            target_modules=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
        ),
        1.0,
        None,
    ),
    "motion": (dict(r=2, lora_alpha=2, target_modules=["ff.net.0.proj", "ff.net.2"]), 1.0, None),  # a subset
    "detail": (dict(r=6, lora_alpha=3, target_modules=EVERY_LAYER, use_rslora=True), 0.5, None),  # all modules
}
# the request's lists: two; three with one negative weight; a subset beside one on all; Turbo with another
CASES = {
    "two": [("style", 0.8), ("detail", 1.3)],
    "three-negative": [("style", 0.5), ("motion", -0.7), ("detail", 1.2)],
    "subset-beside-all": [("motion", 1.5), ("detail", None)],  # None: the adapter's own scale (0.5)
    "turbo-with-another": [("turbo", None), ("style", 0.6)],
}


@pytest.fixture(scope="module")
def specs(base, tmp_path_factory) -> dict[str, LoraSpec]:  # noqa: F811
    out = {}
    for seed, (name, (kwargs, scale, steps)) in enumerate(COMPOSABLE.items(), start=10):
        config = LoraConfig(**kwargs)
        directory = save(tmp_path_factory.mktemp(name), lora_state_dict(base, config, seed), config)
        out[name] = LoraSpec(path=directory, scale=scale, steps=steps)
    return out


@pytest.fixture(scope="module")
def adapters(served, specs) -> dict[str, LoraAdapter]:  # noqa: F811
    return {name: LoraAdapter.load(name, spec, served) for name, spec in specs.items()}


def composed_reference(base, specs: dict[str, LoraSpec], uses):  # noqa: F811
    """diffusers alone: every adapter loaded by ``load_lora_weights``, activated by ``set_adapters(names, weights)``
    (a weight left out: the adapter's deploy-time scale) and fused into a copy of the base transformer."""
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=copy.deepcopy(base))
    names = [name for name, _ in uses]
    for name in names:
        pipe.load_lora_weights(specs[name].path, adapter_name=name)
    pipe.set_adapters(names, [specs[name].scale if weight is None else weight for name, weight in uses])
    pipe.fuse_lora(components=["transformer"], adapter_names=names)
    return pipe.transformer


def test_a_pack_of_compositions_single_adapters_and_the_base_equals_diffusers_set_adapters_per_request(
    base,  # noqa: F811
    served,  # noqa: F811
    specs,
    adapters,
):
    slots = {name: slot for slot, name in enumerate(COMPOSABLE, 1)}
    by_slot = {slots[name]: adapter for name, adapter in adapters.items()}
    # every case, one single adapter (a composition of one) and the base model, all in one pack
    lists = [*CASES.values(), [("style", None)], []]
    docs = [document(**{**DOCUMENTS[i % len(DOCUMENTS)], "seed": 20 + i}) for i in range(len(lists))]
    compositions = {i: tuple((slots[n], w) for n, w in uses) for i, uses in enumerate(lists, 1) if uses}
    document_slots = [i if uses else 0 for i, uses in enumerate(lists, 1)]
    pack = pack_documents(docs, row_multiple=4)
    weights = {k: v.clone() for k, v in served.state_dict().items()}
    with adapting(served, by_slot, pack_slots(pack, document_slots), compositions):
        outputs = pack.split(*packed_forward(served, pack))

    for uses, doc, (video, audio) in zip(lists, docs, outputs, strict=True):
        reference = composed_reference(base, specs, uses) if uses else base
        expected_video, expected_audio = diffusers_forward(reference, doc)
        torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)
        if len(uses) > 1:  # the composition is not any one of its adapters: each adapter's effect is far above ATOL
            for name, _ in uses:
                alone_video, _ = diffusers_forward(composed_reference(base, specs, [(name, None)]), doc)
                assert (video - alone_video).abs().max() > 1e-2, name
    assert all(torch.equal(weights[k], v) for k, v in served.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in served.modules())


def test_composition_keys_round_trip():
    uses = (("style", 0.8), ("motion", -0.5), ("detail", None), ("tiny", 1e-05))
    key = composition_key(uses)
    assert key == "style@0.8,motion@-0.5,detail,tiny@1e-05" and parse_composition(key) == uses
    assert composition_key([("style", None)]) == "style" and parse_composition("style") == (("style", None),)
    assert composition_key([]) is None and parse_composition(None) == ()


def clip(steps: int | None = 6, **kwargs) -> GenerationRequest:
    if steps is not None:
        kwargs["num_inference_steps"] = steps
    return GenerationRequest(prompt="a bell", width=64, height=64, seed=kwargs.pop("seed", 1), **kwargs)


@pytest.fixture(scope="module")
def composing(tiny_checkpoint, specs):
    limits = LoraLimits(max_per_request=3, max_rank_per_pack=14)
    return H3Pipeline.load(tiny_checkpoint, "torch_sdpa", loras=LoraSpecs(loras=specs, limits=limits))


def test_a_request_over_the_limits_or_naming_an_unknown_adapter_is_refused_by_field(composing):
    def refused(key, steps=6, given=True):
        with pytest.raises(RequestError) as e:
            request = clip(steps) if given else clip(None)
            composing.with_adapter(request, key)
        return e.value.field, str(e.value)

    assert refused("style@1.0,anime@0.5") == (
        "lora",
        "no adapter 'anime' on this deployment; its adapters: detail, motion, style, turbo",
    )
    assert refused("anime")[0] == "model"  # the one adapter a model id names
    assert refused("style@1.0,motion@1.0,detail@1.0,turbo") == (
        "lora",
        "4 adapters; this deployment composes at most 3",
    )
    assert refused("style@1.0,style@0.5") == ("lora", "adapter 'style' is listed more than once")
    # style 8 + detail 6 + turbo 4 > 14: too much for any pack; each pair fits
    assert refused("style@1.0,detail@1.0,turbo", steps=4)[0] == "lora"
    assert "ranks sum to 18, over this deployment's max_rank_per_pack 14" in refused("style,detail,turbo", 4)[1]
    field, message = refused("turbo,style@0.6", steps=12)  # a few-step adapter in the list brings its steps
    assert field == "num_inference_steps" and "distilled for 4 steps" in message
    assert composing.with_adapter(clip(None), "turbo,style@0.6").num_inference_steps == 4


def test_requests_whose_adapters_do_not_fit_one_pack_run_in_two_packs_of_a_step(composing):
    requests = [clip(seed=s) for s in (1, 2, 3)]
    keys = ["style@0.8,detail@1.3", "motion@-0.7,style@0.5", "motion@0.3"]  # ranks 8 + 6, 2 + 8, 2
    states = [composing.prepare(composing.with_adapter(r, k), None, k) for r, k in zip(requests, keys, strict=True)]
    packs = composing.packs(states)
    # style+detail fill 14; the second adds motion to style (16 > 14): another pack, which the third joins (16 > 14
    # beside the first, 10 beside the second)
    assert [[states.index(s) for s in group] for group, _ in packs] == [[0], [1, 2]]
    assert packs[1][1].compositions == {1: ((3, -0.7), (2, 0.5)), 2: ((3, 0.3),)}
    assert packs[1][1].document_slots == [1, 2]
    # and each request ends where it would alone
    while not all(s.done for s in states):
        composing.step([s for s in states if not s.done])
    for request, key, together in zip(requests, keys, states, strict=True):
        alone = composing.prepare(composing.with_adapter(request, key), None, key)
        while not alone.done:
            composing.step([alone])
        torch.testing.assert_close(together.video_rows, alone.video_rows, atol=1e-5, rtol=0)


def test_the_ingress_reads_a_lora_list_in_every_form_and_refuses_by_field():
    from h3serve.deploy.common.args import RequestLimits
    from h3serve.deploy.common.errors import APIError
    from h3serve.deploy.ingress.adapters import lora_of
    from h3serve.deploy.ingress.bodies import ImagesBody

    specs = LoraSpecs(
        loras={"style": LoraSpec(path="s"), "turbo": LoraSpec(path="t", steps=4), "fast": LoraSpec(path="f", steps=8)},
        limits=LoraLimits(max_per_request=2),
    )

    def body(lora, form=False, **fields):
        context = {"limits": RequestLimits(), "cache": ["off"], "form": form}
        return ImagesBody.model_validate({"prompt": "x", "lora": lora, **fields}, context=context)

    def refused(lora, model_adapter=None, **fields):
        with pytest.raises(APIError) as e:
            lora_of(body(lora, **fields), model_adapter, specs)
        return e.value.param, e.value.message

    assert lora_of(body([{"name": "style", "scale": -0.5}, {"name": "turbo"}]), None, specs) == "style@-0.5,turbo@1.0"
    assert lora_of(body("style"), None, specs) == "style@1.0"  # the single form: a name, or one object
    assert lora_of(body({"name": "style", "scale": 2}), None, specs) == "style@2.0"
    assert lora_of(body('[{"name": "style", "scale": 0.25}]', form=True), None, specs) == "style@0.25"
    assert lora_of(body(None), "turbo", specs) == "turbo"  # the model id's adapter
    assert refused([{"name": "anime"}]) == (
        "lora",
        "lora: no adapter 'anime' on this deployment; its adapters: fast, style, turbo",
    )
    assert refused(["style", "turbo", "fast"])[0] == "lora"  # over max_per_request
    assert "different step counts" in refused(["turbo", "fast"])[1]
    assert refused(["style"], model_adapter="turbo")[0] == "lora"  # both the model id and a list
    assert refused(["turbo"], num_inference_steps=9)[0] == "num_inference_steps"
    for bad in ([], [{"name": "style", "weight": 1}], [{"name": "style", "scale": "nan"}], "[oops"):
        with pytest.raises(Exception) as e:
            body(bad)
        assert "lora" in str(e.value)


def test_adapter_admin_bodies_are_checked_before_any_replica_and_users_are_refused():
    import json
    from types import SimpleNamespace

    from h3serve.deploy.common.errors import APIError
    from h3serve.deploy.ingress.adapters import adapter_spec, check_admin
    from h3serve.deploy.ingress.tenants import Tenant

    specs = LoraSpecs(loras={"style": LoraSpec(path="s")})

    def refused(body):
        with pytest.raises(APIError) as e:
            adapter_spec(json.dumps(body).encode(), specs, max_steps=50)
        return e.value.status, e.value.param

    name, spec = adapter_spec(b'{"name": "motion", "path": "/m", "scale": 0.5, "steps": 4}', specs, 50)
    assert (name, spec) == ("motion", LoraSpec(path="/m", scale=0.5, steps=4))
    assert refused({"name": "Motion 2", "path": "/m"}) == (400, "name")
    assert refused({"name": "style", "path": "/s"}) == (409, "name")  # already served: DELETE it first
    assert refused({"name": "motion"}) == (400, "path")
    assert refused({"name": "motion", "path": "s3://bucket/m"}) == (400, "path")
    assert refused({"name": "motion", "path": "/m", "steps": 80}) == (400, "steps")
    assert refused({"name": "motion", "path": "/m", "rank": 4})[0] == 400  # an unknown field

    check_admin(SimpleNamespace(state=SimpleNamespace(tenant=None)))  # open mode
    check_admin(SimpleNamespace(state=SimpleNamespace(tenant=Tenant("ops", "admin"))))
    with pytest.raises(APIError) as e:
        check_admin(SimpleNamespace(state=SimpleNamespace(tenant=Tenant("alpha", "user"))))
    assert e.value.status == 403
