"""H3Replica: the Serve deployment around one SP worker group and its step engine.

Start: the worker group is built (failing closed), then one warm-up forward (``engine.warmup``) runs before
``__init__`` returns, so kernel setup and compilation never land on the first user: Serve reports a replica
ready only after its constructor. With stage deployments of their own (``args.stages``: ``spec.stages`` is
"remote") rank 0 holds no text encoder and no VAE, so the warm-up request is prepared by the conditioner stage
(the constructor is async to await it) and its one forward runs here. Then, with ``engine.warmup_clip`` on, a
whole clip at the served size through the same stages, so the VAE's and the encoder's first calls at that size
are not the first user's either. A stage call whose stage replica dies
under it is made again on a live one (``ServeStages``): the request waits, it does not fail.

Serving: ``generate_image`` / ``generate_video`` submit to the engine with the
ingress's request id (in every log line about the request) and deadline; ``check_health`` is the engine's
(its loop, the SP workers, and the step watchdog).

Drain. Ray Serve 2.60 stops a replica (scale-down, a rolling update, shutdown) like this
(``DeploymentReplica.stop`` in the controller, ``ReplicaActor.perform_graceful_shutdown`` here):

1. the controller marks the replica STOPPING and broadcasts the running set without it: handles route no new
   requests here (a router that has not heard yet still may);
2. ``perform_graceful_shutdown`` waits, re-checking every ``graceful_shutdown_wait_loop_s``, until no request is
   ongoing (a stream is ongoing until it ends); it has no timeout of its own;
3. it then refuses new handle requests, stops its servers and calls the user's ``__del__``;
4. ``graceful_shutdown_timeout_s`` after step 1 the controller kills the actor, whether or not 2 and 3 finished.

Nothing tells user code that step 1 happened, and ``__del__`` runs only once every request has ended. Left to
that, a queued video would wait behind the active ones and then be killed with them. So the replica watches
its own state (``DrainWatch``: the controller's view of this deployment, every ``DRAIN_POLL_S``) and on
STOPPING drains its engine: new submits raise ``EngineDraining``, never-started requests fail at once with
``EngineDraining`` (the ingress answers an image 503 + Retry-After and re-submits a video job elsewhere),
active ones finish within ``engine.drain_timeout_s`` and after it fail. Serve's own wait (step 2) then ends as
soon as the last stream does. ``graceful_shutdown_timeout_s`` is ``drain_timeout_s + DRAIN_MARGIN_S`` so that
step 4 never cuts a drain that keeps to its budget.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from h3serve.attention import selector_calls
from h3serve.deploy.common.args import DRAIN_MARGIN_S, DeployArgs, JobStoreArgs
from h3serve.deploy.common.autoscaling import replica_stats
from h3serve.deploy.common.metrics import GAUGE_REFRESH_S, RECORD_TIMEOUT_S, EngineMetrics, admission_recorder
from h3serve.deploy.common.serve_controller import ReplicaStates
from h3serve.deploy.common.serve_logging import log_through_serve
from h3serve.deploy.jobs.adapter_registry import AdapterRegistry
from h3serve.deploy.jobs.media_store import MediaStore, store_url
from h3serve.deploy.model_server.adapter_sync import ReplicaAdapters
from h3serve.deploy.model_server.stage_client import ServeStages
from h3serve.pipelines.h3 import (
    EncodedMedia,
    GeneratedMedia,
    GenerationRequest,
    ModelRules,
)
from h3serve.pipelines.h3.lora_spec import LoraSpec
from h3serve.replicas import DeadlineExceeded, Engine, EngineDraining, EngineLimits, ReplicaSpec, Ticket, WorkerGroup
from h3serve.replicas.stage_worker import lower_thread_priority

logger = logging.getLogger(__name__)
DRAIN_POLL_S = 1.0  # how often a replica asks the controller whether it is being stopped
# how long a staged replica's warm-up waits for the conditioner stage to prepare its request: the conditioner
# may still be loading Qwen3-VL (tens of GB) when this replica's transformer is ready
STAGE_WARMUP_TIMEOUT_S = 900.0
TIMELINES_KEPT = 1024  # finished requests whose stage marks ``timelines`` returns (benchmarks.served_trace)


class ReplicaObserver(EngineMetrics):
    """The engine's observer in a replica: Prometheus, and each followed request's events (``REQUEST_EVENTS``) queued
    for the stream that follows it (``H3Replica.generate_video``). Called on the replica's event loop."""

    def __init__(self, ranks: int = 1):
        super().__init__(ranks)
        self.followers: dict[Ticket, asyncio.Queue[dict[str, Any]]] = {}

    def follow(self, ticket: Ticket) -> asyncio.Queue[dict[str, Any]]:
        return self.followers.setdefault(ticket, asyncio.Queue())

    def unfollow(self, ticket: Ticket) -> None:
        self.followers.pop(ticket, None)

    def on_request_event(self, ticket: Ticket, kind: str, fields: dict[str, Any]) -> None:
        queue = self.followers.get(ticket)
        if queue is not None:  # an image, or a video whose stream ended: nobody follows it
            queue.put_nowait({"event": kind, **fields})


