"""The OpenAI-style HTTP API (FastAPI under @serve.ingress).

Every route is a method under ``@route``, which runs it through ``H3Ingress._call``: the request id,
bearer auth, error mapping to OpenAI's error shape (``h3serve.deploy.common.errors``), and request
metrics, in one place. Request bodies are read here and parsed by ``h3serve.deploy.ingress.bodies`` (not by FastAPI's
body
binding) so that every malformed body gets a 4xx that says what is wrong; the deployment's limits are checked by the
body models' validators, and ``h3serve.deploy.ingress.openapi`` documents them. Video jobs run in
``h3serve.deploy.jobs.video_jobs``, their event streams are ``h3serve.deploy.jobs.events``'s, the playground page at
``/`` is
``h3serve.deploy.ingress.playground``'s. Only ``PUBLIC_ROUTES`` answer without the token.

Backpressure: an ingress replica holds at most ``DeployArgs.generation_slots`` generation requests (what
the H3 replicas can queue and run together; more get 503 here) plus ``ingress.headroom`` other requests,
so job polls and /health never wait behind generations, and ``ingress.event_streams`` open event streams (each an
ongoing request for Serve while it lasts); ``ingress_options`` gives Serve those numbers.

Over 600 lines on purpose: every route is a method of the one Serve deployment class (``@serve.ingress`` binds
FastAPI's routes on it), each a few lines over what it calls (``h3serve.deploy.ingress.bodies``,
``h3serve.deploy.jobs``, the H3 replicas' handle). Groups that need only a few of the ingress's attributes live in
their own routers, methods of a base class ``H3Ingress`` inherits (a Protocol there says what they need of it):
remix and extend (``h3serve.deploy.ingress.derived``), the admin's adapter routes
(``h3serve.deploy.ingress.adapters``). The rest share the plumbing below (``_call``, ``_parse``, the tenant's
quotas, ``_queue_video``).
"""

import asyncio
import base64
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from h3serve.deploy.common.args import DRAIN_MARGIN_S, DeployArgs
from h3serve.deploy.common.errors import (
    DEADLINE_MESSAGE,
    QUEUE_FULL_MESSAGE,
    RETRY_AFTER_S,
    APIError,
    http_error,
)
from h3serve.deploy.common.metrics import RECORD_TIMEOUT_S, RequestMetrics, TenantMetrics, admission_recorder
from h3serve.deploy.common.retry import retry
from h3serve.deploy.common.serve_logging import audit, log_through_serve
from h3serve.deploy.ingress import adapters, content, derived
from h3serve.deploy.ingress.adapters import ADAPTERS_TTL_S, lora_of, steps_on
from h3serve.deploy.ingress.bodies import AnyBody, Body, ImagesBody, VideosBody, parse_body
from h3serve.deploy.ingress.cold_start import ColdStart
from h3serve.deploy.ingress.openapi import REQUEST_ID, document, redoc_page, swagger_page, swagger_sign_in_page
from h3serve.deploy.ingress.playground import playground_page
from h3serve.deploy.ingress.quotas import Quotas
from h3serve.deploy.ingress.routing import route
from h3serve.deploy.ingress.tenants import Tenant, Tenants
from h3serve.deploy.jobs.adapter_registry import AdapterRegistry
from h3serve.deploy.jobs.events import last_event_id
from h3serve.deploy.jobs.media_store import MediaStore, store_url
from h3serve.deploy.jobs.store import JobPolicy, JobStore, epoch_seconds
from h3serve.deploy.jobs.video_jobs import RESUBMIT, VideoJobs, caused_by, ingress_identity
from h3serve.deploy.jobs.webhooks import WebhookSender, job_webhook, resolve_secret
from h3serve.pipelines.h3 import GenerationRequest, ModelRules
from h3serve.replicas import EngineDraining

logger = logging.getLogger(__name__)
# A liveness probe answers without the token, and so does the playground page (a page a browser opens cannot send
# one: it holds no data and asks for the key, which its scripts then send as a bearer token); everything else needs
# it, the API docs included (they list this deployment's limits). Unknown routes answer 404 either way.
PUBLIC_ROUTES = ("/health", "/")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer an event stream


