"""The ingress process starts without the model's libraries: importing h3serve.deploy.ingress.routes (H3Ingress and
everything it imports) loads no torch, diffusers, transformers or peft. Each of them costs an ingress seconds of CPU at
every start (tests/README.md: most of the suite's time is processes starting); the platform probe's worker loads torch
alone (``h3serve/deploy/driver/probe.py``). What made that possible is held here too: the torch-free restatement of
diffusers'
clip and canvas geometry (``h3serve/pipelines/h3/geometry.py``) equals diffusers' own."""

import itertools
import subprocess
import sys

import pytest
from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as diffusers_geometry

from h3serve.pipelines.h3 import geometry

HEAVY = ("torch", "diffusers", "transformers", "peft")


def heavy_modules_after(statement: str) -> list[str]:
    code = f"{statement}; import sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return eval(done.stdout.strip().splitlines()[-1])  # a list literal printed by the child


@pytest.mark.slow  # a fresh interpreter per check (`make test-fast`, no subprocesses, leaves it out)
def test_importing_the_ingress_loads_no_torch_diffusers_transformers_or_peft():
    assert heavy_modules_after("import h3serve.deploy.ingress.routes") == []


@pytest.mark.slow  # a fresh interpreter per check (`make test-fast`, no subprocesses, leaves it out)
def test_the_platform_probe_task_loads_torch_but_no_diffusers_transformers_or_peft():
    # Ray imports a task's module in the worker that runs it, and the builds of `h3serve serve` run at once, so
    # there is about one new probe worker per application: it pays torch (the probe asks it), not admission's rest
    assert heavy_modules_after("import h3serve.deploy.driver.probe") == ["torch"]


@pytest.mark.slow  # a fresh interpreter per check (`make test-fast`, no subprocesses, leaves it out)
def test_the_ingress_args_round_trip_without_torch():
    # the ingress receives its DeployArgs and ModelRules pickled (Serve's init args): unpickling them, and reading
    # the rules a request is checked against, stays torch-free
    statement = (
        "import pickle; from h3serve.pipelines.h3 import ModelRules; "
        "rules = pickle.loads(PICKLED); rules.check_canvas(1344, 768); rules.frames_for_seconds(5)"
    )
    from h3serve.pipelines.h3 import ModelRules

    rules = ModelRules(
        fps=24, min_seconds=5, max_seconds=15, frames_per_chunk=17, latents_per_chunk=5, canvas_multiple=32,
        canvas_short_edge=768, canvas_max_pixels=768 * 1344, spatial_compression=16, patch_hw=(2, 2),
        sample_rate=32000, audio_channels=2, partitions=("transformer",), video_references=False,
    )  # fmt: skip
    import pickle

    assert heavy_modules_after(f"PICKLED = {pickle.dumps(rules)!r}; {statement}") == []


def outcome(function, *args):
    try:
        return function(*args)
    except ValueError as e:
        return ("ValueError", str(e))


@pytest.mark.parametrize("name", ["MINIMAX_H3_MIN_ASPECT_RATIO", "MINIMAX_H3_MAX_ASPECT_RATIO", "MINIMAX_H3_FPS"])
def test_geometry_constants_are_diffusers(name):
    assert getattr(geometry, name) == getattr(diffusers_geometry, name)


def test_geometry_functions_agree_with_diffusers_over_a_grid():
    sides = (1, 3, 9, 16, 64, 100, 768, 1344, 4000)
    for w, h, multiple, edge, pixels in itertools.product(sides, sides, (16, 32), (64, 768), (64 * 64, 768 * 1344)):
        args = (w, h, multiple, edge, pixels)
        assert outcome(geometry.resolve_canvas_size, *args) == outcome(diffusers_geometry.resolve_canvas_size, *args)
    assert outcome(geometry.resolve_canvas_size, 0, 1, 32, 768, 1) == outcome(
        diffusers_geometry.resolve_canvas_size, 0, 1, 32, 768, 1
    )
    for frames, chunk, latents in itertools.product(range(-1, 400), (17, 9), (5, 3)):
        args = (frames, chunk, latents)
        assert outcome(geometry.align_num_frames, *args) == outcome(diffusers_geometry.align_num_frames, *args)
        assert outcome(geometry.video_latent_num_frames, *args) == outcome(
            diffusers_geometry.video_latent_num_frames, *args
        )
    for frames, fps in itertools.product(range(1, 400), (24, 30, 12.5)):
        assert geometry.audio_latent_num_frames(frames, fps) == diffusers_geometry.audio_latent_num_frames(frames, fps)
    assert geometry.audio_latent_num_frames(125) == diffusers_geometry.audio_latent_num_frames(125)
