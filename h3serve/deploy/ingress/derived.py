"""``POST /v1/videos/{id}/remix`` and ``POST /v1/videos/{id}/extend``: a new job made from a completed one.

remix (OpenAI's route): the source's request as it ran (seed, canvas, length, steps, cache tier, model or LoRA
adapter, keyframes and references) with a new prompt. extend: FL2VA from the source's last frame, as decoded from its
MP4 and sent to the model losslessly as a PNG, on the source's canvas (the MP4's frame size), with a new prompt; its
seed, steps and length are the source's unless the body gives its own. With ``join: true`` the two are also made into
one MP4 when the extension completes (``variants.join``: the source's frames, then the extension's after its first),
its content's ``?variant=joined``; its object says ``join: true`` (false when the source was removed before the
extension completed: nothing to join). Neither takes any other setting: a field that
would change what the source fixed is a 400 naming it (``POST /v1/videos`` sets those).

The source must be the caller's (another tenant's is a 404, as every job route answers) and ``completed`` (else a
409); what it ran with is read from ``<id>.settings``, which the job store keeps with a completed clip
(``store.JobStore.settings``). The new job's object links its source: ``remixed_from_video_id`` (OpenAI's field) or
``extended_from_video_id``, in its record, in ``GET /v1/videos/{id}`` and in its webhook. ``Idempotency-Key`` is
honoured as on create, scoped to the route and the source.

The routes are methods of ``DerivedVideos``, which ``H3Ingress`` inherits (Serve binds a FastAPI router's methods
found along the class's MRO); the work is the module's functions over the ingress.
"""

from __future__ import annotations

import asyncio
import io
from typing import Any, ClassVar, Protocol, cast

from fastapi import APIRouter, Request
from pydantic import Field, ValidationInfo, field_validator, model_validator

from h3serve.deploy.common.errors import APIError, FieldError
from h3serve.deploy.ingress.bodies import Body, VideosBody, limits_of
from h3serve.deploy.ingress.routing import route
from h3serve.deploy.jobs.variants import decoded_frames, frame_count
from h3serve.deploy.jobs.video_jobs import VideoJobs
from h3serve.pipelines.h3 import GenerationRequest, ModelRules, RequestError
from h3serve.pipelines.h3.lora_spec import LoraSpecs, parse_composition


class H3Ingress(Protocol):
    """What a derived job needs of ``routes.H3Ingress`` (which inherits these routes): its jobs, models and adapters,
    and the steps of ``POST /v1/videos`` it shares (parse, admit, scope a key, the model's rules, queue the job)."""

    videos: VideoJobs
    model_name: str
    adapter_ids: dict[str, str]
    lora_specs: LoraSpecs

    @property
    def model_ids(self) -> list[str]: ...

    async def _parse(self, request: Request, model: Any) -> Any: ...

    def _admit(self, request: Request, body: Body) -> Any: ...

    @staticmethod
    def _scope(route: str, request: Request) -> str: ...

    async def _job(self, request: Request, video_id: str) -> dict: ...

    async def _video_rules(self) -> tuple[bool, ModelRules]: ...

    async def _queue_video(
        self,
        request: Request,
        body: Any,
        generation_request: GenerationRequest,
        adapter: str | None,
        cold: bool,
        rules: ModelRules,
        links: dict[str, Any] | None = None,
    ) -> dict: ...


router = APIRouter()
REMIX_LINK, EXTEND_LINK = "remixed_from_video_id", "extended_from_video_id"


class DerivedBody(Body):
    """A derived job's body: a prompt and how to run it (priority, deadline, webhook); ``documented`` lists the fields
    it takes (the OpenAPI document shows those), any other field of ``POST /v1/videos`` is refused by name."""

    documented: ClassVar[tuple[str, ...]] = ("prompt", "priority", "timeout_s", "webhook")
    action: ClassVar[str] = ""
    webhook: str | None = Field(default=None, max_length=2048)

    @model_validator(mode="before")
    @classmethod
    def _fixed_by_the_source(cls, data: Any) -> Any:
        """A setting the source fixed, sent anyway, would be silently overridden or silently ignored: named instead."""
        if isinstance(data, dict):
            fixed = (set(VideosBody.model_fields) | {"n"}) - set(cls.documented)
            for name in sorted(fixed & data.keys()):
                raise FieldError(name, f"is the source job's on {cls.action}; POST /v1/videos sets it")
        return data


class RemixBody(DerivedBody):
    action = "remix"


class ExtendBody(DerivedBody):
    documented = ("prompt", "seconds", "seed", "num_inference_steps", "join", "priority", "timeout_s", "webhook")
    action = "extend"
    seconds: float | None = Field(default=None, description="the new clip's length; default: the source's")
    join: bool = Field(
        default=False,
        description="also make the source and the new clip as one MP4 (its frames after the first, which repeats "
        "the source's last), when the new clip completes: GET /v1/videos/{id}/content?variant=joined",
    )

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, seconds: float | None, info: ValidationInfo) -> float | None:
        limit = limits_of(info).max_seconds
        if seconds is not None and not seconds <= limit:  # `not <=`: NaN too
            raise ValueError(f"seconds={seconds:g} exceeds this server's limit of {limit:g}")
        return seconds


