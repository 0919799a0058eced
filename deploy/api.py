"""The OpenAI-style HTTP API (FastAPI under @serve.ingress).

Every route goes through ``H3Ingress._call``: bearer auth, the body size limit, error mapping to
OpenAI's error shape, and request metrics, in one place. Request bodies are parsed here (not by
FastAPI's body binding) so that every malformed body gets a 4xx that says what is wrong;
``deploy.openapi`` documents them. Only ``PUBLIC_ROUTES`` answer without the bearer token.
"""

import asyncio
import base64
import binascii
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipelines.h3 import GenerationRequest, ModelRules, Reference, RequestError, VisionUnavailable
from replicas import EngineStopped, QueueFull

from .args import DeployArgs, JobStoreArgs, RequestLimits
from .jobs import JobGone, JobPolicy, JobRunner, JobStore, LeaseLost, epoch_seconds
from .media_store import MediaStore
from .metrics import RequestMetrics
from .openapi import document

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "2"
OVERLOADED = (QueueFull, EngineStopped, BackPressureError, DeploymentUnavailableError, RayActorError)
# fields of the model's errors -> the API parameter a client set
API_PARAM = {
    "width": "size",
    "height": "size",
    "num_frames": "seconds",
    "first_frame": "input_reference",
    "last_frame": "last_reference",
}
# Not parameters of a guidance-distilled model: refused by name rather than silently ignored.
DISTILLED = ("guidance_scale", "negative_prompt")
# A liveness probe answers without the token; everything else needs it, the API docs included (they
# list this deployment's limits). Unknown routes answer 404 either way: there is nothing behind them.
PUBLIC_ROUTES = ("/health",)
PROGRESS_EVERY_S = 0.5  # progress is written at most this often; the heartbeat covers the rest


class APIError(Exception):
    """An error the client can act on, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def root_cause(error: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (whose str() is a remote traceback)."""
    return getattr(error, "cause", None) or error


