"""Auto order from a measured ranking: it orders capable, available candidates and nothing else."""

import json
import os

import pytest
import torch

from h3serve.attention import (
    AdmissionError,
    AttentionRequirements,
    AttentionSelectionError,
    Platform,
    RankedBackend,
    Ranking,
    RankingError,
    Resolution,
    clear_cache,
    get_backend,
    probe_platform,
    resolve,
)
from h3serve.attention.ranking import ENV_VAR, load, save

VARLEN = AttentionRequirements(packed_varlen=True)
LIBS = {"torch.nn.attention.flex_attention": "2.13.0", "torch.nn.attention.varlen": "2.13.0"}
H200 = Platform.cuda((9, 0), LIBS, device_name="NVIDIA H200")  # torch_version: this torch's


def ranking(*names, device_name="NVIDIA H200", torch_version=torch.__version__, **kw) -> Ranking:
    return Ranking(
        device_name=device_name,
        compute_capability=(9, 0),
        torch_version=torch_version,
        backends=[RankedBackend(name=n, ms=1.0 + i) for i, n in enumerate(names)],
        **kw,
    )


@pytest.fixture(autouse=True)
def no_ranking_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    clear_cache()
    yield
    clear_cache()


def test_declared_order_without_a_ranking():
    resolution = resolve(VARLEN, "auto", H200, dtype="bfloat16", head_dim=128)
    assert resolution.backend == "torch_varlen" and resolution.order == "declared" and resolution.ranking is None


def test_measured_first_backend_wins(tmp_path):
    path = save(ranking("flex_attn", "torch_varlen", "torch_sdpa", dtype="bfloat16", head_dim=128), tmp_path / "r.json")
    resolution = resolve(VARLEN, "auto", H200, dtype="bfloat16", head_dim=128, ranking=path)
    assert resolution.backend == "flex_attn" and resolution.order == "measured"
    assert resolution.rejected == ()
    assert "measured order" in resolution.describe() and "flex_attn > torch_varlen" in resolution.describe()
    # torch_sdpa measured ahead of torch_varlen beats the declared order too
    assert resolve(VARLEN, "auto", H200, ranking=ranking("torch_sdpa", "torch_varlen")).backend == "torch_sdpa"


def test_the_environment_variable_names_the_file(tmp_path, monkeypatch):
    path = save(ranking("flex_attn", "torch_sdpa"), tmp_path / "r.json")
    monkeypatch.setenv(ENV_VAR, str(path))
    assert resolve(VARLEN, "auto", H200).backend == "flex_attn"


def test_unranked_candidates_follow_in_declared_order():
    # only torch_sdpa is ranked: it is tried first, ahead of the declared flash_attn and torch_varlen
    resolution = resolve(VARLEN, "auto", H200, ranking=ranking("torch_sdpa"))
    assert resolution.backend == "torch_sdpa" and resolution.rejected == ()
    # a ranked backend that cannot run here is passed over, then the declared order resumes
    resolution = resolve(VARLEN, "auto", H200, dtype="float32", ranking=ranking("torch_varlen", "nonesuch"))
    assert resolution.backend == "torch_sdpa"
    assert [(r.backend, r.kind) for r in resolution.rejected] == [
        ("torch_varlen", "unavailable"),
        ("flash_attn", "unavailable"),
    ]


@pytest.mark.parametrize(
    "other,field",
    [
        (dict(device_name="NVIDIA H100 80GB HBM3"), "device"),
        (dict(torch_version="2.12.0+cu126"), "torch"),
        (dict(dtype="float16"), "dtype"),
        (dict(head_dim=64), "head_dim"),
    ],
)
def test_a_ranking_for_another_platform_is_ignored(other, field):
    measured = ranking("flex_attn", "torch_sdpa", **other)
    resolution = resolve(VARLEN, "auto", H200, dtype="bfloat16", head_dim=128, ranking=measured)
    assert resolution.backend == "torch_varlen" and resolution.order == "declared"
    assert resolution.ranking.startswith(f"ignored: measured on {field}") and "ignored" in resolution.describe()


def test_dtype_and_head_dim_apply_only_when_both_sides_state_them():
    measured = ranking("flex_attn", dtype="bfloat16", head_dim=128)
    assert resolve(VARLEN, "auto", H200, ranking=measured).backend == "flex_attn"
    unstated = ranking("flex_attn")
    assert resolve(VARLEN, "auto", H200, ranking=unstated, dtype="float16", head_dim=64).backend == "flex_attn"


def test_an_incapable_or_opt_in_backend_ranked_first_is_never_selected():
    with_sage = Platform.cuda((9, 0), {**LIBS, "sageattention": "2.1"}, device_name="NVIDIA H200")
    measured = ranking("sage_attn", "flashinfer", "torch_sdpa")
    resolution = resolve(VARLEN, "auto", with_sage, ranking=measured)
    assert resolution.backend == "torch_sdpa" and resolution.order == "measured"
    assert all(r.backend != "sage_attn" for r in resolution.rejected)
    # even where it would be capable (dense only), an opt-in backend is not an auto candidate
    assert resolve(AttentionRequirements(), "auto", with_sage, ranking=measured).backend == "torch_sdpa"


