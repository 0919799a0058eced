"""The session's one `h3serve serve` (``conftest.served``): the applications of every test module that talks HTTP to a
server it does not stop or reconfigure, in one serve config on the session's cluster.

A start of `h3serve serve` costs 30-60 s on 2 cores (the command's interpreter, the pre-flight's probe task, each
application's build task, replicas and ingresses importing torch and diffusers); one process serving every such
module's applications pays the fixed part once. Each module owns its applications (``APPS``): its own name, route
prefix, args and job store, so no module sees another's jobs, counters or queue; the module's ``server`` fixture
deletes them when it ends, so their replicas stop before the next module runs. Only the applications of modules
the session collected are deployed. A module whose tests stop, restart or scale the server keeps a process of its
own (test_api_lifecycle, test_drain, test_stages, test_deploy_scaling).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.harness import FOREIGN_DIMS, ServeProcess, default_config

KEY = "h3-test-key"  # test_api_http's locked application's bearer token
LOCKED_BODY_LIMIT = 65536
FLOOD_ENGINE = {"max_queue": 4, "max_active": 2}  # 6 generations at once: more than Serve's default of 5 per replica


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the applications are made of beyond the default config: files written once for the session."""

    tmp: Path  # the job stores and the files below live under it
    tiny_checkpoint: Path  # the random tiny preset (conftest's ``tiny_checkpoint``): the adapters' base modules


def library_checkpoint(inputs: Inputs) -> Path:
    """test_deploy_checkpoint's: a checkpoint h3serve did not write (diffusers' and transformers' own
    save_pretrained, diffusers' own index with absolute paths), at dims of its own (FOREIGN_DIMS, no preset's)."""
    from diffusers.modular_pipelines import MiniMaxH3Blocks

    from h3serve.pipelines.h3 import preset
    from h3serve.pipelines.h3.checkpoint import tiny_components

    directory = inputs.tmp / "library" / "MiniMax-H3-foreign"
    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.register_to_config(**preset("tiny").pipeline_config)
    pipe.update_components(**tiny_components(seed=11, transformer=FOREIGN_DIMS))
    pipe.save_pretrained(str(directory), overwrite_modular_index=True)
    return directory


def lora_adapters(inputs: Inputs) -> dict[str, dict]:
    """test_lora_http's deploy-args ``loras``: test_lora's adapters, saved by diffusers' save_lora_weights."""
    from diffusers import MiniMaxH3Transformer3DModel
    from peft import LoraConfig

    from tests.test_lora import ADAPTERS, lora_state_dict, save

    base = MiniMaxH3Transformer3DModel.from_pretrained(inputs.tiny_checkpoint / "transformer").eval()
    loras = {}
    for seed, (name, (kwargs, scale)) in enumerate(ADAPTERS.items()):
        config = LoraConfig(**kwargs)
        directory = save(inputs.tmp / "loras" / name, lora_state_dict(base, config, seed), config)
        loras[name] = {"path": str(directory), "scale": scale, **({"steps": 3} if name == "turbo" else {})}
    return loras


def _app(inputs: Inputs, name: str, route: str, **args) -> dict:
    app = copy.deepcopy(default_config()["applications"][0])
    app.update(name=name, route_prefix=route)
    # a tenth of a CPU each (the default's half would fit four replicas in the cluster's two, and every module's
    # applications start together): placement only, a replica's threads are not limited by it
    app["args"].update(jobs={"store": str(inputs.tmp / "videos")}, rank_resources={"CPU": 0.1}, **args)
    app["deployments"] = [
        {"name": "H3Ingress", "ray_actor_options": {"num_cpus": 0.02}},
        {"name": "H3Replica", "num_replicas": 1},
    ]
    return app


def _http_apps(inputs: Inputs) -> list[dict]:
    default = _app(inputs, "h3serve", "/")
    locked = _app(inputs, "locked", "/locked", api_key_env="H3_TEST_KEY")
    locked["runtime_env"] = {"env_vars": {"H3_TEST_KEY": KEY}}
    locked["args"]["limits"] = {**locked["args"]["limits"], "max_body_bytes": LOCKED_BODY_LIMIT}
    return [default, locked]


def _flood_apps(inputs: Inputs) -> list[dict]:
    flood = _app(inputs, "flood", "/flood")
    flood["args"]["engine"] = {**flood["args"]["engine"], **FLOOD_ENGINE}
    return [flood]


# test_events_http's: one request in the pack at a time (queue positions), a preview every 2 steps, in arrival order
# (fcfs: its jobs wait behind the running one, which srpt, the CPU default's policy, would pause for a shorter one);
# its playground page's test runs on it too
EVENTS_ENGINE = {"max_active": 1, "max_queue": 8, "policy": "fcfs", "preview": {"every_steps": 2}}


def _events_apps(inputs: Inputs) -> list[dict]:
    events = _app(inputs, "events", "/events")
    events["args"]["engine"] = {**events["args"]["engine"], **EVENTS_ENGINE}
    return [events]


