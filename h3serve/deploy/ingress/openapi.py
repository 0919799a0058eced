"""The OpenAPI document: FastAPI's routes, plus the bodies and query parameters the ingress parses itself.

The routes take a raw ``Request`` (so that every malformed body gets an explicit 4xx), which FastAPI
cannot describe; this fills in what they accept, with this deployment's limits and the model's rules,
so clients and schema fuzzers see the real API. Every field of the validating models must be
described here (``properties`` raises KeyError otherwise), so the two cannot drift apart.

``swagger_page`` and ``redoc_page`` embed the document in the page rather than pointing the browser at
/openapi.json, which it would fetch without the bearer token.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from pydantic import BaseModel

from h3serve.deploy.common.args import RequestLimits
from h3serve.deploy.jobs.idempotency import KEY
from h3serve.deploy.jobs.records import JOB_ID
from h3serve.deploy.jobs.variants import SPRITE_COLUMNS, SPRITE_ROWS, SPRITE_TILE_WIDTH, VARIANTS
from h3serve.pipelines.h3 import ModelRules
from h3serve.replicas import MAX_PRIORITY, MIN_PRIORITY

# an X-Request-Id a client may send (Serve's proxy makes a uuid4 when it sends none)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
REQUEST_ID_HEADER = {
    "name": "X-Request-Id",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": f"^{REQUEST_ID.pattern}$"},
    "description": "names this request in the server's logs and in a video job's record; echoed in the "
    "answer's X-Request-Id header (one is made when none is sent)",
}
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": f"^{KEY.pattern}$"},
    "description": "makes a retried POST the same request (Stripe's header): the same key with the same body within "
    "jobs.idempotency_window_s answers with the first request's answer (a video: the same job, as it reads now), "
    "never a second generation; the same key with another body is a 422 naming this header",
}
IDEMPOTENT_POSTS = (
    "/v1/videos",
    "/v1/images/generations",
    "/v1/videos/{video_id}/remix",
    "/v1/videos/{video_id}/extend",
)
BEARER = {"type": "http", "scheme": "bearer"}
LAST_EVENT_ID = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "pattern": "^[0-9]{1,9}$"},
    "description": "resume after this event of the stream (an EventSource sends it when it reconnects)",
}
CONTENT_PARAMETERS = [
    {
        "name": "variant",
        "in": "query",
        "required": False,
        "schema": {"enum": list(VARIANTS), "default": "video"},
        "description": "video: the MP4 (H.264 + AAC); thumbnail: its middle frame, full size, PNG; spritesheet: "
        f"{SPRITE_COLUMNS * SPRITE_ROWS} evenly spaced frames (first to last), a {SPRITE_COLUMNS}x{SPRITE_ROWS} grid, "
        f"row-major, each {SPRITE_TILE_WIDTH} px wide (a narrower clip: its width), JPEG. Images are made on first "
        "request and kept as long as the clip; joined: an extend with join's source and it as one MP4 (made when it "
        "completes)",
    },
    {
        "name": "Range",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "pattern": "^bytes=[0-9]*-[0-9]*$"},
        "description": "one byte range (bytes=first-last, bytes=first-, bytes=-suffix): 206 with Content-Range; "
        "past the end: 416; several ranges or another unit: the whole file",
    },
    {
        "name": "If-Range",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "the ETag a partial download began with: the Range is honoured only while it still matches",
    },
    {
        "name": "If-None-Match",
        "in": "header",
        "required": False,
        "schema": {"type": "string"},
        "description": "ETags the caller holds: 304 without a body when one is this content's",
    },
]
CONTENT_RESPONSES = {
    "200": {
        "description": "the whole file; ETag (strong: its sha256) and Accept-Ranges: bytes. While the job decodes "
        "(on the ingress that runs it), the video is its fragmented MP4 as the decode makes it, played as it arrives: "
        "X-H3serve-Stream: fragmented-mp4, no length, ETag or ranges",
        "content": {
            media_type: {"schema": {"type": "string", "format": "binary"}}
            for media_type in dict.fromkeys(media for _, media in VARIANTS.values())
        },
    },
    "206": {"description": "the asked byte range, with Content-Range: bytes first-last/size"},
    "304": {"description": "If-None-Match named this content's ETag: no body"},
    "416": {"description": "the Range starts past the end; Content-Range: bytes */size"},
}
SWAGGER_JS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"
SWAGGER_CSS = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"
REDOC_JS = "https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"], "description": "the request parameter at fault, if one is"},
                "code": {"type": "integer", "description": "the HTTP status"},
            },
        }
    },
}
VIDEO = {
    "type": "object",
    "required": ["id", "object", "status", "progress", "created_at"],
    "properties": {
        "id": {"type": "string"},
        "object": {"const": "video"},
        "model": {"type": "string"},
        "status": {"enum": ["queued", "in_progress", "completed", "failed", "cancelled"]},
        "progress": {"type": "integer"},
        "queue_position": {
            "type": ["integer", "null"],
            "description": "while queued: its place in its replica's queue (1 starts next); null otherwise",
        },
        "eta_seconds": {
            "type": ["number", "null"],
            "description": "while queued or in progress: seconds until it is decoded, estimated from the replica's "
            "measured row-step rate; null otherwise",
        },
        "created_at": {"type": "integer"},
        "completed_at": {"type": ["integer", "null"]},
        "expires_at": {"type": ["integer", "null"]},
        "seconds": {"type": "string"},
        "size": {"type": "string"},
        "prompt": {"type": "string"},
        "error": {"type": ["object", "null"]},
        "remixed_from_video_id": {
            "type": "string",
            "description": "a remix's source job (POST /v1/videos/{id}/remix); absent on other jobs",
        },
        "extended_from_video_id": {
            "type": "string",
            "description": "an extension's source job, whose last frame this clip starts from (POST "
            "/v1/videos/{id}/extend); absent on other jobs",
        },
        "join": {
            "type": "boolean",
            "description": "an extension asked with join: true; its content's ?variant=joined is the source and it as "
            "one MP4 once it completes (false: the source was removed before it completed); absent on other jobs",
        },
    },
}
VIDEO_ID = {"type": "string", "pattern": f"^{JOB_ID.pattern}$", "description": "as returned by POST /v1/videos"}
UPLOAD_JSON = {"type": "string", "description": "an image as base64 or a data: URL"}
UPLOAD_FORM = {"type": "string", "format": "binary", "description": "an image file"}
REFERENCE_JSON = {
    "type": "object",
    "required": ["kind", "data"],
    "properties": {"kind": {"enum": ["image", "video", "audio"]}, "data": {"type": "string", "description": "base64"}},
}


def field_docs(
    limits: RequestLimits,
    rules: ModelRules | None,
    form: bool,
    cache_tiers: tuple[list[str], str] = (["off"], "off"),
    model_ids: list[str] | None = None,
) -> dict[str, dict]:
    longest = limits.max_seconds if rules is None else min(limits.max_seconds, rules.max_seconds)
    seconds = {
        "type": "number",
        "maximum": longest,
        "description": "clip length; default: the shortest the model "
        "makes" + ("" if rules is None else f" ({rules.min_seconds:g} s)"),
    }
    if rules is not None:
        seconds["minimum"] = rules.min_seconds
    return {
        "prompt": {"type": "string", "minLength": 1, "maxLength": limits.max_prompt_chars},
        "join": {
            "type": "boolean",
            "default": False,
            "description": "extend only: also the source and the new clip as one MP4 (the new clip's frames after its "
            "first, which repeats the source's last), made when it completes: GET .../content?variant=joined",
        },
        "model": {
            "type": "string",
            **({"enum": model_ids} if model_ids else {}),
            "description": "the served model's id (GET /v1/models), or omitted: the base model; "
            "'<base id>:<adapter>' runs a LoRA adapter of the deployment (its default num_inference_steps is the "
            "adapter's); another id gets HTTP 400 listing these",
        },
        "lora": {
            "description": "LoRA adapters composed on this request, each at its own weight (diffusers' "
            "set_adapters(names, weights)); scale omitted: the adapter's own. One name or object is one adapter. "
            "An unknown adapter, a repeated one, more than the deployment's lora_limits.max_per_request, or adapters "
            "distilled for different steps get HTTP 400 on 'lora'" + ("; in a form, JSON text" if form else ""),
            **(
                {"type": "string"}
                if form
                else {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}, "scale": {"type": "number"}},
                        "additionalProperties": False,
                    },
                }
            ),
        },
        "size": {
            "type": "string",
            "pattern": "^[0-9]{1,5}x[0-9]{1,5}$",
            "description": "WIDTHxHEIGHT; default: "
            "the model's own canvas. At most max_pixels, and within the model's canvas rules",
        },
        "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "num_inference_steps": {
            "type": "integer",
            "minimum": 2,
            "maximum": limits.max_steps,
            "description": f"default {limits.default_steps}",
        },
        "n": {"type": "integer", "minimum": 1, "maximum": limits.max_n, "description": "images, one clip each"},
        "response_format": {"enum": ["b64_json"]},
        "seconds": seconds,
        "fps": {"type": "integer", "description": "the model's own frame rate, or omitted"}
        if rules is None
        else {"enum": [rules.fps], "description": "the model's own frame rate, or omitted"},
        "webhook": {
            "type": "string",
            "format": "uri",
            "maxLength": 2048,
            "description": "a URL the finished job's object (completed, failed or cancelled) is POSTed to, signed "
            "(Standard Webhooks: webhook-id, webhook-timestamp, webhook-signature; h3serve.client.verify_webhook "
            "checks one) and retried with backoff; https, and a host whose every address is public unless the "
            "deployment's jobs.webhooks.allow names its network (else HTTP 400). Default: jobs.webhooks.url. A "
            "deployment without jobs.webhooks.secret_env refuses it",
        },
        "timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": limits.max_timeout_s,
            "description": "the request's deadline in seconds from its arrival: past it the request leaves the "
            "engine and gets HTTP 504 (error type 'timeout'; a video job fails with code 'timeout'). Default: the "
            "deployment's engine.default_deadline_s (none unless configured)",
        },
        "priority": {
            "type": "integer",
            "minimum": MIN_PRIORITY,
            "maximum": MAX_PRIORITY,
            "default": 0,
            "description": "higher runs first when the deployment's engine.policy is 'priority' (a running request "
            "of lower priority pauses at a step boundary for it and resumes later); the other policies ignore it",
        },
        "cache": {
            "enum": cache_tiers[0],
            "default": cache_tiers[1],
            "description": "step caching for this request: 'off', or a tier of the deployment (engine.step_cache). "
            "A cached step skips most transformer blocks when the request's first-block output barely changed "
            "since its last computed step: faster, at some fidelity; decided per request, whatever shares its pack",
        },
        "input_reference": {**(UPLOAD_FORM if form else UPLOAD_JSON), "description": "the first frame (FL2VA)"},
        "last_reference": {**(UPLOAD_FORM if form else UPLOAD_JSON), "description": "the last frame (FL2VA)"},
        "references": {
            "type": "array",
            "description": "ordered image, video or audio references (Ref2VA)",
            "items": {"type": "string", "format": "binary"} if form else REFERENCE_JSON,
        },
    }


def properties(model: type[BaseModel], docs: dict[str, dict]) -> dict:
    """The body's fields: all of them, or those it declares it takes (``documented``: remix's and extend's)."""
    names = getattr(model, "documented", None) or tuple(model.model_fields)
    return {
        "type": "object",
        "required": [n for n in names if model.model_fields[n].is_required()],
        "properties": {name: docs[name] for name in names},
    }


