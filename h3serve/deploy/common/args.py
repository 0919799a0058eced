"""The typed arguments of the application builder, as written under ``args:`` in a serve config.

Over 600 lines on purpose: one schema, every section of ``args`` (engine, limits, jobs and webhooks, auth, ingress,
stages, autoscaling, LoRA) a pydantic model beside the checks that tie sections together; docs/CONFIG.md is
generated from it (``config_reference``), so a reader finds every setting, its default and its bounds in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from h3serve.attention import Platform, Resolution
from h3serve.deploy.common.autoscaling import POLICY_PATH
from h3serve.pipelines.h3 import AUTO, TransformerGeometry, default_dtype, default_vae_dtype, preset
from h3serve.pipelines.h3.lora_spec import LoraLimits, LoraSpec, LoraSpecs
from h3serve.pipelines.h3.step_cache_tiers import OFF, StepCacheTiers
from h3serve.pipelines.h3.uploads import MAX_UPLOAD_PIXELS
from h3serve.replicas import EngineLimits, ReplicaSpec

if TYPE_CHECKING:  # memory imports torch: the ingress, which imports these args, starts without it
    from h3serve.pipelines.h3.memory import MemoryPlan

# graceful_shutdown_timeout_s beyond engine.drain_timeout_s, for the replica and the ingress: the replica's drain
# poll, encoding the last MP4s, Serve's wait loop, and stopping the SP workers
DRAIN_MARGIN_S = 60.0


def default_served_name(model: str, checkpoint: str | None) -> str:
    """The model id a deployment serves unless named: the preset's, or for ``auto`` the checkpoint's folder name."""
    if model == AUTO:
        return Path(checkpoint).name if checkpoint else AUTO  # auto without a checkpoint is refused below
    return preset(model).name


class RequestLimits(BaseModel):
    """What one HTTP request may ask for, on top of the model's own rules. Violations are 4xx naming the field."""

    model_config = ConfigDict(extra="forbid")

    max_pixels: int = Field(default=1344 * 768, ge=1, description="largest width x height a request may ask for")
    max_image_pixels: int = Field(
        default=MAX_UPLOAD_PIXELS,
        ge=1,
        le=MAX_UPLOAD_PIXELS,
        description="largest width x height of an uploaded image (input_reference, last_reference, image "
        f"references), read from its header at submit: larger, or undecodable, is HTTP 400 before a job exists. At "
        f"most {MAX_UPLOAD_PIXELS} ({int(MAX_UPLOAD_PIXELS**0.5)}x{int(MAX_UPLOAD_PIXELS**0.5)}), the bound every "
        "replica checks again before decoding",
    )
    max_seconds: float = Field(default=15.0, gt=0, description="longest clip a request may ask for, in seconds")
    max_n: int = Field(default=4, ge=1, description="images per /v1/images/generations request")
    max_steps: int = Field(default=50, ge=2, description="largest num_inference_steps a request may ask for")
    default_steps: int = Field(default=50, ge=2, description="num_inference_steps when a request gives none")
    max_prompt_chars: int = Field(default=4000, ge=1, description="longest prompt, in characters")
    max_body_bytes: int = Field(
        default=16 * 2**20,
        ge=1024,
        description="largest HTTP request body, chunked or "
        "not: a prompt's few KB plus base64 keyframes and references (a 1344x768 PNG is up to "
        "~4 MB in base64); larger bodies get HTTP 413",
    )
    max_references: int = Field(
        default=8, ge=0, description="references (images, videos, audio) a Ref2VA request may send; more is HTTP 400"
    )
    max_reference_seconds: float = Field(
        default=30.0,
        gt=0,
        description="longest video or audio reference, as its container declares it (read at submit without decoding: "
        "a file that declares no duration is refused); longer is HTTP 400 naming references[i]",
    )
    max_reference_frames: int = Field(
        default=24 * 30, ge=1, description="most frames a video reference may declare (its container's count)"
    )
    max_reference_pixels: int = Field(
        default=1920 * 1080, ge=1, description="largest width x height of a video reference's frames"
    )
    max_reference_sample_rate: int = Field(
        default=48000, ge=1, description="highest sample rate of an audio reference, in Hz"
    )
    reference_video_codecs: list[str] = Field(
        default=["h264", "hevc", "vp8", "vp9", "av1", "mpeg4"],
        min_length=1,
        description="the codecs (FFmpeg's names) a video reference may be in; others are HTTP 400 before any decoder "
        "runs",
    )
    reference_audio_codecs: list[str] = Field(
        default=["aac", "mp3", "opus", "vorbis", "flac", "pcm_s16le", "pcm_s24le", "pcm_f32le"],
        min_length=1,
        description="the codecs (FFmpeg's names) an audio reference may be in",
    )
    max_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="largest timeout_s a request may give (its deadline, in seconds from arrival); "
        "a request without one gets engine.default_deadline_s",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_video_jobs" in data:
            raise ValueError(
                "limits.max_video_jobs is gone: finished video jobs are kept by jobs.ttl_s and jobs.max_bytes only, "
                "and unfinished ones are capped by jobs.max_unfinished; move the value there"
            )
        return data

    @model_validator(mode="after")
    def _steps(self) -> RequestLimits:
        if self.default_steps > self.max_steps:
            raise ValueError(f"default_steps={self.default_steps} exceeds max_steps={self.max_steps}")
        return self


