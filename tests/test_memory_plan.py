"""The memory plan: weights counted from configs equal the loaded checkpoint's, the activation formula equals
the measured per-row cost, and admission refuses a rank that cannot fit its device (counted, reason "memory").
With stage deployments of their own, each role (denoiser ranks, conditioner, decoder) counts what that role
really loads, and the released model's staged layout fits H100s where the one-deployment layout does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3serve.attention import Platform
from h3serve.pipelines.h3 import H3Pipeline, H3StageModels
from h3serve.pipelines.h3 import checkpoint as ckpt
from h3serve.pipelines.h3.admission import MemoryBudgetError, check_memory
from h3serve.pipelines.h3.memory import DEFAULT_RESERVE_BYTES, TEXT_ENCODER_LAYER, GiB, memory_plan
from tests.test_replicas import RESOLUTION

TOLERANCE = 0.05  # |formula bytes per row / measured - 1| (tests/live_memory.py)

REPO = Path(__file__).resolve().parents[1]
PLATFORMS = REPO / "h3serve" / "deploy" / "platforms"


def loaded_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gpu_args(name: str = "serve_config.gpu.yaml", stages: bool = True):
    """The shipped config's args; ``stages`` False: without its stages section (the one-deployment layout)."""
    import yaml

    from h3serve.deploy.common.args import DeployArgs

    config = yaml.safe_load((REPO / "h3serve" / "deploy" / name).read_text())
    raw = config["applications"][0]["args"]
    if not stages:
        raw.pop("stages")
    return DeployArgs.model_validate(raw)


def platform(name: str) -> Platform:
    return Platform.model_validate_json((PLATFORMS / name).read_text())


def held_bytes(models: dict[str, torch.nn.Module]) -> dict[str, int]:
    return {name: loaded_bytes(model) for name, model in models.items()}


@pytest.mark.parametrize(
    "dtype, vae_dtype", [("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")]
)
def test_weights_from_configs_equal_the_loaded_checkpoint(tiny_checkpoint, dtype, vae_dtype):
    """Counted on the meta device from the checkpoint's configs; loaded with the replicas' own loaders (the VAEs at
    ``vae_dtype`` with their ``_keep_in_fp32_modules`` in fp32, as ``stage_models`` loads them)."""
    plan = memory_plan(
        model="tiny", checkpoint=str(tiny_checkpoint), dtype=dtype, sp_degree=2, max_rows=4096, vae_dtype=vae_dtype
    )
    rank0, workers = plan.ranks
    index = ckpt.CheckpointIndex(tiny_checkpoint)
    served = getattr(torch, dtype)
    transformer = ckpt.load_model(index, "transformer", served, "cpu")
    assert {p.dtype for p in transformer.parameters()} == {torch.float32, served}  # boundary layers stay fp32
    text_encoder = ckpt.load_model(index, "text_encoder", served, "cpu")
    ckpt.keep_decoder_layers(text_encoder, TEXT_ENCODER_LAYER + 1)
    assert rank0.weights == {
        "transformer": loaded_bytes(transformer),
        "text_encoder": loaded_bytes(text_encoder),
        "vae": loaded_bytes(vae := ckpt.load_model(index, "vae", getattr(torch, vae_dtype), "cpu")),
        "audio_vae": loaded_bytes(ckpt.load_model(index, "audio_vae", getattr(torch, vae_dtype), "cpu")),
    }
    if vae_dtype == "bfloat16":  # the load kept its _keep_in_fp32_modules in fp32, and the count above matched it
        assert {p.dtype for p in vae.parameters()} == {torch.float32, torch.bfloat16}
    assert workers.role == "worker ranks" and workers.weights == {"transformer": loaded_bytes(transformer)}


def test_every_partition_of_the_checkpoint_is_on_every_rank(tmp_path):
    directory = ckpt.write_tiny_checkpoint(tmp_path / "ref", with_ref=True)
    plan = memory_plan(model="tiny", checkpoint=str(directory), dtype="float32", sp_degree=2, max_rows=1024)
    for rank in plan.ranks:
        assert rank.weights["transformer_ref"] == rank.weights["transformer"] > 0
    assert not any("not readable" in note for note in plan.notes)  # read from the checkpoint itself


