"""`h3serve eval` through the serving path: deterministic verdicts, the JSON it writes, the oracle's 100%."""

import json

import pytest

import h3serve.demo.evaluate
from h3serve.demo.evaluate import ATTRIBUTES, EvalSettings, evaluate
from h3serve.demo.world import HELD_OUT
from h3serve.deploy.driver.cli import main
from h3serve.pipelines.h3 import RequestError

SMALL = dict(n=3, seed=5, steps=3, pack=3, width=64, height=64)


@pytest.mark.slow
def test_a_small_eval_is_deterministic_and_writes_every_verdict(tiny_checkpoint, tmp_path, capsys):
    path = tmp_path / "eval.json"
    argv = ["eval", "--checkpoint", str(tiny_checkpoint), "--n", "3", "--seed", "5", "--steps", "3", "--pack", "3"]
    main(argv + ["--size", "64x64", "--threads", "0", "--json", str(path)])
    printed = capsys.readouterr().out
    written = json.loads(path.read_text())
    again = evaluate(EvalSettings(checkpoint=str(tiny_checkpoint), **SMALL))

    assert [c["detected"] for c in written["clips"]] == [c["detected"] for c in again["clips"]]
    assert written["summary"] == again["summary"]
    assert written["checkpoint"] == str(tiny_checkpoint) and written["oracle"] is False
    assert written["format"] == {"width": 64, "height": 64, "num_frames": 124, "fps": 24, "sample_rate": 8000}
    assert [c["index"] for c in written["clips"]] == [0, 1, 2]
    assert [c["seed"] for c in written["clips"]] == [5, 6, 7]
    for clip in written["clips"]:
        assert set(clip) == {"index", "prompt", "seed", "expected", "detected", "correct", "all_correct"}
        assert set(clip["expected"]) == set(clip["detected"]) == set(clip["correct"]) == set(ATTRIBUTES)
        assert tuple(clip["expected"][a] for a in ("colour", "shape", "motion")) in HELD_OUT
        assert all(clip["correct"][a] == (clip["detected"][a] == clip["expected"][a]) for a in ATTRIBUTES)
        assert clip["all_correct"] == all(clip["correct"].values())
    for attribute in ATTRIBUTES:
        row = written["summary"][attribute]
        assert row["clips"] == 3 and row["correct"] == sum(c["correct"][attribute] for c in written["clips"])
        assert row["accuracy"] == row["correct"] / 3
        assert f"{attribute:<10}" in printed
    assert "all four" in printed and f"wrote {path}" in printed


@pytest.mark.slow  # the demo's tooling, ~2 s: `make test-fast` (the four packages' layers) leaves it out
def test_the_oracle_scores_every_attribute_of_every_held_out_combination(tiny_checkpoint):
    result = evaluate(EvalSettings(checkpoint=str(tiny_checkpoint), n=18, oracle=True))
    assert {tuple(c["expected"][a] for a in ("colour", "shape", "motion")) for c in result["clips"]} == HELD_OUT
    assert all(row["accuracy"] == 1.0 for row in result["summary"].values()), result["summary"]
    assert result["format"]["num_frames"] == 124 and (result["format"]["width"], result["format"]["height"]) == (
        128,
        64,
    )


def test_bad_settings_name_the_field(tiny_checkpoint, capsys, monkeypatch):
    with pytest.raises(RequestError, match="pack must be at least 1") as e:
        EvalSettings(pack=0)
    assert e.value.field == "pack"
    with pytest.raises(RequestError, match="cache must be one of off, high, low, medium, got 'fast'"):
        EvalSettings(cache="fast")
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--checkpoint", str(tiny_checkpoint), "--size", "64by64"])
    assert exit.value.code == 2 and "--size must look like WIDTHxHEIGHT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--checkpoint", str(tiny_checkpoint), "--size", "100x64", "--oracle", "--threads", "0"])
    assert exit.value.code == 2 and "multiples of 32" in capsys.readouterr().err
    with pytest.raises(RequestError, match="sp must be at least 1"):
        EvalSettings(sp=0)

    # refused before a local Ray cluster starts for the ranks (it took ~6 s to refuse after one)
    def no_cluster(sp):
        raise AssertionError(f"a cluster was started for sp={sp}")

    monkeypatch.setattr(h3serve.demo.evaluate, "local_ray", no_cluster)
    with pytest.raises(SystemExit) as exit:
        main(["eval", "--checkpoint", str(tiny_checkpoint), "--sp", "3", "--oracle"])
    assert exit.value.code == 2 and "must divide the transformer's 4 attention heads" in capsys.readouterr().err


# The built-in checkpoint (trained on the demo world) on the first held-out scenes, at the eval's 50 steps: a
# magenta triangle, still, with a low hum; a magenta circle moving left with a high beep. Combinations its
# transformer never trained on, each judged right on every attribute, whether packed together or alone.
BUILT_IN = dict(n=2, seed=0, steps=50)


def _verdicts(result) -> list[dict]:
    return [clip["detected"] for clip in result["clips"]]


@pytest.fixture(scope="module")
def built_in_packed():
    """The built-in checkpoint's eval, two clips in one pack (both tests below compare against it)."""
    return evaluate(EvalSettings(pack=2, **BUILT_IN))


@pytest.mark.slow
def test_the_built_in_checkpoint_makes_the_scenes_its_prompts_name(built_in_packed):
    packed = built_in_packed
    assert packed["checkpoint"].endswith("minimax-h3-tiny-demo")
    assert [clip["all_correct"] for clip in packed["clips"]] == [True, True], packed["clips"]
    assert _verdicts(evaluate(EvalSettings(pack=1, **BUILT_IN))) == _verdicts(packed)  # alone: the same verdicts


@pytest.mark.slow
@pytest.mark.ray
def test_the_built_in_checkpoint_judges_the_same_over_two_ulysses_ranks(ray_cluster, built_in_packed):
    over_two = evaluate(EvalSettings(pack=2, sp=2, **BUILT_IN))  # its ranks on the session's cluster
    assert [clip["all_correct"] for clip in over_two["clips"]] == [True, True], over_two["clips"]
    assert _verdicts(over_two) == _verdicts(built_in_packed)