def resolve_api_key(env: str | None) -> str | None:
    """The bearer token, or None in explicit open mode; a configured but empty variable refuses to start."""
    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise RuntimeError(
            f"api_key_env is {env!r} but that environment variable is empty or unset: set it (a "
            "Kubernetes Secret, or `export` before `h3serve serve`), or set api_key_env: null in the "
            "serve config to run without auth"
        )
    return key


def unknown_job(video_id: str) -> APIError:
    """A 404 for an id the job store does not hold (cut to 80 characters: it is the caller's input, echoed)."""
    return APIError(404, f"no video job {video_id[:80]!r}", "video_id")


app = FastAPI(
    title="h3serve",
    version="0.2.0",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    description="OpenAI-style video (with stereo audio) and still generation with MiniMax-H3",
)
_metrics: RequestMetrics | None = None


def request_metrics() -> RequestMetrics:
    """One set of request metrics per process, shared by the ingress and FastAPI's own errors."""
    global _metrics
    if _metrics is None:
        _metrics = RequestMetrics()
    return _metrics


# FastAPI's own errors (unknown route, wrong method) in OpenAI's shape, counted under one route tag
@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    request_metrics().observe("unmatched", exc.status_code, None)
    return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    first = exc.errors()[0]
    request_metrics().observe("unmatched", 400, None)
    return APIError(400, f"{'.'.join(map(str, first['loc']))}: {first['msg']}").response()


def list_query(request: Request) -> tuple[int, str | None, str]:
    """GET /v1/videos's limit, after and order, parsed here so that auth comes first."""
    query = request.query_params
    limit = query.get("limit", "20")
    if not (limit.isdigit() and len(limit) <= 3 and 1 <= int(limit) <= 100):
        raise APIError(400, f"limit must be an integer from 1 to 100, got {limit[:20]!r}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be 'asc' or 'desc', got {order[:20]!r}", "order")
    return int(limit), query.get("after"), order


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id (Serve's proxy makes one, a uuid4, when the client sent none), or a 400."""
    given = request.headers.get("x-request-id")
    if given is None:  # not through Serve's proxy
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1 to 64 characters of A-Z a-z 0-9 . _ : -", "X-Request-Id")
    return given


def bearer_token(authorization: str) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip(" ") if scheme.lower() == "bearer" else None


def ingress_options(args: DeployArgs) -> dict[str, Any]:
    """H3Ingress's Serve options: room for every generation the H3 replicas can hold plus ``headroom`` other
    requests; ``headroom`` more wait at each proxy, and beyond that the proxy answers 503 with Retry-After.
    A stopping ingress gives its open image requests as long as a draining H3 replica gives their generation."""
    return dict(
        max_ongoing_requests=args.generation_slots + args.ingress.headroom + args.ingress.event_streams,
        max_queued_requests=args.ingress.headroom,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=float(RETRY_AFTER_S)),
        graceful_shutdown_timeout_s=args.engine.drain_timeout_s + DRAIN_MARGIN_S,
    )


# methods of H3Ingress's bases, bound to it by Serve: remix and extend (DerivedVideos), the admin's adapter routes
app.include_router(derived.router)
app.include_router(adapters.router)


