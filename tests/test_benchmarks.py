"""CI smoke of every benchmark (``--smoke`` sizes, GPU scripts' ``--cpu-dry-run``): checks, counts, table rows.

Each runs as a user runs it, ``python -m benchmarks.NAME ... --json PATH`` in a process of its own (``bench``), and
is judged by its exit status, its output and its JSON; the Ray ones join the session's cluster (``--address``).
Never asserts on timings: this machine is shared and small; the numbers live in docs/BENCHMARKS.md.
"""

import dataclasses
import importlib.metadata
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from h3serve.attention import get_backend
from h3serve.pipelines.h3.attention_processor import install
from h3serve.pipelines.h3.forward import packed_forward
from h3serve.pipelines.h3.packing import pack_documents
from h3serve.pipelines.h3.shapes import (
    RELEASED_TEXT_TOKENS,
    Clip,
    build_transformer,
    clip_document,
    forward_flops,
    released_bytes,
    transformer_config,
)
from h3serve.pipelines.h3.step_cache import BUILTIN_TIERS, OFF

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
SCHEDULERS = ["(a) sequential", "(b) bucketed", "(c) packed engine"]
# the benchmarks' own names, as their output and JSON spell them
TRACE_REQUEST_LEVEL, TRACE_POLICIES, TRACE_HIGH_PRIORITY = "request-level FCFS", ("fcfs", "srpt", "priority"), 5
TRACE_MODES = (TRACE_REQUEST_LEVEL, *(f"engine {p}" for p in TRACE_POLICIES))
GPU_PIPELINE_LENGTHS = (124, 141, 158, 175)
TURBO, STYLE_A, STYLE_B = "turbo-4", "style-a", "style-b"
CO_BATCHED, ONE_PER_BATCH, MERGE_SWAP = "co-batched", "one adapter per batch", "merge-swap"
LORA_SMOKE_TURBO_STEPS, LORA_RELEASED_RANKS = 2, (16, 64)
CPU_BENCHMARKS = ["packing", "admission", "serving", "sp", "trace", "default_clip", "step_cache", "lora", "stages"]
CPU_BENCHMARKS += ["preview"]
SERVED_TRACE_PHASES = ["to_engine", "queue", "prepare", "first_step", "steps", "decode_wait", "decode", "encode"]
SERVED_TRACE_PHASES += ["http"]


@dataclasses.dataclass(frozen=True)
class Run:
    code: int  # the exit status
    out: str  # what it printed (stdout)
    result: dict | None  # its --json, when it wrote one


