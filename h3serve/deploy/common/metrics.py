"""Every h3serve metric, defined once. Exported by Ray's metrics agent as ``ray_<name>`` (+``_total`` for counters).

Replicas record through ``ray.serve.metrics`` (which adds deployment/replica/application
tags). Admission outcomes go through a small detached actor, so they stay on the metrics
export port after the build task that produced them has exited.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import ray
from ray.serve.metrics import Counter, Gauge, Histogram

from h3serve.pipelines.h3.placement import STAGE_ROLES
from h3serve.replicas import CANCEL_STAGES, FAILURE_REASONS, EngineLoad
from h3serve.replicas import STAGES as ENGINE_STAGES

logger = logging.getLogger(__name__)

LATENCY_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600]
STEP_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
ROW_BUCKETS = [64, 256, 1024, 4096, 16384, 65536, 262144]
FRACTION_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0]
# one request's stages: a tiny step takes milliseconds, a released-size clip waits and runs for many minutes
STAGE_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600]
# the stage tag's values: what the engine observes (replicas.STAGES) and the replica's own MP4/PNG encoding
STAGES = (*ENGINE_STAGES, "encode")
FAILED_STEP_REASONS = ("pack", "worker_group")
GAUGE_REFRESH_S = 1.0  # a gauge that holds still is set again this often (Ray's shortest export interval)


@dataclasses.dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    tag_keys: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        """The series name Prometheus sees (histograms add _bucket/_sum/_count)."""
        return f"ray_{self.name}" + ("_total" if self.kind == "counter" else "")


ADMISSION_DECISIONS = MetricDef(
    "h3serve_admission_decisions",
    "counter",
    "Attention admission decisions in the driver.",
    ("model", "backend", "chosen_by", "outcome", "reason", "stage"),
)
ADMISSION_FAILURES = MetricDef(
    "h3serve_admission_failures",
    "counter",
    "Deployments refused by attention admission (no replica was created).",
    ("model", "backend", "chosen_by", "reason", "stage"),
)
BUILD_FAILURES = MetricDef(
    "h3serve_replica_build_failures",
    "counter",
    "Replicas that failed to build (backend unavailable on the node, bad weights...).",
    ("backend", "reason"),
)
# "route", not "endpoint": the Prometheus Operator sets its own "endpoint" target label
# "model": a generation's model id, the base model's or "<base>:<adapter>" (a bounded set: the deploy args'
# adapters; an unknown id is never a label); "" for other routes and requests refused before it was read
REQUESTS = MetricDef(
    "h3serve_requests",
    "counter",
    "HTTP requests by route, status code and model id (LoRA adapters: '<base>:<adapter>').",
    ("route", "status", "model"),
)
REQUEST_LATENCY = MetricDef(
    "h3serve_request_latency_seconds",
    "histogram",
    "End-to-end HTTP latency (video jobs: submit to finished), by route and model id.",
    ("route", "model"),
    tuple(LATENCY_BUCKETS),
)
QUEUE_DEPTH = MetricDef("h3serve_queue_depth", "gauge", "Requests per replica engine, waiting or active.", ("state",))
STEP_SECONDS = MetricDef(
    "h3serve_step_seconds",
    "histogram",
    "Wall time of one packed forward and its scheduler steps.",
    (),
    tuple(STEP_BUCKETS),
)
ROWS_PER_STEP = MetricDef(
    "h3serve_rows_per_step", "histogram", "Rows in one packed forward, padding included.", (), tuple(ROW_BUCKETS)
)
PADDING_FRACTION = MetricDef(
    "h3serve_padding_fraction", "histogram", "Padding rows / all rows of a packed forward.", (), tuple(FRACTION_BUCKETS)
)
STAGE_SECONDS = MetricDef(
    "h3serve_stage_seconds",
    "histogram",
    "Seconds one request spent in a stage: queue_wait (submitted to joining the pack), prepare (diffusers' "
    "blocks before the loop), first_step (submitted to its first completed step), step (one packed forward), "
    "decode (VAEs), encode (MP4/PNG), end_to_end (submitted to decoded).",
    ("stage",),
    tuple(STAGE_BUCKETS),
)
FAILED_STEPS = MetricDef(
    "h3serve_failed_steps",
    "counter",
    "Packed forwards that failed: reason pack (the pack's data; its requests are retried in smaller packs) or "
    "worker_group (a rank died or a collective timed out; the replica is replaced).",
    ("reason",),
)
FAILED_REQUESTS = MetricDef(
    "h3serve_failed_requests",
    "counter",
    "Requests the engine failed, by reason: " + ", ".join(FAILURE_REASONS) + ".",
    ("reason",),
)
CANCELLED_REQUESTS = MetricDef(
    "h3serve_cancelled_requests",
    "counter",
    "Requests cancelled (POST /v1/videos/{id}/cancel, DELETE of a running job, an image client that went away), by "
    "where they were: " + ", ".join(CANCEL_STAGES) + " (a running one leaves its pack at the next step boundary).",
    ("stage",),
)
PREEMPTIONS = MetricDef(
    "h3serve_preemptions",
    "counter",
    "Requests paused at a step boundary for another (engine.policy srpt or priority; fcfs only for an earlier "
    "request that did not fit before); each resumes later where it stopped.",
)
DUTY_CYCLE = MetricDef(
    "h3serve_duty_cycle",
    "gauge",
    "Fraction of the engine's busy time (work submitted and not finished) spent in packed forwards, since the "
    "replica started; the rest is time the model thread did not run the transformer.",
)
STEP_CACHE_SKIPPED = MetricDef(
    "h3serve_step_cache_skipped_block_rows",
    "counter",
    "Rows x transformer blocks that step caching skipped (requests with a cache tier reusing their cached "
    "residual); against h3serve_rows_per_step x blocks it is the share of transformer work caching saved.",
)
STAGE_RETRIES = MetricDef(
    "h3serve_stage_retries",
    "counter",
    "Calls from a denoiser to a conditioner or decoder stage (args.stages) made again because the stage replica "
    "died under them (Serve replaces it); the request waits instead of failing, and no denoising is repeated.",
    ("stage",),
)
# "adapter": a LoRA adapter's name from the deploy args' ``loras`` (a bounded set; an unserved name is never a
# label), "" for the base model
LORA_ADAPTERS = MetricDef(
    "h3serve_lora_adapters",
    "gauge",
    "LoRA adapters a replica serves: 1 per adapter (count(...) by replica is how many; the model id is "
    "'<base>:<adapter>').",
    ("adapter",),
)
ADAPTER_DOCUMENT_STEPS = MetricDef(
    "h3serve_adapter_document_steps",
    "counter",
    "Documents in successful packed forwards, by LoRA adapter ('' for the base model): a request adds one per "
    "denoising step; its rate is each adapter's share of the pack.",
    ("adapter",),
)

# the work a replica holds, refreshed every GAUGE_REFRESH_S (and what it reports to Serve's autoscaler,
# h3serve/deploy/common/autoscaling.py); beside ray_serve_autoscaling_target_replicas it shows why the replica count
# moves
BACKLOG_ROW_STEPS = MetricDef(
    "h3serve_backlog_row_steps",
    "gauge",
    "Rows x denoising steps left over every request a replica holds, waiting or running (LoRA adapters' own step "
    "counts included): its work in hand.",
)
ROW_STEP_RATE = MetricDef(
    "h3serve_row_step_rate",
    "gauge",
    "Row-steps a replica gets through per second of busy time, measured (smoothed); backlog / rate is its projected "
    "drain time.",
)
OLDEST_WAIT = MetricDef(
    "h3serve_oldest_wait_seconds",
    "gauge",
    "How long the longest-waiting request a replica holds and has not started has waited (0: none waits).",
)
DEADLINE_SLACK = MetricDef(
    "h3serve_deadline_slack_seconds",
    "gauge",
    "Seconds left to the closest deadline among the requests a replica holds; no series while none has one.",
)

# "tenant": a name from the ingress's key file (auth.keys_file) or "admin" (api_key_env's key): a bounded set; "" for
# a request no key was accepted for. Without tenants (open mode) these stay empty.
TENANT_REQUESTS = MetricDef(
    "h3serve_tenant_requests",
    "counter",
    "HTTP requests by tenant, route and status code.",
    ("tenant", "route", "status"),
)
TENANT_REJECTIONS = MetricDef(
    "h3serve_tenant_rejections",
    "counter",
    "Requests a tenant's limits refused, by the limit (max_priority, requests_per_minute, max_jobs, max_row_steps).",
    ("tenant", "reason"),
)
TENANT_ROW_STEPS = MetricDef(
    "h3serve_tenant_row_steps",
    "counter",
    "Row-steps (rows x num_inference_steps) of the generations admitted, by tenant: its share of the engines' work.",
    ("tenant",),
)
TENANT_GPU_SECONDS = MetricDef(
    "h3serve_tenant_gpu_seconds",
    "counter",
    "Seconds of GPU (of the replica's SP ranks: CPU ranks on a CPU deployment) in packed forwards, by tenant: each "
    "request's rows' share of each forward's wall time, times the replica's ranks. Requests without a tenant are "
    "not counted.",
    ("tenant",),
)
WEBHOOK_OUTCOMES = ("delivered", "rejected", "no_answer", "refused")
WEBHOOK_ATTEMPTS = MetricDef(
    "h3serve_webhook_attempts",
    "counter",
    "Webhook delivery attempts by outcome: delivered (2xx), rejected (another status), no_answer (timeout, connection "
    "refused...), refused (the target no longer passes jobs.webhooks.allow).",
    ("outcome",),
)
# a replica exports at most this many tenants (the ingress names them from its key file): a bug that sends more
# is an error logged by the engine's observer, never an unbounded set of series
MAX_TENANT_SERIES = 1000

ALL_METRICS = (
    ADMISSION_DECISIONS,
    ADMISSION_FAILURES,
    BUILD_FAILURES,
    REQUESTS,
    REQUEST_LATENCY,
    QUEUE_DEPTH,
    STEP_SECONDS,
    ROWS_PER_STEP,
    PADDING_FRACTION,
    STAGE_SECONDS,
    FAILED_STEPS,
    FAILED_REQUESTS,
    CANCELLED_REQUESTS,
    PREEMPTIONS,
    DUTY_CYCLE,
    STEP_CACHE_SKIPPED,
    STAGE_RETRIES,
    LORA_ADAPTERS,
    ADAPTER_DOCUMENT_STEPS,
    BACKLOG_ROW_STEPS,
    ROW_STEP_RATE,
    OLDEST_WAIT,
    DEADLINE_SLACK,
    TENANT_REQUESTS,
    TENANT_REJECTIONS,
    TENANT_ROW_STEPS,
    TENANT_GPU_SECONDS,
    WEBHOOK_ATTEMPTS,
)


def make(metric: MetricDef):
    if metric.kind == "counter":
        return Counter(metric.name, description=metric.description, tag_keys=metric.tag_keys)
    if metric.kind == "gauge":
        return Gauge(metric.name, description=metric.description, tag_keys=metric.tag_keys)
    return Histogram(
        metric.name, description=metric.description, boundaries=list(metric.boundaries), tag_keys=metric.tag_keys
    )


# -- admission: a detached recorder ---------------------------------------------------------
RECORDER_NAME, RECORDER_NAMESPACE = "h3serve-admission-metrics", "h3serve"


@ray.remote(num_cpus=0, max_restarts=-1)
class AdmissionRecorder:
    """Holds the admission counters, and a short log of decisions for diagnostics."""

    def __init__(self):
        self.decisions, self.failures = make(ADMISSION_DECISIONS), make(ADMISSION_FAILURES)
        self.build_failures = make(BUILD_FAILURES)
        self.log: list[dict] = []

    def record_admission(self, tags: dict[str, str]) -> None:
        self.decisions.inc(1, tags=tags)
        if tags["outcome"] == "rejected":
            self.failures.inc(1, tags={k: v for k, v in tags.items() if k != "outcome"})
        self.log = (self.log + [dict(tags)])[-1000:]

    def record_build_failure(self, backend: str, reason: str) -> None:
        self.build_failures.inc(1, tags={"backend": backend, "reason": reason})

    def decisions_log(self) -> list[dict]:
        return list(self.log)


# How long a driver or replica waits for the recorder to count a decision. The first count starts the detached
# actor's process: seconds on an idle node, past 30 s on a 2-core one saturated by other work (a fresh `h3serve
# serve` failed its preflight so); a recorder that does not answer in this long still fails the caller.
RECORD_TIMEOUT_S = 120


# the head node's own resource: a detached actor placed on a worker node keeps that node busy for good, so Ray's
# autoscaler never removes it (a GPU pod held after its replica scaled down)
ON_THE_HEAD = {"node:__internal_head__": 0.001}


def admission_recorder():
    """The detached recorder, created by whichever caller counts first (the driver's preflight, or a replica that
    fails to build when none exists). ``scheduling_strategy="DEFAULT"``: a Serve replica with
    ``placement_group_bundles`` makes its child actors join its placement group, where the head's resource fits no
    bundle; Ray then refuses to create the recorder and the replica's build failure would go uncounted."""
    return AdmissionRecorder.options(  # type: ignore[attr-defined]  # a Ray actor class
        name=RECORDER_NAME,
        namespace=RECORDER_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        resources=ON_THE_HEAD,
        scheduling_strategy="DEFAULT",
    ).remote()


