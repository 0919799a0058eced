"""The released-size step on the meta device: every path a replica takes, run by the real code.

``h3serve.pipelines.h3.meta.report.paths`` (what ``h3serve plan --paths`` prints) runs once for the module, in this
process; the tests read what it returns. ``h3serve plan`` itself runs as a user runs it.
The ``full`` transformer (33.1B parameters, bf16, diffusers' fp32 modules fp32) is built on meta once for the module,
inside a real ``H3Pipeline``; requests laid out by diffusers' builders are admitted as a denoiser admits a stage's
work and stepped by ``H3Pipeline.packs``/``forward``/``apply``. Only the attention kernel and the Ulysses collectives
stand in (``h3serve.pipelines.h3.meta.runtime``). Each path is held to: no tensor off the model's device; fp32
exactly where diffusers keeps it; its host syncs exactly ``step.SYNC_BUDGET``'s sites and counts;
``FlopCounterMode``'s FLOPs equal to ``shapes.forward_flops`` within 1%; its activation peak and its requests' own
tensors within 10% of ``h3serve/pipelines/h3/memory.py``'s plan. ~40 s on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.pipelines.h3 import packing
from h3serve.pipelines.h3.memory import memory_plan
from h3serve.pipelines.h3.meta import report
from h3serve.pipelines.h3.meta.runtime import MetaRun, MetaVarlenImpl
from h3serve.pipelines.h3.meta.step import ADAPTERS, PATHS, MetaReplica, measure
from h3serve.replicas.sequence_parallel import UlyssesGroup

pytestmark = pytest.mark.slow  # builds the released transformer on meta and steps 8 packs of up to 80k rows

FP32 = {"proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"}  # diffusers' _keep_in_fp32_modules
TOLERANCE, FLOP_TOLERANCE = 0.10, 0.01  # step.check's: memory measured / planned, FLOPs counted / formula
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def replica() -> MetaReplica:
    return MetaReplica(adapters=ADAPTERS, ulysses=UlyssesGroup)


@pytest.fixture(scope="module")
def run(replica) -> dict:
    """``paths`` (each path measured), ``checks``, ``sync_budgets``, ``model``."""
    return report.paths(replica)


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
    # composed lists: each adapted document runs both adapters, twice (e)'s deltas (the widened timestep path the same)
    composed, single = (
        measured["(f) LoRA, composed lists"]["formula"]["lora"],
        measured["(e) LoRA, 2 adapters"]["formula"]["lora"],
    )
    assert 1.9 * single < composed < 2 * single
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


def raised(fn) -> tuple[list[str], str]:
    with pytest.raises(Exception) as caught:
        fn()
    return [c.__name__ for c in type(caught.value).__mro__], str(caught.value)


def test_a_cpu_tensor_planted_in_the_pack_path_fails_the_check(replica, monkeypatch):
    """The bug the meta run exists to catch: the padding document made on the CPU (``torch.zeros`` without
    ``device=``), as the pack path once had it. A 37,966-row pack over 4 ranks needs 2 padding rows."""

    class CpuZeros:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*size, device=None, **kwargs):  # drops the device: made on torch's default device, the CPU
            return torch.zeros(*size, **kwargs)

    monkeypatch.setattr(packing, "torch", CpuZeros())
    kinds, message = raised(lambda: measure(replica, PATHS["(a) one 1344x768x124"].asks, sp_degree=4))
    assert "DeviceMismatch" in kinds
    assert re.search(r"aten\.cat.*cpu.*meta.*h3serve/pipelines/h3/packing\.py:\d+ \(pack_documents\)", message)
    assert replica.run.violations and "packing.py" in replica.run.violations[-1]


def test_the_stand_in_kernel_refuses_anything_but_meta_tensors():
    q = torch.zeros(4, 2, 8)
    kernel = MetaVarlenImpl(MetaRun())
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32)
    kinds, message = raised(lambda: kernel.forward_varlen(q, q, q, cu_seqlens=cu_seqlens, max_seqlen=4))
    assert "RuntimeError" in kinds and "meta tensors only" in message


def test_a_step_over_ranks_needs_the_ulysses_group_handed_in():
    """pipelines import nothing from replicas: a replica built without the group refuses a step over ranks."""
    with pytest.raises(ValueError, match="Ulysses group"):
        measure(MetaReplica(), PATHS["(a) one 1344x768x124"].asks, sp_degree=4)


def test_plan_prints_the_gpu_configs_step_projected(tmp_path):
    """``h3serve plan`` as a user runs it, on the H200 config: rank 0's counts at sp=4 and the PROJECTED seconds."""
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [sys.executable, "-m", "h3serve.deploy.driver.cli", "plan", "h3serve/deploy/serve_config.gpu.yaml",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["h3serve"]["placement"]["projection"]
    assert {(r["pack"], r["rows"], r["sp_degree"]) for r in rows} == {
        ("one released clip", 37968, 4), ("row budget (79,932 rows)", 79932, 4)
    }  # fmt: skip
    assert sorted(r["gemm_efficiency"] for r in rows if r["gpu"] == "H200") == [0.4, 0.4, 0.6, 0.6, 0.8, 0.8]
    assert all(r["gemm"] > 0 and r["attention"] > 0 and r["all_to_all"] > 0 and r["fits"] for r in rows)
    assert "PROJECTED (not measured)" in done.stdout and "FlashAttention-3" in done.stdout
    assert "a GPU run replaces it with" in done.stdout


def test_plan_refuses_a_config_of_another_model():
    done = subprocess.run(
        [sys.executable, "-m", "h3serve.deploy.driver.cli", "plan", "h3serve/deploy/serve_config.yaml"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "model: full" in done.stderr + done.stdout


def test_every_stage_of_a_clip_is_counted_by_the_libraries_own_classes(replica):
    """Qwen3-VL's prefill at the released config (51 layers), the VAEs at diffusers' defaults, run on meta under
    ``FlopCounterMode``; the prefill's count equals the decoder's GEMMs and attention by hand; the end-to-end rows
    are the sum of their stages (a small clip: a released decode takes minutes on meta)."""
    from h3serve.pipelines.h3.memory import RELEASED_TEXT_ENCODER
    from h3serve.pipelines.h3.meta import projection
    from h3serve.pipelines.h3.meta.stages import bf16_video_decode, conditioning, stage_counts
    from h3serve.pipelines.h3.shapes import Clip

    t2va, fl2va = conditioning(Clip(1344, 768, 124)), conditioning(Clip(1344, 768, 124, keyframes=("first", "last")))
    text = RELEASED_TEXT_ENCODER["text_config"]
    d, heads, kv, hd, ffn = (text[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                               "intermediate_size"))  # fmt: skip
    n, layers = 256, 51
    per_layer = 2 * n * (d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * ffn) + 4 * n * n * heads * hd
    assert abs(t2va.flops / (layers * per_layer) - 1) < 0.01, t2va
    assert fl2va.flops > 5 * t2va.flops  # two keyframes' 2,016 vision rows through the vision tower and the decoder
    small = Clip(256, 256, 124)  # one tile
    counts = stage_counts(small)
    assert [c.stage for c in counts] == ["conditioning (Qwen3-VL prefill)", "video decode (VAE)", "audio decode (VAE)"]
    assert all(c.flops > 0 and c.weight_bytes > 0 for c in counts)
    bf16 = bf16_video_decode(counts[1])
    assert bf16.flops == counts[1].flops and counts[1].weight_bytes / 2 < bf16.weight_bytes < counts[1].weight_bytes
    rows = projection.end_to_end(replica, small)
    assert [r["placement"] for r in rows] == [p.name for p in projection.PLACEMENTS]
    for r in rows:
        s = {name: st["s"] for name, st in r["stages"].items()}
        both = s["conditioning"] + s["denoising"] + s["mp4"]
        bf16_s = s["video decode bf16, by tiles"]
        assert r["totals"][projection.TODAY] == both + max(s["video decode fp32, 1 GPU"], s["audio decode fp32"])
        assert r["totals"][projection.RELEASED_WAY] == both + max(bf16_s, s["audio decode TF32"])
        assert bf16_s < s["video decode fp32, 1 GPU"] and s["audio decode TF32"] < s["audio decode fp32"]
