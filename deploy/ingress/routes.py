"""The OpenAI-style HTTP API (FastAPI under @serve.ingress).

Every route is a method under ``@route``, which runs it through ``H3Ingress._call``: the request id,
bearer auth, error mapping to OpenAI's error shape (``deploy.common.errors``), and request
metrics, in one place. Request bodies are parsed here (not by FastAPI's body binding) so that every
malformed body gets a 4xx that says what is wrong; the deployment's limits are checked by the body
models' validators, and ``deploy.ingress.openapi`` documents them. Video jobs run in
``deploy.jobs.video_jobs``, their event streams are ``deploy.jobs.events``'s, the playground page at ``/`` is
``deploy.ingress.playground``'s. Only ``PUBLIC_ROUTES`` answer without the token.

Backpressure: an ingress replica holds at most ``DeployArgs.generation_slots`` generation requests (what
the H3 replicas can queue and run together; more get 503 here) plus ``ingress.headroom`` other requests,
so job polls and /health never wait behind generations, and ``ingress.event_streams`` open event streams (each an
ongoing request for Serve while it lasts); ``ingress_options`` gives Serve those numbers.
"""

import asyncio
import base64
import binascii
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from ray import serve
from ray.serve.config import BackpressureConfig
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy.common.args import DRAIN_MARGIN_S, DeployArgs, JobStoreArgs, RequestLimits
from deploy.common.errors import (
    DEADLINE_MESSAGE,
    QUEUE_FULL_MESSAGE,
    RETRY_AFTER_S,
    APIError,
    FieldError,
    http_error,
    invalid,
)
from deploy.common.metrics import RECORD_TIMEOUT_S, RequestMetrics, admission_recorder
from deploy.common.serve_logging import log_through_serve
from deploy.ingress.cold_start import ColdStart
from deploy.ingress.openapi import REQUEST_ID, document, redoc_page, swagger_page
from deploy.ingress.playground import playground_page
from deploy.jobs.events import follow_record, last_event_id
from deploy.jobs.media_store import MediaStore
from deploy.jobs.store import JobPolicy, JobStore, epoch_seconds
from deploy.jobs.video_jobs import RESUBMIT_BACKOFF_S, RESUBMIT_FOR_S, VideoJobs, caused_by
from pipelines.h3 import GenerationRequest, ModelRules, Reference
from pipelines.h3.lora_spec import asked_steps, check_request_steps
from pipelines.h3.paths import cache_dir
from pipelines.h3.uploads import image_problem
from replicas import MAX_PRIORITY, MIN_PRIORITY, EngineDraining

logger = logging.getLogger(__name__)
# Not parameters of a guidance-distilled model: refused by name rather than silently ignored.
DISTILLED = ("guidance_scale", "negative_prompt")
# A liveness probe answers without the token, and so does the playground page (a page a browser opens cannot send
# one: it holds no data and asks for the key, which its scripts then send as a bearer token); everything else needs
# it, the API docs included (they list this deployment's limits). Unknown routes answer 404 either way.
PUBLIC_ROUTES = ("/health", "/")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may buffer an event stream
MAX_SEED = 2**63 - 1  # GenerationRequest's seed is a signed 64-bit integer
# a form field carries text: an optional sign and at most a few digits (no int of thousands of digits is built)
FORM_INTEGER = re.compile(r"[+-]?[0-9]{1,4}")


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


# -- request bodies ----------------------------------------------------------------------------
def limits_of(info: ValidationInfo) -> RequestLimits:
    """The deployment's limits, which every body is validated under (``context={"limits": ...}``)."""
    if not isinstance(info.context, dict) or "limits" not in info.context:
        raise TypeError("request bodies are validated under the deployment's limits: context={'limits': ...}")
    return info.context["limits"]