class IngressArgs(BaseModel):
    """How much one H3Ingress replica holds at once. Its Serve options are derived from these and the
    engine's bounds (``DeployArgs.generation_slots``; docs/CONFIG.md#backpressure)."""

    model_config = ConfigDict(extra="forbid")

    h3_replicas: int = Field(
        default=1,
        ge=1,
        description="the most H3Replica replicas this application runs: autoscaling.max_replicas when args.autoscaling "
        "is set (then it follows it by default); else num_replicas, or autoscaling_config.max_replicas, of H3Replica "
        "under the serve config's deployments: (the builder cannot read that section, so it is repeated here; "
        "`h3serve admit` and `h3serve serve` refuse a config where the two disagree). With the engine's bounds it sets "
        "how many generations an ingress replica holds",
    )
    headroom: int = Field(
        default=32,
        ge=1,
        description="requests an H3Ingress replica takes beyond the generations it holds: job polls, "
        "listings, downloads, /health, POSTs being parsed. It is also the queue in front of each ingress "
        "replica at each proxy (Serve's max_queued_requests); past it the proxy answers HTTP 503 with Retry-After",
    )
    event_streams: int = Field(
        default=128,
        ge=1,
        description="open event streams (GET /v1/videos/{id}/events) an H3Ingress replica holds beyond the above: each "
        "is an ongoing request for Serve while it lasts; one more gets HTTP 503 with Retry-After. An idle stream costs "
        "a waiting coroutine, nothing on the engine",
    )


class WebhookArgs(BaseModel):
    """Signed POSTs of a finished video job to a URL (``h3serve.deploy.jobs.webhooks``)."""

    model_config = ConfigDict(extra="forbid")

    secret_env: str | None = Field(
        default=None,
        description="environment variable holding the signing secret (Standard Webhooks: a 'whsec_' + base64 key, or "
        "any other string, used as its UTF-8 bytes); an empty or unset variable refuses to start. null (the default): "
        "no webhooks, and a request's webhook field is a 400",
    )
    url: str | None = Field(
        default=None,
        description="the webhook of every video job whose request names none (needs secret_env); checked against "
        "allow at each delivery",
    )
    allow: list[str] = Field(
        default_factory=list,
        description="networks (CIDR, e.g. 10.0.0.0/8, 127.0.0.1/32) a webhook may reach although they are loopback, "
        "link-local, private, reserved or a cloud metadata address: every address the host resolves to must be "
        "public or in one of these, else the request is a 400 naming webhook",
    )
    allow_http: bool = Field(
        default=False, description="also accept http:// webhooks (default: https only: the job object is sent)"
    )
    timeout_s: float = Field(default=10.0, gt=0, description="one delivery attempt's timeout")
    first_retry_s: float = Field(
        default=1.0, gt=0, description="the first wait after a failed attempt; it doubles up to max_retry_s"
    )
    max_retry_s: float = Field(default=60.0, gt=0, description="the longest wait between two attempts")
    retry_for_s: float = Field(
        default=3600.0,
        gt=0,
        description="attempts stop once the next would start more than this long after the first (a non-2xx answer or "
        "no answer is retried; the ingress that wrote the job's end delivers it, claimed in the store first so one "
        "ingress attempts it; one that dies mid-retries is succeeded by another after lease_s, with the same "
        "webhook-id)",
    )

    @field_validator("allow")
    @classmethod
    def _networks(cls, allow: list[str]) -> list[str]:
        import ipaddress

        for network in allow:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as e:
                raise ValueError(f"jobs.webhooks.allow: {network!r} is not a network (CIDR): {e}") from None
        return allow

    @model_validator(mode="after")
    def _url_needs_secret(self) -> WebhookArgs:
        if self.url is not None and self.secret_env is None:
            raise ValueError("jobs.webhooks.url needs jobs.webhooks.secret_env: webhooks are always signed")
        return self


