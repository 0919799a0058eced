"""The ``h3serve`` command: serve, admit, plan, generate, eval, weights, probe, rank-attention.

h3serve serve [CONFIG]            admission pre-flight of every application, then run the config like `serve run`
h3serve admit CONFIG              the pre-flight alone; optional Prometheus textfile / Pushgateway
h3serve plan CONFIG               the config's released-size step on the meta device, its PROJECTED seconds;
                                  --paths (every step path checked), --end-to-end (every stage, peers, start)
h3serve generate PROMPT -o OUT    one image (.png) or video (.mp4), locally, no Ray
h3serve eval [--checkpoint DIR]   held-out scenes of the demo world through the packing engine, no Ray;
                                  colour, shape, motion and sound judged per clip; accuracy table, --json
h3serve weights                   create the built-in tiny weights (deterministic, cached)
h3serve probe                     this node's platform as JSON (for `admit --platform`)
h3serve rank-attention --out PATH check and time every attention backend here; the ranking file auto reads
h3serve video create|ls|get|wait|cancel|download   video jobs on a running server (``h3serve.client.video_cli``)
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import signal
import sys
import time
from pathlib import Path

import yaml

BUILDER = "h3serve.deploy.driver.app:build_app"
EXIT_REFUSED, EXIT_FAILED = 2, 1
WATCH_INTERVAL_S = 5.0  # how often `h3serve serve` reads the applications' status once every one is up


def default_config() -> Path:
    return Path(str(importlib.resources.files("h3serve.deploy") / "serve_config.yaml"))


def load_config(path: str | None) -> dict:
    config_path = Path(path) if path else default_config()
    if not config_path.is_file():
        raise SystemExit(f"h3serve: no config file at {config_path}")
    return yaml.safe_load(config_path.read_text()) or {}


def h3_apps(config: dict) -> list[tuple[str, dict]]:
    """(name, args) of every application in the config that this builder runs."""
    return [(app.get("name", "default"), app.get("args") or {}) for app in builder_apps(config)]


def builder_apps(config: dict) -> list[dict]:
    return [app for app in config.get("applications", []) if app.get("import_path") == BUILDER]


def app_deployments(config: dict) -> dict[str, list[dict]]:
    """Each application's ``deployments:`` overrides, which the builder never sees (Serve applies them after it)."""
    return {app.get("name", "default"): app.get("deployments") or [] for app in builder_apps(config)}


def fail(code: int, message: str):
    print(f"h3serve: {message}", file=sys.stderr)
    raise SystemExit(code)


def refusal(app_name: str, error: Exception) -> str:
    """One application's admission refusal, as `admit` and `serve` name it."""
    return f"application {app_name!r}: {error}"


def fail_refused(refused: list[str]):
    """Exit 2 naming every refused application (``refusal``), once every application was checked."""
    fail(EXIT_REFUSED, "admission refused " + "; ".join(refused))


def parse_args(app_name: str, raw: dict, deployments: list[dict]):
    """The typed args, checked against the application's deployment overrides; exits 2 on either failing."""
    from pydantic import ValidationError

    from h3serve.deploy.common.args import DeployArgs

    try:
        args = DeployArgs.model_validate(raw)
    except ValidationError as e:
        fail(EXIT_REFUSED, f"invalid args for application {app_name!r}:\n{e}")
    try:
        args.check_deployments(deployments)
    except ValueError as e:
        fail(EXIT_REFUSED, f"application {app_name!r}: {e}")
    return args


# -- admit --------------------------------------------------------------------------------
def read_platform(value: str):
    """``--platform``: a file of platform JSON (from `h3serve probe`), or the JSON itself; exits 2 naming the flag."""
    from pydantic import ValidationError

    from h3serve.attention import Platform

    path = Path(value)
    text = path.read_text() if path.is_file() else value
    try:
        return Platform.model_validate_json(text)
    except ValidationError as e:
        what = f"file {path}" if path.is_file() else "neither an existing file nor platform JSON"
        fail(EXIT_REFUSED, f"--platform {value!r}: {what} that `h3serve probe` writes:\n{e}")


