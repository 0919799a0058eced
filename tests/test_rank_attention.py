"""`h3serve rank-attention`: the installed command writes the ranking file that auto selection reads."""

import pytest
import torch

from h3serve.attention import AttentionRequirements, clear_cache, probe_platform, resolve
from h3serve.attention.ranking import ENV_VAR, load
from tests.harness import h3serve, h3serve_inline

pytestmark = pytest.mark.slow  # a subprocess: a new interpreter importing torch


@pytest.fixture(autouse=True)
def no_ranking_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    clear_cache()
    yield
    clear_cache()


def test_rank_attention_on_cpu_writes_the_ranking_that_auto_follows(tmp_path):
    out = tmp_path / "ranking" / "attention_ranking.json"
    done = h3serve("rank-attention", "--device", "cpu", "--quick", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "correctness vs fp32 reference" in done.stdout and f"wrote {out}" in done.stdout

    ranking = load(out)  # ranking.py's own reader
    platform = probe_platform("cpu")
    assert ranking.mismatch(platform, torch.float32, 32) == ""  # measured here: cpu, this torch, fp32, head_dim 32
    names = [b.name for b in ranking.backends]
    assert names and set(names) <= {"torch_sdpa", "flex_attn"}  # the CPU backends that run fp32
    assert [b.ms for b in ranking.backends] == sorted(b.ms for b in ranking.backends)  # fastest first

    requirements = AttentionRequirements(packed_varlen=True)
    measured = resolve(requirements, "auto", platform, dtype=torch.float32, head_dim=32, ranking=out)
    assert measured.order == "measured" and measured.ranking == ranking.describe()
    # auto's CPU candidates are torch_sdpa alone (flex_attn is auto on CUDA only): the first ranked one of them wins
    assert measured.backend == "torch_sdpa" in names

    # the file states what it measured: at another head_dim it is ignored, and the Resolution says why
    elsewhere = resolve(requirements, "auto", platform, dtype=torch.float32, head_dim=128, ranking=out)
    assert elsewhere.order == "declared" and "head_dim 32" in (elsewhere.ranking or "")


def test_rank_attention_refuses_cuda_without_a_device(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this node has CUDA")
    done = h3serve_inline("rank-attention", "--out", str(tmp_path / "r.json"))  # --device cuda by default
    assert done.returncode == 2 and "--device cuda" in done.stderr and not (tmp_path / "r.json").exists()
