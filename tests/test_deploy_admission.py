"""Fail closed: an incapable backend never gets a replica, and the refusal stays visible in Prometheus."""

import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import ray
import yaml
from diffusers import MiniMaxH3Transformer3DModel
from ray import serve
from ray.util.state import list_actors

from tests.harness import (
    FOREIGN_DIMS,
    REPO,
    default_config,
    free_port,
    h3serve,
    h3serve_inline,
    scrape,
    serve_run_until_all_failed,
    wait_for,
    write_config,
)

pytestmark = [pytest.mark.ray, pytest.mark.e2e]
MESSAGE = "Attention backend 'sage_attn' does not implement packed varlen attention"


REFUSED_APP = "refused"  # the refused configs' application: a name no other module uses on the session's cluster


@pytest.fixture()
def sage_config(tmp_path):
    config = copy.deepcopy(default_config())
    config["applications"][0]["name"] = REFUSED_APP
    config["applications"][0]["args"]["attention_backend"] = "sage_attn"
    return write_config(tmp_path, config, free_port(), "sage.yaml")


@pytest.fixture(scope="module")
def foreign_checkpoint(tmp_path_factory) -> Path:
    """The tiny layout with a transformer of other dims (FOREIGN_DIMS), written by the libraries' save_pretrained."""
    from h3serve.pipelines.h3.checkpoint import write_tiny_checkpoint

    directory = tmp_path_factory.mktemp("foreign") / "MiniMax-H3-foreign"
    return write_tiny_checkpoint(directory, seed=5, with_ref=True, transformer=FOREIGN_DIMS)


@pytest.fixture()
def foreign_config(tmp_path, foreign_checkpoint):
    """The default config (model: tiny) pointed at the foreign checkpoint: a mismatch admission must refuse."""
    config = copy.deepcopy(default_config())
    config["applications"][0]["name"] = REFUSED_APP
    config["applications"][0]["args"]["checkpoint"] = str(foreign_checkpoint)
    return write_config(tmp_path, config, free_port(), "foreign.yaml")


def foreign_message(checkpoint: Path, read_on: str = "the driver") -> str:
    """The refusal of FOREIGN_DIMS under model: tiny: the field, the checkpoint's folder and both geometries."""
    return (
        "model='tiny' names the minimax-h3-tiny architecture (4 heads x 32, 4 layers, hidden 96), but checkpoint "
        f"{checkpoint / 'transformer'} (read on {read_on}) has 4 heads x 24, 3 layers, hidden 64 (head_dim 32 vs 24; "
        "num_layers 4 vs 3; hidden_size 96 vs 64)"
    )


class Refusal(NamedTuple):
    app: str  # its application in the shared configs below: a name no other module uses on the session's cluster
    args: Callable[[Path], dict]  # what it changes in the default application's args, given the foreign checkpoint
    message: Callable[[Path], str]  # what the refusal says, given the foreign checkpoint
    labels: dict[str, str]  # the labels of its counted series


REFUSALS = {
    "incapable backend": Refusal(
        "refused-backend",
        lambda checkpoint: {"attention_backend": "sage_attn"},
        lambda checkpoint: MESSAGE,
        {"backend": "sage_attn", "reason": "incapable"},
    ),
    "checkpoint of other dims": Refusal(
        "refused-checkpoint",
        lambda checkpoint: {"checkpoint": str(checkpoint)},
        foreign_message,
        {"backend": "auto", "reason": "checkpoint"},
    ),
}


def config_of(apps: dict[str, dict]) -> dict:
    """The default config with one application per entry (its name -> what it changes in the default args), each
    at a route prefix of its own."""
    config = default_config()
    (default,) = config["applications"]
    config["applications"] = []
    for name, args in apps.items():
        app = copy.deepcopy(default)
        app.update(name=name, route_prefix=f"/{name}")
        app["args"].update(args)
        config["applications"].append(app)
    return config


def h3_replica_actors(address: str, app: str):
    """Every H3 replica actor application ``app`` ever had on this cluster, dead ones included."""
    actors = list_actors(address=address, detail=True, limit=10000)
    return [a for a in actors if a.class_name == f"ServeReplica:{app}:H3Replica"]


