"""Several LoRA adapters in one packed forward, against diffusers' own forward with each adapter fused.

Adapters are written by the libraries' own functions (peft's ``LoraConfig`` through diffusers'
``add_adapter``, ``get_peft_model_state_dict``, diffusers' ``save_lora_weights`` for MiniMax-H3) with
seeded non-zero factors; the reference loads each with ``load_lora_weights`` and ``fuse_lora``.
"""

import copy
import dataclasses
import math

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.modular_pipelines import MiniMaxH3Blocks, MiniMaxH3ModularPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from pydantic import ValidationError

from h3serve.attention import get_backend
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.lora import (
    LoraAdapter,
    LoraError,
    LoraSpec,
    LoraSpecs,
    adapting,
    linear_kinds,
    load_partitions,
    pack_slots,
)
from h3serve.pipelines.h3.lora_spec import check_request_steps
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.request import RequestError
from tests.test_h3_forward import CONFIG, DOCUMENTS, diffusers_forward, document

ATOL = 1e-5  # fp32; packed GEMMs round differently from one document's (see test_h3_forward)
with torch.device("meta"):  # every nn.Linear kind of the transformer: all five row streams, the timestep path too
    EVERY_LAYER = linear_kinds(MiniMaxH3Transformer3DModel(**CONFIG))
# name -> (peft config, scale): mixed ranks with a rank pattern, alpha != rank, a scale != 1
ADAPTERS = {
    "turbo": (
        dict(r=4, lora_alpha=8, target_modules=EVERY_LAYER, rank_pattern={"adaln_proj.linear": 2}),
        0.7,
    ),
    "style": (  # the main blocks' attention and FFN only: no timestep path, no refiner
        dict(
            r=8,
            lora_alpha=4,
            target_modules=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))",
        ),
        1.0,
    ),
}


def lora_state_dict(base, config: LoraConfig, seed: int) -> dict[str, torch.Tensor]:
    """peft's state dict of ``config`` on ``base``, with seeded non-zero factors (peft starts B at zero)."""
    model = copy.deepcopy(base)
    model.add_adapter(config, adapter_name="trained")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
            elif ".lora_B." in name:  # [out, r]
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return get_peft_model_state_dict(model, adapter_name="trained")


def save(directory, state_dict, config: LoraConfig | None):
    MiniMaxH3ModularPipeline.save_lora_weights(
        directory,
        transformer_lora_layers=state_dict,
        transformer_lora_adapter_metadata=config.to_dict() if config is not None else None,
    )
    return directory


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    return MiniMaxH3Transformer3DModel.from_pretrained(tiny_checkpoint / "transformer").eval()


@pytest.fixture(scope="module")
def served(base):
    model = copy.deepcopy(base)
    install(model, get_backend("torch_sdpa").make_impl())
    return model


@pytest.fixture(scope="module")
def specs(base, tmp_path_factory) -> dict[str, LoraSpec]:
    out = {}
    for seed, (name, (kwargs, scale)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(**kwargs)
        directory = save(tmp_path_factory.mktemp(name), lora_state_dict(base, config, seed), config)
        out[name] = LoraSpec(path=directory, scale=scale, steps=4 if name == "turbo" else None)
    return out


@pytest.fixture(scope="module")
def adapters(served, specs) -> dict[str, LoraAdapter]:
    return {name: LoraAdapter.load(name, spec, served) for name, spec in specs.items()}


def fused_reference(base, spec: LoraSpec):
    """diffusers alone: the adapter loaded by the pipeline's ``load_lora_weights`` and fused into a copy."""
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=copy.deepcopy(base))
    pipe.load_lora_weights(spec.path, adapter_name="adapter")
    pipe.fuse_lora(components=["transformer"], lora_scale=spec.scale)
    return pipe.transformer


def run(served, docs, document_slots, adapters_by_slot, row_multiple=1):
    pack = pack_documents(docs, row_multiple=row_multiple)
    with adapting(served, adapters_by_slot, pack_slots(pack, document_slots)):
        return pack.split(*packed_forward(served, pack))