def admitted_checkpoint(args, admission) -> str:
    """Which checkpoint geometry was admitted, and where it was read."""
    where = admission.checkpoint.where() if admission.checkpoint else f"{args.checkpoint} (not readable here)"
    return f"checkpoint {where}: {admission.geometry.describe()}"


def cmd_admit(ns: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry, Counter, push_to_gateway, write_to_textfile

    from h3serve.attention import probe_platform
    from h3serve.deploy.common.metrics import ADMISSION_DECISIONS, ADMISSION_FAILURES
    from h3serve.deploy.driver.preflight import ADMISSION_ERRORS, admit, deployment_memory_plan
    from h3serve.pipelines.h3 import CheckpointMismatch
    from h3serve.pipelines.h3.lora import LoraError

    config = load_config(ns.config)
    apps, deployments = h3_apps(config), app_deployments(config)
    if not apps:
        fail(EXIT_REFUSED, f"{ns.config} has no application with import_path {BUILDER}")
    registry = CollectorRegistry()
    decisions = Counter(
        ADMISSION_DECISIONS.name, ADMISSION_DECISIONS.description, ADMISSION_DECISIONS.tag_keys, registry=registry
    )
    failures = Counter(
        ADMISSION_FAILURES.name, ADMISSION_FAILURES.description, ADMISSION_FAILURES.tag_keys, registry=registry
    )
    refused = []

    def count(tags: dict[str, str]) -> None:  # the same series the cluster's recorder exports, without Ray
        decisions.labels(**tags).inc()
        if tags["outcome"] == "rejected":
            failures.labels(**{k: v for k, v in tags.items() if k != "outcome"}).inc()

    for name, raw in apps:
        args = parse_args(name, raw, deployments[name])
        if ns.platform:
            platform = read_platform(ns.platform)
        else:
            platform = probe_platform(args.device)
            if platform.device_type != args.device:
                fail(
                    EXIT_REFUSED,
                    f"application {name!r} targets {args.device}, and this machine has no "
                    f"{args.device}; pass --platform with the replicas' platform (h3serve probe there)",
                )
        plan = None
        try:
            admission = admit(args, "preflight", platform, record=count)
        except ADMISSION_ERRORS as e:
            refused.append(refusal(name, e))
            # each rank role's device memory, admitted or not: what an operator sizes GPUs with (without the adapters
            # when one was refused; none for a checkpoint that was refused, whose dims are not the served ones)
            if not isinstance(e, CheckpointMismatch):
                plan = deployment_memory_plan(args, adapters={} if isinstance(e, LoraError) else None)
        else:
            plan = admission.plan
            print(f"h3serve: application {name!r} admitted: {admission.resolution.describe()}")
            print(f"h3serve: application {name!r} {admitted_checkpoint(args, admission)}")
        if plan is not None:
            print(f"h3serve: application {name!r} " + plan.table(platform.device_memory_bytes))
        # with stages: where each stage's plan lands (every replica of it on a device of the platform checked)
        for role, stage in args.stage_deployments().items():
            print(
                f"h3serve: application {name!r} stage {role}: {stage.num_replicas} replica(s) shared by every "
                f"H3Replica, each reserving {stage.ray_actor_options} and holding the {role} plan above"
            )
    if ns.textfile:
        write_to_textfile(ns.textfile, registry)
    if ns.pushgateway:
        push_to_gateway(ns.pushgateway, job=ns.job, registry=registry)
    if refused:
        fail_refused(refused)


def cmd_plan(ns: argparse.Namespace) -> None:
    """The config's step counted on meta at the released size, and its PROJECTED seconds (``pipelines.h3.meta``)."""
    from h3serve.pipelines.h3.meta.report import plan
    from h3serve.replicas.sequence_parallel import UlyssesGroup

    config = load_config(ns.config)
    deployments = app_deployments(config)
    results = {}
    for name, raw in h3_apps(config):
        args = parse_args(name, raw, deployments[name])
        if args.model != "full":
            fail(
                EXIT_REFUSED,
                f"application {name!r} serves {args.model!r}: `plan` projects the released model (model: full)",
            )
        print(f"h3serve: application {name!r}: sp_degree {args.sp_degree}, {args.engine.max_rows_per_step} rows/step")
        results[name] = plan(args.sp_degree, args.engine.max_rows_per_step, UlyssesGroup, ns.paths, ns.end_to_end)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))
    if not all(r["ok"] for r in results.values()):
        fail(EXIT_REFUSED, "a step path broke its budgets (the checks above)")