def test_admit_refuses_sage_attn_and_writes_the_counter(sage_config, tmp_path):
    textfile = tmp_path / "admission.prom"
    result = h3serve("admit", str(sage_config), "--textfile", str(textfile))
    assert result.returncode == 2, result
    assert MESSAGE in result.stderr
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    failures = families["h3serve_admission_failures"].samples
    assert [(s.labels["backend"], s.labels["reason"], s.value) for s in failures if s.name.endswith("_total")] == [
        ("sage_attn", "incapable", 1.0)
    ]


def test_admit_refuses_a_checkpoint_of_other_dims_and_serves_its_own_with_model_auto(
    foreign_config, foreign_checkpoint, tmp_path
):
    """model: tiny with a checkpoint of other dims is refused offline, naming the field, the folder and both
    geometries, and counted (reason "checkpoint"); model: auto admits it, and plans memory at its real dims."""
    from prometheus_client.parser import text_string_to_metric_families

    from h3serve.pipelines.h3 import preset
    from h3serve.pipelines.h3.memory import activation_row_cost, gib

    textfile = tmp_path / "admission.prom"
    result = h3serve_inline("admit", str(foreign_config), "--textfile", str(textfile))
    assert result.returncode == 2, result
    assert foreign_message(foreign_checkpoint) + ": set model to the checkpoint's architecture" in result.stderr
    assert "memory plan" not in result.stdout  # not the dims that would be served
    families = {f.name: f for f in text_string_to_metric_families(textfile.read_text())}
    failures = families["h3serve_admission_failures"].samples
    assert [(s.labels["reason"], s.value) for s in failures if s.name.endswith("_total")] == [("checkpoint", 1.0)]

    config = yaml.safe_load(foreign_config.read_text())
    config["applications"][0]["args"]["model"] = "auto"
    auto = h3serve_inline("admit", str(write_config(tmp_path, config, free_port(), "auto.yaml")))
    assert auto.returncode == 0, auto.stderr
    assert (
        f"checkpoint {foreign_checkpoint / 'transformer'} (read on the driver): 4 heads x 24, 3 layers, hidden 64"
    ) in auto.stdout
    # the plan counts the checkpoint's transformers (both partitions) and its activations at hidden 64
    transformer = MiniMaxH3Transformer3DModel.from_pretrained(foreign_checkpoint / "transformer")
    weights = gib(sum(p.numel() * p.element_size() for p in transformer.parameters()))
    assert f"weights: transformer {weights}, transformer_ref {weights}, text_encoder" in auto.stdout
    per_row = activation_row_cost(transformer.config, "float32", step_cache=True).per_row(1)
    assert per_row < activation_row_cost(preset("tiny").transformer_config(), "float32", step_cache=True).per_row(1)
    assert f"{per_row / 1e3:.1f} kB per pack row on a rank" in auto.stdout


def test_admit_refuses_a_config_whose_replica_count_the_ingress_was_not_sized_for(tmp_path):
    config = copy.deepcopy(default_config())
    replica = next(d for d in config["applications"][0]["deployments"] if d["name"] == "H3Replica")
    replica["num_replicas"] = 3  # args.ingress.h3_replicas stays 1
    result = h3serve_inline("admit", str(write_config(tmp_path, config, free_port(), "three.yaml")))
    assert result.returncode == 2, result
    assert "H3Replica runs up to 3 replicas (num_replicas under deployments:)" in result.stderr
    assert "args.ingress.h3_replicas is 1" in result.stderr
    config["applications"][0]["args"]["ingress"] = {"h3_replicas": 3}
    assert h3serve_inline("admit", str(write_config(tmp_path, config, free_port(), "three-sized.yaml"))).returncode == 0


