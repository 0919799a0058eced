"""CI smoke of every benchmark (``--smoke`` sizes): outputs agree, checks pass, tables have their rows.

Never asserts on timings: this machine is shared and small; the numbers live in docs/BENCHMARKS.md.
"""

import json
import logging

import pytest
import ray

from benchmarks import admission, gpu_kernels, gpu_pipeline, packing, run_all, serving, sp

SCHEDULERS = ["(a) sequential", "(b) bucketed", "(c) packed engine"]


def test_packing_smoke_outputs_agree_across_the_three_schedulers(capsys, tmp_path):
    assert packing.main(["--smoke", "--json", str(tmp_path / "packing.json")]) == 0
    out = capsys.readouterr().out
    for row in SCHEDULERS + ["b-vs-a", "c-vs-a", "(c)/(a) throughput", "(c) padding"]:
        assert row in out
    assert "outputs agree across schedulers: YES" in out
    result = json.loads((tmp_path / "packing.json").read_text())
    staggered = result["scenarios"]["staggered"]
    for pair in ("b-vs-a", "c-vs-a"):
        agreement = staggered["agreement"][pair]
        assert agreement["agree"] and agreement["requests"] == len(result["workload"])
        assert agreement["max_pixel_diff"] <= 1 and agreement["max_frac_pixels_differ"] < 1e-3
    a, b, c = staggered["rounds"][0]
    assert [a["scheduler"], b["scheduler"], c["scheduler"]] == SCHEDULERS
    # counts, not times: (a) runs one forward per request-step; the burst at t=0 shares (c)'s forwards
    assert a["forwards"] == sum(r["steps"] for r in result["workload"])
    assert c["forwards"] < a["forwards"]
    assert {"met", "why"} <= set(result["targets"]["padding"])


def test_admission_smoke_selector_never_runs_on_the_request_path(capsys):
    result = admission.run(smoke=True)
    out = capsys.readouterr().out
    assert result["ok"]
    path = result["request_path"]
    assert path["completed"] == path["requests"] == 2
    assert path["selector_calls_after"] == path["selector_calls_before"]
    assert set(path["admission_frames"].values()) == {0}
    assert sum(path["calls_per_file"].get(f, 0) for f in ("replicas/engine.py", "pipelines/h3/dit.py")) > 0  # profiled
    backends = {(r["config"], r["call"]): r["backend"] for r in result["cost"]}
    assert backends[("cpu tiny auto", "decide (cold)")] == "torch_sdpa"
    assert backends[("gpu full flash_attn (h100 json)", "decide (cold)")] == "flash_attn"
    for row in ("decide (cold)", "resolve (cold)", "resolve (cached)", "attention.selector.stats.calls"):
        assert row in out


def test_gpu_kernels_cpu_dry_run(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    assert gpu_kernels.main(["--cpu-dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu" and not result.get("error")
    assert any(c["backend"] == "torch_sdpa" and c["result"] == "PASS" for c in result["correctness"])
    assert result["varlen"] and result["block"]


def test_gpu_pipeline_cpu_dry_run(tmp_path):
    out = tmp_path / "gpu_pipeline.json"
    assert gpu_pipeline.main(["--cpu-dry-run", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["backend"] == "torch_sdpa" and result["packed_vs_separate_max_abs"] < 1e-4
    assert result["mixed16_rows"] % 64 == 0


def test_run_all_knows_every_cpu_benchmark():
    assert run_all.CPU_BENCHMARKS == ("packing", "admission", "serving", "sp")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()


@pytest.mark.ray
def test_sp_smoke_sp2_equals_sp1(ray_cluster, capsys):
    result = sp.run(smoke=True)
    out = capsys.readouterr().out
    assert result["ok"] and result["rows"]
    assert all(r["allclose_1e-5"] and r["max_abs_diff"] <= 1e-5 for r in result["rows"])
    assert "1 image 64x64" in out and "sp=2 vs sp=1: YES" in out


@pytest.mark.ray
def test_serving_smoke_http_handle_and_in_process_agree(ray_cluster, capsys):
    result = serving.run(smoke=True)
    out = capsys.readouterr().out
    assert result["ok"]
    assert all(d <= 1 for d in result["pixel_diff_vs_in_process"].values())
    paths = [p["path"] for p in result["paths"]]
    assert paths[:4] == ["in-process engine", "PNG + base64 (in-process)", "Serve handle -> replica",
                         "HTTP -> proxy -> ingress -> replica"]
    assert all(path in out for path in paths) and "target HTTP / in-process" in out