class Body(BaseModel):
    """Fields every generation request shares, checked against the deployment's ``RequestLimits``."""

    model_config = ConfigDict(extra="ignore")  # OpenAI fields h3serve does not use (quality, style, user...)

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = Field(default=None, description="WIDTHxHEIGHT; default: the model's own canvas")
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    # None is replaced by the deployment's default_steps
    num_inference_steps: int | None = Field(default=None, ge=2, validate_default=True)
    # the request's deadline, seconds from arrival; None: the engine's default_deadline_s
    timeout_s: float | None = Field(default=None, gt=0)
    # higher runs first under the deployment's "priority" policy (engine.policy); the other policies ignore it
    priority: int = Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    # step caching: "off" or one of the deployment's tiers (engine.step_cache); None: the deployment's default
    cache: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _unicode(cls, prompt: Any) -> Any:
        """JSON may escape a lone surrogate ("\\ud800"): no text encoder takes it, so say so by name."""
        try:
            if isinstance(prompt, str):
                prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (it holds a lone surrogate)") from None
        return prompt

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: str, info: ValidationInfo) -> str:
        if not prompt.strip():
            raise ValueError("must not be blank")
        limit = limits_of(info).max_prompt_chars
        if len(prompt) > limit:
            raise ValueError(f"is {len(prompt)} characters; the limit is {limit}")
        return prompt

    @field_validator("size")
    @classmethod
    def _size(cls, size: str | None, info: ValidationInfo) -> str | None:
        if size is not None:
            width, height = parse_size(size)
            limit = limits_of(info).max_pixels
            if not 0 < width * height <= limit:
                raise ValueError(f"size {width}x{height} is {width * height} pixels; this server allows 1..{limit}")
        return size

    @field_validator("num_inference_steps")
    @classmethod
    def _steps(cls, steps: int | None, info: ValidationInfo) -> int:
        limits = limits_of(info)
        steps = limits.default_steps if steps is None else steps
        if steps > limits.max_steps:
            raise ValueError(f"num_inference_steps={steps} exceeds this server's limit of {limits.max_steps}")
        return steps

    @field_validator("priority", mode="before")
    @classmethod
    def _priority(cls, priority: Any, info: ValidationInfo) -> int:
        """A JSON integer (not a bool, a float or a string), or in a form the text of one, within the range."""
        form = isinstance(info.context, dict) and info.context.get("form", False)
        if isinstance(priority, str) and form and FORM_INTEGER.fullmatch(priority.strip()):
            priority = int(priority)
        if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
            shown = repr(priority)[:40]
            raise ValueError(f"must be an integer from {MIN_PRIORITY} to {MAX_PRIORITY} (default 0), got {shown}")
        return priority

    @field_validator("cache")
    @classmethod
    def _cache(cls, cache: str | None, info: ValidationInfo) -> str | None:
        """One of the names the deployment offers (``context={"cache": [...]}``), checked before anything runs."""
        if not isinstance(info.context, dict) or "cache" not in info.context:
            raise TypeError(
                "a body naming a cache tier is validated under the deployment's tiers: context={'cache': ...}"
            )
        allowed = info.context["cache"]
        if cache is not None and cache not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}, got {cache[:40]!r}")
        return cache

    @field_validator("timeout_s")
    @classmethod
    def _timeout(cls, timeout_s: float | None, info: ValidationInfo) -> float | None:
        limit = limits_of(info).max_timeout_s
        if timeout_s is not None and not timeout_s <= limit:  # `not <=`: NaN too
            raise ValueError(f"timeout_s={timeout_s:g} exceeds this server's limit of {limit:g} seconds")
        return timeout_s

    def generation(self) -> dict[str, Any]:
        """The fields of a ``GenerationRequest`` this body sets."""
        width, height = parse_size(self.size) if self.size else (None, None)
        fields: dict[str, Any] = dict(
            prompt=self.prompt,
            width=width,
            height=height,
            seed=self.seed,
            num_inference_steps=self.num_inference_steps,
        )
        if self.cache is not None:  # else the deployment's default tier
            fields["cache"] = self.cache
        return fields


AnyBody = TypeVar("AnyBody", bound="Body")


class ImagesBody(Body):
    n: int = Field(default=1, ge=1)
    response_format: Literal["b64_json"] = "b64_json"

    @model_validator(mode="before")
    @classmethod
    def _no_video_fields(cls, data: Any) -> Any:
        """A field of the video route here (a first frame, a length) would change the output if it were honoured;
        ignored like OpenAI's unused fields, it would be lost without a word."""
        if isinstance(data, dict):
            for name in sorted((set(VideosBody.model_fields) - set(cls.model_fields)) & data.keys()):
                raise FieldError(name, "is a field of POST /v1/videos; an image is made from the prompt alone")
        return data

    @field_validator("n")
    @classmethod
    def _n(cls, n: int, info: ValidationInfo) -> int:
        limit = limits_of(info).max_n
        if n > limit:
            raise ValueError(f"n={n} exceeds the limit of {limit}")
        return n

    @model_validator(mode="after")
    def _seeds(self) -> "ImagesBody":
        """Image i uses seed + i, so the last one must still be a valid seed."""
        if self.seed + self.n - 1 > MAX_SEED:
            raise FieldError(
                "seed",
                f"must be at most {MAX_SEED - self.n + 1} with n={self.n}: image i uses seed + i, "
                f"and seeds range from 0 to 2**63 - 1 ({MAX_SEED})",
            )
        return self