def test_every_linear_kind_targets_every_linear_layer_and_nothing_else(base, adapters):
    from peft.tuners.tuners_utils import check_target_module_exists

    linears = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    config = LoraConfig(r=4, target_modules=EVERY_LAYER)
    targeted = {n for n, _ in base.named_modules() if check_target_module_exists(config, n)}
    assert targeted == linears == set(adapters["turbo"].layers)  # the turbo adapter, written by peft, holds them all
    # one kind per repeated layer: the 4 blocks' and 2 refiner blocks' attention and FFN share theirs
    assert len(EVERY_LAYER) == len(set(EVERY_LAYER)) < len(linears) and "attn.to_q" in EVERY_LAYER


def test_adapters_read_ranks_and_alphas_from_their_own_files(adapters):
    turbo, style = adapters["turbo"], adapters["style"]
    assert (
        turbo.ranks["transformer_blocks.0.attn.to_q"] == 4
        and turbo.ranks["transformer_blocks.0.adaln_proj.linear"] == 2
    )
    assert turbo.layers["transformer_blocks.0.attn.to_q"].scaling == 8 / 4  # alpha / r
    assert turbo.layers["transformer_blocks.0.adaln_proj.linear"].scaling == 8 / 2  # rank_pattern applies
    assert "token_refiner.refiner_blocks.0.attn.to_q" in turbo.layers and "norm_out.linear" in turbo.layers
    assert set(style.ranks.values()) == {8} and all(m.startswith("transformer_blocks.") for m in style.layers)
    assert style.layers["transformer_blocks.1.ff.net.2"].scaling == 4 / 8


@pytest.mark.parametrize("row_multiple", [1, 64], ids=["no-padding", "padded-to-64"])
def test_a_pack_of_base_and_two_adapters_equals_diffusers_with_each_fused(base, served, adapters, specs, row_multiple):
    docs = [document(**spec) for spec in DOCUMENTS] + [document(**{**DOCUMENTS[0], "seed": 9})]
    # base, turbo, style, and turbo again: one adapter's rows in two places of the pack
    slots, by_slot = [0, 1, 2, 1], {1: adapters["turbo"], 2: adapters["style"]}
    weights = {k: v.clone() for k, v in served.state_dict().items()}

    outputs = run(served, docs, slots, by_slot, row_multiple)

    references = {0: base, 1: fused_reference(base, specs["turbo"]), 2: fused_reference(base, specs["style"])}
    for doc, slot, (video, audio) in zip(docs, slots, outputs, strict=True):
        expected_video, expected_audio = diffusers_forward(references[slot], doc)
        torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)
        if slot:  # the adapter really changes this document's output, far beyond the tolerance
            base_video, base_audio = diffusers_forward(base, doc)
            assert (video - base_video).abs().max() > 1e-2 and (audio - base_audio).abs().max() > 1e-2
    # base weights never written, and nothing stays installed after the pack
    assert all(torch.equal(weights[k], v) for k, v in served.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in served.modules())


def twin(adapter: LoraAdapter) -> LoraAdapter:
    """The same layers and ranks with other factors: a pack on the twin runs exactly the same kernels."""
    return dataclasses.replace(
        adapter, layers={m: dataclasses.replace(layer, up=-2 * layer.up) for m, layer in adapter.layers.items()}
    )


def test_no_adapter_delta_reaches_another_documents_rows(served, adapters):
    """Swap the adapter of some documents for a twin with other weights: the other documents' bits do not move.

    The twin has the same layers and ranks, so both packs run the same GEMMs over the same rows: any
    difference in a document that kept its adapter (or the base) is a delta that leaked into its rows.
    """
    docs = [document(**spec) for spec in DOCUMENTS] + [document(**{**DOCUMENTS[0], "seed": 9})]
    turbo, style = adapters["turbo"], adapters["style"]
    for slots, swapped in (([0, 1, 2, 1], 1), ([0, 1, 2, 1], 2), ([2, 2, 0, 1], 2)):
        first = run(served, docs, slots, {1: turbo, 2: style})
        by_slot = {1: turbo, 2: style} | {swapped: twin({1: turbo, 2: style}[swapped])}
        second = run(served, docs, slots, by_slot)
        for slot, (video, audio), (video_2, audio_2) in zip(slots, first, second, strict=True):
            if slot == swapped:  # the swap itself is visible: these are not two identical runs
                assert (video - video_2).abs().max() > 1e-2 and (audio - audio_2).abs().max() > 1e-2
            else:
                assert torch.equal(video, video_2) and torch.equal(audio, audio_2), f"slot {swapped} leaked"