def test_admit_passes_both_shipped_configs():
    default = h3serve_inline("admit", "h3serve/deploy/serve_config.yaml")
    assert default.returncode == 0, default.stderr
    assert "stage conditioner" not in default.stdout  # the CPU default stays one deployment
    gpu = h3serve_inline("admit", "h3serve/deploy/serve_config.gpu.yaml")
    assert gpu.returncode == 2 and "--platform" in gpu.stderr  # this machine is not the GPU target
    missing = h3serve_inline(
        "admit", "h3serve/deploy/serve_config.gpu.yaml", "--platform", "h3serve/deploy/platforms/h200.json"
    )
    assert missing.returncode == 2, missing  # a mistyped file name: refused naming the flag, no traceback
    assert (
        "--platform 'h3serve/deploy/platforms/h200.json': neither an existing file nor platform JSON" in missing.stderr
    )
    h200 = "h3serve/deploy/platforms/h200-flash-attn.json"
    given = h3serve_inline("admit", "h3serve/deploy/serve_config.gpu.yaml", "--platform", h200)
    assert given.returncode == 0, given.stderr
    assert "'flash_attn' explicitly selected" in given.stdout
    lines = given.stdout.splitlines()
    for role in ("rank 0", "worker ranks", "conditioner", "decoder"):  # every role's memory plan
        assert any(line.startswith(f"{role} ") for line in lines), (role, given.stdout)
    assert "weights: transformer 61.7 GiB\n" in given.stdout  # the denoiser's ranks: no Qwen3-VL, no VAEs
    assert "weights: text_encoder 50.3 GiB, vae 5.2 GiB, audio_vae 577.2 MiB" in given.stdout
    assert "stage conditioner: 1 replica(s)" in given.stdout and "stage decoder: 2 replica(s)" in given.stdout


def released_layout(tmp_path: Path) -> Path:
    """The released checkpoint's layout and configs without its weights: a tiny checkpoint with transformer_ref/ whose
    model components' config.json are replaced by the released ones, written by the libraries (``save_config`` of a
    meta-device model, ``save_pretrained`` of Qwen3-VL's config). Admission reads them as it would the released
    checkpoint's, and the memory plan counts the released model from them."""
    import torch
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio
    from transformers import Qwen3VLConfig

    from h3serve.pipelines.h3.checkpoint import CheckpointIndex, write_tiny_checkpoint
    from h3serve.pipelines.h3.memory import RELEASED_TEXT_ENCODER

    released = write_tiny_checkpoint(tmp_path / "MiniMax-H3", with_ref=True)
    with torch.device("meta"):
        models = {"transformer": MiniMaxH3Transformer3DModel(), "vae": AutoencoderKLMiniMaxH3()}
        models |= {"transformer_ref": models["transformer"], "audio_vae": AutoencoderKLMiniMaxH3Audio()}
    for name, model in models.items():
        for weights in (released / name).glob("*.safetensors"):
            weights.unlink()
        model.save_config(released / name)
    for weights in (released / "text_encoder").glob("*.safetensors"):
        weights.unlink()
    Qwen3VLConfig(**RELEASED_TEXT_ENCODER).save_pretrained(released / "text_encoder")
    assert CheckpointIndex(released).partitions() == ("transformer", "transformer_ref")
    return released