class VideosBody(Body):
    seconds: float | None = Field(default=None, description="clip length; default: the shortest the model makes")
    fps: int | None = None
    input_reference: bytes | None = None  # the first frame (FL2VA)
    last_reference: bytes | None = None  # the last frame (FL2VA)
    references: list[Reference] = Field(default_factory=list)  # ordered references (Ref2VA)

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, seconds: float | None, info: ValidationInfo) -> float | None:
        limit = limits_of(info).max_seconds
        if seconds is not None and seconds > limit:
            raise ValueError(f"seconds={seconds:g} exceeds this server's limit of {limit:g}")
        return seconds

    @field_validator("input_reference", "last_reference")
    @classmethod
    def _keyframe(cls, data: bytes | None, info: ValidationInfo) -> bytes | None:
        """Opened header-only at submit: an image over the pixel bound or undecodable never becomes a job."""
        problem = None if data is None else image_problem(data, limits_of(info).max_image_pixels)
        if problem is not None:
            raise ValueError(problem)
        return data

    @model_validator(mode="after")
    def _image_references(self, info: ValidationInfo) -> "VideosBody":
        """Image references as keyframes (video and audio ones are decoded on the replica)."""
        for i, reference in enumerate(self.references):
            problem = (
                image_problem(reference.data, limits_of(info).max_image_pixels) if reference.kind == "image" else None
            )
            if problem is not None:
                raise FieldError(f"references[{i}]", problem)
        return self


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 saying why not (never a 500, whatever the bytes)."""
    try:
        fields = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError(400, "the body must be a JSON object: it is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise APIError(400, f"the body must be a JSON object: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise APIError(400, "the body must be a JSON object: it is nested too deeply") from None
    except ValueError as e:  # an integer of thousands of digits
        raise APIError(400, f"the body must be a JSON object: {str(e).split(':')[0]}") from None
    if not isinstance(fields, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(fields).__name__}")
    return fields


def parse_size(size: str) -> tuple[int, int]:
    """'WIDTHxHEIGHT' as integers (at most 5 digits each: no int of thousands of digits is ever built)."""
    width, sep, height = size.strip().partition("x")
    if not (sep and width.isdigit() and height.isdigit() and len(width) <= 5 and len(height) <= 5):
        raise ValueError(f"must look like 'WIDTHxHEIGHT' (e.g. '1280x768'), got {size[:40]!r}")
    return int(width), int(height)


def decode_upload(value: Any, field: str) -> bytes:
    """An uploaded file, or in JSON a base64 string or data URL."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str):
        payload = value.split(",", 1)[1] if value.startswith("data:") else value
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, f"{field} must be an uploaded file, a base64 string or a data: URL", field) from None
    raise APIError(400, f"{field} must be an uploaded file, a base64 string or a data: URL", field)


def closed_multipart(content_type: str, raw: bytes) -> bool:
    """Whether a multipart body ends with its closing delimiter; the parser accepts a truncated one."""
    from python_multipart.multipart import parse_options_header

    boundary = parse_options_header(content_type)[1].get(b"boundary", b"")
    return bool(boundary) and b"--" + boundary + b"--" in raw


MEDIA_KINDS = {"image": "image", "video": "video", "audio": "audio"}
EXTENSION_KINDS = {
    ".png": "image",
    ".jpg": "image",
    ".jpeg": "image",
    ".webp": "image",
    ".mp4": "video",
    ".mov": "video",
    ".webm": "video",
    ".wav": "audio",
    ".mp3": "audio",
    ".flac": "audio",
    ".ogg": "audio",
    ".m4a": "audio",
}


def upload_kind(content_type: str | None, filename: str | None) -> str | None:
    """image / video / audio from an upload's content type, else its file extension."""
    major = (content_type or "").split("/")[0].lower()
    if major in MEDIA_KINDS:
        return MEDIA_KINDS[major]
    return EXTENSION_KINDS.get(os.path.splitext(filename or "")[1].lower())