class JobStoreArgs(BaseModel):
    """Where video jobs and their MP4s live, and for how long. Every ingress replica must see the same store."""

    model_config = ConfigDict(extra="forbid")

    store: str | None = Field(
        default=None,
        description="a directory every ingress replica shares (on Kubernetes: a ReadWriteMany PVC "
        "mounted on every pod that runs H3Ingress), or an fsspec URL such as s3://bucket/prefix (install s3fs, "
        "gcsfs... in the image). Jobs go under <store>/<application name>/. Default: $H3SERVE_CACHE/videos, else "
        "~/.cache/h3serve/videos, on the ingress's own node (one node only)",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for a URL store, e.g. {endpoint_url: ...} for an "
        "S3-compatible store; give credentials through the environment (AWS_*, a service account), not here",
    )
    ttl_s: float = Field(
        default=24 * 3600,
        gt=0,
        description="a finished job and its MP4 are removed this many seconds after finishing (OpenAI's expires_at)",
    )
    max_bytes: int = Field(
        default=20 * 2**30,
        ge=1,
        description="MP4 bytes kept in the store; beyond it the oldest finished jobs are removed first (the only way a "
        "finished job goes before its expires_at: no count of jobs removes one)",
    )
    max_unfinished: int = Field(
        default=256,
        ge=1,
        description="video jobs queued or in progress at once, across the application's ingress replicas; one more is "
        "refused with HTTP 429 and Retry-After (finished jobs are not counted: they go by ttl_s and max_bytes)",
    )
    lease_s: float = Field(
        default=60.0,
        ge=1,
        description="a running job's record is rewritten at least every "
        "lease_s/4; a job not rewritten for lease_s lost its ingress (crash, restart) and reads "
        "as failed. Keep it well above clock skew between nodes and a slow store write",
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="runs of a video job on a model replica: a replica lost under it (its process died, its worker "
        "group broke, Serve replaced it) queues it again until it has had this many; then it fails with code "
        "replica_lost",
    )
    idempotency_window_s: float = Field(
        default=86400.0,
        gt=0,
        description="a POST with an Idempotency-Key answers its retries (same key, same body) with the first "
        "request's answer (a video: the same job) for this long",
    )
    webhooks: WebhookArgs = Field(
        default_factory=WebhookArgs,
        description="signed POSTs of each finished job (completed, failed, cancelled) to its request's webhook URL "
        "(or url here): {secret_env, url, allow, allow_http, timeout_s, first_retry_s, max_retry_s, retry_for_s}",
    )


class AuthArgs(BaseModel):
    """Tenant keys beside ``api_key_env`` (``h3serve.deploy.ingress.tenants``)."""

    model_config = ConfigDict(extra="forbid")

    keys_file: str | None = Field(
        default=None,
        description="a YAML file of bearer keys on every ingress node (on Kubernetes: a Secret mounted as a file): "
        "keys: [{key or key_sha256, tenant, role: user|admin, max_priority, max_jobs, requests_per_minute, "
        "max_row_steps}]. Each tenant sees only its own jobs (admin: all) within its limits. Read at start (a bad "
        "file refuses to start) and again when it changes; one that turns invalid while serving refuses every key "
        "of it until fixed. null: api_key_env's one key (or open mode)",
    )
    reload_s: float = Field(
        default=5.0,
        gt=0,
        description="how often (seconds, at most) the ingress looks whether keys_file changed: a rotated or revoked "
        "key takes effect within this",
    )


