"""The released-size step on the meta device: every path a replica takes, run by the real code.

``python -m benchmarks.meta_step --self-test --json`` runs once for the module, as a user runs it; the tests read its
JSON.
The ``full`` transformer (33.1B parameters, bf16, diffusers' fp32 modules fp32) is built on meta once for the module,
inside a real ``H3Pipeline``; requests laid out by diffusers' builders are admitted as a denoiser admits a stage's
work and stepped by ``H3Pipeline.packs``/``forward``/``apply``. Only the attention kernel and the Ulysses collectives
stand in (``benchmarks.meta_device``). Each path is held to: no tensor off the model's device; fp32 exactly where
diffusers keeps it; its host syncs exactly ``meta_step.SYNC_BUDGET``'s sites and counts; ``FlopCounterMode``'s FLOPs
equal to ``shapes.forward_flops`` within 1%; its activation peak and its requests' own tensors within 10% of
``h3serve/pipelines/h3/memory.py``'s plan. ~40 s on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.pipelines.h3.memory import memory_plan

pytestmark = pytest.mark.slow  # builds the released transformer on meta and steps 8 packs of up to 80k rows

FP32 = {"proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"}  # diffusers' _keep_in_fp32_modules
TOLERANCE, FLOP_TOLERANCE = 0.10, 0.01  # benchmarks.meta_step's: memory measured / planned, FLOPs counted / formula


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """The benchmark's JSON: ``paths`` (each path measured), ``checks``, ``sync_budgets``, ``model``, ``self_test``."""
    out = tmp_path_factory.mktemp("meta_step") / "meta_step.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.meta_step", "--self-test", "--json", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.exists(), done.stdout[-5000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def measured(run) -> dict[str, dict]:
    return run["paths"]


def test_every_path_passes_its_budgets_and_the_plan(run, measured):
    """One summary first: every path, every check (the tests below say which one broke)."""
    assert run["checks"] == {name: [] for name in measured}


def test_every_tensor_of_every_path_is_on_the_models_device(measured):
    for name, result in measured.items():
        assert result["violations"] == [], name
    ulysses = measured["(c) sp=4, rank 0"]["collectives"]
    # every block exchanges q, k and v for heads and the output back; rank 0 gathers the projected rows once; the
    # ranks agree once after the prologue
    assert ulysses == {"alltoall_base_.default": 4 * 50, "gather_.default": 1, "allreduce_.default": 1}
    cached = measured["(d) sp=4, rank 0"]["collectives"]
    assert "_allgather_base_.default" in cached  # the cache's transitions
    assert cached["broadcast_.default"] == 1  # its one decision, rank 0's on every rank


def test_fp32_runs_exactly_where_diffusers_keeps_it(run, measured):
    assert set(run["model"]["keep_in_fp32_modules"]) >= FP32
    for name, result in measured.items():
        assert set(result["fp32_linears"]) == FP32, name  # and every other linear layer ran in bf16
        assert result["mismatched_linears"] == [], name  # every linear's input came in its weight's dtype
        assert result["attention_dtypes"] == ["torch.bfloat16"], name
    assert run["model"]["rope_inv_freq_dtype"] == str(torch.float32)


def test_counted_flops_equal_the_formula(measured):
    one = measured["(a) one 1344x768x124"]
    assert one["rows"] == 37966 and abs(one["flops"] / 1e15 - 3.53) < 0.005  # the 3.53 PFLOP a step
    for name, result in measured.items():
        if name == "(d) sp=4, rank 0":  # a sub-pack padded and split over the ranks: the formula leaves it out
            assert "formula" not in result
            continue
        assert abs(result["flops_ratio"] - 1) <= FLOP_TOLERANCE, (name, result["flops"], result["formula"])
    # the skipping document's middle blocks are not run; the adapters' deltas are
    assert measured["(d) step cache"]["skipped"] == [False] * 5 + [True]
    assert measured["(e) LoRA, 2 adapters"]["formula"]["lora"] > 0
    # over 4 ranks each computes a quarter of the blocks' work, and every rank refines every prompt
    sharded, whole = measured["(c) sp=4, rank 0"]["flops"], measured["(c) H200 row budget"]["flops"]
    assert whole / 4 < sharded < whole / 4 * 1.01


def test_host_syncs_are_the_budgeted_ones(run, measured):
    for name, result in measured.items():
        sites: dict[str, int] = {}
        for site in result["sync_sites"]:
            sites[site] = sites.get(site, 0) + 1
        assert sites == run["sync_budgets"][name], (name, result["syncs"])
    # a step of base documents at sp_degree 1 waits for the device three times, all before its forward's kernels
    assert measured["(a) one 1344x768x124"]["mid_forward_syncs"] == 0


def test_the_memory_plan_is_within_ten_percent_of_the_meta_peak(measured):
    for name, result in measured.items():
        plan = result["plan"]
        assert abs(plan["activation_ratio"] - 1) <= TOLERANCE, (name, plan, result["peak_at"])
        assert abs(plan["request_ratio"] - 1) <= TOLERANCE, (name, plan)


def test_weights_per_rank_are_the_plans(run):
    plan = memory_plan(model="full", checkpoint=None, dtype="bfloat16", sp_degree=4, max_rows=80000)
    transformer = run["model"]["parameter_bytes"]  # every parameter of the meta replica's transformer, in bytes
    assert plan.ranks[1].weights == {"transformer": transformer}
    assert run["model"]["parameters"] == 33_122_992_896


def test_a_cpu_tensor_planted_in_the_pack_path_fails_the_check(run):
    """The bug the meta run exists to catch: the padding document made on the CPU (``torch.zeros`` without
    ``device=``), as the pack path once had it. A 37,966-row pack over 4 ranks needs 2 padding rows. The benchmark's
    ``--self-test`` plants it (``packing.torch.zeros`` dropping the device) and reports what the run raised."""
    planted = run["self_test"]["planted_cpu_zeros"]
    assert "DeviceMismatch" in planted["raised"]
    assert re.search(
        r"aten\.cat.*cpu.*meta.*h3serve/pipelines/h3/packing\.py:\d+ \(pack_documents\)", planted["message"]
    )
    assert planted["last_violation"] and "packing.py" in planted["last_violation"]


def test_the_stand_in_kernel_refuses_anything_but_meta_tensors(run):
    refused = run["self_test"]["stand_in_kernel"]  # forward_varlen given CPU tensors
    assert "RuntimeError" in refused["raised"] and re.search("meta tensors only", refused["message"])
