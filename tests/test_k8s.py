"""The Kubernetes side agrees with the code: CRD schema, serve config, Ray version, metric names,
GPU arithmetic, monitoring wiring, runbooks. Fast, no cluster, no Ray started.

Every RayService k8s/generate.py writes is checked (k8s/rayservice.yaml from h3serve/deploy/serve_config.gpu.yaml on
H200
nodes, k8s/rayservice.h100.yaml from h3serve/deploy/serve_config.h100.yaml on H100 nodes). The GPU arithmetic reads the
worker groups as Ray's KubeRay autoscaler reads them and packs every deployment's replicas with its bin packer."""

from __future__ import annotations

import collections
import copy
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "k8s"
SHARED = REPO.parent / "shared"  # present in the project workspace, absent from users' clones
CRD = SHARED / "schemas" / "kuberay" / "ray.io_rayservices.yaml"

RAYSERVICE = K8S / "rayservice.yaml"  # the H200 one; the checks that need one manifest use it
PVC = K8S / "weights-pvc.yaml"
PODMONITORS = K8S / "monitoring" / "podmonitors.yaml"
RULES = K8S / "monitoring" / "prometheusrule.yaml"
DASHBOARD = K8S / "monitoring" / "grafana-dashboard.json"
SERVE_CONFIG = REPO / "h3serve" / "deploy" / "serve_config.gpu.yaml"
DOCKERFILE = REPO / "Dockerfile"
OPERATIONS = REPO / "docs" / "OPERATIONS.md"
BUILDER = "h3serve.deploy.driver.app:build_app"
STAGE_RESOURCE = "h3serve_stage"  # the custom Ray resource only the stage worker groups offer