# -- serve --------------------------------------------------------------------------------
def cmd_serve(ns: argparse.Namespace) -> None:
    import ray
    from ray import serve
    from ray.serve._private import api as serve_api
    from ray.serve.config import gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    from h3serve.deploy.driver.preflight import ADMISSION_ERRORS, admit

    raw = load_config(ns.config)
    schema = ServeDeploySchema.model_validate(raw)
    deployments = app_deployments(raw)
    apps = [(name, parse_args(name, args, deployments[name])) for name, args in h3_apps(raw)]
    if ns.address is None:  # a local cluster: the ingress reads this process's environment
        from h3serve.deploy.ingress.routes import resolve_api_key
        from h3serve.deploy.ingress.tenants import read_keys

        for name, args in apps:
            try:
                resolve_api_key(args.api_key_env)
                if args.auth.keys_file is not None:  # the ingress reads the same file: refuse a bad one now
                    read_keys(args.auth.keys_file)
            except (RuntimeError, ValueError) as e:
                fail(EXIT_REFUSED, f"application {name!r}: {e}")
    # without --address, always a cluster of its own: never one that `ray start` or RAY_ADDRESS left around
    ray.init(address=ns.address or "local", namespace="serve")
    refused = []
    for name, args in apps:  # every application checked, then fail once, before anything is started
        try:
            admission = admit(args, stage="preflight")
        except ADMISSION_ERRORS as e:
            refused.append(refusal(name, e))
        else:
            print(f"h3serve: application {name!r} admitted: {admitted_checkpoint(args, admission)}", flush=True)
    if refused:
        fail_refused(refused)
    client = serve_api.serve_start(
        http_options=schema.http_options.model_dump(),
        proxy_location=schema.proxy_location,
        grpc_options=gRPCOptions(**schema.grpc_options.model_dump()),
        controller_options=schema.controller_options,
    )
    client.deploy_apps(schema, _blocking=False)
    host, port = schema.http_options.host, schema.http_options.port
    names = [app.name for app in schema.applications]
    print(f"h3serve: deploying {', '.join(names)}", flush=True)

    def stop(*_):
        print("h3serve: shutting down", flush=True)
        serve.shutdown()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    announced: set[str] = set()
    try:
        while True:
            statuses = serve.status().applications
            for name in names:
                app = statuses.get(name)
                if app is None:
                    continue
                if app.status == "DEPLOY_FAILED":
                    details = [app.message] + [
                        f"{d}: {info.message}" for d, info in app.deployments.items() if info.status == "DEPLOY_FAILED"
                    ]
                    print(
                        f"h3serve: application {name!r} failed to deploy:\n" + "\n".join(filter(None, details)),
                        file=sys.stderr,
                        flush=True,
                    )
                    serve.shutdown()
                    raise SystemExit(EXIT_FAILED)
                if app.status == "RUNNING" and name not in announced:
                    announced.add(name)
                    route = next(a.route_prefix for a in schema.applications if a.name == name) or "/"
                    print(
                        f"h3serve: {name} is serving at http://{'localhost' if host == '0.0.0.0' else host}:{port}"
                        f"{route}",
                        flush=True,
                    )
            # every second until each application is up; then slower: a status call costs this process and Serve's
            # controller ~2 s of CPU a minute at 1 s, and a later failure is still reported within seconds
            time.sleep(1 if len(announced) < len(names) else WATCH_INTERVAL_S)
    except KeyboardInterrupt:
        stop()


