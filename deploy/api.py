"""The OpenAI-style HTTP API (FastAPI under @serve.ingress): validation, auth, error mapping."""

import asyncio
import base64
import logging
import os
import re
import secrets
import time
import uuid
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from pipelines.h3 import RequestError, preset, video_frames
from replicas import EngineStopped, QueueFull

from .args import RequestLimits
from .jobs import job_store, now
from .metrics import RequestMetrics

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "2"
SIZE = re.compile(r"^(\d+)x(\d+)$")
OVERLOADED = (QueueFull, EngineStopped, BackPressureError, DeploymentUnavailableError, RayActorError)
# request fields of the model's errors -> the API parameter a client set
API_PARAM = {"width": "size", "height": "size", "num_frames": "seconds", "output_frames": "seconds"}


class APIError(Exception):
    """An error the client can act on, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def root_cause(error: Exception) -> Exception:
    """The replica's own exception inside Ray's wrapper (whose str() is a remote traceback)."""
    return getattr(error, "cause", None) or error


def http_error(error: Exception, what: str) -> APIError:
    """503 for overload, 400 for a request the model refused, 500 (logged) for anything else."""
    cause = root_cause(error)
    if isinstance(error, OVERLOADED) or isinstance(cause, OVERLOADED):
        return APIError(503, f"overloaded: {cause}", headers={"Retry-After": RETRY_AFTER_S})
    if isinstance(cause, RequestError):
        return APIError(400, str(cause), API_PARAM.get(cause.field, cause.field))
    logger.error("%s failed", what, exc_info=error)
    return APIError(500, "internal error; see the server log")


def invalid(errors: list[dict]) -> APIError:
    """A 422 naming the first invalid field (FastAPI's body errors carry a leading "body")."""
    first = errors[0]
    field = ".".join(str(p) for p in first["loc"] if p != "body") or None
    return APIError(422, f"{field}: {first['msg']}", field)


def parse_size(size: str, limits: RequestLimits) -> tuple[int, int]:
    match = SIZE.match(size.strip())
    if not match:
        raise APIError(400, f"size must look like 'WIDTHxHEIGHT' (e.g. '256x256'), got {size!r}", "size")
    width, height = int(match[1]), int(match[2])
    if width * height > limits.max_pixels or width == 0 or height == 0:
        raise APIError(400, f"size {size} is {width * height} pixels; allowed 1..{limits.max_pixels}", "size")
    return width, height


class ImagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI fields we do not use (quality, style, user...)

    prompt: str
    model: str | None = None
    n: int = Field(default=1, ge=1)
    size: str = "256x256"
    response_format: str = "b64_json"
    seed: int = Field(default=0, ge=0, lt=2**62)
    num_inference_steps: int = Field(default=8, ge=1)
    guidance_scale: float = Field(default=4.0, ge=0, le=30)
    negative_prompt: str = ""


class VideosRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    seconds: int = Field(default=4, ge=1)
    size: str = "256x256"
    fps: int = Field(default=8, ge=1)
    seed: int = Field(default=0, ge=0, lt=2**62)
    steps: int = Field(default=8, ge=1)
    guidance_scale: float = Field(default=4.0, ge=0, le=30)
    negative_prompt: str = ""

    @field_validator("seconds", mode="before")
    @classmethod
    def _numeric_string(cls, v: Any) -> Any:  # the openai client sends seconds as "4"
        return int(v) if isinstance(v, str) and v.strip().isdigit() else v


def check_common(limits: RequestLimits, prompt: str, negative: str, steps: int, steps_field: str) -> None:
    for field, text in (("prompt", prompt), ("negative_prompt", negative)):
        if len(text) > limits.max_prompt_chars:
            raise APIError(400, f"{field} is {len(text)} characters; the limit is {limits.max_prompt_chars}", field)
    if not prompt.strip():
        raise APIError(400, "prompt must not be empty", "prompt")
    if steps > limits.max_steps:
        raise APIError(400, f"{steps_field}={steps} exceeds the limit of {limits.max_steps}", steps_field)


app = FastAPI(title="h3serve", version="0.1.0", description="OpenAI-style image and video generation with H3")


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError):
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError):
    return invalid(exc.errors()).response()