def test_an_unreadable_checkpoint_is_said_in_the_plan():
    plan = memory_plan(model="full", checkpoint="/nonexistent/MiniMax-H3", dtype="bfloat16", sp_degree=4, max_rows=8)
    assert "transformer_ref/ is not counted" in plan.notes[0] and "transformer_ref" not in plan.ranks[0].weights


def test_activations_split_over_ranks_and_the_row_budget_that_fits_is_exact():
    one = memory_plan(model="full", checkpoint=None, dtype="bfloat16", sp_degree=1, max_rows=80000)
    four = memory_plan(model="full", checkpoint=None, dtype="bfloat16", sp_degree=4, max_rows=80000)
    assert len(one.ranks) == 1 and [r.role for r in four.ranks] == ["rank 0", "worker ranks"]
    cost = four.row_cost
    block = cost.local * 20000 + cost.kept_text * 80000  # every row a prompt row at worst
    refiner = cost.refiner_text * 80000  # every rank refines every prompt: not split by Ulysses
    assert four.ranks[0].activation_bytes == int(cost.per_pack_row * 80000 + max(block, refiner))
    assert one.ranks[0].activation_bytes > four.ranks[0].activation_bytes
    worker = four.ranks[1]
    device = worker.weight_bytes + worker.reserve_bytes + 2**30
    fits = four.rows_that_fit(worker, device)
    assert cost.bytes_for(fits, 4) <= 2**30 < cost.bytes_for(fits + 4, 4)


@pytest.mark.slow  # ~20 s: three packs on one rank, then the same over 2 Ulysses ranks (gloo processes)
def test_formula_matches_the_measured_per_row_cost():
    """The peak live bytes of real packed forwards (tiny, CPU) grow by the formula's bytes per row, on one rank and
    on each of 2 Ulysses ranks (``tests/live_memory.py``: packs of 1, 2 and 4 documents, sp_degree 2)."""
    from tests.live_memory import measure

    result = measure((1, 2, 4), sp_degree=2)
    peaks = [p["peak_bytes"] for p in result["points"]]
    assert peaks == sorted(peaks) and peaks[-1] > 3 * peaks[0]  # linear in rows, not constant
    assert abs(result["ratio"] - 1) <= TOLERANCE, result
    assert abs(result["attention_ratio"] - 1) <= TOLERANCE, result  # the attention phase's own peak too
    assert result["attention_phase_bytes_per_row"] < result["measured_bytes_per_row"]  # the SwiGLU is the peak
    sp = result["sp"]
    assert len(sp["ratios"]) == 2 and all(abs(r - 1) <= TOLERANCE for r in sp["ratios"]), sp
    # each rank holds less than one rank alone, but more than half: inputs and prompts are on every rank
    assert (
        result["measured_bytes_per_row"] / 2 < min(sp["measured_bytes_per_pack_row"]) < result["measured_bytes_per_row"]
    )


def test_the_released_rank_zero_is_refused_on_an_h100_and_admitted_on_an_h200():
    args = gpu_args()
    plan = memory_plan(
        model=args.model, checkpoint=args.checkpoint, dtype=args.dtype, sp_degree=args.sp_degree, max_rows=80000
    )
    h100 = Platform.model_validate_json((PLATFORMS / "h100-flash-attn.json").read_text())
    h200 = Platform.model_validate_json((PLATFORMS / "h200-flash-attn.json").read_text())
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(plan, h100)
    message = str(refused.value)
    assert refused.value.reason == "memory"
    assert message.startswith("rank 0 needs") and "worker ranks" not in message  # a worker rank fits 80 GB
    for number in ("transformer 61.7 GiB", "text_encoder 50.3 GiB", "vae 9.7 GiB", "79.6 GiB"):
        assert number in message
    assert "no max_rows_per_step fits" in message
    assert "largest max_rows_per_step that fits is" in check_memory(plan, h200)