def http_error(error: BaseException, what: str) -> APIError:
    """503 for overload, 400 for a request the model refused, 500 (logged) for anything else."""
    cause = root_cause(error)
    if isinstance(error, OVERLOADED) or isinstance(cause, OVERLOADED):
        return APIError(503, f"overloaded: {cause}", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(cause, RequestError):
        return APIError(400, str(cause), API_PARAM.get(cause.field, cause.field))
    if isinstance(cause, VisionUnavailable):
        return APIError(400, str(cause), "references")
    logger.error("%s failed", what, exc_info=error)
    return APIError(500, "internal error; see the server log")


def invalid(error: ValidationError) -> APIError:
    """A 400 naming the first invalid field."""
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or None
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    return APIError(400, f"{field}: {message}" if field else message, field)


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
    seed: int = Field(default=0, ge=0, lt=2**63)
    # None is replaced by the deployment's default_steps
    num_inference_steps: int | None = Field(default=None, ge=2, validate_default=True)

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

    def generation(self) -> dict[str, Any]:
        """The fields of a ``GenerationRequest`` this body sets."""
        width, height = parse_size(self.size) if self.size else (None, None)
        return dict(
            prompt=self.prompt,
            width=width,
            height=height,
            seed=self.seed,
            num_inference_steps=self.num_inference_steps,
        )


AnyBody = TypeVar("AnyBody", bound="Body")


class ImagesBody(Body):
    n: int = Field(default=1, ge=1)
    response_format: Literal["b64_json"] = "b64_json"

    @field_validator("n")
    @classmethod
    def _n(cls, n: int, info: ValidationInfo) -> int:
        limit = limits_of(info).max_n
        if n > limit:
            raise ValueError(f"n={n} exceeds the limit of {limit}")
        return n


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
    base = config.store or str(Path(os.environ.get("H3SERVE_CACHE", Path.home() / ".cache" / "h3serve")) / "videos")
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


@serve.deployment(name="H3Ingress")
@serve.ingress(app)
class H3Ingress:
    def __init__(self, replica: DeploymentHandle, args: DeployArgs):
        self.api_key = resolve_api_key(args.api_key_env)  # refuses to start before serving anything
        self.replica, self.model_name, self.limits = replica, args.served_model_name, args.limits
        self.metrics = request_metrics()
        store = MediaStore(store_url(args.jobs, serve.get_replica_context().app_name), args.jobs.storage_options)
        store.check()  # an unusable store refuses to start, like a missing token
        policy = JobPolicy(
            ttl_s=args.jobs.ttl_s,
            max_bytes=args.jobs.max_bytes,
            lease_s=args.jobs.lease_s,
            max_jobs=self.limits.max_video_jobs,
        )
        self.jobs = JobStore(store, policy)
        self.io = ThreadPoolExecutor(max_workers=16, thread_name_prefix="h3serve-jobs")  # store calls block
        self.tasks: dict[str, asyncio.Task] = {}
        self.runners: dict[str, JobRunner] = {}
        self._rules: ModelRules | None = None
        self._openapi: dict | None = None
        self._sweeper: asyncio.Task | None = None

    async def _io(self, fn: Callable, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.io, lambda: fn(*args, **kwargs))

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def check_health(self) -> None:
        """Serve calls this every few seconds from the start: the sweeper runs without waiting for traffic."""
        self._start_sweeper()

    async def _sweep_forever(self) -> None:
        """TTL, byte cap and lost runners without waiting for a reader; every replica sweeps, harmlessly."""
        while True:
            await self._sweep_once()
            await asyncio.sleep(self.jobs.policy.lease_s / 2)

    async def _sweep_once(self) -> None:
        try:
            await self._io(self.jobs.sweep)
        except Exception:
            logger.exception("sweeping the video job store failed; the next sweep retries")

    # -- plumbing ------------------------------------------------------------------------
    async def _call(self, route: str, request: Request, handler: Callable[[], Awaitable[Any]]):
        """Auth, then ``handler``; errors become OpenAI-shaped answers; every answer is timed and counted."""
        started, status = time.perf_counter(), 200
        self._start_sweeper()
        try:
            self._authorize(route, request)
            result = await handler()
            status = getattr(result, "status_code", 200)
            return result
        except Exception as e:
            error = e if isinstance(e, APIError) else http_error(e, route)
            status = error.status
            return error.response()
        finally:
            self.metrics.observe(route, status, time.perf_counter() - started)

    def _authorize(self, route: str, request: Request) -> None:
        if self.api_key is None or route in PUBLIC_ROUTES:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
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
            return model.model_validate(fields, context={"limits": self.limits})
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
        if self._rules is None:
            self._rules = await self.replica.rules.remote()
        return self._rules

    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise APIError(404, f"model {model!r} is not served here; available: {self.model_name}", "model")

    # -- images: a still of the shortest clip ----------------------------------------------------
    @app.post("/v1/images/generations")
    async def images(self, request: Request):
        async def run():
            body = await self._parse(request, ImagesBody)
            self._check_model(body.model)
            base = body.generation()
            # n images are n clips: the engine packs them into the same forwards
            calls = [
                self.replica.generate_image.remote(GenerationRequest(**{**base, "seed": body.seed + i}))
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

        return await self._call("/v1/images/generations", request, run)

    # -- videos --------------------------------------------------------------------------------
    @app.post("/v1/videos")
    async def create_video(self, request: Request):
        async def run():
            body = await self._parse(request, VideosBody, uploads=("input_reference", "last_reference"))
            rules = await self.rules()
            if body.fps is not None and body.fps != rules.fps:
                raise APIError(400, f"fps: MiniMax-H3 generates at a fixed {rules.fps} fps", "fps")
            self._check_model(body.model)
            generation = body.generation()
            if body.seconds is not None:
                generation["num_frames"] = rules.frames_for_seconds(body.seconds)
            request_ = GenerationRequest(
                **generation,
                first_frame=body.input_reference,
                last_frame=body.last_reference,
                references=tuple(body.references),
            )
            await self.replica.validate.remote(request_)  # refuse now, not in a failed job later
            num_frames = request_.num_frames or rules.min_frames
            width, height = (request_.width, request_.height) if request_.width else rules.default_canvas
            video = {
                "id": f"video_{uuid.uuid4().hex}",
                "object": "video",
                "model": self.model_name,
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
            runner = await self._io(self.jobs.create, video)
            if runner is None:
                raise APIError(
                    503,
                    f"{self.limits.max_video_jobs} video jobs are unfinished; retry later",
                    headers={"Retry-After": RETRY_AFTER_S},
                )
            self.runners[runner.job_id] = runner
            self.tasks[runner.job_id] = asyncio.get_running_loop().create_task(self._run_job(runner, request_))
            return video

        return await self._call("/v1/videos", request, run)

    async def _run_job(self, runner: JobRunner, request: GenerationRequest) -> None:
        """Stream the replica's progress into the job's record; the MP4 into the store."""
        started, code, written = time.perf_counter(), 500, 0.0
        stream = self.replica.options(stream=True).generate_video.remote(request)
        job = asyncio.current_task()
        assert job is not None  # a route's task
        heartbeat = asyncio.get_running_loop().create_task(self._heartbeat(runner, job))
        try:
            async for event in stream:
                if "mp4" in event:
                    await self._io(runner.complete, event["mp4"])
                    code = 200
                    break
                done, total = event["progress"]
                if time.monotonic() - written >= PROGRESS_EVERY_S:
                    written = time.monotonic()
                    await self._write(runner, status="in_progress", progress=int(100 * done / max(total, 1)))
            if code != 200:
                raise RuntimeError("the replica's stream ended without a video")
            asyncio.get_running_loop().create_task(self._sweep_once())  # the byte cap, now
        except (JobGone, LeaseLost) as e:
            code = 499  # deleted, or this runner lost its lease: stop generating
            logger.info("video job %s stopped: %r", runner.job_id, e)
            stream.cancel()
        except asyncio.CancelledError:
            code = 499
            stream.cancel()
            if runner.stopping == "shutdown":
                await self._fail(runner, "server_stopped", "the server stopped while this job ran; resubmit it")
            raise
        except Exception as e:
            error = http_error(e, f"video job {runner.job_id}")
            code = error.status
            await self._fail(runner, str(code), error.message)
        finally:
            heartbeat.cancel()
            self.tasks.pop(runner.job_id, None)
            self.runners.pop(runner.job_id, None)
            self.metrics.observe("/v1/videos:job", code, time.perf_counter() - started)

    async def _heartbeat(self, runner: JobRunner, job: asyncio.Task) -> None:
        """Rewrite the record every lease_s/4, also while the job waits in the engine's queue."""
        while True:
            await asyncio.sleep(runner.record["lease_s"] / 4)
            try:
                await self._io(runner.update)
            except (JobGone, LeaseLost) as e:
                logger.info("video job %s stopped: %r", runner.job_id, e)
                runner.stopping = "deleted" if isinstance(e, JobGone) else "lease lost"
                job.cancel()
                return
            except Exception:
                logger.exception("heartbeat of video job %s failed; retrying", runner.job_id)

    async def _write(self, runner: JobRunner, **fields) -> None:
        """A progress write; a store hiccup is logged and left to the next write (the lease allows for it)."""
        try:
            await self._io(runner.update, **fields)
        except (JobGone, LeaseLost):
            raise
        except Exception:
            logger.exception("writing video job %s failed", runner.job_id)

    async def _fail(self, runner: JobRunner, code: str, message: str) -> None:
        try:
            await self._io(runner.fail, code, message)
        except (JobGone, LeaseLost):
            pass
        except Exception:  # the lease will fail it for readers
            logger.exception("recording the failure of video job %s failed", runner.job_id)

    async def _job(self, video_id: str) -> dict:
        video = await self._io(self.jobs.get, video_id)
        if video is None:
            raise APIError(404, f"no video job {video_id[:80]!r}", "video_id")
        return video

    @app.get("/v1/videos")
    async def list_videos(self, request: Request):
        async def run():
            limit, after, order = list_query(request)
            videos = await self._io(self.jobs.list)
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

        return await self._call("/v1/videos:list", request, run)

    @app.get("/v1/videos/{video_id}")
    async def get_video(self, video_id: str, request: Request):
        return await self._call("/v1/videos/{id}", request, lambda: self._job(video_id))

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(self, video_id: str, request: Request):
        async def run():
            video = await self._job(video_id)
            if video["status"] != "completed":
                raise APIError(409, f"video {video_id} is {video['status']}, not completed", "video_id")
            content = await self._io(self.jobs.content, video_id)
            if content is None:  # removed (TTL, byte cap, DELETE) since the record was read
                raise APIError(404, f"video {video_id} has expired", "video_id")
            return Response(content, media_type="video/mp4")

        return await self._call("/v1/videos/{id}/content", request, run)

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(self, video_id: str, request: Request):
        async def run():
            if not await self._io(self.jobs.delete, video_id):
                raise APIError(404, f"no video job {video_id[:80]!r}", "video_id")
            task, runner = self.tasks.get(video_id), self.runners.get(video_id)
            if task is not None and runner is not None:  # running here; elsewhere its runner sees the tombstone
                runner.stopping = "deleted"
                task.cancel()
            return {"id": video_id, "object": "video.deleted", "deleted": True}

        return await self._call("/v1/videos/{id}:delete", request, run)

    # -- models, health, docs --------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: Request):
        async def run():
            return {
                "object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "h3serve"}],
            }

        return await self._call("/v1/models", request, run)

    @app.get("/health")
    async def health(self, request: Request):
        async def run():
            try:
                info = await asyncio.wait_for(self.replica.diagnostics.remote(), timeout=10)
            except Exception as e:
                return JSONResponse({"status": "unavailable", "error": str(e).splitlines()[0]}, status_code=503)
            return {"status": "ok", "model": self.model_name, "backend": info["backend"]}

        return await self._call("/health", request, run)

    @app.get("/openapi.json")
    async def openapi(self, request: Request):
        async def run():
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
                self._openapi = document(base, bodies, self.limits, await self.rules())
            return self._openapi

        return await self._call("/openapi.json", request, run)

    @app.get("/docs")
    async def docs(self, request: Request):
        return await self._call("/docs", request, self._html(get_swagger_ui_html, request))

    @app.get("/redoc")
    async def redoc(self, request: Request):
        return await self._call("/redoc", request, self._html(get_redoc_html, request))

    @staticmethod
    def _html(render, request: Request) -> Callable[[], Awaitable[HTMLResponse]]:
        async def run():
            return render(openapi_url=request.scope.get("root_path", "") + "/openapi.json", title="h3serve API")

        return run

    async def __del__(self):
        """Serve stops this replica: fail its running jobs now rather than after their lease."""
        if not hasattr(self, "io"):  # the constructor refused
            return
        for video_id, task in list(self.tasks.items()):
            runner = self.runners.get(video_id)
            if runner is not None:
                runner.stopping = "shutdown"
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.io.shutdown(wait=False)