def load_generate():
    spec = importlib.util.spec_from_file_location("k8s_generate", K8S / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# manifest file name -> (the RayService, the serve config it is generated from)
MANIFESTS = {target.name: (target, source) for source, target in load_generate().PAIRS}


# -- loading ------------------------------------------------------------------------------
def load_one(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(docs) == 1, f"{path}: expected one document, found {len(docs)}"
    return docs[0]


@pytest.fixture(params=sorted(MANIFESTS))
def manifest(request) -> str:
    """Each shipped RayService, by file name."""
    return request.param


@cache
def rayservice(name: str = RAYSERVICE.name) -> dict:
    return load_one(MANIFESTS[name][0])


def cluster(name: str = RAYSERVICE.name) -> dict:
    return rayservice(name)["spec"]["rayClusterConfig"]


def gpu_groups(name: str = RAYSERVICE.name) -> list[dict]:
    groups = [g for g in cluster(name)["workerGroupSpecs"] if "nvidia.com/gpu" in container(g)["resources"]["limits"]]
    assert groups, f"{name}: no GPU worker group"
    return groups


def container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in the first container


@cache
def serve_config(name: str = RAYSERVICE.name) -> dict:
    return yaml.safe_load(MANIFESTS[name][1].read_text())


def h3_app(name: str = RAYSERVICE.name) -> dict:
    apps = [a for a in serve_config(name)["applications"] if a.get("import_path") == BUILDER]
    assert len(apps) == 1, f"{MANIFESTS[name][1]}: expected one application with import_path {BUILDER}"
    return apps[0]


def deployment(deployment_name: str, name: str = RAYSERVICE.name) -> dict:
    return next((d for d in h3_app(name).get("deployments", []) if d["name"] == deployment_name), {})


def deploy_args(name: str = RAYSERVICE.name):
    from h3serve.deploy.common.args import DeployArgs  # applies the builder's own defaults

    return DeployArgs.model_validate(h3_app(name).get("args") or {})


def dockerfile_base() -> re.Match:
    froms = [line for line in DOCKERFILE.read_text().splitlines() if re.match(r"\s*FROM\s", line, re.IGNORECASE)]
    assert len(froms) == 1, f"{DOCKERFILE}: expected one FROM line, found {froms}"
    match = re.match(
        r"\s*FROM\s+(?:--platform=\S+\s+)?rayproject/ray:(?P<ray>\d+\.\d+\.\d+)-py3(?P<py>\d+)-(?P<flavor>\S+)",
        froms[0],
        re.IGNORECASE,
    )
    assert match, f"{DOCKERFILE}: FROM must be rayproject/ray:<version>-py3XX-<flavor>, got {froms[0]!r}"
    return match


# -- 1. everything parses -----------------------------------------------------------------
def test_every_manifest_parses():
    yamls = sorted([*K8S.rglob("*.yaml"), *K8S.rglob("*.yml")])
    jsons = sorted(K8S.rglob("*.json"))
    assert {target for target, _ in MANIFESTS.values()} <= set(yamls)
    assert PVC in yamls and PODMONITORS in yamls and RULES in yamls and DASHBOARD in jsons
    for path in yamls:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: a document without apiVersion/kind"
    for path in jsons:
        json.loads(path.read_text())
    base = dockerfile_base()
    assert base["flavor"].startswith(("gpu", "cu")), "the image runs CUDA replicas: use a GPU base image"


# -- 2. the RayService against KubeRay's CRD ----------------------------------------------
@cache
def crd_validator():
    import jsonschema

    if not CRD.is_file():
        pytest.skip(f"KubeRay CRD not found at {CRD} (only the project workspace has shared/)")
    crd = yaml.load(CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB: use libyaml
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    formats = jsonschema.FormatChecker()
    formats.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)
    formats.checks("int64")(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**63)
    schema = structural_to_jsonschema(version["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, format_checker=formats)


def structural_to_jsonschema(node):
    """A Kubernetes structural schema (OpenAPI v3 subset) as JSON Schema draft 7, keeping its constraints.

    - Unknown fields: the API server prunes them (and rejects them under strict field validation), so an
      object with `properties` and no `additionalProperties` gets `additionalProperties: false`. This is
      stricter than plain JSON Schema and is what catches a misspelt field.
    - int-or-string fields are already `anyOf: [integer, string]` plus a `pattern`, which JSON Schema
      applies to strings only: no shim needed.
    - `nullable: true` adds "null" to the type.
    - `x-kubernetes-*` (list/map semantics, CEL rules) are not JSON Schema and are not evaluated here.
    """
    if isinstance(node, list):
        return [structural_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: structural_to_jsonschema(sub) for name, sub in value.items()}
        else:
            out[key] = structural_to_jsonschema(value)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_errors(doc: dict) -> list[str]:
    validator = crd_validator()
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]


def test_rayservice_validates_against_kuberay_crd(manifest):
    doc = rayservice(manifest)
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    errors = crd_errors(doc)
    assert not errors, f"k8s/{manifest} does not fit the RayService CRD:\n" + "\n".join(errors)


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"].__setitem__("rayStartParam", {}), "rayStartParam"),
        (
            lambda d: container(d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0])["resources"][
                "limits"
            ].__setitem__("nvidia.com/gpu", "four"),
            "does not match",
        ),
        (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].__setitem__("maxReplicas", 2**31), "int32"),
        (lambda d: d["spec"].__setitem__("serveConfigV2", {"applications": []}), "is not of type 'string'"),
    ],
)
def test_crd_validation_is_not_toothless(mutate, expected):
    doc = copy.deepcopy(rayservice())
    mutate(doc)
    assert any(expected in e for e in crd_errors(doc)), f"a broken RayService passed validation ({expected})"


# -- 3. serveConfigV2 is the serve config -------------------------------------------------
def test_serve_config_v2_is_its_serve_config(manifest):
    embedded = rayservice(manifest)["spec"]["serveConfigV2"]
    assert isinstance(embedded, str), "serveConfigV2 must be a YAML string"
    assert yaml.safe_load(embedded) == serve_config(manifest), (
        f"k8s/{manifest}'s serveConfigV2 differs from {MANIFESTS[manifest][1].name}: run python k8s/generate.py"
    )


def test_every_gpu_serve_config_has_a_rayservice():
    """A GPU serve config shipped without its RayService (or a RayService generate.py does not write) drifts."""
    gpu_configs = {
        path
        for path in (REPO / "h3serve" / "deploy").glob("serve_config*.yaml")
        if any(a.get("args", {}).get("device") == "cuda" for a in yaml.safe_load(path.read_text())["applications"])
    }
    assert gpu_configs == {source for _, source in MANIFESTS.values()}
    assert {p.name for p in K8S.glob("rayservice*.yaml")} == set(MANIFESTS)


def test_generate_check_passes():
    result = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"python k8s/generate.py --check failed:\n{result.stdout}\n{result.stderr}"


