"""Errors a client can act on, in OpenAI's error shape, and the mapping of everything else onto them.

A 5xx body never carries an internal exception's text (a worker's traceback, a Ray actor's name): the
client gets a generic message and the request id, the log gets the text under the same request id.
"""

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from h3serve.pipelines.h3 import RequestError, VisionUnavailable
from h3serve.replicas import DeadlineExceeded, EngineStopped, QueueFull

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "2"


class StageUnavailable(RuntimeError):
    """A stage's replica died under a request on every one of its attempts
    (``h3serve.deploy.model_server.stage_client.STAGE_ATTEMPTS``):
    the request's error, naming the stage (the denoiser replica and the other requests carry on)."""

    def __init__(self, stage: str, message: str):
        super().__init__(message)
        self.stage = stage

    def __reduce__(self):  # keep the stage across process boundaries (Ray pickles errors)
        return type(self), (self.stage, str(self))


# every queue on the way is full: the engine's, or Serve's in front of a replica
QUEUE_FULL = (QueueFull, BackPressureError)
# no replica can take the request now: stopped, draining (EngineDraining), stalled (EngineStalled), dead, starting,
# or a stage's replicas kept dying under it
UNAVAILABLE = (EngineStopped, DeploymentUnavailableError, RayActorError, StageUnavailable)
QUEUE_FULL_MESSAGE = "the queue is full; retry later"
UNAVAILABLE_MESSAGE = "the model is unavailable right now; retry later"
DEADLINE_MESSAGE = "the request did not finish within its deadline (timeout_s)"
# fields of the model's errors -> the API parameter a client set
API_PARAM = {
    "width": "size",
    "height": "size",
    "num_frames": "seconds",
    "first_frame": "input_reference",
    "last_frame": "last_reference",
}


class APIError(Exception):
    """An error the client can act on, in OpenAI's error shape. ``kind`` is OpenAI's ``error.type``
    (default: invalid_request_error below 500, server_error from 500)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict | None = None,
        kind: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def response(self, headers: dict | None = None) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}
        return JSONResponse(body, status_code=self.status, headers={**(self.headers or {}), **(headers or {})})


class FieldError(ValueError):
    """A model validator's error that belongs to one field (pydantic would report it for the whole body)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def root_cause(error: BaseException) -> BaseException:
    """The replica's own exception inside Ray's wrapper (whose str() is a remote traceback)."""
    return getattr(error, "cause", None) or error


def http_error(error: BaseException, what: str) -> APIError:
    """503 + Retry-After for overload and unavailable replicas, 504 for a passed deadline, 400 for a request the
    model refused, 500 for anything else. ``what`` (the route or job and its request id) heads the log line
    that holds the internal text the client does not see."""
    cause = root_cause(error)
    retry = {"Retry-After": RETRY_AFTER_S}
    if isinstance(error, QUEUE_FULL) or isinstance(cause, QUEUE_FULL):
        logger.warning("%s: 503, queue full: %s", what, cause)
        return APIError(503, QUEUE_FULL_MESSAGE, headers=retry)
    if isinstance(error, UNAVAILABLE) or isinstance(cause, UNAVAILABLE):
        logger.warning("%s: 503, no replica can take it: %s: %s", what, type(cause).__name__, cause)
        return APIError(503, UNAVAILABLE_MESSAGE, headers=retry)
    if isinstance(cause, DeadlineExceeded):
        logger.info("%s: 504, %s", what, cause)
        return APIError(504, DEADLINE_MESSAGE, "timeout_s", kind="timeout")
    if isinstance(cause, RequestError):
        return APIError(400, str(cause), API_PARAM.get(cause.field, cause.field))
    if isinstance(cause, VisionUnavailable):
        return APIError(400, str(cause), "references")
    logger.error("%s failed", what, exc_info=error)
    return APIError(500, "internal error; see the server log")


def invalid(error: ValidationError) -> APIError:
    """A 400 naming the first invalid field."""
    first = error.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or getattr(first.get("ctx", {}).get("error"), "field", None)
    message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    return APIError(400, f"{field}: {message}" if field else message, field)
