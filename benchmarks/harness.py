"""The benchmarks' one harness: the entry point, timing, percentiles, tables, JSON results, a served app, a trace.

Every benchmark is a plain module, ``python -m benchmarks.NAME [--smoke] [--json PATH] ...``, ending in

    main = cli(__doc__, run, options, __name__)   # options(ap) adds its arguments; run(args) -> result dict;
                                                 # run as a script (``__name__`` "__main__"), it runs and exits

``cli`` parses the arguments (``--smoke``, ``--json``, ``--address``: join a running Ray cluster, as the tests'
session cluster, instead of starting one), runs, stamps the result with the machine and the git commit
(``stamp``), writes it to ``--json`` and exits 1 when ``result["ok"]`` is false (a refusal returns an int: 2).
The shared pieces: ``table`` (``h3serve.pipelines.h3.meta.tables``, ``h3serve plan``'s too)/``columns``/``say`` print,
``percentile``/``median``/``time_ms``/``interleaved``/``Phases`` time, ``torch_threads``/``worker_group`` hold a
thread count and a WorkerGroup for a block, ``default_config`` (the shipped config with an overlay) and
``ServedConfig``/``ServedDefault`` start ``h3serve serve`` as a user does (or ``Attached`` to one already up,
``--url``), ``by_shares``/``unit_gaps`` draw a trace and ``at_times`` replays its arrivals; the API calls
themselves are ``h3serve.client``'s.

The GPU scripts (gpu_kernels, gpu_pipeline, gpu_smoke) use only the torch-only helpers: nothing at module level here
imports Ray, the deploy package or the model pipeline (gpu_session.sh carries only torch, diffusers and pydantic).

Over 600 lines: the one harness by design (entry point, results, timing and tables, engine observers, a served
app, a trace, the GPU scripts' timing), in that order, one section each.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from h3serve.attention.measure import Budget as Budget  # the GPU scripts' timing, re-exported: one definition
from h3serve.attention.measure import attempt as attempt
from h3serve.attention.measure import median_ms as median_ms
from h3serve.pipelines.h3.meta.hardware import BF16_DENSE_TFLOPS
from h3serve.pipelines.h3.meta.tables import table

REPO = Path(__file__).resolve().parents[1]
H3SERVE = str(Path(sys.executable).parent / "h3serve")  # the installed console script


# -- the entry point --------------------------------------------------------------------------------
def parser(doc: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=(doc or "").strip().splitlines()[0] if doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds long (CI)")
    ap.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    ap.add_argument(
        "--address", metavar="GCS", help="join this running Ray cluster (namespace serve) instead of starting one"
    )
    return ap


def cli(
    doc: str | None,
    run: Callable[[argparse.Namespace], dict | int],
    options: Callable[[argparse.ArgumentParser], None] | None = None,
    module: str | None = None,
) -> Callable[..., int]:
    """The ``python -m benchmarks.NAME`` entry point: ``main(argv) -> exit status`` (see the module's docstring).
    ``module``, the caller's ``__name__``: when it is "__main__" (run as a script), run now and exit with the status.
    """

    def entry(argv: Sequence[str] | None = None) -> int:
        ap = parser(doc)
        if options is not None:
            options(ap)
        args = ap.parse_args(argv)
        if args.address:
            join_ray(args.address)
        result = run(args)
        if isinstance(result, int):  # a refusal, said already
            return result
        write_json(args.json, result)
        return 0 if result.get("ok", True) else 1

    if module == "__main__":
        raise SystemExit(entry())
    return entry


def smoke_main(doc: str | None, run: Callable[[bool], dict], module: str | None = None) -> Callable[..., int]:
    """``cli`` for a benchmark whose only option is ``--smoke``: ``run(smoke) -> dict``."""
    return cli(doc, lambda args: run(args.smoke), module=module)


def width_main(
    doc: str | None, name: str, what_gpu_measures: str, run: Callable[..., dict], module: str | None = None
) -> Callable[..., int]:
    """``cli`` of a per-step cost measured on CPU at a smaller width or, with ``--gpu``, on CUDA at the released width:
    ``python -m benchmarks.NAME [--quick | --smoke | --gpu] [--json PATH]``, ``run(quick, gpu=, smoke=)``."""

    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument(
            "--quick", action="store_true", help="CPU: hidden 512 and 1.4k rows (else hidden 1024, 4k rows)"
        )
        ap.add_argument("--gpu", action="store_true", help="CUDA, the released width: " + what_gpu_measures)

    def run_args(args: argparse.Namespace) -> dict | int:
        if args.gpu and not torch.cuda.is_available():
            say(f"{name} --gpu: no CUDA device here; nothing measured. It measures: {what_gpu_measures}")
            return 2
        if args.gpu:
            say(f"{name} --gpu measures: {what_gpu_measures}")
        return run(args.quick or args.smoke, gpu=args.gpu, smoke=args.smoke)

    return cli(doc, run_args, options, module)


def join_ray(address: str) -> None:
    """This process joins the Ray cluster at ``address`` in namespace "serve" (where `h3serve serve` deploys, so
    Serve handles reach its replicas); a benchmark then starts no cluster of its own and leaves this one running."""
    import logging

    import ray

    ray.init(address=address, namespace="serve", log_to_driver=False, logging_level=logging.WARNING)


# -- results ----------------------------------------------------------------------------------------
@functools.cache
def git_commit() -> str | None:
    """The checkout's commit (``+dirty`` when it has changes), or None outside a git checkout (a GPU node's copy)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def stamp(result: dict) -> dict:
    """``result`` with where it was measured: ``machine`` (kept when the benchmark filled it), ``commit``, ``argv``."""
    return {**result, "machine": result.get("machine") or machine(), "commit": git_commit(), "argv": sys.argv}