def test_the_ranking_never_admits_what_the_platform_cannot_run(monkeypatch):
    monkeypatch.setattr(type(get_backend("torch_sdpa")), "auto_rank", {"cpu": 0})  # no always-available fallback
    bare = Platform.cuda((7, 5), {}, device_name="NVIDIA H200")
    with pytest.raises(AdmissionError) as e:
        resolve(VARLEN, "auto", bare, ranking=ranking("flex_attn", "torch_varlen", "torch_sdpa"))
    assert e.value.reason == "no_candidate" and "flex_attn: unavailable" in str(e.value)


def test_an_explicit_choice_ignores_the_ranking(tmp_path, monkeypatch):
    resolution = resolve(VARLEN, "torch_sdpa", H200, ranking=ranking("flex_attn"))
    assert resolution.backend == "torch_sdpa" and resolution.order == "declared" and resolution.ranking is None
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "missing.json"))  # not even read
    assert resolve(VARLEN, "varlen", H200).backend == "torch_varlen"


def test_cpu_auto_stays_torch_sdpa_under_any_ranking():
    cpu = probe_platform("cpu")
    measured = Ranking(
        device_name=cpu.device_name,
        torch_version=cpu.torch_version,
        backends=[RankedBackend(name="flex_attn", ms=0.1), RankedBackend(name="torch_sdpa", ms=9.0)],
    )
    resolution = resolve(VARLEN, "auto", cpu, ranking=measured)
    assert resolution.backend == "torch_sdpa" and resolution.order == "measured"


def test_the_ranking_is_part_of_the_cache_key(tmp_path, monkeypatch):
    declared = resolve(VARLEN, "auto", H200)
    path = save(ranking("flex_attn"), tmp_path / "r.json")
    monkeypatch.setenv(ENV_VAR, str(path))
    assert resolve(VARLEN, "auto", H200).backend == "flex_attn"
    first = resolve(VARLEN, "auto", H200)
    assert resolve(VARLEN, "auto", H200) is first and first.backend == "flex_attn"  # cached
    save(ranking("torch_sdpa", "flex_attn"), path)  # the file changes: its content is re-read
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert resolve(VARLEN, "auto", H200).backend == "torch_sdpa"
    monkeypatch.delenv(ENV_VAR)
    assert resolve(VARLEN, "auto", H200) is declared


def test_resolution_with_a_measured_order_round_trips_as_json():
    resolution = resolve(VARLEN, "auto", H200, model="h3-full", ranking=ranking("flex_attn", "torch_sdpa"))
    data = json.loads(resolution.model_dump_json())
    assert data["order"] == "measured" and "flex_attn > torch_sdpa" in data["ranking"]
    assert Resolution.model_validate_json(resolution.model_dump_json()) == resolution


def test_ranking_file_round_trips_and_bad_files_raise(tmp_path):
    measured = ranking("flex_attn", "torch_sdpa", dtype="bfloat16", head_dim=128, measured="test")
    assert load(save(measured, tmp_path / "sub" / "r.json")) == measured
    (tmp_path / "bad.json").write_text('{"device_name": "x"}')
    for bad in (tmp_path / "bad.json", tmp_path / "missing.json"):
        with pytest.raises(RankingError, match="cannot read attention ranking") as e:
            resolve(VARLEN, "auto", H200, ranking=bad)
        assert isinstance(e.value, ValueError) and isinstance(e.value, AttentionSelectionError)
        assert e.value.reason == "bad_ranking"


def test_from_times_ranks_by_geometric_mean_over_packs_every_backend_ran():
    times = {
        "a": {"torch_sdpa": 4.0, "flex_attn": 1.0, "torch_varlen": 2.0},
        "b": {"torch_sdpa": 1.0, "flex_attn": 9.0, "torch_varlen": 3.0},
        "c": {"torch_sdpa": 1.0, "torch_varlen": 1.0},  # flex_attn cut by the budget: not compared
    }
    measured = Ranking.from_times(H200, times, dtype=torch.bfloat16, head_dim=128, measured="unit")
    assert [b.name for b in measured.backends] == ["torch_sdpa", "torch_varlen", "flex_attn"]
    assert [b.ms for b in measured.backends] == pytest.approx([2.0, 6**0.5, 3.0])
    assert measured.dtype == "bfloat16" and measured.device_name == "NVIDIA H200"
    assert measured.torch_version == H200.torch_version and "2 packs" in measured.measured
    assert measured.mismatch(H200, torch.bfloat16, 128) == ""
    assert Ranking.from_times(H200, {}) is None