def test_admit_sizes_the_h200_config_for_the_released_checkpoint(tmp_path):
    """With transformer_ref/ every rank holds two transformers: staged, they fit an H200 (the shipped H200 config);
    in one deployment rank 0 would also hold Qwen3-VL and the VAEs, and fits no GPU; staged on an H100, no rank
    fits."""
    from h3serve.pipelines.h3.memory import gib, memory_plan

    released = released_layout(tmp_path)
    config = yaml.safe_load((REPO / "h3serve" / "deploy" / "serve_config.gpu.yaml").read_text())
    args = config["applications"][0]["args"]
    args["checkpoint"] = str(released)
    h200, h100 = (REPO / "h3serve" / "deploy" / "platforms" / f"{gpu}-flash-attn.json" for gpu in ("h200", "h100"))
    h200_bytes = json.loads(h200.read_text())["device_memory_bytes"]
    from h3serve.deploy.common.args import DeployArgs

    engine = DeployArgs.model_validate(args).engine  # the config's bounds, its defaults filled in
    plan = memory_plan(
        model="full",
        checkpoint=str(released),
        dtype="bfloat16",
        sp_degree=4,
        max_rows=80000,
        stages="remote",
        text_rows=engine.max_text_rows_per_step,
        requests=engine.max_active + engine.max_prepared,
        steps=args["limits"]["max_steps"],
        vae_dtype="bfloat16",  # the GPU default (args.vae_dtype on cuda): the VAEs as released
    )
    rank0, workers = plan.ranks
    assert rank0.weights == workers.weights and set(rank0.weights) == {"transformer", "transformer_ref"}
    assert rank0.weights["transformer_ref"] == rank0.weights["transformer"]
    assert plan.max_rows_that_fit(h200_bytes) >= args["engine"]["max_rows_per_step"]  # what makes it admissible

    staged = h3serve_inline(
        "admit", str(write_config(tmp_path, config, free_port(), "h200-released.yaml")), "--platform", str(h200)
    )
    assert staged.returncode == 0, staged.stderr
    assert plan.table(h200_bytes) in staged.stdout  # every role's numbers, as planned for the released checkpoint
    assert "weights: transformer 61.7 GiB, transformer_ref 61.7 GiB\n" in staged.stdout
    assert "is not readable here" not in staged.stdout

    on_h100 = h3serve_inline(
        "admit", str(write_config(tmp_path, config, free_port(), "h100-released.yaml")), "--platform", str(h100)
    )
    assert on_h100.returncode == 2, on_h100.stdout
    assert f"rank 0 needs {gib(rank0.total_bytes)}" in on_h100.stderr and "has 79.6 GiB" in on_h100.stderr

    del args["stages"]
    local = memory_plan(
        model="full",
        checkpoint=str(released),
        dtype="bfloat16",
        sp_degree=4,
        max_rows=80000,
        text_rows=engine.max_text_rows_per_step,
        requests=engine.max_active + engine.max_prepared,
        steps=args["limits"]["max_steps"],
        vae_dtype="bfloat16",
    )
    assert local.ranks[0].weight_bytes > h200_bytes  # no row budget can help
    unstaged = h3serve_inline(
        "admit", str(write_config(tmp_path, config, free_port(), "h200-unstaged.yaml")), "--platform", str(h200)
    )
    assert unstaged.returncode == 2, unstaged.stdout
    assert f"admission refused application 'h3serve': rank 0 needs {gib(local.ranks[0].total_bytes)}" in unstaged.stderr
    for number in ("transformer 61.7 GiB", "transformer_ref 61.7 GiB", "text_encoder 50.3 GiB", "has 140.4 GiB"):
        assert number in unstaged.stderr
    assert "no max_rows_per_step fits" in unstaged.stderr


def test_admit_passes_the_staged_h100_config_and_refuses_it_without_stages(tmp_path):
    platform = "h3serve/deploy/platforms/h100-flash-attn.json"
    staged = h3serve_inline("admit", "h3serve/deploy/serve_config.h100.yaml", "--platform", platform)
    assert staged.returncode == 0, staged.stderr
    assert "application 'h3serve' admitted" in staged.stdout
    # the plan of every role: the denoiser's ranks hold the transformer alone, each stage its own models
    lines = staged.stdout.splitlines()
    for role in ("rank 0", "worker ranks", "conditioner", "decoder"):
        assert any(line.startswith(f"{role} ") for line in lines), (role, staged.stdout)
    assert "weights: transformer 61.7 GiB\n" in staged.stdout  # rank 0 and the workers: nothing else
    assert "weights: text_encoder 50.3 GiB, vae 5.2 GiB, audio_vae 577.2 MiB" in staged.stdout  # the conditioner
    assert "weights: vae 5.2 GiB, audio_vae 577.2 MiB" in staged.stdout  # the decoder
    assert "stage conditioner: 1 replica(s)" in staged.stdout and "stage decoder: 2 replica(s)" in staged.stdout
    config = yaml.safe_load((REPO / "h3serve" / "deploy" / "serve_config.h100.yaml").read_text())
    del config["applications"][0]["args"]["stages"]
    unstaged = h3serve_inline(
        "admit", str(write_config(tmp_path, config, free_port(), "h100-unstaged.yaml")), "--platform", platform
    )
    assert unstaged.returncode == 2, unstaged.stdout
    assert "admission refused application 'h3serve': rank 0 needs" in unstaged.stderr
    for number in ("transformer 61.7 GiB", "text_encoder 50.3 GiB", "vae 5.2 GiB", "has 79.6 GiB"):
        assert number in unstaged.stderr
    assert "stage conditioner" not in unstaged.stdout