def test_a_row_budget_too_large_is_refused_with_the_one_that_fits():
    plan = memory_plan(model="full", checkpoint=None, dtype="bfloat16", sp_degree=4, max_rows=2_000_000)
    h200 = Platform.model_validate_json((PLATFORMS / "h200-flash-attn.json").read_text())
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(plan, h200)
    fits = plan.max_rows_that_fit(h200.device_memory_bytes or 0)
    assert f"the largest max_rows_per_step that fits is {fits}" in str(refused.value)
    smaller = memory_plan(model="full", checkpoint=None, dtype="bfloat16", sp_degree=4, max_rows=fits)
    check_memory(smaller, h200)


def test_cuda_without_device_memory_fails_closed_and_cpu_is_not_checked():
    plan = memory_plan(model="tiny", checkpoint=None, dtype="float32", sp_degree=1, max_rows=1024)
    with pytest.raises(MemoryBudgetError, match="does not state device_memory_bytes"):
        check_memory(plan, Platform.cuda(kernel_libraries={"flash_attn": "2.8.3"}))
    assert "not checked on cpu" in check_memory(plan, Platform.cpu())
    assert plan.ranks[0].reserve_bytes == DEFAULT_RESERVE_BYTES


def test_admit_counts_a_memory_refusal_like_an_attention_refusal():
    from h3serve.deploy.driver.preflight import admit

    args = gpu_args(stages=False)  # rank 0 with Qwen3-VL and the VAEs beside the transformer
    recorded: list[dict[str, str]] = []
    h100 = Platform.model_validate_json((PLATFORMS / "h100-flash-attn.json").read_text())
    with pytest.raises(MemoryBudgetError):
        admit(args, "preflight", h100, record=recorded.append)
    h200 = Platform.model_validate_json((PLATFORMS / "h200-flash-attn.json").read_text())
    assert admit(args, "preflight", h200, record=recorded.append).resolution.backend == "flash_attn"
    assert [(t["outcome"], t["reason"], t["backend"], t["stage"]) for t in recorded] == [
        ("rejected", "memory", "flash_attn", "preflight"),
        ("admitted", "ok", "flash_attn", "preflight"),
    ]


def test_with_stages_every_role_counts_what_its_deployment_loads(tiny_checkpoint):
    """Rank 0 and the workers: the transformer a denoiser-only pipeline holds; the conditioner and the decoder:
    the models their stage deployments load (H3StageModels), each with the reserve and no pack rows."""
    kwargs = dict(model="tiny", checkpoint=str(tiny_checkpoint), dtype="float32", sp_degree=2, max_rows=4096)
    plan = memory_plan(**kwargs, stages="remote")  # type: ignore[arg-type]
    assert [role.role for role in plan.roles] == ["rank 0", "worker ranks", "conditioner", "decoder"]
    rank0, workers = plan.ranks
    denoiser = H3Pipeline.load(tiny_checkpoint, "torch_sdpa", stages="remote")
    assert rank0.weights == workers.weights == held_bytes(denoiser.held_models())
    assert set(rank0.weights) == {"transformer"}
    conditioner, decoder = plan.stages
    assert conditioner.weights == held_bytes(H3StageModels.load("conditioner", tiny_checkpoint).held_models())
    assert decoder.weights == held_bytes(H3StageModels.load("decoder", tiny_checkpoint).held_models())
    assert set(conditioner.weights) == {"text_encoder", "vae", "audio_vae"} and set(decoder.weights) == {
        "vae",
        "audio_vae",
    }
    for stage in plan.stages:
        assert stage.activation_bytes == 0 and stage.reserve_bytes == DEFAULT_RESERVE_BYTES
    # the one-deployment plan is unchanged: rank 0 holds the conditioner's models beside the transformer
    local = memory_plan(**kwargs)  # type: ignore[arg-type]
    assert local.stages == () and local.ranks[0].weights == {**rank0.weights, **conditioner.weights}
    assert local.ranks[0].weights == held_bytes(H3Pipeline.load(tiny_checkpoint, "torch_sdpa").held_models())
    assert plan.ranks[0].activation_bytes == local.ranks[0].activation_bytes  # the same pack on the same ranks
    device = DEFAULT_RESERVE_BYTES + 2**26  # the reserve and 64 MiB: room for the tiny weights and some rows
    assert plan.rows_that_fit(rank0, device) > local.rows_that_fit(local.ranks[0], device) > 0  # rank 0 has more