def bench(name: str, *args: str, json_path: Path | None = None, address: str | None = None, timeout: float = 1500):
    """``python -m benchmarks.NAME ARGS [--json PATH] [--address GCS]`` from the repository root, as a user runs it."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *args]
    cmd += ["--json", str(json_path)] if json_path else []
    cmd += ["--address", address] if address else []
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    print(done.stdout[-20000:], done.stderr[-20000:], sep="\n")  # shown when the test fails
    result = json.loads(json_path.read_text()) if json_path and json_path.exists() else None
    return Run(done.returncode, done.stdout, result)


def test_packing_smoke_outputs_agree_and_every_scheduler_does_the_same_rows(tmp_path):
    run = bench("packing", "--smoke", json_path=tmp_path / "packing.json")
    assert run.code == 0
    out = run.out
    for row in SCHEDULERS + ["b-vs-a", "c-vs-a", "(c)/(a) throughput", "(c) padding", "join TTFS p50 s"]:
        assert row in out
    assert "outputs agree across schedulers: YES" in out
    result = json.loads((tmp_path / "packing.json").read_text())
    work = result["workload"]
    assert {w["task"] for w in work} == {"t2va", "fl2va"}  # T2VA and FL2VA share the packs
    staggered = result["scenarios"]["staggered"]
    for pair in ("b-vs-a", "c-vs-a"):
        agreement = staggered["agreement"][pair]
        assert agreement["agree"] and agreement["requests"] == len(work)
        assert agreement["max_pixel_diff"] <= 1 and agreement["max_frac_pixels_differ"] < 1e-3
    a, b, c = staggered["rounds"][0]
    assert [a["scheduler"], b["scheduler"], c["scheduler"]] == SCHEDULERS
    # counts, not times: (a) runs one forward per model evaluation (N grid points = N-1 of them) ...
    assert a["forwards"] == sum(w["steps"] - 1 for w in work)
    # packing never adds forwards; how many it saves depends on arrivals against service times (the engine
    # steps a prepared request at once, so a smoke of 1-2 forwards a request may finish each before the next)
    assert c["forwards"] <= a["forwards"] and b["forwards"] <= a["forwards"]
    # ... every scheduler pushes exactly the same rows through the model, and on sp=1 none of them is padding
    assert a["rows"] == b["rows"] == c["rows"] > 0
    assert a["padding_rows"] == b["padding_rows"] == c["padding_rows"] == 0
    assert result["targets"]["padding"]["value"] == 0 and result["targets"]["padding"]["met"]
    assert sum(s["requests"] for s in staggered["engine_steps"]) == a["forwards"]  # request-steps, however packed


def test_trace_quick_replays_one_trace_through_every_mode_with_the_same_outputs(tmp_path):
    run = bench("trace", "--quick", json_path=tmp_path / "trace.json")
    assert run.code == 0
    out = run.out
    result = json.loads((tmp_path / "trace.json").read_text())
    sizes = result["sizes"]
    assert (sizes["requests"], sizes["steps"], sizes["loads"]) == (6, 3, [0.8])
    kinds = [r["class"] for r in result["trace"]]
    assert sorted(kinds) == ["clip", "clip", "long", "still", "still", "still"]  # the mix: a half, a third, the rest
    assert [r["priority"] for r in result["trace"]].count(TRACE_HIGH_PRIORITY) == 1  # a tenth, at least one
    rows = result["results"]["0.8"]
    assert [r["mode"] for r in rows] == list(TRACE_MODES)
    for row in rows:
        assert set(row["per_class"]) == {"still", "clip", "long", "high priority"}
        assert [row["per_class"][k]["latency"]["n"] for k in ("still", "clip", "long", "high priority")] == [3, 2, 1, 1]
        assert all(c["ttfs"]["p99"] <= c["latency"]["p99"] for c in row["per_class"].values())  # a step before done
        agreement = row["agreement"]  # every request's output against request-level FCFS's
        assert agreement["agree"] and agreement["requests"] == 6 and agreement["max_pixel_diff"] <= 1
        assert 0 < row["duty_cycle"] <= 1
    by_mode = {r["mode"]: r for r in rows}
    # counts, not times: request-level FCFS runs one forward per model evaluation and never pauses a request;
    # the engines pack some of those evaluations together
    assert by_mode[TRACE_REQUEST_LEVEL]["forwards"] == 6 * (3 - 1)
    assert by_mode[TRACE_REQUEST_LEVEL]["preemptions"] == 0
    assert all(0 < by_mode[f"engine {p}"]["forwards"] <= 12 for p in TRACE_POLICIES)
    # each engine mode splits its high-priority request's latency into phases that add up to it
    high = [i for i, r in enumerate(result["trace"]) if r["priority"] == TRACE_HIGH_PRIORITY]
    assert by_mode[TRACE_REQUEST_LEVEL]["high_timelines"] == {}
    for policy in TRACE_POLICIES:
        [(index, phases)] = by_mode[f"engine {policy}"]["high_timelines"].items()
        assert [int(index)] == high
        parts = [phases[k] for k in ("to_first_step_s", "steps_s", "to_decoded_s")]
        assert min(parts) >= 0 and parts[0] > 0 and parts[2] > 0
        latency = by_mode[f"engine {policy}"]["latency_by_request"][high[0]]
        assert sum(parts) == pytest.approx(latency, abs=1e-6)
        assert set(phases["idle"]) == {"to_first_step_s", "steps_s", "to_decoded_s"}
    assert result["agreement"]["agree"] and result["ok"]
    assert [t["target"].split(" (")[0] for t in result["targets"]] == [
        "duty cycle",
        "stills P99 / request-level FCFS's",
        "mean latency / request-level FCFS's",
        "throughput / request-level FCFS's",
        "high-priority P99 of latency / idle",
    ]
    for words in (
        "request-level FCFS",
        "engine srpt",
        "engine priority",
        "TTFS p99 s",
        "to 1st step s",
        "issue 23's targets",
        "AGREE",
    ):
        assert words in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_trace_gpu_mode_refuses_at_once_without_cuda():
    run = bench("trace", "--gpu", "--checkpoint", str(REPO))
    assert run.code == 2
    assert "CUDA is not available here" in run.out


def test_admission_smoke_selector_never_runs_on_the_request_path(tmp_path):
    run = bench("admission", "--smoke", json_path=tmp_path / "admission.json")
    result, out = run.result, run.out
    assert run.code == 0 and result["ok"]
    path = result["request_path"]
    assert path["completed"] == path["requests"] == 2
    assert path["selector_calls_after"] == path["selector_calls_before"]
    assert set(path["admission_frames"].values()) == {0}
    assert (
        sum(path["calls_per_file"].get(f, 0) for f in ("h3serve/replicas/engine.py", "h3serve/pipelines/h3/forward.py"))
        > 0
    )
    backends = {(r["config"], r["call"]): r["backend"] for r in result["cost"]}
    assert backends[("cpu tiny auto", "admit (cold)")] == "torch_sdpa"
    assert backends[("gpu full flash_attn (h200 json)", "admit (cold)")] == "flash_attn"  # serve_config.gpu.yaml
    for row in ("admit (cold)", "resolve (cold)", "resolve (cached)", "attention.selector_calls()"):
        assert row in out


def test_gpu_kernels_cpu_dry_run_ranks_what_passed_and_runs_the_diffusers_block(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    assert bench("gpu_kernels", "--cpu-dry-run", "--out", str(out)).code == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu" and not result.get("error")
    passed = {c["backend"] for c in result["correctness"] if c["result"] == "PASS"}
    assert {"torch_sdpa", "flex_attn"} <= passed
    ranking = json.loads((tmp_path / "attention_ranking.json").read_text())  # default: beside --out
    assert {b["name"] for b in ranking["backends"]} == passed and ranking["head_dim"] == 32
    assert ranking == result["ranking"]
    cfg = transformer_config("tiny")
    for pack in result["settings"]["block_packs"]:  # every pack through every passing backend, no error
        rows = sum(clip_document(cfg, Clip(*map(int, c.split("x")), text_tokens=32)).length for c in pack)
        runs = [b for b in result["block"] if b["requests"] == pack]
        assert {b["backend"] for b in runs} == passed
        assert all(b["rows"] == rows and b["padding_rows"] == 0 and not b["error"] for b in runs)


def test_released_request_rows_come_from_the_layout_builders():
    doc = clip_document(transformer_config("full"), Clip(1344, 768, 124))
    # 124 frames -> 37 latent frames of 48x84 latents, 2x2 patches: 37 * 24 * 42 video rows; 2 x 207 audio rows
    assert (doc.video_indices.numel(), doc.audio_indices.numel(), doc.text_indices.numel()) == (37296, 414, 256)
    assert doc.length == 37966  # the issue's ~38k rows


def test_forward_flops_match_counted_matmuls_and_attention_calls():
    cfg = transformer_config("tiny")
    model = build_transformer(cfg, "cpu", torch.float32)
    impl = get_backend("torch_sdpa").make_impl()
    counted, original = [0], impl.forward_varlen

    def spy(q, k, v, *, cu_seqlens, max_seqlen, **kw):  # 4 L^2 H D for every document of every call
        bounds = cu_seqlens.tolist()
        counted[0] += sum(4 * (b - a) ** 2 * q.shape[1] * q.shape[2] for a, b in itertools.pairwise(bounds))
        return original(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, **kw)

    impl.forward_varlen = spy
    install(model, impl)
    pack = pack_documents([clip_document(cfg, Clip(128, 64, 124, 32)), clip_document(cfg, Clip(64, 64, 141, 20))])
    with torch.inference_mode(), FlopCounterMode(display=False) as flop_counter:
        packed_forward(model, pack)
    flops = forward_flops(cfg, pack)
    assert flops["matmul"] == flop_counter.get_total_flops()  # every mm/addmm the forward ran
    assert flops["attention"] == counted[0]


def test_gpu_pipeline_cpu_dry_run_measures_every_part(tmp_path):
    out = tmp_path / "gpu_pipeline.json"
    run = bench("gpu_pipeline", "--cpu-dry-run", json_path=out)
    assert run.code == 0
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu" and not result["errors"] and not result["skipped"]
    cfg = transformer_config("tiny")
    assert result["parameters"] == sum(p.numel() for p in build_transformer(cfg, "cpu", torch.float32).parameters())
    rows = [clip_document(cfg, Clip(128, 64, n, 32)).length for n in GPU_PIPELINE_LENGTHS]
    assert result["single"]["rows"] == rows[0]
    assert [p["requests"] for p in result["packing"]] == [2, 3, 4]
    assert [p["rows"] for p in result["packing"]] == [sum(rows[:n]) for n in (2, 3, 4)]  # packs carry no padding
    assert result["compiled"]["rows"] == rows[0] and result["compiled"]["unique_graphs"] >= 1
    printed = run.out
    assert "FLOPs of one packed forward" in printed and "MFU >= 50%" in printed and "joiner's first step s" in printed


def test_gpu_smoke_cpu_dry_run_runs_the_serving_path_with_padded_packs():
    run = bench("gpu_smoke", "--cpu-dry-run")
    assert run.code == 0
    printed = run.out
    assert "gpu_smoke: ok" in printed and "FAILED" not in printed
    assert "generate: 124 frames 64x64" in printed and "128x64x124 + 128x64x141" in printed


def test_clip_documents_are_made_on_the_requested_device():
    doc = clip_document(transformer_config("tiny"), Clip(128, 64, 124, 32), device="meta")
    assert {getattr(doc, name).device.type for name in doc.__dataclass_fields__} == {"meta"}


def test_build_transformer_keeps_diffusers_fp32_modules():
    model = build_transformer(transformer_config("tiny"), "cpu", torch.bfloat16)
    fp32 = {n.split(".")[0] for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {"proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"}
    assert model.rope.inv_freq.dtype == torch.float32 and not model.rope.inv_freq.is_meta
    assert {p.dtype for n, p in model.named_parameters() if n.startswith("transformer_blocks.")} == {torch.bfloat16}


def test_step_cache_smoke_reports_every_tier_and_a_mixed_pack_equal_to_its_parts(tmp_path):
    assert bench("step_cache", "--smoke", json_path=tmp_path / "step_cache.json").code == 0
    result = json.loads((tmp_path / "step_cache.json").read_text())
    tiers = {t["tier"]: t for t in result["tiers"]}
    assert list(tiers) == [OFF, *BUILTIN_TIERS]
    assert tiers[OFF]["skipped_block_rows_fraction"] == 0
    assert all(r["psnr_db"] == math.inf for r in tiers[OFF]["requests"])  # off against itself
    skipped = [tiers[t]["skipped_block_rows_fraction"] for t in BUILTIN_TIERS]
    assert skipped == sorted(skipped) and skipped[-1] > 0  # looser thresholds skip more, and something is skipped
    mixed = result["mixed"]
    assert mixed["tiers"] == [OFF, "high"] and mixed["each_equals_alone"] == [True, True] and result["ok"]


def test_stream_decode_smoke_plays_the_first_frame_before_the_file_is_finished(tmp_path):
    run = bench("stream_decode", "--smoke", json_path=tmp_path / "stream.json")
    assert run.code == 0
    streamed, whole = (run.result["in_process"]["128x64"][mode] for mode in ("streamed", "whole"))
    assert 0 < streamed["first_byte_s"] <= streamed["first_frame_s"] < streamed["finished_s"]
    assert whole["first_frame_s"] == whole["finished_s"]  # a plain MP4 plays once it is all there


def test_lora_trace_smoke_serves_every_request_in_every_mode_with_the_same_outputs(tmp_path):
    run = bench("lora", "--smoke", "--steps", "4", json_path=tmp_path / "lora.json")
    assert run.code == 0
    out = run.out
    result = json.loads((tmp_path / "lora.json").read_text())
    sizes, n = result["sizes"], result["sizes"]["requests"]
    assert sizes["steps"] == 4 and sizes["turbo_steps"] == LORA_SMOKE_TURBO_STEPS  # --steps: base and style
    models = ["base", TURBO, STYLE_A, STYLE_B]
    assert sorted(r["model"] for r in result["trace"]) == sorted(models * (n // 4))  # a quarter on each model
    # a turbo request asks no steps and runs its adapter's; the others run the trace's
    assert all(r["steps"] == (sizes["turbo_steps"] if r["model"] == TURBO else sizes["steps"]) for r in result["trace"])
    assert result["adapters"][TURBO]["steps"] == sizes["turbo_steps"]
    rows = {r["mode"]: r for r in result["results"]}
    assert list(rows) == [CO_BATCHED, ONE_PER_BATCH, MERGE_SWAP]
    for row in rows.values():  # every request completed in every mode: the same requests served
        assert row["completed"] == list(range(n)) and row["latency"]["n"] == n
        assert {name: s["n"] for name, s in row["per_model"].items()} == dict.fromkeys(models, n // 4)
        agreement = row["agreement"]  # every request's output against co-batched's
        assert agreement["agree"] and agreement["requests"] == n and agreement["max_pixel_diff"] <= 1
        assert 0 < row["duty_cycle"] <= 1
    assert len({r["rows"] for r in rows.values()}) == 1  # the same rows through the model, however packed
    # the peers' modes never pack two models together; each model gets batches of its own
    for mode in (ONE_PER_BATCH, MERGE_SWAP):
        assert rows[mode]["max_models_per_step"] == 1 and set(rows[mode]["batches"]) == set(models)
    assert rows[CO_BATCHED]["batches"] is None and rows[CO_BATCHED]["swaps"] == []
    merge = rows[MERGE_SWAP]
    # a swap exactly where a batch's model differs from the one fused before it (the weights start as the base)
    changes = [cur for prev, cur in itertools.pairwise(["base", *merge["batches"]]) if prev != cur]
    assert [s["to"] for s in merge["swaps"]] == changes and len(changes) >= len(models) - 1
    assert all(s["s"] >= s["restore_s"] >= 0 for s in merge["swaps"]) and merge["restored_exactly"]
    assert [t["adapter"] for t in result["merge_swap"]["tiny"]] == [TURBO, STYLE_A, STYLE_B]
    released = {(r["layout"], r["rank"]): r for r in result["merge_swap"]["released"]}
    assert set(released) == {(name, rank) for name in (TURBO, STYLE_A, STYLE_B) for rank in LORA_RELEASED_RANKS}
    # style-b adapts the 50 released blocks' q, k, v and out projections: 5376 <-> 7168, bf16
    attention = released[(STYLE_B, 16)]
    assert (attention["layers"], attention["params"]) == (50 * 4, 50 * 4 * 5376 * 7168)
    assert attention["bytes"] == 2 * attention["params"]
    assert released[(TURBO, 64)]["params"] > released[(STYLE_A, 64)]["params"] > attention["params"]
    assert [t["target"] for t in result["targets"]] == [
        "mean latency, co-batched / one adapter per batch",
        "P99 latency, co-batched / one adapter per batch",
        "throughput, co-batched / one adapter per batch",
    ]
    assert result["agreement"]["agree"] and result["ok"]
    for words in (ONE_PER_BATCH, MERGE_SWAP, "issue 25's targets", "at the released size", "AGREE"):
        assert words in out


def test_run_all_commands_name_runnable_benchmarks(tmp_path):
    """``run_all --dry-run`` prints its commands (name -> argv) and checks each names a benchmark module with a callable
    ``main`` (exit 1 if one does not); ``--cuda``: the commands of a CUDA node."""
    run = bench("run_all", "--dry-run", "--smoke", "--json-dir", str(tmp_path))
    assert run.code == 0
    cpu = json.loads(run.out)
    assert list(cpu) == CPU_BENCHMARKS
    for name, cmd in cpu.items():
        assert cmd[1:4] == ["-m", f"benchmarks.{name}", "--smoke"] and cmd[-1] == str(tmp_path / f"{name}.json")
        assert (REPO / "benchmarks" / f"{name}.py").is_file()
    run = bench("run_all", "--dry-run", "--cuda")
    assert run.code == 0
    gpu = json.loads(run.out)
    assert set(gpu) == set(CPU_BENCHMARKS) | {"gpu_kernels", "gpu_pipeline"}
    assert gpu["gpu_pipeline"][1:] == ["-m", "benchmarks.gpu_pipeline"]


def test_gpu_session_script_parses_and_carries_the_versions_installed_here():
    script = REPO / "benchmarks" / "gpu_session.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    pins = dict(re.findall(r'"([a-z-]+)==([0-9.]+)"', script.read_text()))
    for package in ("diffusers", "pydantic", "pydantic-core"):  # what the lent machine lacks
        assert pins[package] == importlib.metadata.version(package)


def test_gpu_session_plans_six_minutes_in_the_issue_s_order_with_the_stand_in_named():
    """Every part on the lent machine runs under its own cap, in order, and the caps add up to at most 6 minutes:
    one request eager then compiled, then (a new process) a pack of two and the warm-up at the row budget, then (a new
    process) one released clip's decode, serial and by tiles, then the serving path's smoke. torch_varlen is the
    stand-in and says so; flex is opt-in; nothing CPU-only runs there."""
    text = (REPO / "benchmarks" / "gpu_session.sh").read_text()
    (caps,) = re.findall(r"^CAPS=\(([0-9 ]+)\)$", text, re.M)
    caps = [int(c) for c in caps.split()]
    assert sum(caps) <= 360
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    capped = re.findall(r'timeout "\$\{CAPS\[(\d)\]\}" (\S+)(?: -m (\S+))?', code)
    assert [int(i) for i, *_ in capped] == list(range(len(caps)))  # every cap used once, in order
    modules = [m for *_, m in capped]
    assert modules == ["", *["benchmarks.gpu_pipeline"] * 2, "benchmarks.gpu_decode", "benchmarks.gpu_smoke"]
    assert re.findall(r"--parts ([a-z0-9_ ]+?) (?:--|\$)", code) == ["single compile", "reserve pack2 max_rows"]
    assert "BACKEND=torch_varlen" in code and "the STAND-IN for flash-attn" in code
    assert "meta_step" not in code and "gpu_kernels" not in code  # CPU-only and opt-in work stays off the device
    (flex,) = re.findall(r'if \[ -n "\$FLEX" \].*?\n(.*?)\nfi', code, re.S)
    assert "test_attention_flex.py" in flex and code.count("test_attention_flex.py") == 1


def test_gpu_session_dry_run_runs_every_part_on_the_cpu(tmp_path):
    """``bash benchmarks/gpu_session.sh --dry-run`` as CI runs it: every part at the tiny dims, every check but the
    CUDA calls, each part's file written."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "benchmarks/gpu_session.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    dest = tmp_path / "dry-run"
    assert sorted(p.name for p in dest.iterdir()) == [
        "env.txt",
        "gpu_decode.json",
        "gpu_decode.log",
        "gpu_pack.json",
        "gpu_pack.log",
        "gpu_pipeline.json",
        "gpu_pipeline.log",
        "gpu_smoke.log",
    ]
    pipeline = json.loads((dest / "gpu_pipeline.json").read_text())
    assert not pipeline["errors"] and pipeline["single"]["docs"] == 1 and pipeline["compiled"]["s_per_step"] > 0
    pack = json.loads((dest / "gpu_pack.json").read_text())
    assert not pack["errors"] and pack["pack2"]["docs"] == 2
    max_rows = pack["max_rows"]
    assert max_rows["max_rows"] == 2000 and 0 < max_rows["rows"] <= 2000 and max_rows["planned_activation_bytes"] > 0
    assert "measured_activation_bytes" not in max_rows  # mem_get_info is CUDA's: the one call a dry run leaves out
    # the reserve's steps ran (a cuBLAS-sized GEMM, a one-rank communicator made, proven and ended), no device numbers
    reserve = pack["reserve"]
    assert reserve["collectives_backend"] == "gloo" and reserve["nccl_world"] == 1
    assert "measured_bytes" not in reserve and "context_bytes" not in reserve
    # the decode: serial, then split by whole tiles (frames equal bit for bit), then the audio; no device numbers
    decode = json.loads((dest / "gpu_decode.json").read_text())
    assert not decode["errors"] and not decode["skipped"] and decode["dtype"].startswith("bfloat16")
    split = decode["split"]
    assert decode["serial"]["s"] > 0 and split["equal"] and split["max_abs_diff"] == 0
    assert split["tiles"] == len(split["tile_s"]) == 4 and decode["audio"]["s"] > 0
    assert set(split["projected_split_s"]) == {"2", "4", "8"} and split["peak_bytes"] is None