def write_json(path: str | None, result: dict, quiet: bool = False) -> None:
    """``result``, stamped, to ``path`` (nothing when None)."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(stamp(result), indent=1, default=str))
    if not quiet:
        say(f"wrote {path}")


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0],
    }  # a shared machine: other work skews absolute times


# -- timing, tables -------------------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux /proc; ``pid`` itself not included), children before their own children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def now() -> float:
    return time.perf_counter()


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def time_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Wall times of ``reps`` calls, in milliseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = now()
        fn()
        out.append((now() - t0) * 1e3)
    return out


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch on ``n`` threads inside the block (a replica's count: steadier on a shared machine), then as before."""
    own = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(own)


@contextlib.contextmanager
def worker_group(spec) -> Iterator[Any]:
    """``WorkerGroup.create(spec)`` inside the block, shut down (its rank processes with it) after it."""
    from h3serve.replicas import WorkerGroup

    group = WorkerGroup.create(spec)
    try:
        yield group
    finally:
        group.shutdown()


def interleaved(cases: dict[Any, Callable[[], object]], rounds: int) -> dict[Any, list[float]]:
    """Each case's wall milliseconds over ``rounds`` rounds, the cases taking turns in every round: load drift on a
    shared machine hits them alike."""
    times: dict[Any, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = now()
            fn()
            times[name].append((now() - t0) * 1e3)
    return times


class Phases:
    """Wall seconds of named phases: ``with phases("decode"): ...``; ``phases.seconds`` in the order first timed
    (a phase timed again adds up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = now()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + now() - t0


def columns(
    rows: Iterable[Any], cells: Sequence[tuple[str, str | Callable[[Any], object]]], title: str | None = None
) -> str:
    """``table`` with each column's header beside its cell: ``(header, cell)``, the cell a row's key (dots reach into
    nested dicts: ``"latency.p50"``) or a function of the row."""

    def cell(row: Any, get: str | Callable[[Any], object]) -> object:
        return get(row) if callable(get) else functools.reduce(lambda d, key: d[key], get.split("."), row)

    return table([h for h, _ in cells], [[cell(r, get) for _, get in cells] for r in rows], title)


def judge_targets(checks: Sequence[tuple[str, float, str, float]], load: float, title: str) -> list[dict]:
    """Each (target, value, ">=" or "<=", limit) judged, printed as one table; the rows, for the JSON."""
    out = [
        {
            "target": name,
            "load": load,
            "value": value,
            "limit": f"{op} {limit:g}",
            "met": value >= limit if op == ">=" else value <= limit,
        }
        for name, value, op, limit in checks
    ]
    table(["target", "value", "limit", "met"], [[t["target"], t["value"], t["limit"], t["met"]] for t in out], title)
    return out


def say(msg: str = "") -> None:
    print(msg, flush=True)


def compare_media(got, want, audio_rtol: float = 1e-4, audio_atol: float = 1e-5) -> dict:
    """Decoded outputs of the same request from two schedulers (``GeneratedMedia``: numpy frames and audio).

    fp32 GEMMs over different row counts round differently (~1e-6 in the latents), so a pixel may
    cross a uint8 rounding boundary: frames agree when no pixel differs by more than 1.
    """
    import numpy as np

    same_shape = got.frames.shape == want.frames.shape
    diff = np.abs(got.frames.astype(np.int16) - want.frames.astype(np.int16)) if same_shape else None
    same_audio = got.audio.shape == want.audio.shape
    result = {
        "shape_ok": same_shape,
        "max_pixel_diff": int(diff.max()) if same_shape else None,
        "frac_pixels_differ": float((diff > 0).mean()) if same_shape else None,
        "audio_max_diff": float(np.abs(got.audio - want.audio).max()) if same_audio else None,
        "audio_ok": bool(same_audio and np.allclose(got.audio, want.audio, rtol=audio_rtol, atol=audio_atol)),
    }
    result["agree"] = bool(same_shape and result["max_pixel_diff"] <= 1 and result["audio_ok"])
    return result


def summarize_agreement(comparisons: Sequence[dict]) -> dict:
    """Worst case over many per-request comparisons."""
    pixel = [c["max_pixel_diff"] for c in comparisons if c["max_pixel_diff"] is not None]
    frac = [c["frac_pixels_differ"] for c in comparisons if c["frac_pixels_differ"] is not None]
    audio = [c["audio_max_diff"] for c in comparisons if c["audio_max_diff"] is not None]
    return {
        "agree": all(c["agree"] for c in comparisons),
        "requests": len(comparisons),
        "max_pixel_diff": max(pixel, default=None),
        "max_frac_pixels_differ": max(frac, default=None),
        "audio_max_diff": max(audio, default=None),
    }


def cpu_resolution():
    """The driver's admission decision for the tiny model on this CPU (what a ReplicaSpec carries)."""
    from h3serve.attention import Platform
    from h3serve.pipelines.h3 import preset, validate_deployment

    tiny = preset("tiny")
    return validate_deployment(
        model=tiny.name,
        geometry=tiny.geometry(),
        attention_backend="auto",
        platform=Platform.cpu(),
        device="cpu",
        dtype="float32",
    )


def tiny_spec(sp: int = 1, rank_cpus: float = 1.0, checkpoint: str | None = None):
    """What the driver hands a tiny CPU replica: default deploy args, ``sp`` Ulysses ranks, and ``checkpoint``
    (default: the tiny preset with seeded random weights, ``random_tiny_checkpoint()``: same dims, same cost)."""
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.pipelines.h3.checkpoint import random_tiny_checkpoint

    args = DeployArgs(
        sp_degree=sp, rank_resources={"CPU": rank_cpus}, checkpoint=checkpoint or str(random_tiny_checkpoint())
    )
    return args.replica_spec(cpu_resolution())


def keyframe_png(width: int, height: int, seed: int = 0) -> bytes:
    """An encoded RGB keyframe (FL2VA's first/last frame): a seeded colour with a bright square."""
    import io
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    x, y = rng.randrange(width // 2), rng.randrange(height // 2)
    ImageDraw.Draw(image).rectangle((x, y, x + width // 3, y + height // 3), fill=(250, 250, 250))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


class StepLog:
    """EngineObserver: every packed forward's stats, every stage time, every failure, preemptions, duty cycle."""

    def __init__(self):
        self.steps = []
        self.stages: dict[str, list[float]] = {}
        self.failures: list[tuple[str, str]] = []  # (step | request, reason)
        self.preempted = 0
        self.duty_cycle: float | None = None  # the engine's running forward time / busy time

    def on_step(self, stats, seconds: float) -> None:
        self.steps.append(
            {"requests": stats.requests, "rows": stats.rows, "padding_rows": stats.padding_rows, "s": seconds}
        )

    def on_queue(self, waiting: int, active: int) -> None:
        pass

    def on_stage(self, stage: str, seconds: float) -> None:
        self.stages.setdefault(stage, []).append(seconds)

    def on_failed_step(self, reason: str) -> None:
        self.failures.append(("step", reason))

    def on_failed_request(self, reason: str) -> None:
        self.failures.append(("request", reason))

    def on_preempted(self, count: int) -> None:
        self.preempted += count

    def on_duty_cycle(self, fraction: float) -> None:
        self.duty_cycle = fraction


class _CountOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def aten_ops(fn) -> int:
    """How many aten ops (each a Python -> C++ dispatch on CPU, a kernel launch on GPU) ``fn`` runs."""
    with _CountOps() as counter:
        counter.n = 0
        fn()
    return counter.n


# -- a served app -----------------------------------------------------------------------------------
def served_checkpoint() -> str | None:
    """What the default config serves: None (the shipped demo checkpoint) where it exists; else the tiny
    preset with random weights (the same architecture, so the same cost), which the config then names."""
    from h3serve.pipelines.h3.checkpoint import CheckpointError, random_tiny_checkpoint, resolve_checkpoint

    try:
        resolve_checkpoint(None)
        return None
    except CheckpointError:
        return str(random_tiny_checkpoint())


def default_args():
    """The ``DeployArgs`` of the default config's one H3 application (limits.default_steps, engine bounds...)."""
    from h3serve.deploy.common.args import DeployArgs
    from h3serve.deploy.driver.cli import h3_apps, load_config

    ((_, args),) = h3_apps(load_config(None))
    return DeployArgs.model_validate(args)


def merged(base: dict, overlay: dict) -> dict:
    """``base`` with ``overlay`` laid over it, nested dicts key by key (an empty dict replaces)."""
    import copy

    out = copy.deepcopy(base)
    for key, value in overlay.items():
        out[key] = merged(out.get(key) or {}, value) if isinstance(value, dict) and value else copy.deepcopy(value)
    return out


def default_config(port: int, overlay: dict | None = None) -> dict:
    """h3serve/deploy/serve_config.yaml with only the HTTP port changed (127.0.0.1) and ``overlay`` laid over its H3
    application's args; in a checkout without the shipped demo checkpoint (and no checkpoint in ``overlay``), the
    checkpoint set to ``served_checkpoint()``'s tiny preset with random weights."""
    from h3serve.deploy.driver.cli import BUILDER, load_config

    config = merged(load_config(None), {"http_options": {"host": "127.0.0.1", "port": port}})
    overlay = overlay or {}
    if "checkpoint" not in overlay and (checkpoint := served_checkpoint()) is not None:
        overlay = {**overlay, "checkpoint": checkpoint}
    for app in config["applications"]:
        if app.get("import_path") == BUILDER:
            app["args"] = merged(app["args"], overlay)
    return config


class ServedConfig:
    """`h3serve serve CONFIG --address <this cluster>` until ``apps`` applications serve; a context manager.

    Joins the caller's Ray session when there is one (it must be in namespace "serve", where `h3serve serve`
    deploys, for the caller's handles to reach the replicas); else starts a local cluster of ``num_cpus`` CPUs
    (None: all of this node's, and its GPUs). The command joins this process's cluster, so the benchmark can also
    reach the replica through a Serve handle."""

    def __init__(self, config: dict, apps: int = 1, startup_timeout_s: float = 300.0, num_cpus: int | None = 2):
        import tempfile

        self.config, self.apps, self.timeout, self.num_cpus = config, apps, startup_timeout_s, num_cpus
        self.dir = tempfile.TemporaryDirectory(prefix="h3serve-bench-")
        self.started_ray = False
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config['http_options']['port']}"  # every config here serves on 127.0.0.1

    def __enter__(self):
        import logging

        import ray
        import yaml

        if not ray.is_initialized():  # Serve's controller lives in namespace "serve", where `h3serve serve` puts it
            ray.init(
                num_cpus=self.num_cpus,
                namespace="serve",
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self.started_ray = True
        elif ray.get_runtime_context().namespace != "serve":
            raise RuntimeError(
                "the caller's Ray session must be in namespace 'serve' (where `h3serve serve` "
                "deploys) for this process to reach the replicas through handles"
            )
        path = Path(self.dir.name) / "serve_config.yaml"
        path.write_text(yaml.safe_dump(self.config))
        self.log = open(path.with_suffix(".log"), "w+")
        started = time.perf_counter()
        self.proc = subprocess.Popen(
            [H3SERVE, "serve", str(path), "--address", ray.get_runtime_context().gcs_address],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        while self.output().count("is serving at") < self.apps:
            if self.proc.poll() is not None or time.perf_counter() - started > self.timeout:
                text = self.output()[-4000:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"h3serve serve did not start its {self.apps} application(s):\n{text}")
            time.sleep(0.5)
        self.startup_s = time.perf_counter() - started
        return self

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        import signal

        import ray

        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the command shuts Serve down on SIGTERM
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # the command shut Serve down (its controller is gone): forget this driver's cached controller client, or
        # the next Serve app in this Ray session is looked up through the dead one (ActorDiedError)
        from ray.serve.context import _disconnect

        _disconnect()
        if self.started_ray:
            ray.shutdown()
        self.log.close()
        self.dir.cleanup()


class ServedDefault(ServedConfig):
    """`h3serve serve h3serve/deploy/serve_config.yaml` on a free port of 127.0.0.1 (``default_config``)."""

    def __init__(self, startup_timeout_s: float = 300.0):
        from h3serve.replicas.worker_group import free_port

        self.port, self.checkpoint = free_port(), served_checkpoint()
        super().__init__(default_config(self.port), 1, startup_timeout_s)

    def __enter__(self) -> ServedDefault:
        return super().__enter__()


class Attached:
    """A server of the default config already up at ``url`` (``--url``: a test's, joined with ``--address``), in
    place of ``ServedDefault``: nothing started, nothing stopped; ``startup_s`` None."""

    def __init__(self, url: str):
        self.url, self.checkpoint, self.startup_s = url.rstrip("/"), served_checkpoint(), None

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc) -> None:
        pass


def startup(served) -> str:
    """How long the server took to start, for a line of output: "in 12.3 s", or "(already up)" when attached."""
    return "(already up)" if served.startup_s is None else f"in {served.startup_s:.1f} s"


def served_default(url: str | None) -> ServedDefault | Attached:
    """The default config served for a benchmark: the one at ``url`` when given, else a fresh ``ServedDefault``."""
    return Attached(url) if url else ServedDefault()


# -- a trace ----------------------------------------------------------------------------------------
def by_shares(classes: Sequence[Any], n: int, rng: random.Random) -> list:
    """``n`` of ``classes`` (each with a ``share``) in a shuffled order: the shares rounded, the remainder to the
    first class."""
    counts = [round(n * c.share) for c in classes]
    counts[0] += n - sum(counts)
    kinds = [c for c, count in zip(classes, counts, strict=True) for _ in range(count)]
    rng.shuffle(kinds)
    return kinds


def unit_gaps(n: int, rng: random.Random) -> list[float]:
    """Exponential gaps at one arrival a second (Poisson arrivals once scaled by 1/rate); the first opens the trace."""
    return [0.0] + [rng.expovariate(1.0) for _ in range(n - 1)]


async def at_times(arrivals: Iterable[tuple[float, Any]], send: Callable[[int, Any], Awaitable[dict]]) -> list[dict]:
    """Each ``(seconds after the start, item)`` sent at its time, all concurrently: ``send(index, item)``'s results,
    in the arrivals' order, each with its ``index`` and its ``arrival`` (``time.monotonic()``)."""
    t0 = time.monotonic()

    async def at(i: int, when: float, item: Any) -> dict:
        await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
        return {**(await send(i, item)), "index": i, "arrival": t0 + when}

    return await asyncio.gather(*(at(i, when, item) for i, (when, item) in enumerate(arrivals)))


# -- GPU scripts ----------------------------------------------------------------------------------

PEAK_TFLOPS = BF16_DENSE_TFLOPS  # H200 SXM bf16 dense, NVIDIA spec (h3serve plan projects with the same)


def no_cuda(mode: str, device: str) -> dict | None:
    """A GPU script's result when its mode wants CUDA and this machine has none (said; nothing measured); None: the
    device is there (or the mode runs on CPU), go on."""
    if device != "cuda" or torch.cuda.is_available():
        return None
    say("no CUDA device: nothing measured (use --cpu-dry-run to exercise the script on CPU)")
    return {"mode": mode, "error": "no CUDA device"}
