"""A request's LoRA adapters at the ingress: its ``lora`` list (or the adapter its ``model`` id names) checked against
the deployment's adapters and limits before any replica sees it, as the one string they travel as
(``lora_spec.composition_key``). Torch-free."""

from __future__ import annotations

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.ingress.bodies import Body
from h3serve.pipelines.h3.lora_spec import LoraSpecs, composition_key
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
    return key


def steps_on(body: Body, adapter: str | None, specs: LoraSpecs, field: str | None = None) -> int | None:
    """The steps ``body`` runs on ``adapter``: a few-step adapter's own when the body sets none, else the body's.

    ``field``: the field a refused adapter list is named by (None: the one ``LoraSpecs.compose`` names)."""
    given = "num_inference_steps" in body.model_fields_set
    try:
        return specs.compose(adapter, body.num_inference_steps, given).steps
    except RequestError as e:
        name = e.field if field is None or e.field == "num_inference_steps" else field
        raise APIError(400, f"{name}: {e}" if name == "lora" else str(e), name) from None