def test_default_clip_smoke_makes_a_clip_with_sound_through_the_cli(tmp_path):
    run = bench("default_clip", "--smoke", json_path=tmp_path / "default_clip.json")
    result, out = run.result, run.out
    assert run.code == 0 and result["ok"] and result["default_steps"] >= 2
    assert [r["way"] for r in result["rows"]] == ["CLI: h3serve generate", "in-process phases (1 thread)"]
    assert all(r["frames"] == 124 and r["size"] == "128x64" and r["audio_channels"] == 2 for r in result["rows"])
    assert "target: a default video request in under 60 s" in out


def test_step_cache_step_smoke_forces_each_decision_and_projects_the_released_depth(tmp_path):
    run = bench("step_cache_step", "--smoke", json_path=tmp_path / "step_cache_step.json")
    result, out = run.result, run.out
    assert run.code == 0
    assert result["ok"] and "decisions as forced: YES" in out  # each document skipped or computed as forced
    cases = {c["case"]: c for c in result["cases"]}
    assert [c["skipping"] for c in cases.values()] == [0.0, 0.0, 0.5, 1.0]
    assert cases["off"]["ratio"] == cases["off"]["projected_ratio"] == 1.0
    assert all(len(c["times_ms"]) == 2 and min(c["times_ms"]) > 0 for c in cases.values())