def require_auth(request: Request) -> None:
    expected = request.app.state.api_key
    if not expected:
        return
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {expected}".encode()):
        raise APIError(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


@serve.deployment(name="H3Ingress")
@serve.ingress(app)
class H3Ingress:
    def __init__(self, replica: DeploymentHandle, model: str, model_name: str, limits: dict, api_key_env: str):
        self.replica, self.model_name, self.limits = replica, model_name, RequestLimits(**limits)
        self.config = preset(model)
        app.state.api_key = os.environ.get(api_key_env, "")
        self.metrics = RequestMetrics()
        self.jobs = job_store(serve.get_replica_context().app_name, self.limits.max_video_jobs)
        self.tasks: dict[str, asyncio.Task] = {}

    # -- plumbing ------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model not in (None, "", self.model_name):
            raise APIError(404, f"model {model!r} is not served here; available: {self.model_name}", "model")

    async def _call(self, endpoint: str, call):
        """Run ``call``, map replica errors to HTTP, count and time the request."""
        started, status = time.perf_counter(), 200
        try:
            return await call()
        except APIError as e:
            status = e.status
            raise
        except Exception as e:
            error = http_error(e, endpoint)
            status = error.status
            raise error from None
        finally:
            self.metrics.observe(endpoint, status, time.perf_counter() - started)

    # -- images --------------------------------------------------------------------------
    @app.post("/v1/images/generations", dependencies=[Depends(require_auth)])
    async def images(self, body: ImagesRequest):
        async def run():
            self._check_model(body.model)
            if body.response_format != "b64_json":
                raise APIError(400, "response_format must be 'b64_json'", "response_format")
            if body.n > self.limits.max_n:
                raise APIError(400, f"n={body.n} exceeds the limit of {self.limits.max_n}", "n")
            check_common(self.limits, body.prompt, body.negative_prompt, body.num_inference_steps,
                         "num_inference_steps")
            width, height = parse_size(body.size, self.limits)
            base = dict(prompt=body.prompt, negative_prompt=body.negative_prompt, width=width, height=height,
                        steps=body.num_inference_steps, guidance_scale=body.guidance_scale)
            # n images are n requests: the engine packs them into the same forwards
            calls = [self.replica.generate_image.remote({**base, "seed": body.seed + i}) for i in range(body.n)]
            try:
                pngs = await asyncio.gather(*calls)
            except BaseException:
                for call in calls:
                    call.cancel()
                raise
            return {"created": int(time.time()),
                    "data": [{"b64_json": base64.b64encode(png).decode(), "revised_prompt": None} for png in pngs]}

        return await self._call("/v1/images/generations", run)

    # -- videos --------------------------------------------------------------------------
    @app.post("/v1/videos", dependencies=[Depends(require_auth)])
    async def create_video(self, request: Request):
        async def run():
            body = await self._video_body(request)
            self._check_model(body.model)
            check_common(self.limits, body.prompt, body.negative_prompt, body.steps, "steps")
            if body.seconds > self.limits.max_seconds:
                raise APIError(400, f"seconds={body.seconds} exceeds the limit of {self.limits.max_seconds}", "seconds")
            if body.fps > self.limits.max_fps:
                raise APIError(400, f"fps={body.fps} exceeds the limit of {self.limits.max_fps}", "fps")
            width, height = parse_size(body.size, self.limits)
            frames, keep = video_frames(body.seconds, body.fps, self.config)
            if frames > self.limits.max_frames:
                raise APIError(400, f"{body.seconds}s at {body.fps} fps is {frames} frames; the limit is "
                                    f"{self.limits.max_frames}", "seconds")
            generation = dict(prompt=body.prompt, negative_prompt=body.negative_prompt, width=width, height=height,
                              num_frames=frames, output_frames=keep, fps=body.fps, steps=body.steps,
                              guidance_scale=body.guidance_scale, seed=body.seed)
            await self.replica.validate.remote(generation)  # refuse now, not in a failed job later
            job = {"id": f"video_{uuid.uuid4().hex}", "object": "video", "model": self.model_name,
                   "status": "queued", "progress": 0, "created_at": now(), "completed_at": None,
                   "seconds": str(body.seconds), "size": f"{width}x{height}", "prompt": body.prompt, "error": None}
            if not await self.jobs.create.remote(job):
                raise APIError(503, "too many unfinished video jobs; retry later", headers={"Retry-After": RETRY_AFTER_S})
            self.tasks[job["id"]] = asyncio.get_running_loop().create_task(self._run_job(job["id"], generation))
            return job

        return await self._call("/v1/videos", run)

    async def _video_body(self, request: Request) -> VideosRequest:
        try:
            if request.headers.get("content-type", "").startswith("application/json"):
                raw = await request.json()
            else:  # multipart or urlencoded form, as the openai client sends it
                raw = dict(await request.form())
            return VideosRequest.model_validate(raw)
        except ValidationError as e:
            raise invalid(e.errors()) from None
        except ValueError as e:
            raise APIError(400, f"request body is not valid JSON or form data: {e}") from None

    async def _run_job(self, job_id: str, generation: dict) -> None:
        started = time.perf_counter()
        code = 500
        stream = self.replica.options(stream=True).generate_video.remote(generation)
        try:
            async for event in stream:
                if "mp4" in event:
                    code = 200
                    await self.jobs.update.remote(job_id, {"status": "completed", "progress": 100,
                                                           "completed_at": now()}, event["mp4"])
                    return
                done, total = event["progress"]
                if not await self.jobs.update.remote(job_id, {"status": "in_progress",
                                                              "progress": int(100 * done / total)}):
                    code = 499  # deleted meanwhile: stop generating
                    stream.cancel()
                    return
        except asyncio.CancelledError:
            code = 499
            stream.cancel()
            raise
        except Exception as e:
            error = http_error(e, f"video job {job_id}")
            code = error.status
            await self.jobs.update.remote(job_id, {"status": "failed", "completed_at": now(),
                                                   "error": {"code": str(code), "message": error.message}})
        finally:
            self.tasks.pop(job_id, None)
            self.metrics.observe("/v1/videos:job", code, time.perf_counter() - started)

    async def _job(self, video_id: str) -> dict:
        job = await self.jobs.get.remote(video_id)
        if job is None:
            raise APIError(404, f"no video job {video_id!r}", "video_id")
        return job

    @app.get("/v1/videos/{video_id}", dependencies=[Depends(require_auth)])
    async def get_video(self, video_id: str):
        return await self._call("/v1/videos/{id}", lambda: self._job(video_id))

    @app.get("/v1/videos/{video_id}/content", dependencies=[Depends(require_auth)])
    async def video_content(self, video_id: str):
        async def run():
            job = await self._job(video_id)
            if job["status"] != "completed":
                raise APIError(409, f"video {video_id} is {job['status']}, not completed", "video_id")
            content = await self.jobs.get_content.remote(video_id)
            return Response(content, media_type="video/mp4")

        return await self._call("/v1/videos/{id}/content", run)

    @app.delete("/v1/videos/{video_id}", dependencies=[Depends(require_auth)])
    async def delete_video(self, video_id: str):
        async def run():
            if not await self.jobs.delete.remote(video_id):
                raise APIError(404, f"no video job {video_id!r}", "video_id")
            task = self.tasks.pop(video_id, None)
            if task is not None:  # running here; elsewhere the runner stops at its next update
                task.cancel()
            return {"id": video_id, "object": "video.deleted", "deleted": True}

        return await self._call("/v1/videos/{id}:delete", run)

    # -- models and health ----------------------------------------------------------------
    @app.get("/v1/models", dependencies=[Depends(require_auth)])
    async def models(self):
        return {"object": "list",
                "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "h3serve"}]}

    @app.get("/health")
    async def health(self):
        try:
            info = await asyncio.wait_for(self.replica.diagnostics.remote(), timeout=10)
        except Exception as e:
            return JSONResponse({"status": "unavailable", "error": str(e).splitlines()[0]}, status_code=503)
        return {"status": "ok", "model": self.model_name, "backend": info["backend"]}
