"""LoRA adapters at the ingress: a request's ``lora`` list (or the adapter its ``model`` id names) checked against
the deployment's adapters and limits before any replica sees it, as the one string they travel as
(``lora_spec.composition_key``); and the admin's ``POST /v1/adapters`` / ``DELETE /v1/adapters/{name}`` bodies and
errors (the routes themselves are ``routes.H3Ingress``'s). Torch-free."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3serve.deploy.common.errors import APIError, invalid, root_cause
from h3serve.deploy.ingress.bodies import Body, parse_json_object
from h3serve.deploy.ingress.tenants import Tenant
from h3serve.pipelines.h3.lora_spec import LoraError, LoraSpec, LoraSpecs, composition_key, validate_lora_name
from h3serve.pipelines.h3.request import RequestError


def lora_of(body: Body, model_adapter: str | None, specs: LoraSpecs) -> str | None:
    """The adapters ``body`` runs on: ``model_adapter`` (its model id's), or its ``lora`` list; None: the base model.

    400 on ``lora`` for both at once, an unknown adapter (naming it and the served ones), a repeated one, a list over
    ``lora_limits.max_per_request``, or adapters distilled for different steps or shifts.
    """
    if body.lora is None:
        return model_adapter
    if model_adapter is not None:
        raise APIError(
            400, f"lora: the model id already names adapter {model_adapter!r}; use the base model id with lora", "lora"
        )
    key = composition_key([(use.name, use.scale) for use in body.lora])
    steps_on(body, key, specs, field="lora")  # every check that needs no model
    # every weight explicit: a replica that refuses the list (its adapter unloaded meanwhile) names `lora`, not `model`
    return composition_key(
        [(use.name, specs.loras[use.name].scale if use.scale is None else use.scale) for use in body.lora]
    )


def steps_on(body: Body, adapter: str | None, specs: LoraSpecs, field: str | None = None) -> int | None:
    """The steps ``body`` runs on ``adapter``: a few-step adapter's own when the body sets none, else the body's.

    ``field``: the field a refused adapter list is named by (None: the one ``LoraSpecs.compose`` names)."""
    given = "num_inference_steps" in body.model_fields_set
    try:
        return specs.compose(adapter, body.num_inference_steps, given).steps
    except RequestError as e:
        name = e.field if field is None or e.field == "num_inference_steps" else field
        raise APIError(400, f"{name}: {e}" if name == "lora" else str(e), name) from None


# -- adapters at run time: POST /v1/adapters, DELETE /v1/adapters/{name} (admin) ----------------------------------


class AdapterBody(BaseModel):
    """``POST /v1/adapters``: an adapter as the deploy args' ``loras`` declare one, and its name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="its model id becomes '<served_model_name>:<name>'")
    path: str = Field(
        min_length=1,
        description="a local directory in diffusers' LoRA format that every H3Replica's node can read (a shared "
        "volume); fsspec URLs (s3://...) are refused with a 400 on path",
    )
    scale: float = Field(default=1.0, allow_inf_nan=False)
    steps: int | None = Field(default=None, ge=2)
    shift: float | None = Field(default=None, gt=0, allow_inf_nan=False)


def check_admin(request: Request) -> None:
    """403 unless the caller is an admin (open mode: every caller is, as ``GET /v1/me`` says)."""
    tenant: Tenant | None = request.state.tenant
    if tenant is not None and not tenant.admin:
        raise APIError(403, f"only an admin key may change the adapters; tenant {tenant.name!r} is a user")


# the POST body's schema in /openapi.json (its route reads the raw body: FastAPI would not document it)
ADAPTER_BODY_SCHEMA = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": AdapterBody.model_json_schema()}},
    }
}
ADAPTERS_TTL_S = 2.0  # how stale an ingress's copy of the adapter registry may be (a DELETE reaches every ingress)


def adapter_spec(raw: bytes, specs: LoraSpecs, max_steps: int) -> tuple[str, LoraSpec]:
    """The name and spec of ``POST /v1/adapters``'s body, or 400 naming the field (409 for a name served)."""
    try:
        body = AdapterBody.model_validate(parse_json_object(raw))
    except ValidationError as e:
        raise invalid(e) from None
    try:
        validate_lora_name(body.name)
    except LoraError as e:
        raise APIError(400, f"name: {e}", "name") from None
    if body.name in specs.loras:
        raise APIError(409, f"name: adapter {body.name!r} is already served; DELETE it first", "name")
    if body.steps is not None and body.steps > max_steps:
        raise APIError(400, f"steps: {body.steps} is over this server's limits.max_steps {max_steps}", "steps")
    if "://" in body.path:
        raise APIError(400, "path: a local directory the replicas can read (fsspec URLs are not read yet)", "path")
    fields = body.model_dump(exclude={"name"})
    return body.name, LoraSpec(**fields)


def load_refused(error: BaseException) -> APIError | None:
    """A replica's LoraError (the adapter does not fit the checkpoint, naming the module, or the adapter budget) as
    a 400 on ``path``; None for any other error (the route's usual mapping)."""
    cause = root_cause(error)
    if isinstance(cause, LoraError):
        return APIError(400, f"path: {cause}", "path")
    return None


def never_loaded(error: BaseException) -> bool:
    """Whether a replica's refusal to unload an adapter says it does not serve it (it never ran a request on it, or
    could not load it): nothing of it to wait for there."""
    return isinstance(root_cause(error), LoraError)