@pytest.mark.ray
def test_sp_smoke_sp2_equals_sp1_and_pads_only_to_the_degree(ray_cluster, tmp_path):
    run = bench("sp", "--smoke", json_path=tmp_path / "sp.json", address=ray_cluster.address)
    result, out = run.result, run.out
    assert run.code == 0 and result["ok"] and len(result["rows"]) == 2
    for r in result["rows"]:
        assert r["allclose_1e-5"] and r["max_abs_diff"] <= 1e-5
        assert r["sp1_padding_rows"] == 0 and r["sp2_padding_rows"] == r["rows"] % 2
        assert r["sp2_rows"] == r["rows"] + r["sp2_padding_rows"]
    assert "1 request 64x64x124" in out and "sp=2 vs sp=1: YES" in out
    # rank 0 gathers the output heads' columns, not the hidden state's: 96 instead of 5376 when released
    released = result["released_gather"]
    assert (released["columns_before"], released["columns_after"], released["reduction"]) == (5376, 96, 56)
    assert released["bytes_before"] == released["rows"] * 5376 * 4 and released["rows"] > 80_000
    # step caching that skips nothing, timed against off at both degrees (a ratio, not a target)
    assert set(result["caching_overhead"]) == {"sp=1", "sp=2"}
    assert all(o["off ms"] > 0 and o["never skips ms"] > 0 for o in result["caching_overhead"].values())
    assert "step caching that skips nothing" in out
    assert "bytes rank 0 gathers per packed forward" in out