class StageDeploymentArgs(BaseModel):
    """One stage deployment (H3Conditioner or H3Decoder): how many replicas, and what each one reserves."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(
        default=1, ge=1, description="replicas of this stage, shared by every H3Replica (Serve routes between them)"
    )
    ray_actor_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Ray options of each replica (num_cpus, num_gpus, resources, accelerator_type, memory...); "
        "default: {num_cpus: 1} on cpu, {num_cpus: 4, num_gpus: 1} on cuda. On cuda it must reserve num_gpus >= 1 "
        "(it loads its models on the replica's GPU)",
    )
    max_ongoing_requests: int = Field(
        default=4,
        ge=1,
        description="requests one replica of this stage works on at once (each holds one request's tensors); "
        "more wait in the calling H3Replica's handle",
    )


class StagesArgs(BaseModel):
    """Conditioning and decoding in deployments of their own, shared by every H3Replica (issue 27).

    The conditioner loads the tokenizer, processor, text encoder, both VAEs (their encoders read keyframes and
    references) and diffusers' blocks before the loop, and returns each request's prepared state as host tensors
    through the object store; the decoder loads both VAEs and runs the blocks after the loop and the PNG/MP4
    encoding. Neither loads a transformer, and each H3Replica's rank 0 then loads none of theirs: it holds only the
    transformer partitions (and the tokenizer), which is what lets the released model's rank 0 fit an 80 GB GPU.
    Without this section every H3Replica's rank 0 loads and runs them in process."""

    model_config = ConfigDict(extra="forbid")

    conditioner: StageDeploymentArgs = Field(
        default_factory=StageDeploymentArgs, description="the H3Conditioner deployment (text encoder, VAE encoders)"
    )
    decoder: StageDeploymentArgs = Field(
        default_factory=StageDeploymentArgs, description="the H3Decoder deployment (VAE decoders, PNG/MP4 encoding)"
    )
    parallel_decode: bool = Field(
        default=True,
        description="split each clip's video decode by whole VAE tiles (every temporal chunk's spatial tiles) over "
        "the decoder's replicas, blended by diffusers' own code (the same frames bit for bit); the audio decode runs "
        "beside it. Takes effect with decoder.num_replicas >= 2; a run a busy peer does not take is decoded by the "
        "clip's own replica (docs/OPERATIONS.md)",
    )

    def decode_split(self) -> int:
        """How many runs one clip's video tiles are split into over the decoder's replicas (1: none)."""
        return self.decoder.num_replicas if self.parallel_decode else 1


class AutoscalingArgs(BaseModel):
    """H3Replica scaled on its backlog (``h3serve/deploy/common/autoscaling.py``): the builder sets the deployment's
    Serve
    ``autoscaling_config`` from these, with the backlog policy. Choosing ``target_wait_s``: docs/OPERATIONS.md#scale.
    """

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(
        default=1,
        ge=0,
        description="fewest H3Replica replicas; 0 scales to zero when idle: a video job is then accepted and queued "
        "while the first replica loads, an image request gets `cold_images`",
    )
    max_replicas: int = Field(
        ge=1, description="most H3Replica replicas (args.ingress.h3_replicas follows it, and must equal it if given)"
    )
    initial_replicas: int | None = Field(
        default=None, ge=0, description="replicas started with the deployment; None: min_replicas"
    )
    target_wait_s: float = Field(
        default=120.0,
        gt=0,
        description="the longest the summed backlog (rows x steps left of every request held) may take to drain "
        "at the replicas' measured row-step rate: the fewest replicas that keep to it run",
    )
    downscale_below: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="hysteresis: scale down only when one replica fewer would drain the backlog within this "
        "fraction of target_wait_s (and no request has waited that long without starting)",
    )
    deadline_boost_max: float = Field(
        default=4.0,
        ge=1,
        description="a replica holding a request whose deadline is closer than target_wait_s counts its backlog "
        "target_wait_s / slack times, at most this many",
    )
    upscale_delay_s: float = Field(default=10.0, ge=0, description="Serve's: a scale-up must be asked for this long")
    downscale_delay_s: float = Field(
        default=300.0, ge=0, description="Serve's: a scale-down must be asked for this long"
    )
    downscale_to_zero_delay_s: float | None = Field(
        default=None, ge=0, description="Serve's: the wait before going from 1 to 0 replicas; None: downscale_delay_s"
    )
    metrics_interval_s: float = Field(
        default=2.0, gt=0, description="how often each replica sends its backlog to Serve's controller"
    )
    look_back_period_s: float = Field(
        default=10.0, gt=0, description="Serve's window of reports kept per replica (the policy reads the newest)"
    )
    cold_images: Literal["refuse", "wait"] = Field(
        default="refuse",
        description="an image request while no H3Replica runs (min_replicas 0): 'refuse' answers HTTP 503 with "
        "Retry-After from the expected load time (the request starts one); 'wait' holds it until one serves",
    )
    expected_load_s: float = Field(
        default=60.0,
        gt=0,
        description="seconds from asking for a replica to its serving, for Retry-After until the ingress has "
        "measured one start (then its measured time)",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingArgs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}: min_replicas must be "
                "at most max_replicas"
            )
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(
                f"initial_replicas={self.initial_replicas} must be between min_replicas={self.min_replicas} and "
                f"max_replicas={self.max_replicas}"
            )
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(
                f"look_back_period_s={self.look_back_period_s:g} must exceed metrics_interval_s="
                f"{self.metrics_interval_s:g} (Serve keeps the reports of one look-back period)"
            )
        return self

    def policy_kwargs(self) -> dict[str, float]:
        """``h3serve.deploy.common.autoscaling.BacklogPolicy``'s keyword arguments."""
        return {
            "target_wait_s": self.target_wait_s,
            "downscale_below": self.downscale_below,
            "deadline_boost_max": self.deadline_boost_max,
        }

    def serve_config(self) -> dict[str, Any]:
        """H3Replica's Serve ``autoscaling_config``: these bounds and delays, the backlog policy."""
        config = self.model_dump(
            include={
                "min_replicas",
                "max_replicas",
                "initial_replicas",
                "upscale_delay_s",
                "downscale_delay_s",
                "downscale_to_zero_delay_s",
                "metrics_interval_s",
                "look_back_period_s",
            },
            exclude_none=True,
        )
        config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": self.policy_kwargs()}
        return config