def test_generate_check_reports_drift(tmp_path):
    stale = tmp_path / "rayservice.yaml"
    text = RAYSERVICE.read_text()
    stale.write_text(text.replace("serveConfigV2: |\n", "serveConfigV2: |\n    stale: true\n", 1))
    result = subprocess.run(
        [sys.executable, str(K8S / "generate.py"), "--check", "--target", str(stale)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"^-\s+stale: true$", result.stdout, re.M), f"no diff shown:\n{result.stdout}"
    assert "stale: true" in stale.read_text(), "--check must not write"


def test_generate_check_reports_drift_of_the_h100_manifest(tmp_path):
    """The H100 RayService is generated from its own config: an H200 config's copy in it is drift."""
    target, source = MANIFESTS["rayservice.h100.yaml"]
    copy_of = tmp_path / target.name
    copy_of.write_text(target.read_text())

    def check(config: Path) -> subprocess.CompletedProcess:
        command = [
            sys.executable,
            str(K8S / "generate.py"),
            "--check",
            "--source",
            str(config),
            "--target",
            str(copy_of),
        ]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)

    assert check(source).returncode == 0
    drift = check(SERVE_CONFIG)
    assert drift.returncode == 1, drift.stdout + drift.stderr
    assert re.search(r"^-.*GENERATED serveConfigV2 from h3serve/deploy/serve_config.h100.yaml", drift.stdout, re.M)
    assert re.search(r"^\+.*GENERATED serveConfigV2 from h3serve/deploy/serve_config.gpu.yaml", drift.stdout, re.M)


# -- 4. one Ray version everywhere --------------------------------------------------------
def test_ray_versions_agree(manifest):
    image_ray = dockerfile_base()["ray"]
    assert cluster(manifest)["rayVersion"] == image_ray, f"rayVersion in k8s/{manifest} != the Dockerfile's base image"
    pin = re.search(r'"ray\[serve\]==(\d+\.\d+)\.\*"', (REPO / "pyproject.toml").read_text())
    assert pin, "pyproject.toml must pin ray[serve]==MAJOR.MINOR.*"
    installed = importlib.metadata.version("ray")
    minor = ".".join(image_ray.split(".")[:2])
    assert minor == pin[1] == ".".join(installed.split(".")[:2]), (
        f"image Ray {image_ray}, pyproject pin {pin[1]}.*, installed Ray {installed}"
    )
    python_minor = int(dockerfile_base()["py"])
    assert python_minor >= 10, "pyproject requires Python >= 3.10"


# -- 5. every metric name used exists -----------------------------------------------------
def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label names, label values and grouping lists removed)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^{}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", "", expr)
    expr = re.sub(r"\blabel_values\(([^,()]*),[^()]*\)", r"\1", expr)  # Grafana: label_values(metric, label)
    return set(re.findall(r"(?<![\w$:])ray_[a-z0-9_]+", expr))