# test_scale_from_zero's: H3Replica at zero until a request comes, back to zero 3 s after its work is done
COLD_AUTOSCALING = {
    "min_replicas": 0,
    "max_replicas": 1,
    "target_wait_s": 30,
    "upscale_delay_s": 0,
    "downscale_delay_s": 3,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
    "expected_load_s": 45,
}


def _cold_apps(inputs: Inputs) -> list[dict]:
    """Two applications scaled on the backlog from zero: image requests refused while cold (the default), or held."""
    apps = []
    for name, images in (("coldstart", "refuse"), ("coldwait", "wait")):
        app = _app(inputs, name, f"/{name}", autoscaling={**COLD_AUTOSCALING, "cold_images": images})
        app["args"].pop("ingress")  # sized for autoscaling.max_replicas
        app["deployments"] = [d for d in app["deployments"] if d["name"] != "H3Replica"]  # the builder's
        apps.append(app)
    return apps


# test_tenants_http's: three tenants (alpha and beta users, ops an admin) and one per quota, from a key file re-read
# every second; one request in the pack at a time, in arrival order, so a long job holds the engine while others wait
TENANT_KEYS = {
    "alpha": "alpha-key-0123456789abcdef",
    "beta": "beta-key-0123456789abcdef",
    "ops": "ops-key-0123456789abcdef00",
    "rpm": "rpm-key-0123456789abcdef00",
    "steps": "steps-key-0123456789abcdef",
}
TENANT_ENGINE = {"max_active": 1, "max_queue": 16, "policy": "fcfs"}


def tenant_entries(keys: dict[str, str], steps_limit: int = 1) -> list[dict]:
    """The key file's entries (``auth.keys_file``) for ``keys`` (tenant -> key); the ``steps`` tenant's row-step limit
    is set by the test once it knows a request's size."""
    limits = {
        "alpha": {"role": "user", "max_priority": 1, "max_jobs": 2},
        "beta": {"role": "user"},
        "ops": {"role": "admin"},
        "rpm": {"role": "user", "requests_per_minute": 2},
        "steps": {"role": "user", "max_row_steps": steps_limit},
    }
    return [{"key": key, "tenant": name.split("-")[0], **limits[name.split("-")[0]]} for name, key in keys.items()]


def tenants_keys_file(inputs: Inputs) -> Path:
    return inputs.tmp / "tenants" / "keys.yaml"


def _tenant_apps(inputs: Inputs) -> list[dict]:
    import yaml

    path = tenants_keys_file(inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"keys": tenant_entries(TENANT_KEYS)}))
    app = _app(inputs, "tenants", "/tenants", api_key_env=None, auth={"keys_file": str(path), "reload_s": 1})
    app["args"]["engine"] = {**app["args"]["engine"], **TENANT_ENGINE}
    return [app]


def _cli_apps(inputs: Inputs) -> list[dict]:
    """test_client_cli's: the default, with room for a job long enough (CLI_STEPS) to press Ctrl-C under its bar."""
    cli = _app(inputs, "cli", "/cli")
    cli["args"]["limits"] = {**cli["args"]["limits"], "max_steps": CLI_STEPS}
    return [cli]


# test_webhooks_http's: webhooks signed with WEBHOOK_SECRET, allowed to 127.0.0.1 over http (the test's receiver),
# retried fast; two ingress replicas and a short lease (a killed runner's job ends on the other in seconds)
WEBHOOK_SECRET = "whsec_" + "aDNzZXJ2ZS13ZWJob29rLXRlc3Qtc2VjcmV0"  # base64 of "h3serve-webhook-test-secret"
WEBHOOKS = {
    "secret_env": "H3_WEBHOOK_SECRET",
    "allow": ["127.0.0.1/32"],
    "allow_http": True,
    "first_retry_s": 0.3,
    "max_retry_s": 1.0,
    "retry_for_s": 60,
}
WEBHOOKS_LEASE_S = 6


def _webhook_apps(inputs: Inputs) -> list[dict]:
    app = _app(inputs, "webhooks", "/webhooks")
    app["args"]["jobs"]["webhooks"] = WEBHOOKS
    app["args"]["jobs"]["lease_s"] = WEBHOOKS_LEASE_S
    app["deployments"][0]["num_replicas"] = 2
    app["runtime_env"] = {"env_vars": {"H3_WEBHOOK_SECRET": WEBHOOK_SECRET}}
    return [app]


# test_derived_http's: two tenants (alpha, beta), one request in the pack at a time and in arrival order, so a derived
# clip and the same request sent to POST /v1/videos each run alone and compare frame for frame
DERIVED_KEYS = {"alpha": "alpha-derived-0123456789abcdef", "beta": "beta-derived-0123456789abcdef0"}


def _derived_apps(inputs: Inputs) -> list[dict]:
    import yaml

    path = inputs.tmp / "derived" / "keys.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = [{"key": key, "tenant": name, "role": "user"} for name, key in DERIVED_KEYS.items()]
    path.write_text(yaml.safe_dump({"keys": entries}))
    app = _app(inputs, "derived", "/derived", api_key_env=None, auth={"keys_file": str(path)})
    app["args"]["engine"] = {**app["args"]["engine"], **TENANT_ENGINE}
    return [app]