ADMISSIBLE_APP = "admissible-beside-refusals"  # the pre-flight's config: admitted, and still never started


@pytest.fixture(scope="module")
def preflight(ray_cluster, foreign_checkpoint, tmp_path_factory):
    """One `h3serve serve` of a config holding an application per refusal, an admissible one between them: the
    config, and the command's result (the pre-flight checks every application, then refuses once)."""
    first, *others = REFUSALS.values()
    apps = {first.app: first.args(foreign_checkpoint), ADMISSIBLE_APP: {}}
    apps |= {refusal.app: refusal.args(foreign_checkpoint) for refusal in others}
    config = write_config(tmp_path_factory.mktemp("preflight"), config_of(apps), free_port(), "preflight.yaml")
    return config, h3serve("serve", str(config), "--address", ray_cluster.address)


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_serve_preflight_exits_before_starting_anything(ray_cluster, preflight, foreign_checkpoint, refusal):
    refused = REFUSALS[refusal]
    _, result = preflight
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"application {refused.app!r}: {refused.message(foreign_checkpoint)}" in result.stderr
    assert not h3_replica_actors(ray_cluster.address, refused.app)


def test_serve_preflight_checks_every_application_then_refuses_once_as_admit_does(ray_cluster, preflight):
    """Every application is checked before the command fails: the admissible one is admitted (and, like the refused
    ones, never started), and the one refusal names every refused application in `h3serve admit`'s words."""
    config, result = preflight
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"application {ADMISSIBLE_APP!r} admitted" in result.stdout
    assert "deploying" not in result.stdout and not h3_replica_actors(ray_cluster.address, ADMISSIBLE_APP)
    admit = h3serve_inline("admit", str(config))
    assert admit.returncode == 2, admit
    (refused,) = [line for line in admit.stderr.splitlines() if line.startswith("h3serve: admission refused")]
    assert all(f"application {r.app!r}: " in refused for r in REFUSALS.values())
    assert [line for line in result.stderr.splitlines() if line.startswith("h3serve: admission refused")] == [refused]


TOKEN_APP = "token-unset"  # the plain `serve run`'s config: admitted, its ingress refuses in its constructor
TOKEN_ENV = "H3_TEST_UNSET_KEY"


def replica_build_failures(metrics_port: int, **labels: str) -> list:
    """The replicas' build failures with ``labels`` (backend, reason), from one scrape of the export port."""
    samples = scrape(metrics_port).get("ray_h3serve_replica_build_failures_total", [])
    return [s for s in samples if labels.items() <= s.labels.items()]


def counted_failures(metrics: int | dict[str, list], labels: dict[str, str]) -> list:
    """The build stage's admission failures with ``labels``, from the export port or one ``scrape`` of it."""
    samples = (scrape(metrics) if isinstance(metrics, int) else metrics).get("ray_h3serve_admission_failures_total", [])
    return [s for s in samples if s.labels.get("stage") == "build" and labels.items() <= s.labels.items()]