# -- replicas: the engine's observer ---------------------------------------------------------
def checked(value: str, allowed: tuple[str, ...], tag: str) -> str:
    """A tag value from its closed set: an unknown one is a bug, never a new (unbounded) series."""
    if value not in allowed:
        raise ValueError(f"{tag} {value!r} is not one of {', '.join(allowed)}")
    return value


class EngineMetrics:
    """replicas.EngineObserver, recording to Prometheus through Ray (the replica reports stage "encode" too)."""

    def __init__(self, ranks: int = 1):
        """``ranks``: the replica's SP ranks (GPUs on cuda), what a forward's wall time is multiplied by."""
        self.ranks = ranks
        self.queue, self.step = make(QUEUE_DEPTH), make(STEP_SECONDS)
        self.rows, self.padding = make(ROWS_PER_STEP), make(PADDING_FRACTION)
        self.stage, self.failed_steps, self.failed_requests = (
            make(STAGE_SECONDS),
            make(FAILED_STEPS),
            make(FAILED_REQUESTS),
        )
        self.preemptions, self.duty_cycle = make(PREEMPTIONS), make(DUTY_CYCLE)
        self.cancelled = make(CANCELLED_REQUESTS)
        self.cache_skipped = make(STEP_CACHE_SKIPPED)
        self.stage_retries = make(STAGE_RETRIES)
        self.adapters, self.adapter_documents = make(LORA_ADAPTERS), make(ADAPTER_DOCUMENT_STEPS)
        self.backlog, self.rate = make(BACKLOG_ROW_STEPS), make(ROW_STEP_RATE)
        self.oldest_wait, self.slack = make(OLDEST_WAIT), make(DEADLINE_SLACK)
        self.tenant_gpu_s, self.tenants_seen = make(TENANT_GPU_SECONDS), set[str]()
        self.served_adapters: tuple[str, ...] = ()  # the adapter label's values, the base model's "" besides
        self._adapters_refresher: threading.Thread | None = None

    def on_step(self, stats, seconds: float) -> None:
        self.step.observe(seconds)
        self.rows.observe(stats.rows)
        self.padding.observe(stats.padding_rows / stats.rows if stats.rows else 0.0)
        if stats.skipped_block_rows > 0:  # Ray's counters refuse an increment of 0
            self.cache_skipped.inc(stats.skipped_block_rows)

    def on_queue(self, waiting: int, active: int) -> None:
        self.queue.set(waiting, tags={"state": "waiting"})
        self.queue.set(active, tags={"state": "active"})

    def on_stage(self, stage: str, seconds: float) -> None:
        self.stage.observe(seconds, tags={"stage": checked(stage, STAGES, "stage")})

    def on_failed_step(self, reason: str) -> None:
        self.failed_steps.inc(1, tags={"reason": checked(reason, FAILED_STEP_REASONS, "failed step reason")})

    def on_failed_request(self, reason: str) -> None:
        self.failed_requests.inc(1, tags={"reason": checked(reason, FAILURE_REASONS, "failed request reason")})

    def on_cancelled(self, stage: str) -> None:
        self.cancelled.inc(1, tags={"stage": checked(stage, CANCEL_STAGES, "cancel stage")})

    def on_request_event(self, ticket, kind: str, fields: dict) -> None:
        """Nothing to export: the replica's observer hands each followed request's events to its stream."""

    def on_preempted(self, count: int) -> None:
        if count > 0:  # Ray's counters refuse an increment of 0
            self.preemptions.inc(count)

    def on_duty_cycle(self, fraction: float) -> None:
        self.duty_cycle.set(fraction)

    def on_load(
        self, load: EngineLoad
    ) -> None:  # h3serve.deploy.model_server.h3_replica.H3Replica, every GAUGE_REFRESH_S
        self.backlog.set(load.backlog_row_steps)
        self.rate.set(load.row_step_rate)
        self.oldest_wait.set(load.oldest_wait_s)
        if load.deadline_slack_s is not None:
            self.slack.set(load.deadline_slack_s)

    def on_stage_retry(
        self, stage: str
    ) -> None:  # h3serve.deploy.model_server.stage_client.ServeStages: a stage replica died under a call
        self.stage_retries.inc(1, tags={"stage": checked(stage, STAGE_ROLES, "stage role")})

    def on_adapters(self, served: Sequence[str]) -> None:
        self.served_adapters = tuple(served)
        if self.served_adapters and self._adapters_refresher is None:
            # Ray exports a gauge only while it is set again within each export interval (one set at start would
            # vanish after a few seconds): a daemon thread sets it for as long as the replica lives
            self._adapters_refresher = threading.Thread(
                target=self._refresh_adapters, name="h3serve-adapter-gauge", daemon=True
            )
            self._adapters_refresher.start()

    def _refresh_adapters(self) -> None:
        while True:
            for name in self.served_adapters:
                self.adapters.set(1, tags={"adapter": name})
            time.sleep(GAUGE_REFRESH_S)

    def on_adapter_documents(self, documents: Mapping[str | None, int]) -> None:
        for adapter, count in documents.items():
            label = "" if adapter is None else checked(adapter, self.served_adapters, "adapter")
            if count > 0:  # Ray's counters refuse an increment of 0
                self.adapter_documents.inc(count, tags={"adapter": label})

    def on_tenant_forward_s(self, seconds: Mapping[str, float]) -> None:
        for tenant, share in seconds.items():
            if tenant not in self.tenants_seen:
                if len(self.tenants_seen) >= MAX_TENANT_SERIES:
                    raise ValueError(f"tenant {tenant!r} is past {MAX_TENANT_SERIES} tenants: not exported")
                self.tenants_seen.add(tenant)
            if share > 0:  # Ray's counters refuse an increment of 0
                self.tenant_gpu_s.inc(share * self.ranks, tags={"tenant": tenant})