def test_base_documents_beside_adapters_get_the_base_models_output(served, adapters):
    docs = [document(**spec) for spec in DOCUMENTS]
    base_only = run(served, docs, [0, 0, 0], {})
    mixed = run(served, docs, [0, 1, 2], {1: adapters["turbo"], 2: adapters["style"]})
    # the timestep path runs over twice the rows here (base and turbo groups), so GEMMs may round differently
    torch.testing.assert_close(mixed[0][0], base_only[0][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(mixed[0][1], base_only[0][1], atol=ATOL, rtol=0)


def test_fused_qkv_projections_get_each_adapters_q_k_v_deltas(served, adapters):
    fused = copy.deepcopy(served)
    fused.fuse_qkv_projections()
    assert fused.transformer_blocks[0].attn.fused_projections
    docs = [document(**spec) for spec in DOCUMENTS]
    by_slot = {1: adapters["turbo"], 2: adapters["style"]}
    for (video, audio), (expected_video, expected_audio) in zip(
        run(fused, docs, [1, 2, 0], by_slot), run(served, docs, [1, 2, 0], by_slot), strict=True
    ):
        torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)


def test_slots_of_a_pack_follow_its_documents_and_split_over_ranks():
    docs = [document(**spec) for spec in DOCUMENTS]
    pack = pack_documents(docs, row_multiple=4)
    whole = pack_slots(pack, [3, 0, 5])
    expected = torch.cat(
        [torch.full((n,), s) for n, s in zip(pack.lengths + [pack.padding_rows], [3, 0, 5, 0], strict=True)]
    )
    assert torch.equal(whole.rows, expected) and whole.groups.tolist() == [0, 3, 5]
    assert torch.equal(whole.text, expected[pack.text_indices]) and torch.equal(
        whole.video, expected[pack.video_indices]
    )
    halves = [pack_slots(pack, [3, 0, 5], rank, 2) for rank in (0, 1)]
    assert torch.equal(torch.cat([h.rows for h in halves]), whole.rows)
    assert sorted(torch.cat([h.video for h in halves]).tolist()) == sorted(whole.video.tolist())
    with pytest.raises(ValueError, match="2 entries for a pack of 3 documents"):
        pack_slots(pack, [1, 2])


def test_a_slot_without_an_adapter_is_refused(served, adapters):
    pack = pack_documents([document(**DOCUMENTS[0])])
    with pytest.raises(ValueError, match=r"slots \[4\] with no adapter"):
        with adapting(served, {1: adapters["turbo"]}, pack_slots(pack, [4])):
            pass
    with pytest.raises(ValueError, match="slot 0 is the base model"):
        with adapting(served, {0: adapters["turbo"]}, pack_slots(pack, [0])):
            pass


# ----------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def good_state_dict(base):
    return lora_state_dict(base, LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_v"]), seed=5)


def test_an_unexpected_key_is_refused_by_name(served, good_state_dict, tmp_path):
    bad = {**good_state_dict}
    bad["transformer_blocks.0.attn.to_gate.lora_A.weight"] = torch.zeros(4, 96)
    bad["transformer_blocks.0.attn.to_gate.lora_B.weight"] = torch.zeros(96, 4)
    save(tmp_path, bad, None)
    with pytest.raises(LoraError, match=r"unexpected keys.*transformer_blocks\.0\.attn\.to_gate\.lora_A\.weight") as e:
        LoraAdapter.load("bad", LoraSpec(path=tmp_path), served)
    assert str(tmp_path) in str(e.value)


def test_a_wrong_shape_is_refused_naming_the_key(served, good_state_dict, tmp_path):
    bad = {**good_state_dict, "transformer_blocks.1.attn.to_v.lora_A.weight": torch.zeros(4, 95)}
    save(tmp_path, bad, None)
    with pytest.raises(
        LoraError, match=r"mismatched shapes: transformer_blocks\.1\.attn\.to_v\.lora_A\.weight \(4, 95\)"
    ):
        LoraAdapter.load("bad", LoraSpec(path=tmp_path), served)


def test_a_missing_half_is_refused_naming_the_key(served, good_state_dict, tmp_path):
    bad = {k: v for k, v in good_state_dict.items() if k != "transformer_blocks.2.attn.to_q.lora_B.weight"}
    save(tmp_path, bad, None)
    with pytest.raises(LoraError, match=r"missing keys.*transformer_blocks\.2\.attn\.to_q\.lora_B\.weight"):
        LoraAdapter.load("bad", LoraSpec(path=tmp_path), served)


def test_a_directory_that_is_no_adapter_is_refused(served, tmp_path):
    with pytest.raises(LoraError, match=f"{tmp_path / 'nowhere'} is not a directory"):
        LoraAdapter.load("gone", LoraSpec(path=tmp_path / "nowhere"), served)
    with pytest.raises(LoraError, match=f"{tmp_path} cannot be read as a MiniMax-H3 LoRA"):
        LoraAdapter.load("empty", LoraSpec(path=tmp_path), served)


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(path="x", steps=0), "steps"),
        (dict(path="x", shift=-1.0), "shift"),
        (dict(path="x", scale=float("nan")), "scale"),
        (dict(path="x", alpha=4), "alpha"),
        (dict(steps=4), "path"),
    ],
)
def test_bad_spec_fields_are_named(fields, named):
    with pytest.raises(ValidationError, match=rf"(?s)^.*\n{named}\n"):
        LoraSpec(**fields)


