"""The Kubernetes side agrees with the code: CRD schema, serve config, Ray version, metric names,
GPU arithmetic, monitoring wiring, runbooks. Fast, no cluster, no Ray started."""

from __future__ import annotations

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

RAYSERVICE = K8S / "rayservice.yaml"
PVC = K8S / "weights-pvc.yaml"
PODMONITORS = K8S / "monitoring" / "podmonitors.yaml"
RULES = K8S / "monitoring" / "prometheusrule.yaml"
DASHBOARD = K8S / "monitoring" / "grafana-dashboard.json"
SERVE_CONFIG = REPO / "deploy" / "serve_config.gpu.yaml"
DOCKERFILE = REPO / "Dockerfile"
OPERATIONS = REPO / "docs" / "OPERATIONS.md"
BUILDER = "deploy.app:build_app"


# -- loading ------------------------------------------------------------------------------
def load_one(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert len(docs) == 1, f"{path}: expected one document, found {len(docs)}"
    return docs[0]


@cache
def rayservice() -> dict:
    return load_one(RAYSERVICE)


def cluster() -> dict:
    return rayservice()["spec"]["rayClusterConfig"]


def gpu_group() -> dict:
    groups = [g for g in cluster()["workerGroupSpecs"] if "nvidia.com/gpu" in container(g)["resources"]["limits"]]
    assert len(groups) == 1, "expected exactly one GPU worker group"
    return groups[0]


def container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in the first container


@cache
def serve_config() -> dict:
    return yaml.safe_load(SERVE_CONFIG.read_text())


def h3_app() -> dict:
    apps = [a for a in serve_config()["applications"] if a.get("import_path") == BUILDER]
    assert len(apps) == 1, f"{SERVE_CONFIG}: expected one application with import_path {BUILDER}"
    return apps[0]


def deployment(name: str) -> dict:
    return next((d for d in h3_app().get("deployments", []) if d["name"] == name), {})


def deploy_args():
    from deploy.args import DeployArgs  # applies the builder's own defaults

    return DeployArgs.model_validate(h3_app().get("args") or {})


def quantity(value) -> float:
    """A Kubernetes CPU quantity ("36", "500m", 4) as cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


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
    assert RAYSERVICE in yamls and PVC in yamls and PODMONITORS in yamls and RULES in yamls and DASHBOARD in jsons
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


def test_rayservice_validates_against_kuberay_crd():
    doc = rayservice()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    errors = crd_errors(doc)
    assert not errors, "k8s/rayservice.yaml does not fit the RayService CRD:\n" + "\n".join(errors)


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
def test_serve_config_v2_is_the_gpu_serve_config():
    embedded = rayservice()["spec"]["serveConfigV2"]
    assert isinstance(embedded, str), "serveConfigV2 must be a YAML string"
    assert yaml.safe_load(embedded) == serve_config(), (
        "k8s/rayservice.yaml's serveConfigV2 differs from deploy/serve_config.gpu.yaml: run python k8s/generate.py"
    )


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


# -- 4. one Ray version everywhere --------------------------------------------------------
def test_ray_versions_agree():
    image_ray = dockerfile_base()["ray"]
    assert cluster()["rayVersion"] == image_ray, "rayVersion in k8s/rayservice.yaml != the Dockerfile's base image"
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
    from deploy.metrics import ALL_METRICS

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
    assert not unknown, f"{source} uses series that deploy/metrics.py does not export: {sorted(unknown)}"
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
    from deploy.metrics import ALL_METRICS

    shown = set().union(*(promql_metric_names(e) for e in dashboard_exprs()))
    missing = sorted(m.exported for m in ALL_METRICS if not any(n.startswith(m.exported) for n in shown))
    assert not missing, f"deploy/metrics.py exports series no dashboard panel shows: {missing}"


@pytest.mark.parametrize("source", ["prometheusrule", "grafana"])
def test_stage_and_reason_label_values_exist(source):
    """A panel or alert that filters on a stage or a failure reason the code never reports shows nothing."""
    from deploy.metrics import FAILED_STEP_REASONS, FAILURE_REASONS, STAGES

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


def test_drain_fits_in_serves_and_kuberays_grace_periods():
    """Serve kills a stopping replica graceful_shutdown_timeout_s after it asked it to stop, and KubeRay deletes the
    old cluster of an upgrade rayClusterDeletionDelaySeconds after the switch: both must leave the drain its time."""
    from deploy.replica import H3Replica

    args = deploy_args()
    grace = H3Replica.deployment_options(args)["graceful_shutdown_timeout_s"]
    assert grace > args.engine.drain_timeout_s, (grace, args.engine.drain_timeout_s)
    delay = rayservice()["spec"].get("rayClusterDeletionDelaySeconds", 60)  # KubeRay's default: 60
    assert delay >= grace, (
        f"rayClusterDeletionDelaySeconds {delay} < the H3 replicas' graceful_shutdown_timeout_s {grace}: an upgrade "
        "would cut off the videos the old cluster is generating"
    )


def test_rules_and_dashboard_name_the_served_application():
    named = set()
    for expr in rule_exprs() + dashboard_exprs():
        named |= set(re.findall(r'application\s*=\s*"([^"]+)"', expr))
    assert named == {h3_app()["name"]}, (
        f"PromQL filters on application {named}, the serve config names {h3_app()['name']!r}"
    )


# -- 6. GPU arithmetic --------------------------------------------------------------------
def serve_replica_bounds(name: str) -> tuple[int, int]:
    config = deployment(name)
    autoscaling = config.get("autoscaling_config")
    if autoscaling:
        return autoscaling.get("min_replicas", 1), autoscaling.get("max_replicas", 1)
    replicas = config.get("num_replicas", 1)
    assert isinstance(replicas, int), f"{name}: num_replicas {replicas!r} needs an autoscaling_config"
    return replicas, replicas


def test_worker_group_capacity_covers_serve_autoscaling():
    args = deploy_args()
    sp, gpus_per_rank, cpus_per_rank = (
        args.sp_degree,
        args.rank_resources.get("GPU", 0),
        args.rank_resources.get("CPU", 0),
    )
    assert args.device == "cuda" and gpus_per_rank >= 1
    replica_gpus, replica_cpus = sp * gpus_per_rank, sp * cpus_per_rank  # one STRICT_PACK group: one pod

    group = gpu_group()
    limits = container(group)["resources"]["limits"]
    pod_gpus = int(limits["nvidia.com/gpu"])
    pod_cpus = quantity(group["rayStartParams"].get("num-cpus", limits["cpu"]))
    head_cpus = quantity(
        cluster()["headGroupSpec"]["rayStartParams"].get(
            "num-cpus", container(cluster()["headGroupSpec"])["resources"]["limits"]["cpu"]
        )
    )
    assert cluster()["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0", "GPUs belong to the worker group"

    assert pod_gpus % replica_gpus == 0, f"{pod_gpus} GPUs per pod strand some: a replica takes {replica_gpus}"
    slots = min(pod_gpus // replica_gpus, int(pod_cpus // replica_cpus))
    assert slots >= 1, (
        f"a pod ({pod_gpus} GPU, {pod_cpus} CPU) cannot hold one replica ({replica_gpus} GPU, {replica_cpus} CPU)"
    )

    serve_min, serve_max = serve_replica_bounds("H3Replica")
    pods_min, pods_max = group["minReplicas"], group["maxReplicas"]
    assert pods_min <= group.get("replicas", pods_min) <= pods_max
    assert pods_min * slots >= serve_min, (
        f"minReplicas {pods_min} x {slots} slot(s) < Serve min_replicas {serve_min} ({replica_gpus} GPUs each)"
    )
    assert pods_max * slots >= serve_max, (
        f"maxReplicas {pods_max} x {slots} slot(s) < Serve max_replicas {serve_max} ({replica_gpus} GPUs each)"
    )
    # Every app rebuild runs admission's probe, one rank's shape: at Serve's max a slot must be left for it.
    assert pods_max * slots - serve_max >= 1, "no headroom for the admission probe at max_replicas"
    # At the minimum the ingress replicas must fit next to the H3 replicas (the head runs none).
    ingress_min, _ = serve_replica_bounds("H3Ingress")
    ingress_cpus = deployment("H3Ingress").get("ray_actor_options", {}).get("num_cpus", 1)
    assert pods_min * pod_cpus + head_cpus >= serve_min * replica_cpus + ingress_min * ingress_cpus


# -- 7. wiring between the manifests ------------------------------------------------------
def test_metrics_ports_match_metrics_export_port():
    for name, group in [
        ("head", cluster()["headGroupSpec"]),
        *((g["groupName"], g) for g in cluster()["workerGroupSpecs"]),
    ]:
        ports = {p["name"]: p["containerPort"] for p in container(group).get("ports", [])}
        assert str(ports.get("metrics")) == group["rayStartParams"].get("metrics-export-port"), (
            f"{name}: container port `metrics` must be the metrics-export-port (the PodMonitors scrape it by name)"
        )


def test_podmonitors_select_the_ray_pods():
    groups = {"head": [cluster()["headGroupSpec"]], "worker": cluster()["workerGroupSpecs"]}
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


def test_weights_come_read_only_from_the_pvc():
    pvc = load_one(PVC)
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadOnlyMany" in pvc["spec"]["accessModes"]
    spec = gpu_group()["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = [
        m
        for m in container(gpu_group())["volumeMounts"]
        if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
    ]
    assert len(mounts) == 1 and mounts[0].get("readOnly") is True
    assert volumes[mounts[0]["name"]]["persistentVolumeClaim"].get("readOnly") is True
    checkpoint = deploy_args().checkpoint
    assert checkpoint and checkpoint.startswith(mounts[0]["mountPath"].rstrip("/") + "/"), (
        f"checkpoint {checkpoint} is not under the weights mount {mounts[0]['mountPath']}"
    )


def test_api_key_env_reaches_every_ray_container():
    name = deploy_args().api_key_env
    for group in [cluster()["headGroupSpec"], *cluster()["workerGroupSpecs"]]:
        env = {e["name"]: e for e in container(group).get("env", [])}
        assert name in env, f"{name} is not set on {container(group)['name']} (ingress replicas read it)"
        # required: a missing Secret must stop the pod, never leave the API open
        assert env[name]["valueFrom"]["secretKeyRef"].get("optional") is not True, "the API key Secret is required"


def test_the_video_job_store_is_mounted_where_ingress_replicas_run():
    store = deploy_args().jobs.store
    worker = container(cluster()["workerGroupSpecs"][0])
    assert any(
        store == m["mountPath"] or store.startswith(m["mountPath"] + "/")
        for m in worker["volumeMounts"]
        if not m.get("readOnly")
    ), f"{store} is not a writable mount of the GPU worker pods"
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in cluster()["workerGroupSpecs"][0]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    jobs_pvc = yaml.safe_load((REPO / "k8s" / "jobs-pvc.yaml").read_text())
    assert jobs_pvc["metadata"]["name"] in claims.values()
    assert jobs_pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker pod mounts it


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