class RequestMetrics:
    def __init__(self):
        self.requests, self.latency = make(REQUESTS), make(REQUEST_LATENCY)

    def observe(self, route: str, status: int, seconds: float | None, model: str = "") -> None:
        self.requests.inc(1, tags={"route": route, "status": str(status), "model": model})
        if seconds is not None:
            self.latency.observe(seconds, tags={"route": route, "model": model})


class TenantMetrics:
    """Requests, refusals by limit and admitted row-steps by tenant (the ingress's)."""

    def __init__(self):
        self.requests, self.rejections = make(TENANT_REQUESTS), make(TENANT_REJECTIONS)
        self.row_steps = make(TENANT_ROW_STEPS)

    def observe(self, tenant: str, route: str, status: int) -> None:
        self.requests.inc(1, tags={"tenant": tenant, "route": route, "status": str(status)})

    def rejected(self, tenant: str, reason: str) -> None:
        self.rejections.inc(1, tags={"tenant": tenant, "reason": reason})

    def admitted(self, tenant: str, row_steps: int) -> None:
        if row_steps > 0:  # Ray's counters refuse an increment of 0
            self.row_steps.inc(row_steps, tags={"tenant": tenant})


class WebhookMetrics:
    """Webhook delivery attempts by outcome (the ingress's)."""

    def __init__(self):
        self.attempts = make(WEBHOOK_ATTEMPTS)

    def attempt(self, outcome: str) -> None:
        self.attempts.inc(1, tags={"outcome": checked(outcome, WEBHOOK_OUTCOMES, "outcome")})
