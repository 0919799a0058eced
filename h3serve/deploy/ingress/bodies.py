"""The request bodies of the generation routes and their parsing: a JSON object, or (``/v1/videos``) a multipart or
urlencoded form with uploads. Every malformed body gets a 4xx that says what is wrong; the deployment's limits
(``RequestLimits``) are checked by the models' validators, under ``context={"limits": ..., "cache": ...}``. No
Serve or FastAPI here: the routes (``h3serve.deploy.ingress.routes``) read the body and hand it over."""

import base64
import binascii
import json
import os
import re
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from h3serve.deploy.common.args import RequestLimits
from h3serve.deploy.common.errors import APIError, FieldError, invalid
from h3serve.deploy.ingress.references import media_problem
from h3serve.pipelines.h3 import Reference
from h3serve.pipelines.h3.uploads import image_problem
from h3serve.replicas import MAX_PRIORITY, MIN_PRIORITY

# Not parameters of a guidance-distilled model: refused by name rather than silently ignored.
DISTILLED = ("guidance_scale", "negative_prompt")
MAX_SEED = 2**63 - 1  # GenerationRequest's seed is a signed 64-bit integer
# a form field carries text: an optional sign and at most a few digits (no int of thousands of digits is built)
FORM_INTEGER = re.compile(r"[+-]?[0-9]{1,4}")


def limits_of(info: ValidationInfo) -> RequestLimits:
    """The deployment's limits, which every body is validated under (``context={"limits": ...}``)."""
    if not isinstance(info.context, dict) or "limits" not in info.context:
        raise TypeError("request bodies are validated under the deployment's limits: context={'limits': ...}")
    return info.context["limits"]


class LoraUse(BaseModel):
    """One adapter of a request's ``lora`` list: its name and weight (diffusers' ``set_adapters`` weight)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=63)
    scale: float | None = Field(default=None, allow_inf_nan=False, description="default: the adapter's own scale")


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
    # LoRA adapters composed on this request (diffusers' set_adapters(names, weights)); None: the base model, or the
    # adapter its `model` id names
    lora: list[LoraUse] | None = Field(
        default=None,
        description='[{"name": ..., "scale": ...}, ...], or one adapter\'s name or object; in a form, JSON text',
    )

    @field_validator("lora", mode="before")
    @classmethod
    def _lora(cls, value: Any) -> Any:
        """One name, one object or a list of either; a form's field is text: JSON, or one adapter's name."""
        if isinstance(value, str) and value.strip().startswith(("[", "{")):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("must be a JSON list of {name, scale} objects") from None
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("must name at least one adapter (leave it out for the base model)")
        return [{"name": item} if isinstance(item, str) else item for item in items]

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
    webhook: str | None = Field(default=None, max_length=2048)  # a signed POST of the finished job (jobs.webhooks)

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
    def _references(self, info: ValidationInfo) -> "VideosBody":
        """At most ``max_references``; image ones checked as keyframes, video and audio ones on their container's
        metadata (``references``: duration, frames, size, sample rate, codec), none decoded here."""
        limits = limits_of(info)
        if len(self.references) > limits.max_references:
            raise FieldError(
                "references", f"holds {len(self.references)}; a request may send at most {limits.max_references}"
            )
        for i, reference in enumerate(self.references):
            if reference.kind == "image":
                problem = image_problem(reference.data, limits.max_image_pixels)
            else:
                problem = media_problem(reference.data, reference.kind, limits)
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


async def parse_body(
    headers: Any,
    raw: bytes,
    model: type[AnyBody],
    uploads: tuple[str, ...],
    limits: RequestLimits,
    cache_tiers: list[str],
) -> AnyBody:
    """A JSON object, or (where ``uploads`` are allowed) a multipart/urlencoded form, validated. ``headers``: the
    request's (its content type says which)."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json" or (not uploads and kind in ("", "text/plain")):
        fields = parse_json_object(raw)
    elif uploads and kind in ("multipart/form-data", "application/x-www-form-urlencoded"):
        fields = await parse_form(headers, raw)
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
        context = {"limits": limits, "form": form, "cache": cache_tiers}
        return model.model_validate(fields, context=context)
    except ValidationError as e:
        raise invalid(e) from None


async def parse_form(headers: Any, raw: bytes) -> dict[str, Any]:
    """A multipart or urlencoded form's fields (uploads read), or a 400 saying why it is malformed."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

    async def stream():
        yield raw

    content_type = headers.get("content-type", "")
    multipart = content_type.lower().startswith("multipart/")
    try:
        form = await (MultiPartParser if multipart else FormParser)(headers, stream()).parse()
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