def test_adapter_names_become_model_ids_so_they_are_checked():
    assert set(LoraSpecs(loras={"turbo-4": {"path": "x", "steps": 4, "shift": 5.0}}).loras) == {"turbo-4"}
    with pytest.raises(ValidationError, match="adapter name 'Turbo 4' is not allowed"):
        LoraSpecs(loras={"Turbo 4": {"path": "x"}})


def kohya_state_dict(rank: int, seed: int, alphas: bool) -> dict[str, torch.Tensor]:
    """A LoRA over the original checkpoint's module names, as ai-toolkit / kohya write them (fused qkv, fc1)."""
    c = CONFIG
    inner, hidden = c["num_attention_heads"] * c["attention_head_dim"], c["hidden_size"]
    shapes = {  # module -> (in_features, out_features) in the original layout
        "attn.qkv_proj": (hidden, 3 * inner),
        "attn.out_proj": (inner, hidden),
        "mlp.fc1": (hidden, 2 * c["ffn_dim"]),
        "mlp.fc2": (c["ffn_dim"], hidden),
        "adaln_proj.linear": (c["time_embed_dim"], 6 * hidden * 3),
    }
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for block in range(c["num_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            key = f"diffusion_model.blocks.{block}.{module}"
            out[f"{key}.lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) / math.sqrt(fan_in)
            out[f"{key}.lora_up.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.2
            if alphas:
                out[f"{key}.alpha"] = torch.tensor(float(rank // 2))
    return out


@pytest.mark.parametrize("alphas", [True, False], ids=["alpha-tensors", "metadata-alpha"])
def test_a_non_diffusers_adapter_is_converted_as_diffusers_converts_it(base, served, tmp_path, alphas):
    from safetensors.torch import save_file

    save_file(
        kohya_state_dict(8, seed=11, alphas=alphas),
        tmp_path / "lora.safetensors",
        metadata=None if alphas else {"alpha": "2"},
    )
    spec = LoraSpec(path=tmp_path, scale=1.3)
    adapter = LoraAdapter.load("kohya", spec, served)
    assert "transformer_blocks.0.attn.to_k" in adapter.layers and "transformer_blocks.3.ff.net.0.proj" in adapter.layers
    doc = document(**DOCUMENTS[1])
    (video, audio), (base_video, _) = run(served, [doc, doc], [1, 0], {1: adapter})
    expected_video, expected_audio = diffusers_forward(fused_reference(base, spec), doc)
    torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
    torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)
    assert (video - base_video).abs().max() > 1e-2


def _sp_rank(rank: int, world: int, init_file: str, checkpoint, specs, pack, document_slots, out_file: str) -> None:
    """One Ulysses rank over gloo: this rank's rows of the pack, under its own slots."""
    import torch.distributed as dist

    from h3serve.replicas.sequence_parallel import UlyssesGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = MiniMaxH3Transformer3DModel.from_pretrained(checkpoint / "transformer").eval()
        install(model, get_backend("torch_sdpa").make_impl())
        by_slot = {slot: LoraAdapter.load(name, spec, model) for slot, (name, spec) in enumerate(specs.items(), 1)}
        sp = UlyssesGroup(world, rank, model.config.num_attention_heads)
        with adapting(model, by_slot, pack_slots(pack, document_slots, rank, world)):
            result = packed_forward(model, pack, sp)
        if rank == 0:
            torch.save(result, out_file)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned gloo processes, each builds the tiny model (`make test-fast` leaves it out)
def test_ulysses_over_two_ranks_equals_one_rank(served, adapters, specs, tiny_checkpoint, tmp_path):
    """Each rank adapts only its own rows (and its own video/audio rows): sp=2 over gloo equals sp=1."""
    import torch.multiprocessing as mp

    docs = [document(**spec) for spec in DOCUMENTS]
    document_slots = [1, 0, 2]
    pack = pack_documents(docs, row_multiple=2)
    with adapting(served, {1: adapters["turbo"], 2: adapters["style"]}, pack_slots(pack, document_slots)):
        expected_video, expected_audio = packed_forward(served, pack)
    out_file = tmp_path / "rank0.pt"
    mp.spawn(
        _sp_rank,
        args=(2, str(tmp_path / "init"), tiny_checkpoint, specs, pack, document_slots, str(out_file)),
        nprocs=2,
    )
    video, audio = torch.load(out_file)
    torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
    torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)


def test_mixed_precision_adapters_follow_each_layers_dtype(tiny_checkpoint, specs):
    """The serving dtype: a bf16 body with fp32 boundary modules; each adapter layer takes its module's dtype."""
    reference = MiniMaxH3Transformer3DModel.from_pretrained(
        tiny_checkpoint / "transformer", torch_dtype=torch.bfloat16
    ).eval()
    served = copy.deepcopy(reference)
    install(served, get_backend("torch_sdpa").make_impl())
    turbo = LoraAdapter.load("turbo", specs["turbo"], served).placed_for(served)
    assert turbo.layers["transformer_blocks.0.attn.to_q"].down.dtype == torch.bfloat16
    assert turbo.layers["proj_in"].up.dtype == torch.float32  # diffusers keeps proj_in in fp32
    doc = document(**DOCUMENTS[0])
    doc.prompt_embeds = doc.prompt_embeds.bfloat16()
    ((video, audio),) = run(served, [doc], [1], {1: turbo})
    expected_video, expected_audio = diffusers_forward(fused_reference(reference, specs["turbo"]), doc)
    assert video.dtype == expected_video.dtype == torch.float32
    # diffusers rounds W + scale * B A to bf16 once; h3serve rounds W x and the delta apart (measured 1.3e-2)
    torch.testing.assert_close(video, expected_video, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(audio, expected_audio, atol=2e-2, rtol=2e-2)
    base_video, _ = diffusers_forward(reference, doc)
    assert (expected_video - base_video).abs().max() > 0.5  # the adapter's effect dwarfs the tolerance


def test_adapters_load_onto_the_partition_they_are_served_on(served, good_state_dict, tmp_path):
    # a file with `transformer.` keys serves transformer_ref too, as diffusers' load_into_transformer_ref routes it
    save(tmp_path / "plain", good_state_dict, None)
    ref = LoraAdapter.load("plain", LoraSpec(path=tmp_path / "plain"), served, partition="transformer_ref")
    assert ref.partition == "transformer_ref" and "transformer_blocks.0.attn.to_q" in ref.layers
    # a file that names transformer_ref is not served on transformer
    MiniMaxH3ModularPipeline.save_lora_weights(tmp_path / "ref", transformer_ref_lora_layers=good_state_dict)
    with pytest.raises(LoraError, match=r"keys outside the 'transformer' partition: transformer_ref\."):
        LoraAdapter.load("ref", LoraSpec(path=tmp_path / "ref"), served)


def test_a_few_step_adapter_runs_its_own_steps_and_refuses_others():
    turbo = LoraSpec(path="x", steps=4, shift=5.0)
    assert check_request_steps("turbo-4", turbo, None) == 4 and check_request_steps("turbo-4", turbo, 4) == 4
    with pytest.raises(RequestError, match="distilled for 4 steps; the request asks for 50") as e:
        check_request_steps("turbo-4", turbo, 50)
    assert e.value.field == "num_inference_steps"
    assert check_request_steps("style", LoraSpec(path="x"), 30) == 30  # an adapter without steps takes any
    with pytest.raises(RequestError, match="declares no steps"):
        check_request_steps("style", LoraSpec(path="x"), None)


# ----------------------------------------------------------------------------- an adapter for transformer_ref only


@pytest.fixture(scope="module")
def ref_base():
    """A stand-in for the checkpoint's Ref2VA partition: the same layout, its own weights."""
    torch.manual_seed(1)
    return MiniMaxH3Transformer3DModel(**CONFIG).eval()


def test_a_transformer_ref_only_adapter_adapts_that_partition_alone_as_diffusers_does(base, served, ref_base, tmp_path):
    config = LoraConfig(r=4, lora_alpha=8, target_modules=EVERY_LAYER)  # every layer, the timestep path included
    directory = tmp_path / "ref-only"
    MiniMaxH3ModularPipeline.save_lora_weights(
        directory,
        transformer_ref_lora_layers=lora_state_dict(ref_base, config, seed=7),
        transformer_ref_lora_adapter_metadata=config.to_dict(),
    )
    spec = LoraSpec(path=directory, scale=0.6)
    served_ref = copy.deepcopy(ref_base)
    install(served_ref, get_backend("torch_sdpa").make_impl())

    adapters = load_partitions("ref-only", spec, {"transformer": served, "transformer_ref": served_ref})
    assert adapters["transformer"].layers == {}  # the file names transformer_ref alone: transformer stays the base
    linears = {n for n, m in ref_base.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(adapters["transformer_ref"].layers) == linears
    with pytest.raises(LoraError, match=r"does not serve \(it serves 'transformer'\): transformer_ref\.") as e:
        load_partitions("ref-only", spec, {"transformer": served})  # a checkpoint without the Ref2VA partition
    assert "adapter 'ref-only'" in str(e.value)

    # diffusers alone: load_lora_weights routes the file into transformer_ref, fuse_lora fuses it there
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=copy.deepcopy(base), transformer_ref=copy.deepcopy(ref_base))
    pipe.load_lora_weights(directory, adapter_name="ref-only")
    pipe.fuse_lora(components=["transformer_ref"], lora_scale=spec.scale)

    docs = [document(**s) for s in DOCUMENTS]
    slots = [1, 0, 1]
    outputs = run(served_ref, docs, slots, {1: adapters["transformer_ref"]})
    for doc, slot, (video, audio) in zip(docs, slots, outputs, strict=True):
        expected_video, expected_audio = diffusers_forward(pipe.transformer_ref if slot else ref_base, doc)
        torch.testing.assert_close(video, expected_video, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, expected_audio, atol=ATOL, rtol=0)
        if slot:  # the adapter really changes this document's output, far beyond the tolerance
            base_video, _ = diffusers_forward(ref_base, doc)
            assert (video - base_video).abs().max() > 1e-2
    # on transformer, diffusers left the weights alone, and h3serve's empty adapter adds nothing: the same bits
    doc = docs[0]
    torch.testing.assert_close(diffusers_forward(pipe.transformer, doc), diffusers_forward(base, doc), atol=0, rtol=0)
    ((on_adapter, _),), ((on_base, _),) = (
        run(served, [doc], [1], {1: adapters["transformer"]}),
        run(served, [doc], [0], {}),
    )
    assert torch.equal(on_adapter, on_base)


def test_a_file_for_both_partitions_adapts_each_with_its_own_keys(served, good_state_dict, tmp_path):
    ref_state_dict = {k: -v for k, v in good_state_dict.items()}
    MiniMaxH3ModularPipeline.save_lora_weights(
        tmp_path / "both", transformer_lora_layers=good_state_dict, transformer_ref_lora_layers=ref_state_dict
    )
    spec = LoraSpec(path=tmp_path / "both")
    adapters = load_partitions("both", spec, {"transformer": served, "transformer_ref": served})
    main, ref = adapters["transformer"].layers, adapters["transformer_ref"].layers
    assert set(main) == set(ref) and main
    for module in main:
        assert torch.equal(ref[module].up, -main[module].up) and torch.equal(ref[module].down, -main[module].down)
    # one partition's view (LoraAdapter.load) still refuses the other's keys
    with pytest.raises(LoraError, match=r"keys outside the 'transformer' partition: transformer_ref\."):
        LoraAdapter.load("both", spec, served)