@pytest.mark.ray
class TestOnOneServerOfTheDefaultConfig:
    """The smokes that serve h3serve/deploy/serve_config.yaml as shipped share one `h3serve serve` of it (each started
    its
    own: ~30 s on 2 cores). Class-scoped, so it is stopped before the next smoke deploys a config of its own on the
    same cluster (a second `h3serve serve` would replace its applications)."""

    @pytest.fixture(scope="class")
    def default_server(self, ray_cluster, tiny_checkpoint, tmp_path_factory):
        """`h3serve serve h3serve/deploy/serve_config.yaml` on the session's cluster (the tiny preset's random weights
        where
        this checkout lacks the shipped demo checkpoint, as the benchmarks' own server)."""
        from h3serve.pipelines.h3.checkpoint import CheckpointError, resolve_checkpoint
        from tests.harness import ServeProcess, default_config, free_port, write_config

        config = default_config()
        try:
            resolve_checkpoint(None)
        except CheckpointError:
            config["applications"][0]["args"]["checkpoint"] = str(tiny_checkpoint)
        port = free_port()
        served = ServeProcess(write_config(tmp_path_factory.mktemp("bench"), config, port), ray_cluster.address, port)
        try:
            served.wait_serving(timeout=600)
            yield served
        finally:
            served.stop()

    def test_serving_smoke_http_handle_and_in_process_agree(self, ray_cluster, default_server, tmp_path):
        run = bench(
            "serving",
            "--smoke",
            "--url",
            default_server.url,
            json_path=tmp_path / "s.json",
            address=ray_cluster.address,
        )
        result, out = run.result, run.out
        assert run.code == 0 and result["ok"] and result["video_same_shape"]
        assert all(d <= 1 for d in result["pixel_diff_vs_in_process"].values())
        paths = [p["path"] for p in result["paths"]]
        assert paths[:6] == [
            "in-process engine",
            "PNG + base64 (in-process)",
            "MP4 encode (in-process)",
            "Serve handle -> replica (PNG)",
            "HTTP image: POST /v1/images/generations",
            "HTTP video job: POST, poll, GET content",
        ]
        assert all(path in out for path in paths) and "target HTTP / in-process" in out

    def test_served_trace_smoke_serves_every_request_over_http_with_its_timeline(
        self, ray_cluster, default_server, tmp_path
    ):
        run = bench(
            "served_trace",
            "--smoke",
            "--url",
            default_server.url,
            json_path=tmp_path / "served_trace.json",
            address=ray_cluster.address,
        )
        assert run.code == 0
        out, result = run.out, run.result
        (run,) = result["runs"]["default"]
        kinds = [a["kind"] for a in result["trace"]]
        assert len(run["requests"]) == len(kinds) == 4 and {"still", "clip5"} <= set(kinds)
        # every request came back over HTTP and the replica kept every stage mark of it
        assert run["timelines_missing"] == 0 and [r["kind"] for r in run["requests"]] == kinds
        for request in run["requests"]:
            assert set(request["timeline"]) == set(SERVED_TRACE_PHASES) and request["latency_s"] > 0
        # the replica's threads were found by name: the step loop's and the stage worker's CPU is counted apart
        assert {"replica", "ingress", "proxy", "thread: step loop", "thread: stage worker"} <= set(run["cpu_s"])
        assert result["targets"] == []  # one config: nothing to judge
        assert "where a request's latency went" in out and "CPU seconds in a run" in out