def rule_exprs() -> list[str]:
    rules = load_one(RULES)
    return [r["expr"] for g in rules["spec"]["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())

    def panels(items):
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    exprs = [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def h3serve_series() -> set[str]:
    from h3serve.deploy.common.metrics import ALL_METRICS

    series = set()
    for metric in ALL_METRICS:
        if metric.kind == "histogram":
            series |= {f"{metric.exported}_{suffix}" for suffix in ("bucket", "sum", "count")}
        else:
            series.add(metric.exported)
    return series


@cache
def ray_source_text() -> str:
    root = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    return "\n".join(p.read_text(errors="ignore") for p in sorted((root / "serve").rglob("*.py")))


def ray_metric_defined(name: str) -> bool:
    base = name.removeprefix("ray_")
    candidates = {base} | {base.removesuffix(s) for s in ("_total", "_bucket", "_sum", "_count") if base.endswith(s)}
    return any(f'"{c}"' in ray_source_text() for c in candidates)


@pytest.mark.parametrize("source", ["prometheusrule", "grafana"])
def test_metric_names_exist(source):
    exprs = rule_exprs() if source == "prometheusrule" else dashboard_exprs()
    names = set().union(*(promql_metric_names(e) for e in exprs))
    ours = {n for n in names if n.startswith("ray_h3serve_")}
    assert ours, f"no ray_h3serve_* names found in the {source} expressions: is the extraction broken?"
    unknown = ours - h3serve_series()
    assert not unknown, f"{source} uses series that h3serve/deploy/common/metrics.py does not export: {sorted(unknown)}"
    foreign = names - ours
    missing = sorted(n for n in foreign if not ray_metric_defined(n))
    assert not missing, f"{source} uses Ray metrics not defined in the installed ray.serve: {missing}"


def test_metric_extraction_ignores_labels():
    expr = (
        "sum by (le, ray_io_cluster) (rate(ray_h3serve_request_latency_seconds_bucket"
        '{ray_io_cluster=~"ray_x", route!="/v1/videos:job"}[5m])) '
        "or on (namespace) label_values(ray_serve_application_status, ray_io_cluster)"
    )
    assert promql_metric_names(expr) == {"ray_h3serve_request_latency_seconds_bucket", "ray_serve_application_status"}


def label_values(expr: str, label: str) -> set[str]:
    """The values a PromQL expression matches ``label`` against: `l="a"`, `l!="a"`, `l=~"a|b"`, `l!~"a|b"`."""
    values = set()
    for op, value in re.findall(rf'\b{label}\s*(=~|!~|!=|=)\s*"([^"]*)"', expr):
        values |= set(value.split("|")) if "~" in op else {value}
    return values


def test_every_h3serve_metric_is_on_the_dashboard():
    from h3serve.deploy.common.metrics import ALL_METRICS

    shown = set().union(*(promql_metric_names(e) for e in dashboard_exprs()))
    missing = sorted(m.exported for m in ALL_METRICS if not any(n.startswith(m.exported) for n in shown))
    assert not missing, f"h3serve/deploy/common/metrics.py exports series no dashboard panel shows: {missing}"


@pytest.mark.parametrize("source", ["prometheusrule", "grafana"])
def test_stage_and_reason_label_values_exist(source):
    """A panel or alert that filters on a stage or a failure reason the code never reports shows nothing."""
    from h3serve.deploy.common.metrics import FAILED_STEP_REASONS, FAILURE_REASONS, STAGES

    exprs = rule_exprs() if source == "prometheusrule" else dashboard_exprs()
    stages = set().union(*(label_values(e, "stage") for e in exprs))
    reasons = set().union(*(label_values(e, "reason") for e in exprs if "failed_" in e))
    assert stages, f"no stage filters found in the {source} expressions: is the extraction broken?"
    assert stages <= set(STAGES), f"{source} filters on stages the code never reports: {stages - set(STAGES)}"
    known = set(FAILURE_REASONS) | set(FAILED_STEP_REASONS)
    assert reasons <= known, f"{source} filters on failure reasons the code never reports: {reasons - known}"


def test_label_value_extraction():
    expr = 'rate(x{stage=~"queue_wait|step", reason!="draining"}[5m]) and y{stage="decode"}'
    assert label_values(expr, "stage") == {"queue_wait", "step", "decode"}
    assert label_values(expr, "reason") == {"draining"}


def test_the_dashboard_shows_the_backlog_against_the_replicas():
    """The autoscaling panel: the summed backlog and, in the same panel, the healthy H3Replica count and Serve's
    target for it, so an operator sees why the count moved."""
    board = json.loads(DASHBOARD.read_text())
    (panel,) = [p for p in board["panels"] if p.get("title", "").startswith("Backlog (row-steps) against H3Replica")]
    exprs = [t["expr"] for t in panel["targets"]]
    assert any("ray_h3serve_backlog_row_steps" in e for e in exprs), exprs
    assert any("ray_serve_deployment_replica_healthy" in e and 'deployment="H3Replica"' in e for e in exprs), exprs
    assert any("ray_serve_autoscaling_target_replicas" in e and 'deployment="H3Replica"' in e for e in exprs), exprs


def test_drain_fits_in_serves_and_kuberays_grace_periods(manifest):
    """Serve kills a stopping replica graceful_shutdown_timeout_s after it asked it to stop, and KubeRay deletes the
    old cluster of an upgrade rayClusterDeletionDelaySeconds after the switch: both must leave the drain its time."""
    from h3serve.deploy.model_server.h3_replica import H3Replica

    args = deploy_args(manifest)
    grace = H3Replica.deployment_options(args)["graceful_shutdown_timeout_s"]
    assert grace > args.engine.drain_timeout_s, (grace, args.engine.drain_timeout_s)
    delay = rayservice(manifest)["spec"].get("rayClusterDeletionDelaySeconds", 60)  # KubeRay's default: 60
    assert delay >= grace, (
        f"rayClusterDeletionDelaySeconds {delay} < the H3 replicas' graceful_shutdown_timeout_s {grace}: an upgrade "
        "would cut off the videos the old cluster is generating"
    )


def test_rules_and_dashboard_name_the_served_application():
    named = set()
    for expr in rule_exprs() + dashboard_exprs():
        named |= set(re.findall(r'application\s*=\s*"([^"]+)"', expr))
    served = {h3_app(name)["name"] for name in MANIFESTS}  # one monitoring setup for whichever RayService runs
    assert named == served, f"PromQL filters on application {named}, the serve configs name {served}"


# -- 6. GPU arithmetic --------------------------------------------------------------------
def serve_replica_bounds(deployment_name: str, name: str = RAYSERVICE.name) -> tuple[int, int]:
    args = deploy_args(name)
    if deployment_name == "H3Replica" and args.autoscaling is not None:  # the builder sets its autoscaling_config
        return args.autoscaling.min_replicas, args.autoscaling.max_replicas
    config = deployment(deployment_name, name)
    autoscaling = config.get("autoscaling_config")
    if autoscaling:
        return autoscaling.get("min_replicas", 1), autoscaling.get("max_replicas", 1)
    replicas = config.get("num_replicas", 1)
    assert isinstance(replicas, int), f"{deployment_name}: num_replicas {replicas!r} needs an autoscaling_config"
    return replicas, replicas


def node_types(doc: dict) -> dict[str, dict]:
    """The RayService's Ray node types as Ray's KubeRay autoscaler derives them from its groups: each group's Ray
    resources (container limits, rayStartParams num-cpus/num-gpus and custom `resources`), min and max pods."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    ray_cluster = {"metadata": {"name": doc["metadata"]["name"], "namespace": "h3serve"}}
    return _derive_autoscaling_config_from_ray_cr({**ray_cluster, "spec": doc["spec"]["rayClusterConfig"]})[
        "available_node_types"
    ]


def deployment_demands(name: str) -> dict[str, tuple[dict[str, float], int, int]]:
    """Every deployment of the app the builder composes from this config: one replica's Ray resources as Serve
    computes them (an H3Replica's STRICT_PACK placement group as one demand, as Ray's autoscaler packs it) and its
    replica bounds."""
    from ray.serve._private.config import ReplicaConfig

    from h3serve.deploy.model_server.h3_replica import H3Replica
    from h3serve.deploy.model_server.stage_deployments import H3Conditioner, H3Decoder

    args = deploy_args(name)
    options = H3Replica.deployment_options(args)
    replica = ReplicaConfig.create(
        "h3serve.deploy.model_server.h3_replica:H3Replica",
        ray_actor_options=options["ray_actor_options"],
        placement_group_bundles=options["placement_group_bundles"],
        placement_group_strategy=options["placement_group_strategy"],
    )
    assert replica.placement_group_strategy == "STRICT_PACK"  # all its ranks in one Ray node: one pod
    group_demand: dict[str, float] = collections.Counter()
    for bundle in replica.placement_group_bundles:
        group_demand.update(bundle)
    demands = {"H3Replica": (dict(group_demand), *serve_replica_bounds("H3Replica", name))}
    for stage in (H3Conditioner, H3Decoder):
        if stage.role in args.stage_deployments():
            options = stage.deployment_options(args)
            config = ReplicaConfig.create(
                f"h3serve.deploy.model_server.stage_deployments:{stage.__name__}",
                ray_actor_options=options["ray_actor_options"],
            )
            demands[stage.__name__] = (config.resource_dict, options["num_replicas"], options["num_replicas"])
    ingress = ReplicaConfig.create(
        "h3serve.deploy.ingress.routes:H3Ingress",
        ray_actor_options=deployment("H3Ingress", name).get("ray_actor_options"),
    )
    demands["H3Ingress"] = (ingress.resource_dict, *serve_replica_bounds("H3Ingress", name))
    return demands


def probe_demand(name: str) -> dict[str, float]:
    """Admission's platform probe: a task shaped like one SP rank (h3serve/deploy/driver/preflight.py), run on every app
    build."""
    return dict(deploy_args(name).rank_resources)


def unplaced(nodes: list[dict[str, float]], demands: list[dict[str, float]]) -> list[dict[str, float]]:
    """What Ray's autoscaler's bin packing leaves over after placing ``demands`` on ``nodes``."""
    from ray.autoscaler._private.resource_demand_scheduler import get_bin_pack_residual

    residual, _ = get_bin_pack_residual(nodes, demands)
    return residual


def fits(demand: dict[str, float], node: dict[str, float]) -> bool:
    return not unplaced([node], [demand])


def scheduling_problems(doc: dict, name: str) -> list[str]:
    """Why KubeRay could not run every deployment of ``name``'s config on ``doc``'s worker groups (empty: it can)."""
    types = {k: v for k, v in node_types(doc).items() if k != "headgroup"}
    head = node_types(doc)["headgroup"]["resources"]
    demands = deployment_demands(name)
    problems = []
    for deployment_name, (demand, _, _) in demands.items():
        if not any(fits(demand, t["resources"]) for t in types.values()):
            problems.append(f"{deployment_name} {demand} fits no worker group's pod")
    for group, t in types.items():
        gpus = t["resources"].get("GPU", 0)
        holds_replica = fits(demands["H3Replica"][0], t["resources"])
        for deployment_name, (demand, _, _) in demands.items():
            if demand.get("GPU") and fits(demand, t["resources"]) and gpus % demand["GPU"]:
                problems.append(f"{group}: {gpus} GPUs per pod strand some, a {deployment_name} takes {demand['GPU']}")
            # a stage replica on a denoiser pod would take one of the GPUs a replica needs all of, together
            if (
                holds_replica
                and deployment_name.startswith(("H3Conditioner", "H3Decoder"))
                and fits(demand, t["resources"])
            ):
                problems.append(f"{deployment_name} {demand} can land on {group}'s pods, which hold H3Replicas")

    def placed(pods: str, replicas: int, extra: list[dict[str, float]]) -> list[dict[str, float]]:
        nodes = [dict(head)] + [dict(t["resources"]) for t in types.values() for _ in range(t[pods])]
        wanted = [demand for demand, *bounds in demands.values() for _ in range(bounds[replicas])]
        return unplaced(nodes, wanted + extra)

    # At the groups' minimum, Serve's minimum runs without waiting for the autoscaler.
    if left := placed("min_workers", 0, []):
        problems.append(f"at every group's minReplicas, Serve's minimum leaves {left} unplaced")
    # At their maximum, Serve's maximum runs, and admission's probe (every app rebuild) still finds a rank's slot.
    if left := placed("max_workers", 1, [probe_demand(name)]):
        problems.append(f"at every group's maxReplicas, Serve's maximum and admission's probe leave {left} unplaced")
    return problems


def test_every_deployment_is_schedulable_at_serves_minimum_and_maximum(manifest):
    doc = rayservice(manifest)
    assert cluster(manifest)["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0", "GPUs belong to the worker groups"
    assert deploy_args(manifest).device == "cuda"
    for group in cluster(manifest)["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]
    problems = scheduling_problems(doc, manifest)
    assert not problems, f"k8s/{manifest}:\n" + "\n".join(problems)


def test_the_staged_configs_have_stage_worker_groups(manifest):
    """Each GPU config runs its conditioner and decoder in deployments of their own, on pods of their own."""
    demands = deployment_demands(manifest)
    assert {"H3Conditioner", "H3Decoder"} <= set(demands), f"{MANIFESTS[manifest][1].name} has no stages"
    types = node_types(rayservice(manifest))
    stage_groups = [g for g, t in types.items() if t["resources"].get(STAGE_RESOURCE)]
    assert stage_groups, f"k8s/{manifest}: no worker group offers {STAGE_RESOURCE}"
    for role in ("H3Conditioner", "H3Decoder"):
        demand = demands[role][0]
        assert demand.get(STAGE_RESOURCE) == 1 and demand.get("GPU") == 1, (role, demand)
        assert [g for g, t in types.items() if fits(demand, t["resources"])] == stage_groups


@pytest.mark.parametrize(
    "mutate, expected",
    [
        # without the custom resource no stage replica is ever scheduled
        (
            lambda groups: next(g for g in groups if "resources" in g["rayStartParams"])["rayStartParams"].pop(
                "resources"
            ),
            "H3Conditioner {",
        ),
        # three stage pods hold the three stage replicas, but leave the probe nothing at Serve's maximum
        (
            lambda groups: next(g for g in groups if "resources" in g["rayStartParams"]).__setitem__("maxReplicas", 3),
            "admission's probe leave",
        ),
        # one denoiser pod fewer than Serve's max_replicas
        (
            lambda groups: next(g for g in groups if "resources" not in g["rayStartParams"]).__setitem__(
                "maxReplicas", 3
            ),
            "Serve's maximum and admission's probe leave",
        ),
        # no pod at all before the autoscaler acts: the minimum does not run
        (
            lambda groups: next(g for g in groups if "resources" not in g["rayStartParams"]).__setitem__(
                "minReplicas", 0
            ),
            "Serve's minimum leaves",
        ),
        # 6-GPU denoiser pods strand 2 GPUs of each
        (
            lambda groups: [
                container(g)["resources"][kind].__setitem__("nvidia.com/gpu", 6)
                for g in groups
                if "resources" not in g["rayStartParams"]
                for kind in ("requests", "limits")
            ],
            "GPUs per pod strand some",
        ),
        # the stage resource offered on the denoiser pods too: a stage replica could take a replica's GPU
        (
            lambda groups: next(g for g in groups if "resources" not in g["rayStartParams"])[
                "rayStartParams"
            ].__setitem__("resources", '"{\\"h3serve_stage\\": 4}"'),
            "which hold H3Replicas",
        ),
    ],
)
def test_the_scheduling_check_is_not_toothless(mutate, expected):
    doc = copy.deepcopy(rayservice("rayservice.h100.yaml"))
    mutate(doc["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    problems = scheduling_problems(doc, "rayservice.h100.yaml")
    assert any(expected in p for p in problems), problems


def gfd_product(device_name: str) -> str:
    """NVIDIA GPU Feature Discovery's nvidia.com/gpu.product label for a device name (spaces as dashes)."""
    return re.sub(r"\s*\(assumed\)$", "", device_name).replace(" ", "-")


def test_every_gpu_pod_is_the_platform_the_config_is_admitted_on(manifest):
    """Admission probes one node and plans every role (denoiser ranks, conditioner, decoder) on that platform: every
    GPU group of a RayService must select that one GPU model, the one its serve config names for `h3serve admit`."""
    source = MANIFESTS[manifest][1]
    admit = re.search(r"h3serve admit \S+ --platform (h3serve/deploy/platforms/\S+\.json)", source.read_text())
    assert admit, f"{source.name}: its header names no `h3serve admit ... --platform h3serve/deploy/platforms/...json`"
    platform = json.loads((REPO / admit[1]).read_text())
    products = {g["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for g in gpu_groups(manifest)}
    assert products == {gfd_product(platform["device_name"])}, (products, platform["device_name"])


# -- 7. wiring between the manifests ------------------------------------------------------
def test_metrics_ports_match_metrics_export_port(manifest):
    for name, group in [
        ("head", cluster(manifest)["headGroupSpec"]),
        *((g["groupName"], g) for g in cluster(manifest)["workerGroupSpecs"]),
    ]:
        ports = {p["name"]: p["containerPort"] for p in container(group).get("ports", [])}
        assert str(ports.get("metrics")) == group["rayStartParams"].get("metrics-export-port"), (
            f"{name}: container port `metrics` must be the metrics-export-port (the PodMonitors scrape it by name)"
        )


def test_podmonitors_select_the_ray_pods(manifest):
    groups = {"head": [cluster(manifest)["headGroupSpec"]], "worker": cluster(manifest)["workerGroupSpecs"]}
    monitors = [d for d in yaml.safe_load_all(PODMONITORS.read_text()) if d]
    assert {m["kind"] for m in monitors} == {"PodMonitor"} and len(monitors) == 2
    for monitor in monitors:
        labels = monitor["spec"]["selector"]["matchLabels"]
        assert labels.get("ray.io/is-ray-node") == "yes"
        node_type = labels["ray.io/node-type"]
        for group in groups[node_type]:
            ours = {k: v for k, v in labels.items() if not k.startswith("ray.io/")}  # KubeRay sets ray.io/*
            assert ours.items() <= group["template"]["metadata"]["labels"].items(), (
                f"{monitor['metadata']['name']} selects {ours}, which the {node_type} pods do not carry"
            )
            ports = {p["name"] for p in container(group).get("ports", [])}
            for endpoint in monitor["spec"]["podMetricsEndpoints"]:
                assert endpoint["port"] in ports, (
                    f"{monitor['metadata']['name']} scrapes missing port {endpoint['port']}"
                )
    assert {m["spec"]["selector"]["matchLabels"]["ray.io/node-type"] for m in monitors} == {"head", "worker"}


def test_weights_come_read_only_from_the_pvc(manifest):
    """Every GPU pod loads models (the denoisers' transformer, the stages' text encoder and VAEs) from the PVC."""
    pvc = load_one(PVC)
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadOnlyMany" in pvc["spec"]["accessModes"]
    checkpoint = deploy_args(manifest).checkpoint
    for group in gpu_groups(manifest):
        volumes = {v["name"]: v for v in group["template"]["spec"]["volumes"]}
        mounts = [
            m
            for m in container(group)["volumeMounts"]
            if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
        ]
        assert len(mounts) == 1 and mounts[0].get("readOnly") is True, group["groupName"]
        assert volumes[mounts[0]["name"]]["persistentVolumeClaim"].get("readOnly") is True, group["groupName"]
        assert checkpoint and checkpoint.startswith(mounts[0]["mountPath"].rstrip("/") + "/"), (
            f"{group['groupName']}: checkpoint {checkpoint} is not under the weights mount {mounts[0]['mountPath']}"
        )


def test_api_key_env_reaches_every_ray_container(manifest):
    name = deploy_args(manifest).api_key_env
    for group in [cluster(manifest)["headGroupSpec"], *cluster(manifest)["workerGroupSpecs"]]:
        env = {e["name"]: e for e in container(group).get("env", [])}
        assert name in env, f"{name} is not set on {container(group)['name']} (ingress replicas read it)"
        # required: a missing Secret must stop the pod, never leave the API open
        assert env[name]["valueFrom"]["secretKeyRef"].get("optional") is not True, "the API key Secret is required"


def test_the_video_job_store_is_mounted_where_ingress_replicas_run(manifest):
    """An H3Ingress replica (num_cpus 1) can land on any worker pod with a spare CPU: every worker group mounts
    the shared job store."""
    store = deploy_args(manifest).jobs.store
    jobs_pvc = yaml.safe_load((REPO / "k8s" / "jobs-pvc.yaml").read_text())
    assert jobs_pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker pod mounts it
    for group in cluster(manifest)["workerGroupSpecs"]:
        worker = container(group)
        assert any(
            store == m["mountPath"] or store.startswith(m["mountPath"] + "/")
            for m in worker["volumeMounts"]
            if not m.get("readOnly")
        ), f"{store} is not a writable mount of the {group['groupName']} pods"
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in group["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert jobs_pvc["metadata"]["name"] in claims.values(), group["groupName"]


# -- 8. runbooks ----------------------------------------------------------------------------
def github_anchors(markdown: str) -> set[str]:
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            text = re.sub(r"[`*]", "", m[1]).strip().lower()  # GitHub's slug: keep word chars, '-', ' '
            anchors.add(re.sub(r"[^\w\- ]", "", text).replace(" ", "-"))
    return anchors


def test_every_alert_has_a_runbook_section():
    anchors = github_anchors(OPERATIONS.read_text())
    alerts = [r for g in load_one(RULES)["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts
    for rule in alerts:
        annotations = rule.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), f"{rule['alert']}: summary/description"
        url = urlparse(annotations.get("runbook_url", ""))
        assert url.path.endswith("docs/OPERATIONS.md"), f"{rule['alert']}: runbook_url must point at docs/OPERATIONS.md"
        assert url.fragment == rule["alert"].lower(), f"{rule['alert']}: anchor should be #{rule['alert'].lower()}"
        assert url.fragment in anchors, f"{rule['alert']}: docs/OPERATIONS.md has no heading for #{url.fragment}"


def test_operations_internal_links_resolve():
    text = OPERATIONS.read_text()
    missing = sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - github_anchors(text))
    assert not missing, f"docs/OPERATIONS.md links to missing sections: {missing}"