# test_ingress_replicas': two H3Ingress replicas behind Serve's proxy over one job store, a short lease (a killed
# ingress's jobs are taken over in seconds), jobs run in arrival order one at a time
INGRESSES_LEASE_S = 6


def _ingresses_apps(inputs: Inputs) -> list[dict]:
    app = _app(inputs, "ingresses", "/ingresses")
    app["args"]["jobs"]["lease_s"] = INGRESSES_LEASE_S
    app["args"]["engine"] = {**app["args"]["engine"], "policy": "fcfs"}
    app["deployments"][0]["num_replicas"] = 2
    return [app]


CLI_STEPS = 2000  # ~100 s of the tiny model's steps on 2 cores: the Ctrl-C test cancels it within the first seconds


def _lora_app(inputs: Inputs) -> dict:
    """test_lora_http's: test_lora's adapters, and packs of up to 4 requests (composed lists beside base requests)."""
    app = _app(inputs, "lora", "/lora", loras=lora_adapters(inputs))
    app["args"]["engine"]["max_active"] = 4
    return app


# test_events_live's: a transformer wide enough that one step of the default clip takes ~0.5-2 s on 2 cores (hidden
# 1024, 3 blocks: 52M parameters, 0.2 GiB in fp32, written in ~2 s), so a burst of held events would show
LIVE_TRANSFORMER = {"num_attention_heads": 32, "attention_head_dim": 32, "hidden_size": 1024, "ffn_dim": 4096}


def _live_apps(inputs: Inputs) -> list[dict]:
    from h3serve.pipelines.h3.checkpoint import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint(
        inputs.tmp / "live-h1024-l3", seed=0, transformer={**LIVE_TRANSFORMER, "num_layers": 3}
    )
    return [_app(inputs, "liveevents", "/liveevents", checkpoint=str(checkpoint), model="auto")]


# test module -> its applications (the first is the one its ``server`` fixture hands out)
APPS: dict[str, Callable[[Inputs], list[dict]]] = {
    "test_api_backpressure": _flood_apps,
    "test_client_cli": _cli_apps,
    "test_content_http": lambda inputs: [_app(inputs, "content", "/content")],
    "test_api_http": _http_apps,
    "test_deploy_checkpoint": lambda inputs: [
        _app(inputs, "foreign", "/foreign", checkpoint=str(library_checkpoint(inputs)), model="auto")
    ],
    "test_derived_http": _derived_apps,
    "test_deploy_default": lambda inputs: [_app(inputs, "default", "/default")],
    "test_events_http": _events_apps,
    "test_events_live": _live_apps,
    "test_ingress_replicas": _ingresses_apps,
    "test_lora_http": lambda inputs: [_lora_app(inputs)],
    "test_scale_from_zero": _cold_apps,
    "test_tenants_http": _tenant_apps,
    "test_webhooks_http": _webhook_apps,
}


def serve_config(modules: list[str], inputs: Inputs) -> tuple[dict, dict[str, list[str]]]:
    """One serve config holding the applications of ``modules`` (of APPS), and each module's application names."""
    config, owners = default_config(), {}
    config["applications"] = []
    for module in modules:
        apps = APPS[module](inputs)
        owners[module] = [app["name"] for app in apps]
        config["applications"] += apps
    return config, owners


@dataclasses.dataclass(frozen=True)
class ServedApp:
    """One application of the session's server, as a module's tests see it."""

    process: ServeProcess
    name: str
    route: str
    store: Path  # <jobs store>/<application name>/: its video job records
    metrics_port: int  # the session cluster's metrics export port

    @property
    def root(self) -> str:
        """The server's own URL, every application's routes under it."""
        return self.process.url

    @property
    def url(self) -> str:
        """This application's URL: its routes (/v1/..., /health) under it."""
        return self.process.url + ("" if self.route == "/" else self.route)

    def output(self) -> str:
        """The server process's output so far (every application's)."""
        return self.process.output()


class ServedApps:
    """The running server: each module's applications by name. It stops when the last module that owns applications
    on it ends (``stop``), so whatever runs after those modules has the cluster's CPUs and a Serve of its own."""

    def __init__(
        self,
        process: ServeProcess,
        config: dict,
        owners: dict[str, list[str]],
        store: Path,
        port: int,
        stop: Callable[[], None],
    ):
        self.process, self.owners, self.store, self.metrics_port, self.stop = process, owners, store, port, stop
        self.routes = {app["name"]: app["route_prefix"] for app in config["applications"]}
        self.modules_left = set(owners)

    def app(self, name: str) -> ServedApp:
        return ServedApp(self.process, name, self.routes[name], self.store / name, self.metrics_port)

    @contextlib.contextmanager
    def module(self, module: str) -> Iterator[ServedApp]:
        """A module's first application while the module runs; then all of its applications are deleted, so their
        replicas (and whatever work the module left queued on them) stop before the next module runs."""
        from ray import serve

        module = module.rsplit(".", 1)[-1]
        try:
            yield self.app(self.owners[module][0])
        finally:
            for name in self.owners[module]:
                serve.delete(name)
            self.modules_left.discard(module)
            if not self.modules_left:
                self.stop()