# -- generate, weights, probe -------------------------------------------------------------
def cmd_generate(ns: argparse.Namespace) -> None:
    from pydantic import ValidationError
    from tqdm import tqdm

    from h3serve.attention import AttentionSelectionError, probe_platform, resolve
    from h3serve.pipelines.h3 import (
        REQUIREMENTS,
        CheckpointError,
        GenerationRequest,
        H3Pipeline,
        TransformerGeometry,
        default_dtype,
    )
    from h3serve.pipelines.h3.checkpoint import resolve_checkpoint
    from h3serve.pipelines.h3.step_cache_tiers import StepCacheTiers

    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    out = Path(ns.output)
    if out.suffix.lower() not in (".png", ".mp4"):
        fail(EXIT_REFUSED, f"--output must end in .mp4 (a clip with sound) or .png (its middle frame), got {out}")
    size = None
    if ns.size:
        try:
            size = tuple(int(v) for v in ns.size.lower().split("x"))
            width, height = size
        except ValueError:
            fail(EXIT_REFUSED, f"--size must look like WIDTHxHEIGHT, got {ns.size!r}")
    try:
        directory = resolve_checkpoint(ns.checkpoint)
        geometry = TransformerGeometry.from_checkpoint(directory)
        backend = resolve(
            REQUIREMENTS, ns.backend, probe_platform(ns.device), model=str(directory), head_dim=geometry.head_dim
        ).backend
        pipeline = H3Pipeline.load(directory, backend, device=ns.device, dtype=ns.dtype or default_dtype(ns.device))
        frames = pipeline.rules.frames_for_seconds(ns.seconds) if ns.seconds else None
        first, last = (Path(p).read_bytes() if p else None for p in (ns.first_frame, ns.last_frame))
        request = GenerationRequest(
            prompt=ns.prompt,
            width=size[0] if size else None,
            height=size[1] if size else None,
            num_frames=frames,
            num_inference_steps=ns.steps,
            seed=ns.seed,
            first_frame=first,
            last_frame=last,
        )
        pipeline.validate(request)
        step_cache = StepCacheTiers().policy(ns.cache)
        if step_cache is not None:
            pipeline.check_step_cache(step_cache)
    except (AttentionSelectionError, CheckpointError, ValueError, ValidationError, OSError) as e:
        fail(EXIT_REFUSED, str(e))  # RequestError is a ValueError: it names the field
    forwards: list = []
    with tqdm(total=ns.steps - 1, desc=f"minimax-h3 ({backend})", unit="step") as bar:
        media = pipeline.generate(
            request, progress=lambda done, total: bar.update(done - bar.n), step_cache=step_cache, stats=forwards
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(media.mp4() if out.suffix.lower() == ".mp4" else media.png())
    print(f"h3serve: wrote {out} ({out.stat().st_size} bytes)")
    if step_cache is not None:
        blocks = json.loads((directory / "transformer" / "config.json").read_text())["num_layers"]  # main blocks
        ran = sum(f.rows - f.padding_rows for f in forwards) * blocks
        skipped = sum(f.skipped_block_rows for f in forwards)
        print(f"h3serve: step cache {ns.cache!r} skipped {skipped} of {ran} block-rows ({skipped / ran:.0%})")


def cmd_eval(ns: argparse.Namespace) -> None:
    from pydantic import ValidationError

    from h3serve.attention import AttentionSelectionError
    from h3serve.demo.evaluate import EvalSettings, evaluate, format_table, write_json
    from h3serve.pipelines.h3 import CheckpointError

    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    width = height = None
    if ns.size:
        try:
            width, height = (int(v) for v in ns.size.lower().split("x"))
        except ValueError:
            fail(EXIT_REFUSED, f"--size must look like WIDTHxHEIGHT, got {ns.size!r}")
    try:
        settings = EvalSettings(
            checkpoint=ns.checkpoint,
            n=ns.n,
            seed=ns.seed,
            steps=ns.steps,
            pack=ns.pack,
            width=width,
            height=height,
            num_frames=ns.frames,
            oracle=ns.oracle,
            cache=ns.cache,
            sp=ns.sp,
            device=ns.device,
            dtype=ns.dtype,
            backend=ns.backend,
        )
        result = evaluate(settings)
    except (AttentionSelectionError, CheckpointError, ValueError, ValidationError, OSError) as e:
        fail(EXIT_REFUSED, str(e))  # RequestError is a ValueError: it names the field
    what = "the world's own rendering (oracle)"
    if not ns.oracle:
        what = f"{ns.steps} steps, up to {ns.pack} per pack, sp={ns.sp}"
    fmt = result["format"]
    print(
        f"h3serve eval: {result['checkpoint']}: {ns.n} held-out clips, {fmt['width']}x{fmt['height']}, "
        f"{fmt['num_frames']} frames, seed {ns.seed}, {what}"
    )
    print(format_table(result["summary"]))
    if ns.json:
        write_json(result, ns.json)
        print(f"h3serve: wrote {ns.json}")


def cmd_weights(ns: argparse.Namespace) -> None:
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint, write_tiny_checkpoint

    if ns.output:
        print(write_tiny_checkpoint(Path(ns.output), seed=ns.seed, with_ref=ns.with_ref))
    else:
        print(random_tiny_checkpoint(ns.seed))


def cmd_probe(ns: argparse.Namespace) -> None:
    from h3serve.attention import probe_platform

    print(json.dumps(json.loads(probe_platform(ns.device).model_dump_json()), indent=2))


def cmd_rank_attention(ns: argparse.Namespace) -> None:
    import torch

    from h3serve.attention import probe_platform
    from h3serve.attention.measure import rank
    from h3serve.attention.ranking import ENV_VAR, save
    from h3serve.pipelines.h3.meta.hardware import BF16_DENSE_TFLOPS
    from h3serve.pipelines.h3.meta.tables import table

    if ns.device == "cuda" and not torch.cuda.is_available():
        fail(EXIT_REFUSED, "--device cuda: no CUDA device here (rank on the replicas' nodes, or pass --device cpu)")
    dtype = getattr(torch, ns.dtype or ("bfloat16" if ns.device == "cuda" else "float32"))
    mode = "cpu" if ns.device == "cpu" else "quick" if ns.quick else "full"  # cpu: small sizes, --quick or not
    platform = probe_platform(ns.device)
    print(f"platform: {platform.describe()}; torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    ranking, _ = rank(platform, ns.device, dtype, mode, peak_tflops=BF16_DENSE_TFLOPS, table=table)
    if ranking is None:
        fail(EXIT_FAILED, "no attention backend passed the check and ran every pack: no ranking written")
    else:
        print(f"\nranking: {ranking.describe()}\nwrote {save(ranking, ns.out)} (point {ENV_VAR} at it)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="h3serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="admission pre-flight, then run a serve config")
    p.add_argument("config", nargs="?", help="serve config YAML (default: the embedded CPU/tiny config)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: start a local one)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("admit", help="the admission pre-flight alone")
    p.add_argument("config")
    p.add_argument("--platform", help="replica platform JSON, or a file of it (from `h3serve probe` on a replica node)")
    p.add_argument("--textfile", help="write the admission counters here (node-exporter textfile format)")
    p.add_argument("--pushgateway", help="push the admission counters to this Pushgateway address")
    p.add_argument("--job", default="h3serve-admit", help="Pushgateway job label")
    p.set_defaults(func=cmd_admit)

    p = sub.add_parser("plan", help="the config's released-size step on the meta device and its PROJECTED seconds")
    p.add_argument("config")
    p.add_argument("--paths", action="store_true", help="also every step path checked against its budgets (~1 min)")
    p.add_argument("--end-to-end", action="store_true", help="also every stage of a clip, the peers, the start")
    p.add_argument("--json", help="write every number here")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("generate", help="generate one clip locally, without Ray")
    p.add_argument("prompt")
    p.add_argument(
        "-o", "--output", default="h3.mp4", help="*.mp4 for the clip with its stereo sound, *.png for its middle frame"
    )
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the model's own canvas, or the first frame's aspect)")
    p.add_argument("--seconds", type=float, help="clip length (default: the shortest the model makes)")
    p.add_argument("--steps", type=int, default=50, help="num_inference_steps, the sigma grid's points")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-frame", help="an image the clip starts from (FL2VA)")
    p.add_argument("--last-frame", help="an image the clip ends on (FL2VA)")
    p.add_argument(
        "--cache",
        default="off",
        help="step caching: 'off' or a built-in tier (high, medium, low: more steps skipped, less fidelity)",
    )
    p.add_argument("--checkpoint", help="checkpoint directory in the released layout (default: the built-in tiny)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the tiny model's ops are "
        "too small to gain from more, and a busy core stalls every parallel region); 0: torch's choice",
    )
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("eval", help="judge held-out demo-world clips generated through the packing engine")
    p.add_argument("--checkpoint", help="checkpoint directory in the released layout (default: the built-in tiny)")
    p.add_argument("--n", type=int, default=18, help="clips (default 18: every held-out combination once)")
    p.add_argument("--seed", type=int, default=0, help="orders the held-out scenes; clip i is seeded SEED + i")
    p.add_argument("--json", help="write every clip's verdicts and the summary to this file")
    p.add_argument("--pack", type=int, default=8, help="requests per packed forward at most (engine max_active)")
    p.add_argument("--steps", type=int, default=50, help="num_inference_steps of every clip")
    p.add_argument("--size", help="WIDTHxHEIGHT (default: the model's own canvas)")
    p.add_argument("--frames", type=int, help="frames per clip, 17n+5 (default: the shortest clip)")
    p.add_argument("--oracle", action="store_true", help="judge the world's own rendering instead (the 100%% ceiling)")
    p.add_argument("--cache", default="off", help="every clip's step-cache tier: 'off' or high, medium, low")
    p.add_argument(
        "--sp", type=int, default=1, help="Ulysses ranks (default 1; more: Ray actors on a local cluster, a CPU each)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1, as generate); 0: torch's choice"
    )
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("weights", help="write a tiny checkpoint in the released layout (random weights)")
    p.add_argument("--output", help="directory (default: the cache that `serve` and `generate` read)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--with-ref", action="store_true", help="include a transformer_ref/ partition (Ref2VA)")
    p.set_defaults(func=cmd_weights)

    p = sub.add_parser("probe", help="print this node's attention platform as JSON")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.set_defaults(func=cmd_probe)

    p = sub.add_parser("rank-attention", help="check and time this node's attention backends; write the ranking file")
    p.add_argument("--out", required=True, help="the ranking file to write (H3SERVE_ATTENTION_RANKING reads it)")
    p.add_argument("--quick", action="store_true", help="CUDA: smaller packs, seconds (CPU always runs small ones)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on CUDA, else fp32")
    p.set_defaults(func=cmd_rank_attention)

    from h3serve.client.video_cli import add_commands

    add_commands(sub)

    ns = parser.parse_args(argv)
    ns.func(ns)


if __name__ == "__main__":
    main()
