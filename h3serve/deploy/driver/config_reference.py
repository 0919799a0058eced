"""The serve config's ``args:`` reference, generated from ``DeployArgs`` (its fields and descriptions).

python -m h3serve.deploy.driver.config_reference > docs/CONFIG.md     (tests/test_config_reference.py checks it)
"""

from __future__ import annotations

import sys
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from h3serve.deploy.common.args import DeployArgs

BACKPRESSURE = """\
## Backpressure

Every queue in front of the engine is bounded, so overload answers HTTP 503 with `Retry-After`, never an
unbounded wait. The builder sizes the ingress from the engine's bounds
(`h3serve.deploy.ingress.routes.ingress_options`):

- **generation slots** = `ingress.h3_replicas` x (`engine.max_queue` + `engine.max_active`): the most
  generation requests the H3 replicas hold at once, queued or running. A further one gets 503 from a
  replica's engine (its queue is full), or from the ingress itself once that ingress replica already holds
  this many valid generation requests (an image request counts until it is answered, a video request until
  its job is queued).
- H3Ingress `max_ongoing_requests` = generation slots + `ingress.headroom` + `ingress.event_streams`: whatever
  the generations hold, `headroom` requests more (job polls, listings, downloads, `/health`) are served at once,
  and `event_streams` open event streams besides (each is an ongoing request while it lasts; one more gets 503).
- H3Ingress `max_queued_requests` = `ingress.headroom`: requests waiting at each Serve proxy for an ingress
  replica; past it the proxy answers 503 with `Retry-After: 2` (a plain-text body, Serve's own).

Each H3Ingress replica gets the full count, since Serve may route every generation to one of them.
`ingress.h3_replicas` must equal the most H3Replica replicas: `autoscaling.max_replicas` with
`args.autoscaling` (it follows it when left out), else the H3Replica's `num_replicas` (or
`autoscaling_config.max_replicas`) under `deployments:` (the builder cannot read that section): `h3serve admit`
and `h3serve serve` refuse a config where they differ, or where H3Ingress sets `max_ongoing_requests` or
`max_queued_requests` there (which would replace the derived values). A 503 from the API carries a generic
message; what caused it is in the log under the request's `X-Request-Id`.
"""

SCHEDULING = """\
## Scheduling

`h3serve/deploy/serve_config.yaml` (CPU) runs one request at a time with the least remaining work first
(`engine.max_active: 1`, `engine.policy: srpt`); the GPU configs pack (`max_active: 8`, `fcfs`). Why, from
`python -m benchmarks.served_trace` (docs/BENCHMARKS.md section 16: a seeded trace over HTTP, stills and 5 s and
10 s clips, against fresh `h3serve serve` apps):

- On a CPU replica at one torch thread a forward's time grows with its rows, so a pack of several requests costs
  the step loop the same CPU as running them one after another (8.7-10.0 CPU seconds for the same trace either way)
  and shares it: each request's steps stretch (a still's from 0.69 s to 1.81 s). That is processor sharing,
  which loses to first-come-first-served on mean latency when requests are of similar size (**projected** 1.5x
  for the trace's mix at load 0.8, one server, Poisson arrivals). The stage worker still prepares the next
  request and decodes the last one beside the steps at `max_active: 1`.
- srpt at `max_active: 1` is preemptive shortest-remaining-first at step boundaries, the order with the least
  mean latency on one server (**projected** 0.8x of FCFS's mean, stills' P99 0.2x, for the same mix; measured
  in process, section 7: 0.49x and 0.82x). The engine ranks by rows x steps left: a still and a 5 s clip have
  the same rows, so stills go before 10 s clips only. `aging_s` halves a waiting request's key every 60 s, so a
  long clip is not starved.
- On a GPU a small request's forward leaves the device mostly idle, so a pack adds throughput there: the GPU
  configs keep packing (not measured in this change: no GPU was lent).
- `engine.stage_nice`, `engine.encode_threads` and `engine.step_events_every_s` are there to measure decodes,
  encodes and progress events competing with the steps; they stay at 0 (the old behaviour) until a measurement
  on quiet cores supports another value (on the shared machine of section 16 they were inside the noise).
"""

VAE_DTYPE = """\
## VAE dtype

`vae_dtype: bfloat16` is the VAEs as released: diffusers' `from_pretrained(torch_dtype=bfloat16)` keeps each VAE's
`_keep_in_fp32_modules` in float32 (the video encoder, `quant_conv`, the decoder's norms and scales; most of the audio
VAE) and runs the 36-layer ViT video decoder in bf16; on GPUs that is the default, and a stage deployment lets its
float32 matmuls use TF32. The frames equal diffusers' own pipeline at the same dtype within one uint8 step
(`tests/test_vae_dtype.py`). On CPUs the default stays `float32`, the exact reference the CPU tests and the demo's
evaluation compare against, not for speed: measured with `python -m benchmarks.parallel_decode` (2026-12-05, the
shared 2-core machine, one torch thread, the tiny VAEs, whole decode of both VAEs, two runs), bf16 took 0.95x and
1.09x of fp32's time on the default 128x64 5 s clip (0.11-0.13 s: noise) and 0.74x and 0.86x at 640x384 (2.6-3.1 s
against 3.5-3.6 s), on a Xeon with AVX512-BF16 and AMX-BF16 (a CPU without them may well be slower in bf16).
`vae_dtype: bfloat16` on such a CPU deployment is valid and faster; its frames differ from fp32's by the bf16
rounding.
"""


def _type(field: FieldInfo) -> str:
    text = str(field.annotation).replace("typing.", "")
    for noise in (
        "<class '",
        "'>",
        "h3serve.deploy.common.args.",
        "h3serve.replicas.engine.",
        "h3serve.attention.platform.",
        "h3serve.deploy.jobs.store.",
    ):
        text = text.replace(noise, "")
    return text


def _default(field: FieldInfo) -> str:
    if field.default_factory_takes_validated_data:
        return "depends"  # on other fields: the description says how
    if field.default_factory is not None:
        value = field.get_default(call_default_factory=True)
        return "see below" if isinstance(value, BaseModel) else repr(value)
    return "required" if field.is_required() else repr(field.default)


def _rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    rows, nested = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        cells = (f"`{key}`", f"`{_type(field)}`", f"`{_default(field)}`", field.description or "")
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        annotation = field.annotation
        # an optional section (``stages: StagesArgs | None``) documents its fields as a required one does
        models = [a for a in typing.get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in typing.get_args(annotation):
            annotation = models[0]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation.model_fields:
            nested.append((key, annotation))
    for key, annotation in nested:
        if annotation.__name__ != "Platform":  # a probe's output, documented by `h3serve probe`
            rows += _rows(annotation, f"{key}.")
    return rows


def reference() -> str:
    lines = [
        "# Serve config reference",
        "",
        "Every key under an application's `args:` in a serve config (`h3serve/deploy/serve_config.yaml`,",
        "`h3serve/deploy/serve_config.gpu.yaml`): the fields of `h3serve.deploy.common.args.DeployArgs`. Generated by",
        "`python -m h3serve.deploy.driver.config_reference`; `h3serve admit CONFIG` validates a config against it.",
        "",
        "| key | type | default | meaning |",
        "| --- | --- | --- | --- |",
        *_rows(DeployArgs),
        "",
        BACKPRESSURE,
        SCHEDULING,
        VAE_DTYPE,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(reference())