class DeployArgs(BaseModel):
    """Everything the driver needs to admit and build one MiniMax-H3 application."""

    model_config = ConfigDict(extra="forbid")

    model: Literal["tiny", "full", "auto"] = Field(
        default="tiny",
        description="the architecture the checkpoint must have: 'full' is the released MiniMax-H3, 'tiny' the CPU "
        "default; a checkpoint whose transformer/config.json (or transformer_ref/'s) has other heads, head size, "
        "layers or hidden size is refused before any replica starts (read by the driver, or where only replica nodes "
        "mount it by the platform probe there). 'auto': the checkpoint's own architecture, whatever its dims (needs "
        "checkpoint): its partitions must agree and take its VAEs' latent channels and its text encoder's width; "
        "sp_degree, the step-cache tiers and the memory plan follow its dims",
    )
    checkpoint: str | None = Field(
        default=None,
        description="directory holding a copy of the released checkpoint layout (modular_model_index."
        "json, transformer/, vae/, ...) on every replica node; none: the built-in tiny checkpoint (tiny only)",
    )
    attention_backend: str = Field(
        default="auto",
        description="attention backend name or alias, or 'auto'; an "
        "explicit choice that cannot do packed varlen attention is refused",
    )
    attention_ranking: str | None = Field(
        default=None,
        description="a measured attention ranking file (`h3serve rank-attention --out PATH` on a replica node) that "
        "orders 'auto' when it was measured on the replicas' platform; read by the driver. None: "
        "$H3SERVE_ATTENTION_RANKING if set, else the backends' declared order",
    )
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where the replicas run")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default_factory=lambda fields: default_dtype(fields["device"]),
        description="transformer and text encoder dtype (the transformer's boundary layers stay float32); "
        "default: float32 on cpu, bfloat16 on cuda",
    )
    vae_dtype: Literal["float32", "bfloat16"] = Field(
        default_factory=lambda fields: default_vae_dtype(fields["device"]),
        description="both VAEs' dtype; bfloat16 keeps diffusers' _keep_in_fp32_modules in float32 (as released) and "
        "lets a stage deployment's float32 matmuls use TF32. Default: bfloat16 on cuda, float32 on cpu (the exact "
        "reference there; bf16 measured 0.74-1.09x of its time: docs/CONFIG.md, VAE dtype)",
    )
    sp_degree: int = Field(
        default=1,
        ge=1,
        description="Ulysses ranks per replica, one placement-group bundle each; "
        "must divide the attention heads (56 for the released model)",
    )
    rank_resources: dict[str, float] = Field(
        default_factory=lambda fields: {"CPU": 4.0, "GPU": 1.0} if fields["device"] == "cuda" else {"CPU": 1.0},
        description="one placement-group bundle per SP rank; default {CPU: 1} on cpu, {CPU: 4, GPU: 1} on cuda",
    )

    probe_platform: bool = Field(
        default=True,
        description="learn the replica platform with a probe task shaped "
        "like one SP rank (false: use assumed_platform)",
    )
    platform_probe_timeout_s: float = Field(default=600.0, gt=0, description="how long the probe may wait for a node")
    assumed_platform: Platform | None = Field(
        default=None,
        description="the replica platform when probe_platform is false; default: bare `device`; on cuda it "
        "must give device_memory_bytes (the memory plan is checked against it)",
    )

    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a torch.distributed collective waiting longer on a peer fails the step instead of hanging",
    )
    engine: EngineLimits = Field(default_factory=EngineLimits, description="the step engine's bounds per replica")
    limits: RequestLimits = Field(default_factory=RequestLimits, description="what one HTTP request may ask for")
    ingress: IngressArgs = Field(
        default_factory=IngressArgs, description="how much one H3Ingress replica holds at once (backpressure)"
    )
    autoscaling: AutoscalingArgs | None = Field(
        default=None,
        description="scale H3Replica on its backlog (rows x steps left) against target_wait_s, between min_replicas "
        "(0: scale to zero) and max_replicas; the H3Replica entry under the serve config's deployments: then sets "
        "neither num_replicas nor autoscaling_config. null (the default): the replica count is Serve's, under "
        "deployments:",
    )
    jobs: JobStoreArgs = Field(default_factory=JobStoreArgs, description="where video jobs and their MP4s are kept")
    served_model_name: str = Field(
        default_factory=lambda fields: default_served_name(fields["model"], fields["checkpoint"]),
        description="the id in /v1/models; default: the preset's, for model 'auto' the checkpoint directory's name",
    )
    loras: dict[str, LoraSpec] = Field(
        default_factory=dict,
        description="LoRA adapters served beside the base model, several in one pack: {name: {path, scale, steps, "
        "shift}}. path: a local directory in diffusers' LoRA format for MiniMax-H3 on the driver's and every "
        "replica's node; scale multiplies the adapter's deltas; steps and shift: what a few-step adapter was "
        "distilled for (a request on it gets its steps by default, another step count is refused; shift sets its "
        "video schedule's shift). Each adapter is the model id '<served_model_name>:<name>'; checked against the "
        "transformer's modules at deploy, before any replica starts",
    )
    lora_limits: LoraLimits = Field(
        default_factory=LoraLimits,
        description="what a request's `lora` list may compose (several adapters at their own weights, as diffusers' "
        "set_adapters): max_per_request adapters, and max_rank_per_pack, the ranks of the distinct adapters one pack "
        "runs",
    )
    stages: StagesArgs | None = Field(
        default=None,
        description="conditioner and decoder deployments of their own, shared by every H3Replica: "
        "{conditioner: {num_replicas, ray_actor_options, max_ongoing_requests}, decoder: {...}}. Each H3Replica's "
        "rank 0 then holds only the transformer partitions (the released model's fits an 80 GB GPU), and admission "
        "checks each stage's memory plan against the replicas' platform. null (the default): each H3Replica "
        "prepares and decodes in process, as one deployment",
    )
    decode_on_ranks: bool = Field(
        default=False,
        description="without stages and with sp_degree >= 2: split each clip's video decode by whole VAE tiles over "
        "the replica's own ranks (rank 0 and its SP workers), blended by diffusers' own code (the same frames bit for "
        "bit where the ranks run the same kernels); each worker then also holds the video VAE (counted in its memory "
        "plan). A run a worker does not return is decoded by rank 0. false: rank 0 decodes alone",
    )
    api_key_env: str | None = Field(
        default="H3SERVE_API_KEY",
        description="environment variable holding the bearer token every API call needs (tenant 'admin', role "
        "admin); an empty or unset variable refuses to start. null: open mode, no token (explicitly), or with "
        "auth.keys_file only the file's keys",
    )
    auth: AuthArgs = Field(default_factory=AuthArgs, description="tenant keys from a file (auth.keys_file)")

    @field_validator("loras")
    @classmethod
    def _lora_names(cls, loras: dict[str, LoraSpec]) -> dict[str, LoraSpec]:
        LoraSpecs(loras=loras)  # names become model ids and metric labels: checked there
        return loras

    @property
    def lora_specs(self) -> LoraSpecs:
        return LoraSpecs(loras=self.loras, limits=self.lora_limits)

    @model_validator(mode="after")
    def _consistent(self) -> DeployArgs:
        if self.device == "cuda" and self.rank_resources.get("GPU", 0) < 1:
            raise ValueError(f"rank_resources must hold GPU >= 1 on device cuda, got {self.rank_resources}")
        if self.model != "tiny" and self.checkpoint is None:
            raise ValueError(
                f"checkpoint is required for model {self.model!r}: a directory holding the released "
                "MiniMax-H3 layout (only tiny has a built-in checkpoint)"
            )
        if self.autoscaling is not None:
            most = self.autoscaling.max_replicas
            if "h3_replicas" not in self.ingress.model_fields_set:  # sized for the most replicas the policy runs
                self.ingress = self.ingress.model_copy(update={"h3_replicas": most})
            elif self.ingress.h3_replicas != most:
                raise ValueError(
                    f"ingress.h3_replicas={self.ingress.h3_replicas} but autoscaling.max_replicas={most}: set them "
                    "equal, or leave ingress.h3_replicas out (it follows autoscaling.max_replicas)"
                )
        if self.decode_on_ranks and (self.stages is not None or self.sp_degree < 2):
            raise ValueError(
                f"decode_on_ranks splits rank 0's decode over its SP workers: it needs sp_degree >= 2 (got "
                f"{self.sp_degree}) and no stages (the decoder stage's replicas split it: stages.parallel_decode)"
            )
        if self.sp_degree > 1 and self.engine.step_timeout_min_s >= self.collective_timeout_s:
            # the engine's step bound must end a hung step (abort, replace the group) before the collective's own
            # timeout does (on NCCL its watchdog: the step then still fails, but later and less cleanly)
            raise ValueError(
                f"engine.step_timeout_min_s={self.engine.step_timeout_min_s:g} must be below "
                f"collective_timeout_s={self.collective_timeout_s:g} with sp_degree={self.sp_degree}"
            )
        step_cache = self.engine.step_cache
        if self.sp_degree > 1 and "tiers" not in step_cache.model_fields_set:
            # Under Ulysses every rank holds every caching row's residuals and the rows gathered at the cache's
            # transitions (the memory plan counts them): a deployment offers the tiers it lists, none by default.
            if step_cache.default != OFF:
                raise ValueError(
                    f"engine.step_cache.default={step_cache.default!r} with sp_degree={self.sp_degree} needs "
                    "engine.step_cache.tiers listed: over several ranks a deployment offers only the tiers it lists "
                    "(each rank then holds every caching row's residuals)"
                )
            step_cache = StepCacheTiers(tiers={})
            self.engine = self.engine.model_copy(update={"step_cache": step_cache})
        for name, lora in self.loras.items():
            if lora.steps is not None and not 2 <= lora.steps <= self.limits.max_steps:
                raise ValueError(
                    f"loras.{name}.steps={lora.steps}: a request runs 2..limits.max_steps={self.limits.max_steps} "
                    "steps (sigma grid points, the terminal zero included)"
                )
        for role, stage in self.stage_deployments().items():
            gpus = stage.ray_actor_options.get("num_gpus", 0)
            if self.device == "cuda" and not gpus >= 1:
                raise ValueError(
                    f"stages.{role}.ray_actor_options must reserve num_gpus >= 1 on device cuda (its models load on "
                    f"the replica's GPU), got {stage.ray_actor_options}"
                )
            if self.device == "cpu" and gpus:
                raise ValueError(f"stages.{role}.ray_actor_options reserves num_gpus={gpus} on device cpu: remove it")
        if self.model != AUTO:  # auto: admission checks them against the checkpoint's blocks
            self.check_step_cache(preset(self.model).geometry().num_layers)
        return self

    def check_step_cache(self, num_blocks: int) -> None:
        """ValueError naming the tier whose first and last cached blocks leave none of ``num_blocks`` to skip."""
        for name, policy in self.engine.step_cache.tiers.items():
            try:
                policy.check_blocks(num_blocks)
            except ValueError as e:
                raise ValueError(f"engine.step_cache.tiers.{name}: {e}") from None

    def stage_deployments(self) -> dict[str, StageDeploymentArgs]:
        """The configured stage deployments by role, each with its device's default ray_actor_options filled in;
        empty without ``stages``."""
        if self.stages is None:
            return {}
        default = {"num_cpus": 4.0, "num_gpus": 1.0} if self.device == "cuda" else {"num_cpus": 1.0}
        return {
            role: stage.model_copy(update={"ray_actor_options": dict(stage.ray_actor_options or default)})
            for role, stage in (("conditioner", self.stages.conditioner), ("decoder", self.stages.decoder))
        }

    @property
    def cache_tiers(self) -> list[str]:
        """What a request's ``cache`` field may name here: 'off' and the deployment's tiers."""
        return self.engine.step_cache.names

    @property
    def generation_slots(self) -> int:
        """The most generation requests the H3 replicas hold at once, queued or running: more get HTTP 503."""
        return self.ingress.h3_replicas * self.engine.capacity

    def check_deployments(self, deployments: list[dict[str, Any]]) -> None:
        """Refuse a serve config whose H3Replica entry under ``deployments:`` runs more or fewer replicas than
        ``ingress.h3_replicas`` says (the builder sizes the ingress from the latter; it cannot read the former),
        or whose H3Ingress entry replaces the ingress's derived concurrency."""
        ingress = next((d for d in deployments if d.get("name") == "H3Ingress"), {})
        overridden = sorted({"max_ongoing_requests", "max_queued_requests"} & set(ingress))
        if overridden:
            raise ValueError(
                f"H3Ingress sets {', '.join(overridden)} under deployments:, which replaces what the builder "
                "derives from the engine's bounds and args.ingress.h3_replicas; set args.ingress.headroom instead"
            )
        entry = next((d for d in deployments if d.get("name") == "H3Replica"), {})
        if self.autoscaling is not None:
            overridden = sorted({"num_replicas", "autoscaling_config"} & set(entry))
            if overridden:
                raise ValueError(
                    f"H3Replica sets {', '.join(overridden)} under deployments:, which replaces the backlog "
                    "autoscaling of args.autoscaling; set its bounds and delays there instead"
                )
            return
        autoscaling = entry.get("autoscaling_config") or {}
        declared, where = entry.get("num_replicas", 1), "num_replicas"
        if autoscaling or declared == "auto":
            declared, where = autoscaling.get("max_replicas"), "autoscaling_config.max_replicas"
            if declared is None:  # Serve's default depends on how autoscaling was switched on
                raise ValueError(
                    "H3Replica autoscales without an explicit autoscaling_config.max_replicas: give it, and "
                    "the same number as args.ingress.h3_replicas"
                )
        if declared != self.ingress.h3_replicas:
            raise ValueError(
                f"H3Replica runs up to {declared} replicas ({where} under deployments:) but "
                f"args.ingress.h3_replicas is {self.ingress.h3_replicas}: set them equal (the ingress's "
                "concurrency and queue are sized from h3_replicas)"
            )

    def placement_bundles(self) -> list[dict[str, float]]:
        return [dict(self.rank_resources) for _ in range(self.sp_degree)]

    def replica_spec(
        self, resolution: Resolution, geometry: TransformerGeometry | None = None, plan: MemoryPlan | None = None
    ) -> ReplicaSpec:
        """What every replica builds: these args with the driver's admitted backend and checkpoint geometry (None:
        the preset's, for callers that admitted nothing: tests and benchmarks; every rank checks it either way), and
        admission's memory plan, which the warm-up at the row budget is checked against (None: no check)."""
        from h3serve.pipelines.h3.memory import planned_by_role  # torch: only the driver gets here, never the ingress

        geometry = geometry or preset(self.model).geometry()
        return ReplicaSpec(
            resolution=resolution,
            checkpoint=self.checkpoint,
            model_name=self.served_model_name,
            num_heads=geometry.num_heads,
            head_dim=geometry.head_dim,
            num_layers=geometry.num_layers,
            hidden_size=geometry.hidden_size,
            device=self.device,
            dtype=self.dtype,
            vae_dtype=self.vae_dtype,
            sp_degree=self.sp_degree,
            collective_timeout_s=self.collective_timeout_s,
            rank_resources=dict(self.rank_resources),
            loras=self.lora_specs,
            stages="remote" if self.stages is not None else "local",
            decode_on_ranks=self.decode_on_ranks,
            memory_plan=None if plan is None else planned_by_role(plan),
        )