@serve.deployment(name="H3Ingress")
@serve.ingress(app)
class H3Ingress(derived.DerivedVideos, adapters.AdapterRoutes):
    def __init__(self, replica: DeploymentHandle, args: DeployArgs, rules: ModelRules | None = None):
        """``rules``: the checkpoint's, read by the driver (given when the replicas scale to zero, so that a video job
        is checked and accepted while none runs); None: asked of a replica when first needed."""
        log_through_serve()  # the ingress's own lines (request ids, job hand-backs) into Serve's replica log
        # refuses to start before serving anything: an empty api_key_env, a bad auth.keys_file
        self.tenants = Tenants(args.auth.keys_file, resolve_api_key(args.api_key_env), args.auth.reload_s)
        self.tenant_metrics = TenantMetrics()
        self.quotas = Quotas(self.tenant_metrics.rejected)
        self.replica, self.model_name, self.limits = replica, args.served_model_name, args.limits
        self.cache_tiers, self.cache_default = args.cache_tiers, args.engine.step_cache.default
        # each LoRA adapter is a model id of its own: "<served_model_name>:<adapter name>"
        self.loras = dict(args.loras)
        self.lora_specs = args.lora_specs  # the adapters and the limits on composing them (a request's `lora`)
        self.adapter_ids = {f"{self.model_name}:{name}": name for name in self.loras}
        self.deploy_loras = dict(args.loras)  # never changed at run time; the registry's are added to them
        self.metrics = request_metrics()
        store = MediaStore(store_url(args.jobs, serve.get_replica_context().app_name), args.jobs.storage_options)
        store.check()  # an unusable store refuses to start, like a missing token
        # the run-time adapters every ingress and H3Replica of this app serves (POST/DELETE /v1/adapters write it)
        self.adapter_registry = AdapterRegistry(store, ADAPTERS_TTL_S)
        self.adapters_generation = 0
        policy = JobPolicy(
            ttl_s=args.jobs.ttl_s,
            max_bytes=args.jobs.max_bytes,
            lease_s=args.jobs.lease_s,
            max_unfinished=args.jobs.max_unfinished,
            max_attempts=args.jobs.max_attempts,
            idempotency_window_s=args.jobs.idempotency_window_s,
        )
        self.webhooks = args.jobs.webhooks
        secret = resolve_secret(self.webhooks)  # an empty secret_env refuses to start
        sender = None if secret is None else WebhookSender(self.webhooks, secret)
        self.videos = VideoJobs(JobStore(store, policy, runner=ingress_identity()), replica, self.metrics, sender)
        self.generation_slots, self.generations = args.generation_slots, 0
        self.event_streams, self.streams = args.ingress.event_streams, 0  # at most, and open now
        self._rules: ModelRules | None = rules
        self._openapi: dict | None = None
        autoscaling = args.autoscaling
        self.cold: ColdStart | None = None  # with min_replicas 0: whether a replica runs, and waking one
        if autoscaling is not None and autoscaling.min_replicas == 0:
            app_name = serve.get_replica_context().app_name
            self.cold = ColdStart(app_name, replica, autoscaling.expected_load_s)
            self.cold_images = autoscaling.cold_images

    async def _scaled_to_zero(self) -> bool:
        """Whether the H3 replicas scale to zero and none runs now."""
        return self.cold is not None and await self.cold.running() == 0

    async def check_health(self) -> None:
        """Serve calls this every few seconds from the start: the sweeper runs without waiting for traffic."""
        self.videos.start_sweeper()

    # -- plumbing ------------------------------------------------------------------------
    async def _call(self, route: str, request: Request, handler: Callable[[], Awaitable[Any]]):
        """Request id, auth, then ``handler``; errors become OpenAI-shaped answers (their causes logged under the
        request id); every answer is timed and counted. Serve's access log names each request by the same id:
        its proxy takes the client's X-Request-Id, or makes one, and returns it in the answer's header."""
        started, status, request_id = time.perf_counter(), 200, "-"
        request.state.arrived = time.monotonic()  # timeout_s counts from here
        request.state.tenant = None
        self.videos.start_sweeper()
        try:
            request_id = request.state.request_id = request_id_of(request)
            self._authorize(route, request)
            if route not in PUBLIC_ROUTES:  # /health answers whatever the store does
                await adapters.refresh_adapters(self)
            result = await handler()
            status = getattr(result, "status_code", 200)
            return result
        except Exception as e:
            error = e if isinstance(e, APIError) else http_error(e, f"request {request_id} ({route})")
            status = error.status
            if route == "/docs" and status == 401 and "text/html" in request.headers.get("accept", ""):
                # a browser opening /docs cannot send the header: a page that asks for the key (and holds no data)
                return HTMLResponse(swagger_sign_in_page("h3serve API"), status_code=401, headers=error.headers)
            return error.response()
        finally:  # a generation's model id once it was resolved (a bounded set: the config's), else ""
            self.metrics.observe(route, status, time.perf_counter() - started, getattr(request.state, "model", ""))
            if self.tenants.enabled:
                tenant = request.state.tenant
                self.tenant_metrics.observe(tenant.name if tenant is not None else "", route, status)

    def _authorize(self, route: str, request: Request) -> None:
        """The request's tenant into ``request.state.tenant`` (``h3serve.deploy.ingress.tenants``), or a 401."""
        if not self.tenants.enabled or route in PUBLIC_ROUTES:
            return
        tenant = self.tenants.authenticate(bearer_token(request.headers.get("authorization", "")))
        if tenant is None:
            raise APIError(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
        request.state.tenant = tenant

    @staticmethod
    def _owner(request: Request) -> str | None:
        """The tenant whose jobs the request may see; None: every job (an admin, or a server without tenants)."""
        tenant: Tenant | None = request.state.tenant
        return None if tenant is None or tenant.admin else tenant.name

    @staticmethod
    def _tenant_name(request: Request) -> str | None:
        tenant: Tenant | None = request.state.tenant
        return None if tenant is None else tenant.name

    @staticmethod
    def _scope(route: str, request: Request) -> str:
        """An Idempotency-Key's scope: each tenant's keys are its own (another's same key is another request)."""
        tenant: Tenant | None = request.state.tenant
        return route if tenant is None else f"{route}:{tenant.name}"

    def _admit(self, request: Request, body: Body) -> Tenant | None:
        """The tenant's priority cap (400) and request rate (429) for a generation request."""
        tenant: Tenant | None = request.state.tenant
        self.quotas.check_priority(tenant, body.priority)
        self.quotas.check_rate(tenant)
        return tenant

    async def _usage(self, tenant: Tenant) -> tuple[int, int]:
        return await self.videos.usage(tenant.name)

    async def _body(self, request: Request) -> bytes:
        """The request body, refusing more than ``max_body_bytes`` before reading it all."""
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is {declared} bytes; this server takes at most {limit}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is over {limit} bytes, the most this server takes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _parse(self, request: Request, model: type[AnyBody], uploads: tuple[str, ...] = ()) -> AnyBody:
        """A JSON object, or (where ``uploads`` are allowed) a multipart/urlencoded form, validated."""
        raw = await self._body(request)
        return await parse_body(request.headers, raw, model, uploads, self.limits, self.cache_tiers)

    async def rules(self) -> ModelRules:
        if self._rules is None and self.cold is not None and self.cold.rules is not None:
            self._rules = self.cold.rules
        if self._rules is None:  # while no replica runs, this waits for one (the call itself starts it)
            self._rules = await self.replica.rules.remote()
        return self._rules

    @contextlib.contextmanager
    def _generation(self, request: Request):
        """Count a valid generation request while it is open (an image: to its PNG; a video: until queued);
        at ``generation_slots`` a further one is refused, so the headroom stays free for polls and /health."""
        if self.generations >= self.generation_slots:
            logger.warning(
                "request %s: 503, this ingress holds %d generations", request.state.request_id, self.generations
            )
            raise APIError(503, QUEUE_FULL_MESSAGE, headers={"Retry-After": RETRY_AFTER_S})
        self.generations += 1
        try:
            yield
        finally:
            self.generations -= 1

    @staticmethod
    def _deadline_s(request: Request, timeout_s: float | None) -> float | None:
        """What is left of the request's ``timeout_s`` (which counts from its arrival) for the replica."""
        if timeout_s is None:
            return None
        left = timeout_s - (time.monotonic() - request.state.arrived)
        if left <= 0:
            raise APIError(504, DEADLINE_MESSAGE, "timeout_s", kind="timeout")
        return left

    @property
    def model_ids(self) -> list[str]:
        """The ids a request's ``model`` may name: the base model, then one per LoRA adapter."""
        return [self.model_name, *self.adapter_ids]

    def _adapter(self, request: Request, body: Body) -> str | None:
        """The LoRA adapters the request runs on (``composition_key``: the one ``body.model`` names, or
        ``body.lora``'s list; None: the base model, also when omitted); 400 for another id."""
        model = body.model
        if model in (None, "", self.model_name):
            request.state.model = self.model_name
            return lora_of(body, None, self.lora_specs)
        if model not in self.adapter_ids:
            raise APIError(
                400, f"model {model[:80]!r} is not served here; valid ids: {', '.join(self.model_ids)}", "model"
            )
        request.state.model = model
        return lora_of(body, self.adapter_ids[model], self.lora_specs)

    def _fields(self, body: Body, adapter: str | None) -> dict[str, Any]:
        """The body's ``GenerationRequest`` fields on ``adapter``: a few-step adapter's own steps unless the body
        gives some (others: 400 naming both), then the deployment's default_steps."""
        return {**body.generation(), "num_inference_steps": steps_on(body, adapter, self.lora_specs)}

    # -- images: a still of the shortest clip ----------------------------------------------------
    @app.post("/v1/images/generations")
    @route("/v1/images/generations")
    async def images(self, request: Request):
        body = await self._parse(request, ImagesBody)
        self._admit(request, body)
        async with self.videos.idempotent(request.headers, self._scope("images", request), body) as once:
            if once.replay is not None:
                return once.replay
            once.response = await self._images(request, body)
        return once.response

    async def _images(self, request: Request, body: ImagesBody) -> dict:
        adapter = self._adapter(request, body)
        base = self._fields(body, adapter)
        self._deadline_s(request, body.timeout_s)  # 504 before anything runs when it already passed
        if await self._scaled_to_zero():
            assert self.cold is not None
            self.cold.wake()  # a replica starts for this request, whether it waits for it or not
            if self.cold_images == "refuse":
                retry = self.cold.retry_after_s()
                raise APIError(
                    503,
                    f"no model replica is running (scaled to zero); one is starting, expected in about {retry} s",
                    headers={"Retry-After": str(retry)},
                )
        tenant: Tenant | None = request.state.tenant
        if tenant is not None:
            base["tenant"] = tenant.name
        row_steps = await self._row_steps(GenerationRequest(**base)) * body.n if tenant is not None else 0
        quota = self.quotas.hold(tenant, row_steps, lambda: self._usage(tenant), job=False)  # type: ignore[arg-type]
        async with quota:
            with self._generation(request):
                if tenant is not None:
                    self.tenant_metrics.admitted(tenant.name, row_steps)
                pngs = await self._images_of(request, body, base, adapter)
        return {
            "created": epoch_seconds(),
            "data": [{"b64_json": base64.b64encode(png).decode(), "revised_prompt": None} for png in pngs],
        }

    async def _row_steps(self, generation: GenerationRequest) -> int:
        """A request's work as a tenant's quota counts it: its media's rows (the prompt's not known before it is
        encoded) x its steps."""
        return (await self.rules()).rows(generation, 0) * generation.num_inference_steps

    async def _images_of(self, request: Request, body: ImagesBody, base: dict, adapter: str | None) -> list[bytes]:
        """n images are n clips: the engine packs them into the same forwards."""
        calls = [
            asyncio.ensure_future(
                self._image(request, body, GenerationRequest(**{**base, "seed": body.seed + i}), i, adapter)
            )
            for i in range(body.n)
        ]
        try:
            return list(await asyncio.gather(*calls))
        except BaseException:
            for call in calls:
                call.cancel()
            raise

    async def _image(
        self, request: Request, body: ImagesBody, generation: GenerationRequest, i: int, adapter: str | None
    ) -> bytes:
        """Image i's PNG; one a draining replica hands back unstarted (a scale-down) is sent again, to another."""

        async def generate() -> bytes:
            deadline_s = self._deadline_s(request, body.timeout_s)  # wall-clock to the replica: its wait counts
            deadline_at = None if deadline_s is None else time.time() + deadline_s
            call = self.replica.generate_image.remote(
                generation, f"{request.state.request_id}-{i}", None, body.priority, adapter, deadline_at=deadline_at
            )
            try:
                return await call
            except asyncio.CancelledError:
                call.cancel()
                raise

        def again(error: Exception, attempt: int, wait_s: float) -> None:
            logger.info("request %s-%d: handed back by a draining replica; again", request.state.request_id, i)

        return await retry(generate, RESUBMIT, lambda e: caused_by(e, EngineDraining), again)

    # -- videos --------------------------------------------------------------------------------
    @app.post("/v1/videos")
    @route("/v1/videos")
    async def create_video(self, request: Request):
        body = await self._parse(request, VideosBody, uploads=("input_reference", "last_reference"))
        self._admit(request, body)
        async with self.videos.idempotent(request.headers, self._scope("videos", request), body) as once:
            if once.replay is not None:  # a retry: the same job, as it reads now
                return await self.videos.get(once.replay["id"]) or once.replay
            once.response = await self._create_video(request, body)
        return once.response

    async def _video_rules(self) -> tuple[bool, ModelRules]:
        """Whether the replicas are at zero (then a job is accepted now, and runs once a replica serves), and the
        model's rules (without the driver's, waking a replica and waiting for its)."""
        cold = await self._scaled_to_zero()
        if cold and self._rules is None:
            assert self.cold is not None
            self.cold.wake()  # no rules from the driver: this request waits for the first replica's
        return cold, await self.rules()

    async def _create_video(self, request: Request, body: VideosBody) -> dict:
        cold, rules = await self._video_rules()
        if body.fps is not None and body.fps != rules.fps:
            raise APIError(400, f"fps: MiniMax-H3 generates at a fixed {rules.fps} fps", "fps")
        adapter = self._adapter(request, body)
        generation = self._fields(body, adapter)
        if body.seconds is not None:
            generation["num_frames"] = rules.frames_for_seconds(body.seconds)
        generation_request = GenerationRequest(
            **generation,
            first_frame=body.input_reference,
            last_frame=body.last_reference,
            references=tuple(body.references),
            tenant=None if request.state.tenant is None else request.state.tenant.name,
        )
        return await self._queue_video(request, body, generation_request, adapter, cold, rules)

    async def _queue_video(
        self,
        request: Request,
        body: VideosBody | derived.DerivedBody,
        generation_request: GenerationRequest,
        adapter: str | None,
        cold: bool,
        rules: ModelRules,
        links: dict[str, Any] | None = None,
    ) -> dict:
        """Check ``generation_request``, record it as a queued job under the tenant's quota and queue it; its video
        object (with ``links``: remix's and extend's source job)."""
        if not cold:  # refuse now, not in a failed job later (cold: the replica refuses it, and the job fails as 400)
            await self.replica.validate.remote(generation_request, adapter)
        num_frames = generation_request.num_frames or rules.min_frames
        width, height = generation_request.width, generation_request.height
        if not width:
            width, height = rules.default_canvas
        video = {
            "id": f"video_{uuid.uuid4().hex}",
            "object": "video",
            "model": request.state.model,
            "status": "queued",
            "progress": 0,
            "created_at": epoch_seconds(),
            "completed_at": None,
            "expires_at": None,
            "seconds": f"{num_frames / rules.fps:g}",
            "size": f"{width}x{height}",
            "prompt": body.prompt,
            "error": None,
            **(links or {}),
        }
        deadline_s = self._deadline_s(request, body.timeout_s)
        webhook = await job_webhook(body.webhook, self.webhooks, self.videos.webhooks is not None)
        tenant: Tenant | None = request.state.tenant
        row_steps = rules.rows(generation_request, 0) * generation_request.num_inference_steps
        async with self.quotas.hold(tenant, row_steps, lambda: self._usage(tenant), job=True):  # type: ignore[arg-type]
            with self._generation(request):
                # raises (-> 503 + Retry-After) when no replica can queue it: a job is recorded only once accepted
                accepted = await self.videos.submit(
                    video,
                    generation_request,
                    request.state.request_id,
                    deadline_s,
                    body.priority,
                    adapter,
                    not cold,
                    tenant=generation_request.tenant,
                    row_steps=row_steps,
                    webhook=webhook,
                )
        if accepted and tenant is not None:
            self.tenant_metrics.admitted(tenant.name, row_steps)
        audit(
            generation_request.tenant,
            video["id"],
            "create",
            "queued" if accepted else "refused: store full",
            request.state.request_id,
        )
        if not accepted:
            raise APIError(
                429,
                f"{self.videos.store.policy.max_unfinished} video jobs are unfinished; retry later",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        return video

    async def _job(self, request: Request, video_id: str) -> dict:
        """The job, when the request's tenant may see it; else a 404 as for no job at all."""
        video = await self.videos.get(video_id, self._owner(request))
        if video is None:
            raise unknown_job(video_id)
        return video

    @app.get("/v1/videos")
    @route("/v1/videos:list")
    async def list_videos(self, request: Request):
        limit, after, order = list_query(request)
        videos = await self.videos.list(self._owner(request))
        if order == "asc":
            videos.reverse()
        if after is not None:
            ids = [v["id"] for v in videos]
            if after not in ids:
                raise APIError(400, f"after: no video job {after[:80]!r}", "after")
            videos = videos[ids.index(after) + 1 :]
        page = videos[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(videos) > limit,
        }

    @app.get("/v1/videos/{video_id}")
    @route("/v1/videos/{id}")
    async def get_video(self, request: Request, video_id: str):
        return await self._job(request, video_id)

    @app.get("/v1/videos/{video_id}/content")
    @route("/v1/videos/{id}/content")
    async def video_content(self, request: Request, video_id: str):
        """The MP4 or an image of it (``?variant=``), with ETag and Range (``h3serve.deploy.ingress.content``)."""
        variant = content.variant_of(request)
        video = await self._job(request, video_id)
        live = self.videos.live.get(video_id) if variant == "video" else None
        replica = (self.videos.store.runner or {}).get("replica", "")
        if video["status"] != "completed" and live is not None:  # decoding here: its MP4 as it is made
            return content.streamed(live.read(), replica)
        if video["status"] == "in_progress" and variant == "video" and video_id not in self.videos.tasks:
            stored = await self.videos.live_from_store(video_id)  # decoding on another ingress replica
            if stored is not None:
                return content.streamed(stored, replica)
        if video["status"] != "completed":
            raise content.not_ready(video, variant)
        media = await self.videos.media(video_id, variant)
        if media is None:  # removed (TTL, byte cap, DELETE) since the record was read, or never made
            raise content.missing(video, variant)
        return content.answer(request, *media, variant)

    @app.delete("/v1/videos/{video_id}")
    @route("/v1/videos/{id}:delete")
    async def delete_video(self, request: Request, video_id: str):
        if not await self.videos.delete(video_id, self._owner(request)):
            raise unknown_job(video_id)
        audit(self._tenant_name(request), video_id, "delete", "deleted", request.state.request_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{video_id}/cancel")
    @route("/v1/videos/{id}/cancel")
    async def cancel_video(self, request: Request, video_id: str):
        """sglang's route: a queued job leaves its replica's queue, a running one its pack at the next step
        boundary; the job reads cancelled (409 once it finished)."""
        video = await self.videos.cancel(video_id, self._owner(request))
        if video is None:
            raise unknown_job(video_id)
        audit(self._tenant_name(request), video_id, "cancel", video["status"], request.state.request_id)
        return video

    @app.get("/v1/videos/{video_id}/events")
    @route("/v1/videos/{id}/events")
    async def video_events(self, request: Request, video_id: str):
        """Server-Sent Events of the job (``h3serve.deploy.jobs.events``), resumed after ``Last-Event-ID`` when it is
        sent."""
        after = last_event_id(request.headers.get("last-event-id"))
        video = await self._job(request, video_id)
        if self.streams >= self.event_streams:
            raise APIError(
                503,
                f"this server holds {self.event_streams} open event streams; poll GET /v1/videos/{{id}} or retry later",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        events = await self.videos.event_stream(video_id, video, after)  # the same stream on every ingress replica
        return StreamingResponse(self._counted(events), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _counted(self, events):
        """An event stream, counted among the open ones while it lasts (a client that goes away ends it)."""
        self.streams += 1
        try:
            async for chunk in events:
                yield chunk
        finally:
            self.streams -= 1

    # -- models, health, docs --------------------------------------------------------------------
    @app.get("/v1/models")
    @route("/v1/models")
    async def models(self, request: Request):
        base = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "h3serve",
            # what a generation request's `cache` field may name, and what it gets when it names none
            "cache_tiers": self.cache_tiers,
            "cache_default": self.cache_default,
        }
        adapters = [
            {
                **base,
                "id": model_id,
                "parent": self.model_name,  # a LoRA adapter over the base model's weights, in the same packs
                "num_inference_steps": self.loras[name].steps,  # its default (None: the deployment's)
            }
            for model_id, name in self.adapter_ids.items()
        ]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/v1/me")
    @route("/v1/me")
    async def me(self, request: Request):
        """Who the key belongs to: its tenant, role and limits (the playground shows the tenant). Without tenants
        (open mode) every caller sees every job, as an admin does."""
        tenant: Tenant | None = request.state.tenant
        return (tenant or Tenant(name="", role="admin")).public() | {"auth": self.tenants.enabled}

    @app.get("/health")
    @route("/health")
    async def health(self, request: Request):
        if await self._scaled_to_zero():  # asking a replica would start one: an idle deployment stays at zero
            return {"status": "ok", "model": self.model_name, "replicas": 0}
        try:
            info = await asyncio.wait_for(self.replica.diagnostics.remote(), timeout=10)
        except Exception as e:  # what went wrong is for the log: this route answers without a token
            logger.warning("request %s: /health: no H3 replica answered: %r", request.state.request_id, e)
            body = {"status": "unavailable", "error": "no model replica answered"}
            return JSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_S})
        return {"status": "ok", "model": self.model_name, "backend": info["backend"]}

    @app.get("/v1/stats")
    @route("/v1/stats")
    async def stats(self, request: Request):
        """The server's own figures for the playground's live panel: one H3 replica's engine (queue, duty cycle,
        row-step rate, cancels), this ingress's open jobs and event streams, and admission failures so far. While the
        deployment is at zero, ``replica`` is null: asking one would start it (the playground polls this)."""
        zero = await self._scaled_to_zero()
        info = None if zero else await asyncio.wait_for(self.replica.diagnostics.remote(), timeout=10)
        try:
            log = await asyncio.wait_for(admission_recorder().decisions_log.remote(), timeout=RECORD_TIMEOUT_S)
            admission_failures: int | None = sum(1 for d in log if d.get("outcome") == "rejected")
        except Exception as e:  # the panel shows what it has
            logger.warning("request %s: /v1/stats: no admission log: %r", request.state.request_id, e)
            admission_failures = None
        return {
            "object": "stats",
            "model": self.model_name,
            "replica": None
            if info is None
            else {
                key: info[key]
                for key in (
                    "waiting",
                    "active",
                    "duty_cycle",
                    "row_step_rate",
                    "forwards",
                    "preemptions",
                    "cancelled",
                    "previews",
                    "backend",
                    "policy",
                )
            },
            "admission_failures": admission_failures,
            "video_jobs_running_here": len(self.videos.tasks),
            "event_streams_open": self.streams,
        }

    @app.get("/")
    @route("/")
    async def playground(self, request: Request):
        """The playground page (``h3serve/deploy/ingress/playground/``): plain HTML, CSS and JS, nothing fetched from
        elsewhere."""
        return HTMLResponse(playground_page(auth=self.tenants.enabled, model=self.model_name))

    @app.get("/openapi.json")
    @route("/openapi.json")
    async def openapi(self, request: Request):
        return await self._document(request)

    # The pages hold the document itself: a browser fetching /openapi.json would not send the token
    @app.get("/docs")
    @route("/docs")
    async def docs(self, request: Request):
        return HTMLResponse(swagger_page(await self._document(request), title="h3serve API"))

    @app.get("/redoc")
    @route("/redoc")
    async def redoc(self, request: Request):
        return HTMLResponse(redoc_page(await self._document(request), title="h3serve API"))

    async def _document(self, request: Request) -> dict:
        if self._openapi is None:
            root = request.scope.get("root_path", "")  # the application's route prefix
            base = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
                servers=[{"url": root}] if root else None,
            )
            bodies: dict[str, type[BaseModel]] = {
                "POST /v1/images/generations": ImagesBody,
                "POST /v1/videos": VideosBody,
                **derived.BODIES,
            }
            public = PUBLIC_ROUTES if self.tenants.enabled else None
            self._openapi = document(
                base,
                bodies,
                self.limits,
                await self.rules(),
                public_routes=public,
                cache_tiers=(self.cache_tiers, self.cache_default),
                model_ids=self.model_ids,
            )
        return self._openapi

    async def __del__(self):
        """Serve stops this replica: fail its running jobs now rather than after their lease."""
        if hasattr(self, "videos"):  # else the constructor refused
            await self.videos.close()