def parse_references(value: Any) -> list[Reference]:
    """Ordered Ref2VA references: uploads (kind from their type) or JSON {"kind", "data": base64}."""
    if not isinstance(value, list):
        raise APIError(400, "references must be a list", "references")
    references = []
    for i, item in enumerate(value):
        field = f"references[{i}]"
        if isinstance(item, dict) and isinstance(item.get("data"), str):
            item = {**item, "data": decode_upload(item["data"], field)}
        try:
            references.append(Reference.model_validate(item))
        except ValidationError as e:
            raise APIError(
                400,
                f"{field}: {e.errors()[0]['msg']} (a reference is an uploaded image, video or "
                'audio file, or {"kind": ..., "data": base64})',
                field,
            ) from None
    return references


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


def store_url(config: JobStoreArgs, app_name: str) -> str:
    """This application's part of the configured store (default: a directory under the h3serve cache)."""
    base = config.store or str(cache_dir() / "videos")
    return f"{base.rstrip('/')}/{app_name}"


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


def route(name: str):
    """A route method run by ``H3Ingress._call`` (auth, error mapping, timing, counting), counted as ``name``."""

    def wrap(handler: Callable[..., Awaitable[Any]]):
        @functools.wraps(handler)  # Serve and FastAPI read the handler's name and parameters through this
        async def endpoint(self, request: Request, **params):
            return await self._call(name, request, lambda: handler(self, request, **params))

        return endpoint

    return wrap