# the OpenAPI document's bodies of these routes (``openapi.document``)
BODIES: dict[str, type[DerivedBody]] = {
    "POST /v1/videos/{video_id}/remix": RemixBody,
    "POST /v1/videos/{video_id}/extend": ExtendBody,
}


def last_frame(mp4: bytes) -> tuple[bytes, int, int]:
    """The clip's last frame as decoded from its MP4, as a PNG (lossless: the model gets exactly these pixels), and
    its width and height."""
    from PIL import Image

    last = frame_count(mp4) - 1
    frame = decoded_frames(mp4, [last])[last]  # [H, W, 3] uint8
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG")
    return out.getvalue(), frame.shape[1], frame.shape[0]


async def source_of(ingress: H3Ingress, request: Request, video_id: str) -> tuple[dict, dict]:
    """The caller's completed source job and what it ran with (``VideoJobs.settings``): 404 when it is not the
    caller's to see, 409 when it is not completed or its settings are not kept."""
    video = await ingress._job(request, video_id)
    if video["status"] != "completed":
        raise APIError(409, f"video {video_id} is {video['status']}; only a completed video can be derived", "video_id")
    settings = await ingress.videos.settings(video_id)
    if settings is None:  # completed before the store kept settings, or removed since the record was read
        raise APIError(409, f"video {video_id} keeps no settings to derive from; create a new video", "video_id")
    return video, settings


def model_of(ingress: H3Ingress, request: Request, settings: dict) -> str | None:
    """The source's model id into ``request.state.model`` and its LoRA adapters (``composition_key``'s string: an
    adapter's model id's, or a ``lora`` list on the base model); 409 when the model or an adapter is not served now."""
    model, adapter = settings["model"], settings["adapter"]
    if model not in ingress.model_ids:
        raise APIError(409, f"the source video's model {model!r} is not served here any more", "video_id")
    if model != ingress.model_name:  # an adapter's model id: that adapter alone
        served = ingress.adapter_ids.get(model) == adapter
    else:  # the base model, with the source's `lora` list if it had one
        served = all(name in ingress.lora_specs.loras for name, _ in parse_composition(adapter))
    if not served:
        raise APIError(409, f"the source video's adapters {adapter!r} are not all served here any more", "video_id")
    request.state.model = model
    return adapter


async def derive(ingress: H3Ingress, request: Request, video_id: str, body_type: type[DerivedBody]) -> dict:
    body = await ingress._parse(request, body_type)
    ingress._admit(request, body)
    scope = ingress._scope(f"videos/{video_id}/{body_type.action}", request)
    async with ingress.videos.idempotent(request.headers, scope, body) as once:
        if once.replay is not None:  # a retry: the same job, as it reads now
            return await ingress.videos.get(once.replay["id"]) or once.replay
        _, settings = await source_of(ingress, request, video_id)
        adapter = model_of(ingress, request, settings)
        cold, rules = await ingress._video_rules()
        source: GenerationRequest = settings["request"]
        tenant = None if request.state.tenant is None else request.state.tenant.name
        if isinstance(body, ExtendBody):
            generation = await extended(ingress, video_id, body, source, rules)
            links = {EXTEND_LINK: video_id, **({"join": True} if body.join else {})}
        else:
            generation = source.model_copy(update={"prompt": body.prompt})
            links = {REMIX_LINK: video_id}
        generation = generation.model_copy(update={"tenant": tenant})
        once.response = await ingress._queue_video(request, body, generation, adapter, cold, rules, links)
    return once.response


async def extended(
    ingress: H3Ingress, video_id: str, body: ExtendBody, source: GenerationRequest, rules: ModelRules
) -> GenerationRequest:
    """FL2VA from the source's last frame on its canvas: the source's seed, steps, length and cache unless the body
    gives them."""
    media = await ingress.videos.media(video_id)
    if media is None:  # removed (TTL, byte cap, DELETE) since the record was read
        raise APIError(404, f"video {video_id} has expired", "video_id")
    png, width, height = await asyncio.to_thread(last_frame, media[0])
    given = body.model_fields_set
    num_frames, steps = source.num_frames, source.num_inference_steps
    if "num_inference_steps" in given and body.num_inference_steps is not None:
        steps = body.num_inference_steps
    if body.seconds is not None:
        try:
            num_frames = rules.frames_for_seconds(body.seconds)
        except RequestError as e:
            raise APIError(400, str(e), "seconds") from None
    return GenerationRequest(
        prompt=body.prompt,
        width=width,
        height=height,
        num_frames=num_frames,
        num_inference_steps=steps,
        seed=body.seed if "seed" in given else source.seed,
        first_frame=png,
        cache=source.cache,
    )


class DerivedVideos:
    """The routes, inherited by ``H3Ingress`` (run by its ``_call`` through ``route``)."""

    @router.post("/v1/videos/{video_id}/remix")
    @route("/v1/videos/{id}/remix")
    async def remix_video(self, request: Request, video_id: str):
        """A new job: the completed source's request with a new prompt (``remixed_from_video_id``)."""
        return await derive(cast("H3Ingress", self), request, video_id, RemixBody)

    @router.post("/v1/videos/{video_id}/extend")
    @route("/v1/videos/{id}/extend")
    async def extend_video(self, request: Request, video_id: str):
        """A new job starting from the completed source's last frame (FL2VA), with a new prompt
        (``extended_from_video_id``)."""
        return await derive(cast("H3Ingress", self), request, video_id, ExtendBody)