@pytest.fixture(scope="module")
def plain_serve_run(ray_cluster, foreign_checkpoint, tmp_path_factory):
    """One plain `serve run` (the user's command, bypassing the pre-flight: the builder must refuse on its own) of an
    application per refusal and one whose token is unset on the cluster: each application's status once all of them
    reached DEPLOY_FAILED, and each refusal's count before it (the session's cluster may have counted some before).
    The applications are deleted at once; their dead replica actors and the recorder's series stay to be read."""
    assert TOKEN_ENV not in os.environ  # so not in the session cluster's, which inherits this environment
    apps = {refusal.app: refusal.args(foreign_checkpoint) for refusal in REFUSALS.values()}
    apps[TOKEN_APP] = {"api_key_env": TOKEN_ENV}
    config = write_config(tmp_path_factory.mktemp("plain"), config_of(apps), free_port(), "plain.yaml")
    metrics = scrape(ray_cluster.metrics_port)
    before = {refusal: sum(s.value for s in counted_failures(metrics, r.labels)) for refusal, r in REFUSALS.items()}
    # the three builds import torch at once: one deadline as long as the three separate runs' were together
    statuses = serve_run_until_all_failed(config, ray_cluster.address, list(apps), timeout=420)
    for app in apps:  # (a failure above leaves them to the module's end, which shuts Serve down)
        serve.delete(app)
    return statuses, before


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_plain_serve_run_reaches_deploy_failed_with_no_replica_and_a_scrapeable_counter(
    ray_cluster, plain_serve_run, foreign_checkpoint, refusal
):
    refused = REFUSALS[refusal]
    statuses, before = plain_serve_run
    assert refused.message(foreign_checkpoint) in statuses[refused.app].message
    assert not h3_replica_actors(ray_cluster.address, refused.app), (
        f"an H3 replica was created for a refused deployment ({refusal})"
    )

    def counted():
        return counted_failures(ray_cluster.metrics_port, refused.labels)

    # the build task has exited; the detached recorder keeps the series on the export port
    samples = wait_for(
        lambda: sum(s.value for s in counted()) > before[refusal] and counted(), timeout=60, what="the metric"
    )
    assert sum(s.value for s in samples) == before[refusal] + 1  # refused once, not once per build retry


def test_plain_serve_reaches_deploy_failed_when_the_clusters_token_is_unset(plain_serve_run):
    """On a cluster the replicas' environment decides (`h3serve serve --address` cannot pre-flight it): the
    ingress refuses in its constructor, and the application reaches DEPLOY_FAILED with the message. (From
    test_api_lifecycle, whose cluster it did not need: any cluster without the variable shows it.)"""
    statuses, _ = plain_serve_run
    app = statuses[TOKEN_APP]
    messages = app.message + "".join(d.message for d in app.deployments.values())
    assert f"{TOKEN_ENV!r} but that environment variable is empty or unset" in messages


def test_a_checkpoint_only_replica_nodes_hold_is_read_by_the_probe(
    ray_cluster, foreign_checkpoint, tmp_path, monkeypatch
):
    """Where the driver cannot read the directory (a volume mounted on GPU nodes only), the platform probe reads it
    on a replica node. Here a relative path names the checkpoint from the workers' working directory, and the
    driver (this process) runs elsewhere, where that path leads nowhere."""
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.deploy.driver.preflight import admit
    from h3serve.pipelines.h3 import CheckpointMismatch, TransformerGeometry

    def cwd() -> str:
        return os.getcwd()

    workers_cwd = ray.get(ray.remote(num_cpus=0)(cwd).remote())
    relative = os.path.relpath(foreign_checkpoint, workers_cwd)
    monkeypatch.chdir(tmp_path)
    assert not Path(relative).exists()
    node = f"replica node {ray.util.get_node_ip_address()}"
    recorded: list[dict[str, str]] = []
    args = dict(checkpoint=relative, rank_resources={"CPU": 0.25}, api_key_env=None)
    with pytest.raises(CheckpointMismatch) as refused:
        admit(DeployArgs(**args), "preflight", record=recorded.append)
    assert foreign_message(Path(relative), node) in str(refused.value)
    admitted = admit(DeployArgs(model="auto", **args), "preflight", record=recorded.append)
    assert admitted.geometry == TransformerGeometry(num_heads=4, head_dim=24, num_layers=3, hidden_size=64)
    assert admitted.checkpoint is not None and admitted.checkpoint.read_on == node
    assert admitted.checkpoint.partitions == ("transformer", "transformer_ref")
    assert set(admitted.plan.ranks[0].weights) >= {"transformer", "transformer_ref"}  # read there, counted here
    with pytest.raises(CheckpointMismatch, match=f"is not readable on the driver nor on {node}: .* has no modular"):
        admit(DeployArgs(model="auto", **{**args, "checkpoint": str(tmp_path / "nowhere")}), record=recorded.append)
    assert [(t["outcome"], t["reason"]) for t in recorded] == [
        ("rejected", "checkpoint"),
        ("admitted", "ok"),
        ("rejected", "checkpoint"),
    ]