@serve.deployment(name="H3Ingress")
@serve.ingress(app)
class H3Ingress:
    def __init__(self, replica: DeploymentHandle, args: DeployArgs, rules: ModelRules | None = None):
        """``rules``: the checkpoint's, read by the driver (given when the replicas scale to zero, so that a video job
        is checked and accepted while none runs); None: asked of a replica when first needed."""
        log_through_serve()  # the ingress's own lines (request ids, job hand-backs) into Serve's replica log
        self.api_key = resolve_api_key(args.api_key_env)  # refuses to start before serving anything
        self.replica, self.model_name, self.limits = replica, args.served_model_name, args.limits
        self.cache_tiers, self.cache_default = args.cache_tiers, args.engine.step_cache.default
        # each LoRA adapter is a model id of its own: "<served_model_name>:<adapter name>"
        self.loras = dict(args.loras)
        self.adapter_ids = {f"{self.model_name}:{name}": name for name in self.loras}
        self.metrics = request_metrics()
        store = MediaStore(store_url(args.jobs, serve.get_replica_context().app_name), args.jobs.storage_options)
        store.check()  # an unusable store refuses to start, like a missing token
        policy = JobPolicy(
            ttl_s=args.jobs.ttl_s,
            max_bytes=args.jobs.max_bytes,
            lease_s=args.jobs.lease_s,
            max_jobs=self.limits.max_video_jobs,
        )
        self.videos = VideoJobs(JobStore(store, policy), replica, self.metrics)
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
        self.videos.start_sweeper()
        try:
            request_id = request.state.request_id = request_id_of(request)
            self._authorize(route, request)
            result = await handler()
            status = getattr(result, "status_code", 200)
            return result
        except Exception as e:
            error = e if isinstance(e, APIError) else http_error(e, f"request {request_id} ({route})")
            status = error.status
            return error.response()
        finally:  # a generation's model id once it was resolved (a bounded set: the config's), else ""
            self.metrics.observe(route, status, time.perf_counter() - started, getattr(request.state, "model", ""))

    def _authorize(self, route: str, request: Request) -> None:
        if self.api_key is None or route in PUBLIC_ROUTES:
            return
        token = bearer_token(request.headers.get("authorization", ""))
        if token is None or not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

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
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        raw = await self._body(request)
        if kind == "application/json" or (not uploads and kind in ("", "text/plain")):
            fields = parse_json_object(raw)
        elif uploads and kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
            fields = await self._form(request, raw, uploads)
        else:
            allowed = "application/json" + (", multipart/form-data" if uploads else "")
            raise APIError(415, f"content-type {kind or 'none'!r} is not accepted here; send {allowed}")
        for name in DISTILLED:
            if name in fields:
                raise APIError(400, f"{name}: MiniMax-H3 is guidance-distilled and takes no {name}", name)
        for name in uploads:
            if fields.get(name) is not None:
                fields[name] = decode_upload(fields[name], name)
        if "references" in fields and uploads:
            fields["references"] = parse_references(fields["references"])
        try:
            form = kind != "application/json" and bool(uploads)  # form fields arrive as text
            context = {"limits": self.limits, "form": form, "cache": self.cache_tiers}
            return model.model_validate(fields, context=context)
        except ValidationError as e:
            raise invalid(e) from None

    @staticmethod
    async def _form(request: Request, raw: bytes, uploads: tuple[str, ...]) -> dict[str, Any]:
        from starlette.datastructures import UploadFile
        from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

        async def stream():
            yield raw

        content_type = request.headers.get("content-type", "")
        multipart = content_type.lower().startswith("multipart/")
        try:
            form = await (MultiPartParser if multipart else FormParser)(request.headers, stream()).parse()
        except (MultiPartException, ValueError, KeyError) as e:
            raise APIError(400, f"malformed form body: {e}") from None
        if multipart and not closed_multipart(content_type, raw):
            raise APIError(400, "malformed form body: no closing boundary (a truncated upload?)")
        fields: dict[str, Any] = {}
        for name, value in form.multi_items():
            if name in ("references", "references[]"):
                if not isinstance(value, UploadFile):
                    raise APIError(400, "references must be uploaded files", "references")
                kind = upload_kind(value.content_type, value.filename)
                if kind is None:
                    raise APIError(
                        400,
                        f"reference {value.filename!r}: cannot tell whether it is an image, a video "
                        "or audio; send it with an image/*, video/* or audio/* content type",
                        "references",
                    )
                fields.setdefault("references", []).append({"kind": kind, "data": await value.read()})
            else:
                fields[name] = await value.read() if isinstance(value, UploadFile) else value
        return fields

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

    def _adapter(self, request: Request, body: "Body") -> str | None:
        """The LoRA adapter ``body.model`` names (None: the base model, also when omitted); 400 for another id."""
        model = body.model
        if model in (None, "", self.model_name):
            request.state.model = self.model_name
            return None
        if model not in self.adapter_ids:
            raise APIError(
                400, f"model {model[:80]!r} is not served here; valid ids: {', '.join(self.model_ids)}", "model"
            )
        request.state.model = model
        return self.adapter_ids[model]

    def _fields(self, body: "Body", adapter: str | None) -> dict[str, Any]:
        """The body's ``GenerationRequest`` fields on ``adapter``: its own steps unless the body gives some (a
        few-step adapter refuses others: 400 naming both), then the deployment's default_steps."""
        fields = body.generation()
        if adapter is not None:
            spec = self.loras[adapter]
            asked = asked_steps(spec, body.num_inference_steps, "num_inference_steps" in body.model_fields_set)
            fields["num_inference_steps"] = check_request_steps(adapter, spec, asked)
        return fields

    # -- images: a still of the shortest clip ----------------------------------------------------
    @app.post("/v1/images/generations")
    @route("/v1/images/generations")
    async def images(self, request: Request):
        body = await self._parse(request, ImagesBody)
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
        with self._generation(request):
            # n images are n clips: the engine packs them into the same forwards
            calls = [
                asyncio.ensure_future(
                    self._image(request, body, GenerationRequest(**{**base, "seed": body.seed + i}), i, adapter)
                )
                for i in range(body.n)
            ]
            try:
                pngs = await asyncio.gather(*calls)
            except BaseException:
                for call in calls:
                    call.cancel()
                raise
        return {
            "created": epoch_seconds(),
            "data": [{"b64_json": base64.b64encode(png).decode(), "revised_prompt": None} for png in pngs],
        }

    async def _image(
        self, request: Request, body: ImagesBody, generation: GenerationRequest, i: int, adapter: str | None
    ) -> bytes:
        """Image i's PNG; one a draining replica hands back unstarted (a scale-down) is sent again, to another."""
        give_up, wait = time.monotonic() + RESUBMIT_FOR_S, RESUBMIT_BACKOFF_S[0]
        while True:
            deadline_s = self._deadline_s(request, body.timeout_s)
            call = self.replica.generate_image.remote(
                generation, f"{request.state.request_id}-{i}", deadline_s, body.priority, adapter
            )
            try:
                return await call
            except asyncio.CancelledError:
                call.cancel()
                raise
            except Exception as e:
                if not caused_by(e, EngineDraining) or time.monotonic() + wait > give_up:
                    raise
                logger.info("request %s-%d: handed back by a draining replica; again", request.state.request_id, i)
                await asyncio.sleep(wait)
                wait = min(2 * wait, RESUBMIT_BACKOFF_S[1])

    # -- videos --------------------------------------------------------------------------------
    @app.post("/v1/videos")
    @route("/v1/videos")
    async def create_video(self, request: Request):
        body = await self._parse(request, VideosBody, uploads=("input_reference", "last_reference"))
        cold = await self._scaled_to_zero()  # then the job is accepted now, and runs once a replica serves
        if cold and self._rules is None:
            assert self.cold is not None
            self.cold.wake()  # no rules from the driver: this request waits for the first replica's
        rules = await self.rules()
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
        )
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
        }
        deadline_s = self._deadline_s(request, body.timeout_s)
        with self._generation(request):
            # raises (-> 503 + Retry-After) when no replica can queue it: a job is recorded only once accepted
            accepted = await self.videos.submit(
                video, generation_request, request.state.request_id, deadline_s, body.priority, adapter, not cold
            )
        if not accepted:
            raise APIError(
                503,
                f"{self.limits.max_video_jobs} video jobs are unfinished; retry later",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        return video

    async def _job(self, video_id: str) -> dict:
        video = await self.videos.get(video_id)
        if video is None:
            raise unknown_job(video_id)
        return video

    @app.get("/v1/videos")
    @route("/v1/videos:list")
    async def list_videos(self, request: Request):
        limit, after, order = list_query(request)
        videos = await self.videos.list()
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
        return await self._job(video_id)

    @app.get("/v1/videos/{video_id}/content")
    @route("/v1/videos/{id}/content")
    async def video_content(self, request: Request, video_id: str):
        video = await self._job(video_id)
        if video["status"] != "completed":
            raise APIError(409, f"video {video_id} is {video['status']}, not completed", "video_id")
        content = await self.videos.content(video_id)
        if content is None:  # removed (TTL, byte cap, DELETE) since the record was read
            raise APIError(404, f"video {video_id} has expired", "video_id")
        return Response(content, media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}")
    @route("/v1/videos/{id}:delete")
    async def delete_video(self, request: Request, video_id: str):
        if not await self.videos.delete(video_id):
            raise unknown_job(video_id)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{video_id}/cancel")
    @route("/v1/videos/{id}/cancel")
    async def cancel_video(self, request: Request, video_id: str):
        """sglang's route: a queued job leaves its replica's queue, a running one its pack at the next step
        boundary; the job reads cancelled (409 once it finished)."""
        video = await self.videos.cancel(video_id)
        if video is None:
            raise unknown_job(video_id)
        return video

    @app.get("/v1/videos/{video_id}/events")
    @route("/v1/videos/{id}/events")
    async def video_events(self, request: Request, video_id: str):
        """Server-Sent Events of the job (``deploy.jobs.events``), resumed after ``Last-Event-ID`` when it is sent."""
        after = last_event_id(request.headers.get("last-event-id"))
        video = await self._job(video_id)
        if self.streams >= self.event_streams:
            raise APIError(
                503,
                f"this server holds {self.event_streams} open event streams; poll GET /v1/videos/{{id}} or retry later",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        log = self.videos.events.get(video_id)
        if log is not None and after > log.last_id:
            raise APIError(
                400,
                f"Last-Event-ID {after} is past this job's last event ({log.last_id}); resume from an id it sent",
                "Last-Event-ID",
            )
        if log is not None:
            events = log.follow(after)
        else:  # another ingress replica runs it (or ran it): its record, once a second
            events = follow_record(lambda: self.videos.get(video_id), video)
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
        row-step rate, cancels), this ingress's open jobs and event streams, and admission failures so far."""
        info = await asyncio.wait_for(self.replica.diagnostics.remote(), timeout=10)
        try:
            log = await asyncio.wait_for(admission_recorder().decisions_log.remote(), timeout=RECORD_TIMEOUT_S)
            admission_failures: int | None = sum(1 for d in log if d.get("outcome") == "rejected")
        except Exception as e:  # the panel shows what it has
            logger.warning("request %s: /v1/stats: no admission log: %r", request.state.request_id, e)
            admission_failures = None
        return {
            "object": "stats",
            "model": self.model_name,
            "replica": {
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
        """The playground page (``deploy/ingress/playground/``): plain HTML, CSS and JS, nothing fetched from
        elsewhere."""
        return HTMLResponse(playground_page(auth=self.api_key is not None, model=self.model_name))

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
            }
            public = PUBLIC_ROUTES if self.api_key is not None else None
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
