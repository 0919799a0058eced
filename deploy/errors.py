"""Errors a client can act on, in OpenAI's error shape, and the mapping of everything else onto them."""

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from pipelines.h3 import RequestError, VisionUnavailable
from replicas import EngineStopped, QueueFull

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