def document(
    base: dict,
    bodies: dict[str, type[BaseModel]],
    limits: RequestLimits,
    rules: ModelRules | None,
    public_routes: tuple[str, ...] | None = None,
    cache_tiers: tuple[list[str], str] = (["off"], "off"),
    model_ids: list[str] | None = None,
) -> dict:
    """``base`` (FastAPI's document) with request bodies, query parameters and error responses filled in.
    ``public_routes``: with a bearer token configured, the routes that answer without it (every other
    operation declares the bearer scheme, so Swagger's Authorize button sends the token). ``cache_tiers``: the
    values a request's ``cache`` field may take here, and its default. ``model_ids``: the ids ``model`` may name."""
    doc = copy.deepcopy(base)
    components = doc.setdefault("components", {})
    components.setdefault("schemas", {}).update(Error=ERROR, Video=VIDEO)
    if public_routes is not None:
        components["securitySchemes"] = {"bearer": BEARER}
    error = {
        "description": "an error in OpenAI's shape",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    json_docs = field_docs(limits, rules, form=False, cache_tiers=cache_tiers, model_ids=model_ids)
    form_docs = field_docs(limits, rules, form=True, cache_tiers=cache_tiers, model_ids=model_ids)
    for path, methods in doc["paths"].items():
        for method, operation in methods.items():
            operation["responses"].pop("422", None)  # FastAPI's validation shape; h3serve answers 400
            operation["responses"]["default"] = error
            operation.setdefault("parameters", []).append(REQUEST_ID_HEADER)
            if public_routes is not None and path not in public_routes:
                operation["security"] = [{"bearer": []}]
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "video_id":
                    parameter["schema"] = VIDEO_ID
            model = bodies.get(f"{method.upper()} {path}")
            if model is not None:
                content: dict[str, Any] = {"application/json": {"schema": properties(model, json_docs)}}
                if "input_reference" in model.model_fields:  # the openai client posts videos as multipart
                    content["multipart/form-data"] = {"schema": properties(model, form_docs)}
                operation["requestBody"] = {"required": True, "content": content}
    for path in IDEMPOTENT_POSTS:
        post = doc["paths"].get(path, {}).get("post")
        if post is not None:
            post["parameters"].insert(0, IDEMPOTENCY_KEY)
    video_answers = (
        ("/v1/videos", "post"),
        ("/v1/videos/{video_id}", "get"),
        ("/v1/videos/{video_id}/remix", "post"),
        ("/v1/videos/{video_id}/extend", "post"),
    )
    for path, method in video_answers:
        if method in doc["paths"].get(path, {}):
            doc["paths"][path][method]["responses"]["200"]["content"] = {
                "application/json": {"schema": {"$ref": "#/components/schemas/Video"}}
            }
    if "post" in doc["paths"].get("/v1/videos/{video_id}/cancel", {}):
        doc["paths"]["/v1/videos/{video_id}/cancel"]["post"]["responses"]["200"]["content"] = {
            "application/json": {"schema": {"$ref": "#/components/schemas/Video"}}
        }
    events = doc["paths"].get("/v1/videos/{video_id}/events", {}).get("get")
    if events is not None:
        events["parameters"].insert(0, LAST_EVENT_ID)
        events["responses"]["200"]["content"] = {
            "text/event-stream": {
                "schema": {"type": "string"},
                "description": "events queued, started, step, preview, decoding, then completed, failed or "
                "cancelled (the stream ends there); each data line is JSON",
            }
        }
    download = doc["paths"].get("/v1/videos/{video_id}/content", {}).get("get")
    if download is not None:
        download["parameters"][1:1] = copy.deepcopy(CONTENT_PARAMETERS)  # after video_id
        download["responses"].update(copy.deepcopy(CONTENT_RESPONSES))
    page = doc["paths"].get("/", {}).get("get")
    if page is not None:
        page["responses"]["200"]["content"] = {"text/html": {"schema": {"type": "string"}}}
    listing = doc["paths"].get("/v1/videos", {}).get("get")
    if listing is not None:
        listing["parameters"] = [
            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
            {"name": "after", "in": "query", "schema": VIDEO_ID},
            {"name": "order", "in": "query", "schema": {"enum": ["asc", "desc"]}},
            REQUEST_ID_HEADER,
        ]
    return doc


def html_json(value: Any) -> str:
    """JSON that is safe inside a <script> element (no "</script>", no HTML entities)."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def swagger_page(doc: dict, title: str) -> str:
    """Swagger UI with ``doc`` inline (its ``spec`` option): nothing to fetch, so nothing without the token. The token
    typed into its Authorize dialog stays in the tab's memory (``persistAuthorization`` off: not in localStorage)."""
    return f"""<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{SWAGGER_CSS}">
<title>{title}</title>
</head>
<body>
<div id="swagger-ui"></div>
<script src="{SWAGGER_JS}"></script>
<script id="openapi-document" type="application/json">{html_json(doc)}</script>
<script>
const spec = JSON.parse(document.getElementById("openapi-document").textContent);
SwaggerUIBundle({{
  spec: spec,
  dom_id: "#swagger-ui",
  layout: "BaseLayout",
  deepLinking: true,
  persistAuthorization: false,
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
}});
</script>
</body>
</html>
"""


def swagger_sign_in_page(title: str) -> str:
    """What a browser gets at /docs without a key (with the 401): a form for the key, which then fetches the document
    with it as a bearer token and opens Swagger UI authorized with it. The key stays in the tab's memory only (not in
    sessionStorage or localStorage, not in the URL); the page itself holds no data."""
    return f"""<!DOCTYPE html>
<html>
<head>
<meta name="viewport" content="width=device-width, initial-scale=1.0">
<link type="text/css" rel="stylesheet" href="{SWAGGER_CSS}">
<title>{title}</title>
</head>
<body>
<form id="key-form" style="margin: 2em; font-family: sans-serif">
<label>API key <input id="key" type="password" autocomplete="off"></label> <button>Authorize</button>
<span id="key-error"></span>
</form>
<div id="swagger-ui"></div>
<script src="{SWAGGER_JS}"></script>
<script>
document.getElementById("key-form").addEventListener("submit", async (e) => {{
  e.preventDefault();
  const key = document.getElementById("key").value.trim();
  const url = location.pathname.replace(/[/]docs[/]?$/, "") + "/openapi.json";
  const response = await fetch(url, {{headers: {{Authorization: "Bearer " + key}}}});
  if (!response.ok) {{
    document.getElementById("key-error").textContent = "the key was refused (" + response.status + ")";
    return;
  }}
  document.getElementById("key-form").hidden = true;
  const ui = SwaggerUIBundle({{
    spec: await response.json(),
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    persistAuthorization: false,
    presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset],
  }});
  ui.preauthorizeApiKey("bearer", key);
}});
</script>
</body>
</html>
"""


def redoc_page(doc: dict, title: str) -> str:
    """Redoc with ``doc`` inline (``Redoc.init`` with an object rather than a spec-url)."""
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>body {{ margin: 0; padding: 0; }}</style>
</head>
<body>
<div id="redoc"></div>
<script src="{REDOC_JS}"></script>
<script id="openapi-document" type="application/json">{html_json(doc)}</script>
<script>
Redoc.init(JSON.parse(document.getElementById("openapi-document").textContent), {{}}, document.getElementById("redoc"));
</script>
</body>
</html>
"""