def test_the_released_model_fits_h100s_with_stages_and_its_rank0_does_not_without():
    h100 = platform("h100-flash-attn.json")
    staged = memory_plan_of(gpu_args("serve_config.h100.yaml"))
    rank0, workers = staged.ranks
    assert rank0.weights == workers.weights and set(rank0.weights) == {"transformer"}
    checked = check_memory(staged, h100)
    fits = staged.max_rows_that_fit(h100.device_memory_bytes or 0)
    assert f"the largest max_rows_per_step that fits is {fits}" in checked and fits >= staged.max_rows
    assert "the conditioner stage fits it with" in checked and "the decoder stage fits it with" in checked
    table = staged.table(h100.device_memory_bytes)
    assert "conditioner" in table and "decoder" in table and "(no rows)" in table
    # the VAEs as released on GPUs (vae_dtype bfloat16): the video VAE's encoder and norms stay fp32, most of the audio
    # VAE too (9.7 GiB and 577.2 MiB in fp32)
    for number in ("transformer 61.7 GiB", "text_encoder 50.3 GiB", "vae 5.2 GiB", "audio_vae 577.2 MiB"):
        assert number in table
    # the same config in one deployment: rank 0 also holds Qwen3-VL and both VAEs, and no row budget fits it
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(memory_plan_of(gpu_args("serve_config.h100.yaml", stages=False)), h100)
    message = str(refused.value)
    assert message.startswith("rank 0 needs") and "worker ranks" not in message and "conditioner" not in message
    for number in ("transformer 61.7 GiB", "text_encoder 50.3 GiB", "vae 5.2 GiB", "has 79.6 GiB"):
        assert number in message
    assert "no max_rows_per_step fits" in message


def memory_plan_of(args):
    from h3serve.deploy.driver.preflight import deployment_memory_plan

    return deployment_memory_plan(args)


def test_a_stage_that_does_not_fit_is_refused_whatever_the_row_budget(tiny_checkpoint):
    """The tiny conditioner (Qwen3-VL's 51 layers and both VAEs) outweighs the tiny transformer: on a device
    between the two only the conditioner is refused, and no row budget is offered for it."""
    plan = memory_plan(
        model="tiny", checkpoint=str(tiny_checkpoint), dtype="float32", sp_degree=1, max_rows=64, stages="remote"
    )
    rank0, (conditioner, decoder) = plan.ranks[0], plan.stages
    assert rank0.total_bytes < conditioner.total_bytes  # what makes this device size possible
    device = (rank0.total_bytes + conditioner.total_bytes) // 2
    small = Platform.cuda(kernel_libraries={"flash_attn": "2.8.3"}, device_memory_bytes=device)
    with pytest.raises(MemoryBudgetError) as refused:
        check_memory(plan, small)
    message = str(refused.value)
    assert refused.value.reason == "memory"
    assert message.startswith("conditioner needs") and "rank 0" not in message.split("; note")[0]
    assert "the conditioner stage holds no pack rows: its weights and reserve alone exceed the device" in message
    assert "max_rows_per_step that fits" not in message
    assert ("decoder needs" in message) == (decoder.total_bytes > device)