@pytest.mark.ray
def test_autoscale_smoke_replays_one_trace_under_both_policies_and_loses_no_request(ray_cluster, tmp_path):
    # --settings replaces the smoke's own (default 2, backlog 1): the settings reach the applications
    run = bench(
        "autoscale", "--smoke", "--settings", "default=3,backlog=1.5", json_path=tmp_path / "a.json",
        address=ray_cluster.address,
    )  # fmt: skip
    assert run.code == 0
    out, result = run.out, run.result
    assert result["ok"] and result["targets"] == []  # the smoke judges nothing
    classes = [c["name"] for c in result["sizes"]["classes"]]
    n = len(result["trace"])
    assert n > 0 and {a["class"] for a in result["trace"]} == set(classes)  # seed 0's trace holds both classes
    default, backlog = result["results"]
    assert (default["policy"], backlog["policy"]) == ("default", "backlog")
    for row in (default, backlog):
        # the same trace through each policy's application: every request answered, none lost to a scale change
        assert row["requests"] == row["completed"] == n and row["failed"] == []
        assert row["latency"]["all"]["n"] == sum(row["latency"][c]["n"] for c in classes) == n
        assert row["latency"]["all"]["p50"] <= row["latency"]["all"]["p99"]
        assert 1 <= row["max_running"] <= 2 and row["replica_seconds"] > 0  # within min/max_replicas
        assert row["scale_back_after_last_done_s"] is not None  # the run ended back at one replica
    assert result["best"] == {"default": 3.0, "backlog": 1.5} and result["tuning"] == {}
    assert "every request completed in every run: YES" in out and "default (3)" in out and "backlog (1.5)" in out