class DrainWatch:
    """Whether Serve has started stopping this replica, from the controller's view of its deployment.

    A failing poll (a controller restarting) is logged and retried, and never starts a drain."""

    def __init__(self):
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._states = ReplicaStates(context.app_name, context.deployment)
        self._failing = False

    async def stopping(self) -> bool:
        try:
            states = await self._states.poll()
        except Exception as e:
            if not self._failing:  # once per streak: the controller may be restarting for a while
                logger.warning("cannot ask the Serve controller whether replica %s stops: %r", self.replica_id, e)
            self._failing = True
            return False
        self._failing = False
        return states.get(self.replica_id) == "STOPPING"  # a str enum: equal to its value


def unique_id(request_id: str | None, serving: dict) -> str | None:
    """The id a request is served under: the ingress's, or (when a request with that id is still here, e.g. two
    clients sent one X-Request-Id) that id with a suffix, so neither replaces the other's ticket."""
    if request_id is None or request_id not in serving:
        return request_id
    n = 2
    while f"{request_id}~{n}" in serving:
        n += 1
    return f"{request_id}~{n}"


class H3Replica:
    """One SP worker group and its engine (the builder makes it a Serve deployment with ``deployment_options``)."""

    @staticmethod
    def deployment_options(args: DeployArgs) -> dict[str, Any]:
        """The replica's Serve options: one placement-group bundle per SP rank (it takes bundle 0)."""
        bundles = args.placement_bundles()
        return dict(
            name="H3Replica",
            health_check_period_s=5,
            health_check_timeout_s=30,
            placement_group_bundles=bundles,
            placement_group_strategy="STRICT_PACK",
            ray_actor_options={"num_cpus": bundles[0].get("CPU", 0), "num_gpus": bundles[0].get("GPU", 0)},
            # the engine's bounded queue is the backpressure point (QueueFull -> 503), so Serve must route
            # past it rather than queue in front of it
            max_ongoing_requests=2 * args.engine.capacity,
            # the drain (module docstring) finishes active requests within drain_timeout_s; Serve kills the
            # replica this long after it started stopping it
            graceful_shutdown_timeout_s=args.engine.drain_timeout_s + DRAIN_MARGIN_S,
            # Serve re-checks for ongoing requests this often once stopping: the replica goes soon after its last
            graceful_shutdown_wait_loop_s=1.0,
            # scaled on its backlog (record_autoscaling_stats below) when args.autoscaling is set
            **({"autoscaling_config": args.autoscaling.serve_config()} if args.autoscaling is not None else {}),
        )

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor (a staged warm-up awaits a stage)
        self,
        spec: ReplicaSpec,
        limits: EngineLimits,
        conditioner: DeploymentHandle | None = None,
        decoder: DeploymentHandle | None = None,
        jobs: JobStoreArgs | None = None,
    ):
        """``conditioner``, ``decoder``: the stage deployments' handles (``args.stages``, and ``spec.stages``
        "remote"); None: in process (``spec.stages`` "local"). ``jobs``: the application's job store, which holds
        its run-time adapters (``adapter_sync``; None: this replica serves only those loaded through it)."""
        log_through_serve()
        staged = conditioner is not None and decoder is not None
        if staged != (spec.stages == "remote") or (conditioner is None) != (decoder is None):
            raise ValueError(
                f"spec.stages={spec.stages!r} needs {'both' if spec.stages == 'remote' else 'neither of the'} "
                f"conditioner and decoder handles; got conditioner={conditioner is not None}, "
                f"decoder={decoder is not None}"
            )
        self.spec = spec
        backend = spec.resolution.backend
        self.metrics = ReplicaObserver(spec.sp_degree)
        self.tickets: dict[str, Ticket] = {}  # request id -> its ticket, while this replica serves it
        self._watch: asyncio.Task | None = None
        self._load_gauges: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None
        # request id -> its stage marks (Ticket.marks, then encode/encoded, finished), the newest TIMELINES_KEPT
        self.finished: collections.OrderedDict[str, dict[str, float]] = collections.OrderedDict()
        # PNG/MP4 encoding: engine.encode_threads threads at engine.stage_nice (0: asyncio's default pool)
        self._encoder = (
            concurrent.futures.ThreadPoolExecutor(
                limits.encode_threads,
                thread_name_prefix="h3-encode",
                initializer=lower_thread_priority,
                initargs=(limits.stage_nice,),
            )
            if limits.encode_threads
            else None
        )
        try:
            # builds exactly the driver's backend; fails closed if it is incapable or this node cannot run it
            group = WorkerGroup.create(spec)
        except Exception as e:
            self._record_build_failure(backend, e)
            raise
        remote = None
        if conditioner is not None and decoder is not None:
            caller = serve.get_replica_context().replica_id.unique_id
            remote = ServeStages(conditioner, decoder, caller, self.metrics)
        self.stage_client = remote
        # the engine owns the group from here: it replaces it when a step breaks it (``h3serve.replicas.supervisor``)
        self.engine = Engine(group, limits, self.metrics, remote)
        if limits.preview.enabled:  # previews configured and impossible: refuse, as any other build failure
            try:
                await self._fit_preview(conditioner)
            except Exception as e:
                self._record_build_failure(backend, e, during="fitting the preview map")
                group.shutdown()
                raise
        if limits.warmup:
            try:
                seconds = self.engine.warm_up() if remote is None else await self._warm_up_through(remote)
            except Exception as e:
                self._record_build_failure(backend, e, during="its warm-up forward")
                group.shutdown()
                raise
            logger.info("H3 replica warmed up: one packed forward on every rank took %.2f s", seconds)
            if self.engine.clip_warm_up_due:  # the served size's first calls, before the first user's clip
                try:
                    await self.engine.warm_up_clip()
                except Exception as e:
                    self._record_build_failure(backend, e, during="its warm-up clip")
                    group.shutdown()
                    raise
        self.adapters: ReplicaAdapters | None = None
        if jobs is not None:  # the run-time adapters the other replicas serve, loaded and warmed up before serving
            app_name = serve.get_replica_context().app_name
            registry = AdapterRegistry(MediaStore(store_url(jobs, app_name), jobs.storage_options))
            self.adapters = ReplicaAdapters(self.engine, registry)
            await self.adapters.reconcile(fresh=True)
        logger.info("H3 replica ready: %s", spec.resolution.describe())

    async def _fit_preview(self, conditioner: DeploymentHandle | None) -> None:
        """The latent -> RGB preview map from the checkpoint's video VAE: here, or by the conditioner stage (which
        holds the VAE when this rank 0 holds none)."""
        pipeline = self.engine.pipeline
        if conditioner is None:
            await asyncio.to_thread(pipeline.fit_preview)
            return
        caller = serve.get_replica_context().replica_id.unique_id
        fitted = await asyncio.wait_for(conditioner.fit_preview.remote(caller), STAGE_WARMUP_TIMEOUT_S)
        pipeline.preview_map = fitted
        logger.info("preview map from the conditioner stage (fit RMSE %.1f of 255)", fitted.rmse)

    async def _warm_up_through(self, remote: ServeStages) -> float:
        """``Engine.warm_up`` for a rank 0 without a text encoder: the conditioner stage prepares the engine's
        warm-up request, then the engine runs its one packed forward on every rank; returns the forward's seconds."""
        request = self.engine.warmup_request()
        started = time.perf_counter()
        try:
            prepared = await asyncio.wait_for(remote.prepare(request, None), STAGE_WARMUP_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"the conditioner stage did not prepare the warm-up request within {STAGE_WARMUP_TIMEOUT_S:g} s"
            ) from None
        logger.info(
            "warm-up: prepared by the conditioner stage in %.2f s (%d bytes)",
            time.perf_counter() - started,
            prepared.nbytes,
        )
        return self.engine.warm_up(self.engine.pipeline.admit(request, prepared))

    @staticmethod
    def _record_build_failure(backend: str, error: Exception, during: str = "build") -> None:
        reason = getattr(error, "reason", type(error).__name__)
        ray.get(admission_recorder().record_build_failure.remote(backend, reason), timeout=RECORD_TIMEOUT_S)
        logger.error("H3 replica failed in %s with %s: %s", during, backend, error)

    def rules(self) -> ModelRules:
        """What the served checkpoint generates (the ingress validates requests against it)."""
        return self.engine.pipeline.rules

    async def validate(self, request: GenerationRequest, adapter: str | None = None) -> int:
        """Check a request without queueing it (video jobs are validated before they are accepted)."""
        await self._ensure(adapter)
        return self.engine.validate(request, adapter)

    async def _ensure(self, adapter: str | None) -> None:
        """The run-time adapters ``adapter`` names, loaded here from the registry if another replica loaded them."""
        if self.adapters is not None and adapter is not None:
            await self.adapters.ensure(adapter)

    async def load_adapter(self, name: str, spec: LoraSpec) -> int:
        """Serve LoRA adapter ``name`` from now (POST /v1/adapters); its bytes on this replica's rank. LoraError
        when it does not fit the checkpoint (naming the module) or lora_limits.max_adapter_bytes."""
        return await self.engine.load_adapter(name, spec)

    async def unload_adapter(self, name: str) -> None:
        """Refuse new requests on ``name`` now; return once its running requests finished and it is freed."""
        await self.engine.unload_adapter(name)

    # -- generation --------------------------------------------------------------------------
    async def generate_image(
        self,
        request: GenerationRequest,
        request_id: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
        deadline_at: float | None = None,
    ) -> bytes:
        """One still as PNG bytes (the ingress sends request i of n as f"{id}-{i}"; no id: the engine makes one).
        ``adapter``: the deployment's LoRA adapter it runs on (None: the base model). ``deadline_at``: the request's
        deadline as wall-clock time (``time.time()``), which the ingress sends: the wait for this replica counts."""
        self._watch_for_stop()
        deadline_s = self._deadline_s(request_id, deadline_s, deadline_at)
        await self._ensure(adapter)
        ticket = self._submit(request, request_id, deadline_s, priority, adapter, "png")
        try:
            # shielded: a caller that goes away (Serve cancels this call when its HTTP client disconnects) must not
            # cancel the ticket's future itself, so that _release cancels it through the engine, which counts it
            media = await asyncio.shield(ticket.future)
            return await self._encode(media, "png", ticket)
        except EngineDraining:
            logger.info("request %s: handed back unstarted, this replica drains", ticket.id)
            raise
        finally:  # the caller went away (or it finished): leave the pack
            self._release(ticket)

    async def generate_video(
        self,
        request: GenerationRequest,
        request_id: str | None = None,
        deadline_s: float | None = None,
        priority: int = 0,
        adapter: str | None = None,
        deadline_at: float | None = None,
    ):
        """Stream {"queued": True, "event": "queued", "position", "eta_s", "progress": [0, total]} once the engine
        accepted the request (QueueFull, EngineDraining, RequestError... raise before it), then the engine's events
        for it ({"event": kind, **fields, "progress": [done, total]}: ``replicas.REQUEST_EVENTS``: queue position
        changes, started, each step, previews as PNG bytes, decoding, the fragmented MP4's bytes while it decodes),
        then {"mp4": bytes}.
        """
        self._watch_for_stop()
        deadline_s = self._deadline_s(request_id, deadline_s, deadline_at)
        await self._ensure(adapter)
        ticket = self._submit(request, request_id, deadline_s, priority, adapter, "mp4")
        ticket.preview = True  # followed: previews under engine.preview
        ticket.stream = True  # and its MP4 streamed while it decodes (decoded here: a decoder stage answers it whole)
        events = self.metrics.follow(ticket)
        try:
            position, eta_s = self.engine.queue_position(ticket), self.engine.eta_s(ticket)
            yield {
                "queued": True,
                "event": "queued",
                "position": position,
                "eta_s": eta_s,
                "progress": list(ticket.progress),
            }
            while not ticket.future.done():
                event = asyncio.ensure_future(events.get())
                waiters: list[asyncio.Future[Any]] = [event, ticket.future]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    event.cancel()  # a cancelled Queue.get takes nothing
                    break
                yield {**event.result(), "progress": list(ticket.progress)}
            while not events.empty():  # what the engine reported before the end (decoding)
                yield {**events.get_nowait(), "progress": list(ticket.progress)}
            try:
                media = await ticket.future
            except EngineDraining:
                logger.info("request %s: handed back unstarted, this replica drains", ticket.id)
                raise
            yield {"progress": list(ticket.progress)}
            yield {"mp4": await self._encode(media, "mp4", ticket)}
        finally:  # the consumer went away (job deleted or cancelled, ingress gone), or it finished: leave the pack
            self.metrics.unfollow(ticket)
            self._release(ticket)

    @staticmethod
    def _deadline_s(request_id: str | None, deadline_s: float | None, deadline_at: float | None) -> float | None:
        """What is left of a request's deadline on arrival here; DeadlineExceeded when it passed on the way (in the
        router's queue, waiting for this replica to start). Wall-clock: the nodes' clocks must agree (NTP)."""
        if deadline_at is None:
            return deadline_s
        left = deadline_at - time.time()
        if left <= 0:
            raise DeadlineExceeded(f"request {request_id} reached this replica {-left:.1f} s after its deadline")
        return left if deadline_s is None else min(left, deadline_s)

    def _submit(
        self,
        request: GenerationRequest,
        request_id: str | None,
        deadline_s: float | None,
        priority: int,
        adapter: str | None = None,
        output: str | None = None,
    ) -> Ticket:
        # the engine logs it with its id; a priority out of range is its RequestError("priority") (HTTP 400)
        ticket = self.engine.submit(request, unique_id(request_id, self.tickets), deadline_s, priority, adapter, output)
        self.tickets[ticket.id] = ticket
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self.engine.cancel(ticket)
        if self.tickets.get(ticket.id) is ticket:
            del self.tickets[ticket.id]

    async def _encode(self, media: GeneratedMedia | EncodedMedia, kind: str, ticket: Ticket) -> bytes:
        """PNG or MP4 bytes off the event loop, timed as stage "encode" (a decoder stage encoded them already)."""
        if isinstance(media, EncodedMedia):
            assert media.kind == kind, (media.kind, kind)
            self._finish(ticket)
            return media.data
        started = time.perf_counter()
        ticket.marks["encode"] = time.monotonic()
        encode = media.png if kind == "png" else media.mp4
        data = await asyncio.get_running_loop().run_in_executor(self._encoder, encode)
        ticket.marks["encoded"] = time.monotonic()
        self._finish(ticket)
        seconds = time.perf_counter() - started
        self.metrics.on_stage("encode", seconds)
        logger.info("request %s: %s of %d bytes encoded in %.2f s", ticket.id, kind, len(data), seconds)
        return data

    def _finish(self, ticket: Ticket) -> None:
        self.finished[ticket.id] = dict(ticket.marks)
        while len(self.finished) > TIMELINES_KEPT:
            self.finished.popitem(last=False)

    def timelines(self, request_ids: list[str] | None = None) -> dict[str, dict[str, float]]:
        """The stage marks (time.monotonic() on this node: ``h3serve.replicas.engine.TICKET_MARKS``, then encode and
        encoded)
        of finished requests: those named, or all kept."""
        if request_ids is None:
            return dict(self.finished)
        return {i: self.finished[i] for i in request_ids if i in self.finished}

    def threads(self) -> dict:
        """This process's id, its torch threads and its Python threads' native ids by name (the step loop
        h3-engine_*, the stage worker h3-stages_*, encoders h3-encode_* or asyncio_*), for per-thread CPU time from
        /proc/<pid>/task/<tid>/stat; the threads not named here are native ones (torch's pool, Ray's core worker)."""
        import torch

        return {
            "pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "threads": {t.name: t.native_id for t in threading.enumerate() if t.native_id is not None},
        }

    # -- load: Serve's autoscaler and the gauges -------------------------------------------------
    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (args.autoscaling, ``h3serve/deploy/common/autoscaling.py``): backlog in
        row-steps,
        the measured row-step rate, the oldest wait of a request not started, the tightest deadline slack."""
        load = self.engine.load()
        return replica_stats(load.backlog_row_steps, load.row_step_rate, load.oldest_wait_s, load.deadline_slack_s)

    async def _report_load_forever(self) -> None:
        while True:  # Ray exports a gauge only while it is set again within each export interval
            self.metrics.on_load(self.engine.load())
            await asyncio.sleep(GAUGE_REFRESH_S)

    # -- drain ---------------------------------------------------------------------------------
    def _watch_for_stop(self) -> None:
        """Start the drain watch and the load gauges on the serving event loop (there is none in ``__init__``)."""
        if self._watch is None:
            self._watch = asyncio.get_running_loop().create_task(self._watch_forever())
        if self._load_gauges is None:
            self._load_gauges = asyncio.get_running_loop().create_task(self._report_load_forever())

    async def _watch_forever(self) -> None:
        watch = DrainWatch()
        while not await watch.stopping():
            await asyncio.sleep(DRAIN_POLL_S)
        self._start_drain("Serve is stopping this replica")

    def _start_drain(self, why: str) -> asyncio.Task:
        if self._drain is None:
            waiting, active = self.engine.queue_depth
            logger.info(
                "%s: draining (%d waiting handed back, %d active get up to %g s: %s)",
                why,
                waiting,
                active,
                self.engine.limits.drain_timeout_s,
                ", ".join(sorted(self.tickets)) or "no requests",
            )
            self._drain = asyncio.get_running_loop().create_task(self.engine.drain())
        return self._drain

    @property
    def draining(self) -> bool:
        return self._drain is not None

    # -- health, diagnostics, shutdown -----------------------------------------------------------
    async def check_health(self) -> None:
        """The engine's loop, its SP workers and its step watchdog (EngineStalled when steps stopped)."""
        self._watch_for_stop()  # Serve calls this every few seconds from the start
        await asyncio.to_thread(self.engine.check_health)
        if self.adapters is not None:  # adapters another replica added or removed: here too
            self.adapters.in_background()

    def diagnostics(self) -> dict:
        waiting, active = self.engine.queue_depth
        clip = self.engine.last_clip_warm_up
        return {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "pid": os.getpid(),
            "backend": self.spec.resolution.backend,
            "chosen_by": self.spec.resolution.chosen_by,
            "sp_degree": self.spec.sp_degree,
            "selector_calls": selector_calls(),
            "waiting": waiting,
            "active": active,
            "forwards": self.engine.stats.forwards,
            "stages": self.engine.remote is not None,  # conditioner and decoder deployments of their own
            # the models rank 0 holds and their parameters: the transformer partition(s) alone with stages
            "rank0_models": {
                name: sum(p.numel() for p in model.parameters())
                for name, model in self.engine.pipeline.held_models().items()
            },
            "handoff_bytes": dict(self.engine.stats.handoff_bytes),
            # stage calls made again because the stage replica died under them, by stage
            "stage_retries": dict(self.stage_client.retries) if self.stage_client is not None else {},
            "policy": self.engine.limits.policy,
            "preemptions": self.engine.stats.preemptions,
            # SP groups replaced after a step broke them (a rank failed past the step's agreement, died or hung)
            "group_replacements": self.engine.stats.group_replacements,
            # the current group's loads by rank (wall clock; a kept worker's is not there): rank 0 loads beside them
            "rank_loads": {rank: dataclasses.asdict(load) for rank, load in self.engine.group.loads.items()},
            # its decodes' tiles by who decoded them (decode_on_ranks): "own", "workers", "taken_back"
            "tiles_decoded": dict(self.engine.group.tiles_decoded),
            "duty_cycle": self.engine.stats.duty_cycle,
            "row_step_rate": self.engine.row_step_rate,  # rows of packed forward per second: what ETAs divide by
            "cancelled": dict(self.engine.stats.cancelled),
            "previews": self.engine.stats.previews,
            # the warm-up clip at the served size (engine.warmup_clip), what it ran and took; None: not run
            "warm_up_clip": None if clip is None else dataclasses.asdict(clip),
            "draining": self.draining,
            # what this replica serves now: request id -> how far it got (forwards 0: not started), its priority
            "requests": {
                request_id: {
                    "progress": list(ticket.progress),
                    "forwards": ticket.forwards,
                    "priority": ticket.priority,
                    "adapter": ticket.adapter,
                }
                for request_id, ticket in self.tickets.items()
            },
        }

    async def __del__(self):
        """Serve stops this replica once no request is ongoing: end the drain, release the SP workers (the group now
        serving: a replacement's, after a step broke the first)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            for task in (self._watch, self._load_gauges):
                if task is not None:
                    task.cancel()
            await self._start_drain("the replica is shutting down")
            engine.group.shutdown()
        encoder = getattr(self, "_encoder", None)
        if encoder is not None:
            encoder.shutdown(wait=False)