def test_admit_counts_a_staged_h100_admission_and_the_unstaged_refusal():
    from h3serve.deploy.driver.preflight import admit

    recorded: list[dict[str, str]] = []
    h100 = platform("h100-flash-attn.json")
    assert (
        admit(gpu_args("serve_config.h100.yaml"), "preflight", h100, record=recorded.append).resolution.backend
        == "flash_attn"
    )
    with pytest.raises(MemoryBudgetError):
        admit(gpu_args("serve_config.h100.yaml", stages=False), "preflight", h100, record=recorded.append)
    assert [(t["outcome"], t["reason"], t["stage"]) for t in recorded] == [
        ("admitted", "ok", "preflight"),
        ("rejected", "memory", "preflight"),
    ]


# --- the plan measured: the warm-up at the row budget (issue 53) ---------------------------------


H200_BYTES = 150_754_820_096  # torch.cuda.mem_get_info's total on an H200 (140.4 GiB)


def test_a_warm_up_within_the_plan_and_its_reserve_serves_and_one_past_it_is_refused_naming_rank_plan_and_bytes():
    """The shipped H200 config's plan (sp 4, 80,000 rows), as admission makes it and the replica receives it, against
    device uses a warm-up at the row budget could measure: spending the reserve is the plan; past it, the replica
    refuses to serve, naming the rank, its plan and the measured bytes."""
    from h3serve.pipelines.h3.memory import MeasuredUse, PlanExceeded, check_measured, planned_by_role

    args = gpu_args()
    spec = args.replica_spec(RESOLUTION, plan=memory_plan_of(args))  # what every replica of the deployment gets
    planned = spec.memory_plan
    assert planned is not None and set(planned) == {"rank 0", "worker ranks"}
    assert planned == planned_by_role(memory_plan_of(args))
    rank0, worker = planned["rank 0"], planned["worker ranks"]
    tensors0 = rank0["weights"] + rank0["activations"] + rank0["requests"]
    tensors = worker["weights"] + worker["activations"]
    assert worker["requests"] == 0 and rank0["reserve"] == worker["reserve"] == 4 * GiB

    def use(rank, used, tensor_peak):
        return MeasuredUse(rank, H200_BYTES - used, H200_BYTES, tensor_peak)

    fine = [
        use(0, tensors0 + 3 * GiB, tensors0 - GiB),  # the context, NCCL and the allocator's cache took 3 GiB
        use(1, tensors + worker["reserve"], tensors),  # the whole reserve spent, not more
        use(2, tensors + GiB, tensors),
        use(3, tensors, tensors),
    ]
    lines = check_measured(planned, fine)
    assert [line.split(":")[0] for line in lines] == [
        "rank 0 (rank 0)",
        "rank 1 (worker ranks)",
        "rank 2 (worker ranks)",
        "rank 3 (worker ranks)",
    ]
    assert "planned 65.2 GiB" in lines[1] and "+ reserve 4.0 GiB = 69.2 GiB" in lines[1], lines[1]

    past = tensors + worker["reserve"] + 2**20  # 1 MiB past the reserve on rank 2
    with pytest.raises(PlanExceeded) as refused:
        check_measured(planned, [*fine[:2], use(2, past, tensors), fine[3]])
    message = str(refused.value)
    assert "refuses to serve" in message and "rank 2 (worker ranks)" in message
    assert all(f"rank {r} (" not in message for r in (0, 1, 3))  # only the rank past its plan is named
    assert f"{past} bytes measured, {tensors + worker['reserve']} planned with the reserve" in message
    assert "4.0 GiB past the plan, more than its reserve" in message
    assert "engine.max_rows_per_step" in message  # what the operator can do about it


def test_a_measured_rank_without_a_plan_for_its_role_fails_closed():
    from h3serve.pipelines.h3.memory import MeasuredUse, check_measured, planned_by_role

    solo = planned_by_role(memory_plan(model="tiny", checkpoint=None, dtype="float32", sp_degree=1, max_rows=1024))
    with pytest.raises(ValueError, match="rank 1: no plan for 'worker ranks'"):
        check_measured(solo, [MeasuredUse(1, 0, GiB, 0)])
