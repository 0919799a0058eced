"""LoRA adapters at the ingress: a request's ``lora`` list (or the adapter its ``model`` id names) checked against
the deployment's adapters and limits before any replica sees it, as the one string they travel as
(``lora_spec.composition_key``); and the admin's ``POST /v1/adapters`` / ``DELETE /v1/adapters/{name}``: their
bodies, errors and routes, and the ingress's copy of the application's adapter registry (``refresh_adapters``, which
``H3Ingress._call`` runs before every non-public route). Torch-free.

The routes are methods of ``AdapterRoutes``, which ``H3Ingress`` inherits (Serve binds a FastAPI router's methods
found along the class's MRO), as ``derived.DerivedVideos``'s are; the work is the module's functions over the ingress.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from h3serve.deploy.common.errors import APIError, invalid, root_cause
from h3serve.deploy.ingress.bodies import Body, parse_json_object
from h3serve.deploy.ingress.routing import route
from h3serve.deploy.ingress.tenants import Tenant
from h3serve.pipelines.h3.lora_spec import LoraError, LoraSpec, LoraSpecs, composition_key, validate_lora_name
from h3serve.pipelines.h3.request import RequestError

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

    from h3serve.deploy.common.args import RequestLimits
    from h3serve.deploy.jobs.adapter_registry import AdapterRegistry, Adapters


class H3Ingress(Protocol):
    """What the adapter routes need of ``routes.H3Ingress`` (which inherits them): the H3 replicas' handle, the
    request limits, the adapters it serves (the deploy args' and the registry's, as model ids and as specs), the
    registry, and its cached OpenAPI document (whose ``model`` enum lists the adapters' ids)."""

    replica: DeploymentHandle
    model_name: str
    limits: RequestLimits
    loras: dict[str, LoraSpec]
    lora_specs: LoraSpecs
    adapter_ids: dict[str, str]
    deploy_loras: dict[str, LoraSpec]
    adapter_registry: AdapterRegistry
    adapters_generation: int
    _openapi: dict | None


router = APIRouter()


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


async def register(ingress: H3Ingress, request: Request) -> dict:
    """Load the body's adapter on one H3Replica (checked against the checkpoint, warmed up), then record it in the
    registry; its adapter object."""
    check_admin(request)
    await refresh_adapters(ingress, fresh=True)
    name, spec = adapter_spec(await request.body(), ingress.lora_specs, ingress.limits.max_steps)
    try:
        nbytes = await ingress.replica.load_adapter.remote(name, spec)
    except Exception as e:
        refused = load_refused(e)
        if refused is None:
            raise
        raise refused from None

    def add(loras: dict) -> dict:
        if name in loras:  # another admin added it meanwhile
            raise APIError(409, f"name: adapter {name!r} is already served; DELETE it first", "name")
        return {**loras, name: spec}

    adapters = await asyncio.to_thread(ingress.adapter_registry.change, add)
    serve_adapters(ingress, adapters)
    return {
        "object": "adapter",
        "id": f"{ingress.model_name}:{name}",
        "name": name,
        "bytes": nbytes,
        "generation": adapters.generation,
        # one H3Replica loaded it before this answer; the others load it before serving a request on it
        "loaded": "checked_and_registered",
    }


async def unregister(ingress: H3Ingress, request: Request, name: str) -> dict:
    """Take run-time adapter ``name`` out of the registry, then wait for the running requests on it of the H3Replica
    this call reaches; its adapter object, deleted."""
    check_admin(request)
    await refresh_adapters(ingress, fresh=True)
    if name in ingress.deploy_loras:
        raise APIError(409, f"adapter {name[:80]!r} is declared in args.loras: remove it there and redeploy")
    if name not in ingress.loras:
        served = ", ".join(sorted(ingress.loras)) or "none"
        raise APIError(404, f"no adapter {name[:80]!r}; its adapters: {served}")

    def remove(loras: dict) -> dict:
        if name not in loras:
            raise APIError(404, f"no adapter {name[:80]!r}: another call deleted it")
        return {n: s for n, s in loras.items() if n != name}

    serve_adapters(ingress, await asyncio.to_thread(ingress.adapter_registry.change, remove))
    try:
        await ingress.replica.unload_adapter.remote(name)
    except Exception as e:  # that replica had not loaded it (it never ran a request on it): nothing to wait for
        if not never_loaded(e):
            raise
    return {"object": "adapter", "id": f"{ingress.model_name}:{name}", "name": name, "deleted": True}


async def refresh_adapters(ingress: H3Ingress, fresh: bool = False) -> None:
    """The registry's adapters beside the deploy-time ones (read at most every ``ADAPTERS_TTL_S``)."""
    registry = ingress.adapter_registry
    adapters = registry.cached() if not fresh else None
    if adapters is None:
        adapters = await asyncio.to_thread(registry.read, fresh)
    if adapters.generation != ingress.adapters_generation:
        serve_adapters(ingress, adapters)


def serve_adapters(ingress: H3Ingress, adapters: Adapters) -> None:
    """Serve the deploy-time adapters and ``adapters`` (the registry's generation) from now on."""
    loras = {**ingress.deploy_loras, **adapters.loras}
    ingress.adapters_generation = adapters.generation
    ingress.loras = loras
    ingress.lora_specs = ingress.lora_specs.model_copy(update={"loras": loras})
    ingress.adapter_ids = {f"{ingress.model_name}:{n}": n for n in loras}
    ingress._openapi = None  # its `model` enum lists the ids: built again on its next read


class AdapterRoutes:
    """The admin's adapter routes, inherited by ``H3Ingress`` (run by its ``_call`` through ``route``)."""

    @router.post("/v1/adapters", openapi_extra=ADAPTER_BODY_SCHEMA)
    @route("/v1/adapters")
    async def add_adapter(self, request: Request):
        """Admin: load a LoRA adapter (checked against the checkpoint, warmed up, by one H3Replica), then record it in
        the application's adapter registry: every ingress serves it from its next read of the registry, every other
        H3Replica loads it before its first request on it (or at its next health check), a new one at its start."""
        return await register(cast("H3Ingress", self), request)

    @router.delete("/v1/adapters/{name}")
    @route("/v1/adapters/{name}")
    async def delete_adapter(self, request: Request, name: str):
        """Admin: take run-time adapter ``name`` out of the registry (every ingress refuses new requests on it from
        its next read of the registry), then answer once the running requests on it of the H3Replica this call
        reaches finished (the others unload it at their next health check, once theirs finished)."""
        return await unregister(cast("H3Ingress", self), request, name)