def test_a_replica_that_cannot_run_the_admitted_backend_fails_closed(ray_cluster, tmp_path):
    """The driver was told (assumed_platform) that replicas have flash_attn on CUDA; this node has
    neither. The replica must refuse to build, count it, and never fall back to another backend."""
    address, metrics_port = ray_cluster.address, ray_cluster.metrics_port
    config = copy.deepcopy(default_config())
    config["applications"][0]["name"] = app = "claims-gpu"
    platform = json.loads((REPO / "h3serve" / "deploy" / "platforms" / "h100-flash-attn.json").read_text())
    config["applications"][0]["args"].update(
        attention_backend="flash_attn",
        device="cuda",
        dtype="bfloat16",
        probe_platform=False,
        assumed_platform=platform,
        rank_resources={"CPU": 0.25, "GPU": 1},
    )
    path = write_config(tmp_path, config, free_port(), "claims-gpu.yaml")
    # the pre-flight passes (the assumed platform has flash_attn); the replicas then refuse, and
    # `h3serve serve` must notice DEPLOY_FAILED and exit non-zero instead of serving nothing forever
    result = h3serve("serve", str(path), "--address", address, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "failed to deploy" in result.stderr
    assert "BackendUnavailable" in result.stderr and "flash_attn" in result.stderr
    replicas = h3_replica_actors(address, app)
    assert replicas and all(a.state == "DEAD" for a in replicas)
    recorder = ray.get_actor("h3serve-admission-metrics", namespace="h3serve")
    flash = [e for e in ray.get(recorder.decisions_log.remote()) if e["backend"] == "flash_attn"]
    assert {e["outcome"] for e in flash} == {"admitted"}  # the driver admitted; no replica fell back

    samples = wait_for(
        lambda: replica_build_failures(metrics_port, backend="flash_attn"),
        timeout=60,
        what="replica build failure metric",
    )
    assert {s.labels["reason"] for s in samples} == {"unavailable"} and sum(s.value for s in samples) >= 1


def spec_for(backend: str, sp_degree: int = 1):
    from h3serve.attention import Platform, Resolution, resolve
    from h3serve.pipelines.h3 import REQUIREMENTS
    from h3serve.replicas import ReplicaSpec

    admitted = resolve(REQUIREMENTS, "auto", Platform.cpu(), model="minimax-h3-tiny", head_dim=32)
    resolution = Resolution(**{**admitted.model_dump(), "backend": backend})
    return ReplicaSpec(
        resolution=resolution,
        checkpoint=None,
        model_name="minimax-h3-tiny",
        num_heads=4,
        head_dim=32,
        num_layers=4,
        hidden_size=96,
        sp_degree=sp_degree,
        rank_resources={"CPU": 0.25},
    )


def replica_app(spec, name: str, **limits):
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.deploy.model_server.h3_replica import H3Replica
    from h3serve.replicas import EngineLimits

    options = H3Replica.deployment_options(DeployArgs(rank_resources={"CPU": 0.25}, sp_degree=spec.sp_degree))
    return serve.deployment(H3Replica, **options).bind(spec, EngineLimits(**limits)), name


def recorder_actors(address: str, state: str) -> list:
    from h3serve.deploy.common.metrics import RECORDER_NAME

    actors = list_actors(address=address, detail=True, limit=10000, filters=[("name", "=", RECORDER_NAME)])
    return [a for a in actors if a.state == state]


@pytest.fixture()
def no_recorder(ray_cluster):
    """No admission recorder on the cluster, as before any driver counted: the detached actor that earlier tests (or
    modules) created is killed and not restarted, so the next count must create it. Its counters go with it, as
    when the head restarts it."""
    from h3serve.deploy.common.metrics import RECORDER_NAME, RECORDER_NAMESPACE

    try:
        ray.kill(ray.get_actor(RECORDER_NAME, namespace=RECORDER_NAMESPACE), no_restart=True)
    except ValueError:  # none yet: this test runs first on a fresh cluster
        pass
    wait_for(lambda: not recorder_actors(ray_cluster.address, "ALIVE"), timeout=30, what="the recorder to be gone")


def test_a_replica_handed_an_incapable_backend_refuses_and_counts_it(ray_cluster, no_recorder):
    """Fail closed at every layer: a spec the driver would never make is refused by the replica itself. No driver
    counted before it (no recorder exists): the replica creates the recorder, outside its own placement group."""
    metrics_port = ray_cluster.metrics_port
    app, name = replica_app(spec_for("sage_attn"), "incapable-replica")
    with pytest.raises(RuntimeError, match=f"Deploying application {name} failed"):
        serve.run(app, name=name, route_prefix=None)
    status = serve.status().applications[name]
    assert status.status == "DEPLOY_FAILED"
    message = status.deployments["H3Replica"].message
    assert "does not implement packed varlen attention" in message
    assert "AdmissionRecorder" not in message, message[-3000:]  # counting it did not fail on top of the refusal
    # the replica made it: detached, on no placement group (the replica's bundles hold no head resource)
    (recorder,) = recorder_actors(ray_cluster.address, "ALIVE")
    assert recorder.is_detached and recorder.placement_group_id is None

    samples = wait_for(
        lambda: replica_build_failures(metrics_port, backend="sage_attn"),
        timeout=60,
        what="replica build failure metric",
    )
    assert {s.labels["reason"] for s in samples} == {"incapable"}
    serve.delete(name)


def test_a_warm_up_clip_the_model_refuses_fails_the_replica_closed_and_counts_it(ray_cluster):
    """engine.warmup_clip at a size the served model refuses: no replica serves, the reason is in the status, and
    the build failure is counted by the exception's name."""
    metrics_port = ray_cluster.metrics_port
    app, name = replica_app(spec_for("torch_sdpa"), "refused-clip", warmup_clip={"enabled": True, "num_frames": 6})
    with pytest.raises(RuntimeError, match=f"Deploying application {name} failed"):
        serve.run(app, name=name, route_prefix=None)
    status = serve.status().applications[name]
    assert status.status == "DEPLOY_FAILED"
    assert "engine.warmup_clip" in status.deployments["H3Replica"].message

    wait_for(
        lambda: replica_build_failures(metrics_port, reason="ClipWarmUpRefused"),
        timeout=60,
        what="replica build failure metric",
    )
    serve.delete(name)


def test_a_stopped_replica_releases_its_sp_workers(ray_cluster):
    address = ray_cluster.address
    app, name = replica_app(spec_for("torch_sdpa", sp_degree=2), "sp-teardown", warmup_clip={"enabled": True})
    handle = serve.run(app, name=name, route_prefix=None)
    diagnostics = handle.diagnostics.remote().result()
    assert diagnostics["sp_degree"] == 2
    loads = diagnostics["rank_loads"]  # the replica's start: its worker's load asked for before rank 0 began its own
    assert sorted(loads) == [0, 1] and loads[1]["requested"] <= loads[0]["started"] < loads[0]["finished"]
    # it was ready only after its warm-up clip: the served size's steps on both ranks, decoded, streamed, encoded
    clip = diagnostics["warm_up_clip"]
    assert clip["forwards"] == 1 and clip["streamed"] and clip["mp4_bytes"] > 0 and len(clip["frames"]) == 3
    assert diagnostics["forwards"] == 0 and diagnostics["requests"] == {}  # counted nowhere

    def workers(state: str):
        return [
            a
            for a in list_actors(address=address, detail=True, limit=10000)
            if (a.class_name or "").endswith("SPWorker") and a.state == state
        ]

    assert len(workers("ALIVE")) == 1
    serve.delete(name)
    wait_for(lambda: not workers("ALIVE"), timeout=60, what="the SP worker to stop with its replica")
