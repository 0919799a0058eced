"""docs/CONFIG.md is what `python -m h3serve.deploy.driver.config_reference` generates from DeployArgs."""

from pathlib import Path

import pytest
import yaml

from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.driver.config_reference import reference

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def test_the_config_reference_is_up_to_date():
    assert DOC.read_text() == reference(), "run: python -m h3serve.deploy.driver.config_reference > docs/CONFIG.md"


def test_every_field_is_described():
    undescribed = [name for name, field in DeployArgs.model_fields.items() if not field.description]
    assert not undescribed
    assert all(f"`{name}`" in reference() for name in DeployArgs.model_fields)


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml", "serve_config.h100.yaml"])
def test_the_shipped_configs_size_the_ingress_for_their_h3_replicas(name):
    """ingress.h3_replicas repeats the H3Replica count under deployments: (the builder sees only args)."""
    config = yaml.safe_load((DOC.parents[1] / "h3serve" / "deploy" / name).read_text())
    for app in config["applications"]:
        args = DeployArgs.model_validate(app["args"])
        args.check_deployments(app["deployments"])
        if args.autoscaling is not None:  # the backlog policy's bounds live in args (the GPU configs)
            assert args.ingress.h3_replicas == args.autoscaling.max_replicas
        else:
            h3 = next(d for d in app["deployments"] if d["name"] == "H3Replica")
            most = h3.get("autoscaling_config", {}).get("max_replicas", h3.get("num_replicas"))
            assert args.ingress.h3_replicas == most
        assert args.generation_slots == args.ingress.h3_replicas * (args.engine.max_queue + args.engine.max_active)


@pytest.mark.parametrize(
    "name, staged",
    [("serve_config.yaml", False), ("serve_config.gpu.yaml", True), ("serve_config.h100.yaml", True)],
)
def test_the_gpu_configs_run_the_stages_and_the_cpu_default_does_not(name, staged):
    """The CPU default stays one process group (no stage deployments to set up); both GPU configs condition and
    decode in stages of their own, each replica on one GPU, asking for the h3serve_stage resource that only the
    RayServices' stage worker groups offer (tests/test_k8s.py schedules them there)."""
    config = yaml.safe_load((DOC.parents[1] / "h3serve" / "deploy" / name).read_text())
    args = DeployArgs.model_validate(config["applications"][0]["args"])
    stages = args.stage_deployments()
    assert (args.stages is not None) == staged and bool(stages) == staged
    for role, stage in stages.items():
        options = stage.ray_actor_options
        assert options["num_gpus"] == 1 and options["resources"] == {"h3serve_stage": 1}, (role, options)


def test_the_step_bound_must_end_a_hung_step_before_the_collective_timeout():
    """Under Ulysses the engine's step bound aborts and replaces a hung group; at or past the collective's own timeout
    (NCCL's watchdog) it would come second. One rank has no collective, so nothing to order."""
    with pytest.raises(ValueError, match="engine.step_timeout_min_s=60 must be below collective_timeout_s=60"):
        DeployArgs.model_validate({"sp_degree": 2, "collective_timeout_s": 60, "engine": {"step_timeout_min_s": 60}})
    DeployArgs.model_validate({"sp_degree": 2, "collective_timeout_s": 60, "engine": {"step_timeout_min_s": 59}})
    DeployArgs.model_validate({"sp_degree": 1, "collective_timeout_s": 10, "engine": {"step_timeout_min_s": 30}})