@pytest.mark.parametrize("bad", ["default=4", "default=4,backlog=4,default=2", "default=4,backlog=x", "fast=1"])
def test_autoscale_settings_name_each_policy_once_with_a_positive_number(bad):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.autoscale", "--settings", bad], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "argument --settings: '" in done.stderr


@pytest.mark.ray
def test_stages_smoke_serves_one_trace_through_both_apps_and_counts_the_object_store_bytes(ray_cluster, tmp_path):
    run = bench("stages", "--smoke", json_path=tmp_path / "stages.json", address=ray_cluster.address)
    assert run.code == 0
    out, result = run.out, run.result
    assert result["ok"] and all(c["met"] for c in result["checks"])
    n = result["sizes"]["requests"]
    assert n == 4 and len(result["trace"]) == n
    solo, staged = result["results"]
    assert (solo["app"], staged["app"]) == ("solo", "staged")
    for row in (solo, staged):
        assert row["requests"] == n and len(row["latency_by_request"]) == n  # every request got its MP4
        assert 0 < row["duty_cycle"] <= 1 and row["forwards"] > 0
        assert row["latency"]["p50"] <= row["latency"]["p99"] and row["throughput_rps"] > 0
        assert row["bytes_per_request"]["mp4 to caller"] > 0
    assert solo["handoff_bytes"] == {}  # one replica: nothing crosses between stages
    per_request = staged["bytes_per_request"]
    assert per_request["prepared"] > per_request["latents"] > 0 and per_request["media"] > 0
    # the staged denoiser's rank 0 holds the transformer alone: fewer parameters than solo's, which has all
    assert 0 < staged["rank0_parameters"] < solo["rank0_parameters"]
    # what the staged replica counted through the object store = the same requests prepared in the driver
    expected = result["expected_prepared_bytes"]
    assert staged["handoff_bytes"]["prepared"] == sum(
        v for e in expected for k, v in e.items() if k != "handoff latents"
    )
    assert staged["handoff_bytes"]["latents"] == sum(e["handoff latents"] for e in expected)
    # each request, the warm-up, and the preview map's fit (the default config's previews are on)
    assert result["preview_fits"] == 1
    assert sum(result["stage_reports"]["conditioner"]["calls"].values()) == n + 1 + 1
    assert sum(result["stage_reports"]["decoder"]["calls"].values()) == n
    for words in ("denoiser duty", "prepared B/req", "row_timestep_plan", "1344x768x345, 50 steps"):
        assert words in out


def test_stages_released_bytes_follow_the_model_geometry():
    """``h3serve.pipelines.h3.shapes.released_bytes``: what benchmarks.stages prints for a released-size request."""
    short, long = released_bytes()
    # 345 frames -> 5 * 20 + 2 latent frames; 16x spatial and a (1, 2, 2) patch -> 24 x 42 rows per latent frame;
    # 24 channels x 4 per row, float32
    video_rows = (5 * 20 + 2) * (768 // 32) * (1344 // 32)
    assert long["latents"] == video_rows * 24 * 4 * 4
    assert long["video_indices"] == video_rows * 8  # int64
    rows = long["position_ids"] // (3 * 8)  # [rows, 3] float64: every row of the document
    assert rows > video_rows + RELEASED_TEXT_TOKENS
    # one row -> timestep index (int64) per step of 50 (49 intervals) and a few distinct timesteps each
    assert 49 * rows * 8 < long["row_timestep_plan"] <= 49 * (rows * 8 + 4 * 4)
    assert long["prompt_embeds"] == RELEASED_TEXT_TOKENS * 5120 * 2  # bf16
    assert long["handoff latents"] == long["latents"] + long["audio_latents"]
    assert long["prepared"] == sum(v for k, v in long.items() if k not in ("request", "prepared", "handoff latents"))
    assert short["latents"] * 102 == long["latents"] * (5 * 7 + 2)  # 124 frames: 37 latent frames


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_stages_gpu_mode_refuses_at_once_without_cuda():
    run = bench("stages", "--gpu", "--checkpoint", str(REPO), "--rate", "0.1")
    assert run.code == 2
    assert "CUDA is not available here" in run.out


def test_step_path_smoke_sends_workers_metadata_only(tmp_path):
    """benchmarks.step_path's bytes: a worker's step order is a few KB whatever the pack's rows (its tensors go by a
    broadcast), where the old path put the whole pack in the object store."""
    run = bench("step_path", "--smoke", "--bytes-only", json_path=tmp_path / "step_path.json")
    assert run.code == 0
    result = run.result["bytes"]
    assert result["ok"]
    assert max(result["after_ray_bytes_per_worker"].values()) < 4096
    assert result["before_object_store_bytes"]["no caching"] > result["after_broadcast_bytes"] > 100 * 4096


def test_lora_compose_smoke_times_every_case_and_composed_equals_merged_by_hand(tmp_path):
    run = bench("lora_compose", "--smoke", json_path=tmp_path / "compose.json")
    assert run.code == 0 and run.result is not None
    cases = [c["case"] for c in run.result["cases"]]
    assert cases == [
        "base only",
        "single adapters (1 a request)",
        "composed lists (2 a request)",
        "composed, merged per request by hand",
    ]
    assert all(c["median_ms"] > 0 for c in run.result["cases"])
    # the co-batched composition equals what a user gets by merging each request's adapters into the weights
    assert max(run.result["max_diff_vs_merged"]) < 1e-3
    assert "Composed LoRA requests: one packed step (CPU)" in run.out


def test_cold_start_from_zero_reads_the_replica_s_log_lines_on_the_wall_clock():
    """``cold_start --from-zero`` places the replica's warm-up and readiness by its Serve log lines: their local
    time, to the millisecond, on the same clock as the POST's ``time.time()``."""
    import datetime

    from benchmarks.cold_start import _log_time

    line = "INFO 2026-12-05 21:38:44,434 h3serve_H3Replica thx6mb14 -- H3 replica warmed up: one packed forward took"
    assert _log_time(line) == datetime.datetime(2026, 12, 5, 21, 38, 44, 434000).timestamp()
