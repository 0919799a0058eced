"""What callers of a replica's engine see without the engine itself: its limits (the deploy args' ``engine:``
block), its errors, the priority range and the names of its stages and events. Torch-free, so the ingress and
the deploy args hold them without importing the model; ``engine`` re-exports them."""

from __future__ import annotations

import dataclasses

from pydantic import BaseModel, ConfigDict, Field, model_validator

from h3serve.pipelines.h3.request import GenerationRequest, RequestError
from h3serve.pipelines.h3.step_cache_tiers import StepCacheTiers

from .scheduler import Policy


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry later (HTTP 503)."""


class EngineStopped(RuntimeError):
    """The engine is closed or its worker group broke; the replica must be replaced (HTTP 503)."""


class EngineDraining(EngineStopped):
    """The replica is draining (scale-down or shutdown); this request never started here: run it elsewhere."""


class EngineStalled(EngineStopped):
    """Watchdog: work is active and no step completed within the stall window (health fails)."""


class DeadlineExceeded(RuntimeError):
    """The request passed its deadline and left the pack (HTTP 504)."""


# a request's priority (default 0); higher runs first under the "priority" policy
MIN_PRIORITY, MAX_PRIORITY = -10, 10

# the stages the engine times (the replica adds "encode" for MP4/PNG encoding)
STAGES = ("queue_wait", "prepare", "first_step", "step", "decode", "end_to_end")
# Ticket.marks: submitted, its (last) prepare's start and end, its first and last forward's end, its decode's start and
# end; the replica adds encode and encoded (PNG/MP4)
TICKET_MARKS = ("submitted", "prepare", "prepared", "first_step", "last_step", "decode", "decoded")
# why a request failed: its own data, its prepare or decode, its deadline, the worker group, a drain, a shutdown
FAILURE_REASONS = ("error", "prepare", "decode", "deadline", "worker_group", "draining", "shutdown")


def check_priority(priority: object) -> int:
    """A request's priority, or RequestError("priority") naming the allowed range."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise RequestError(
            "priority", f"priority must be an integer between {MIN_PRIORITY} and {MAX_PRIORITY}, got {priority!r}"
        )
    return priority


class PreviewPolicy(BaseModel):
    """When a followed request's preview is captured (``h3serve/pipelines/h3/preview.py``); neither bound set: never."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    every_steps: int | None = Field(default=None, ge=1, description="a preview every this many denoising steps")
    every_s: float | None = Field(
        default=None, gt=0, description="a preview when this many seconds passed since the request's last one"
    )
    frames: int = Field(default=4, ge=1, le=16, description="latent frames in a preview's strip, first to last")

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None


class ClipWarmUpPolicy(BaseModel):
    """The warm-up clip (``WarmUps.clip`` in ``h3serve/replicas/warm_up.py``): one whole request at the served size
    before the replica is ready."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = Field(
        default=False,
        description="run it. Off by default: at the released size it adds the 5 s clip to every start (its decode "
        "**projected** at 18-30 s on one GPU, a few seconds with decode_on_ranks over 8), and from zero replicas "
        "the start is the first request's wait, to save that request first calls (kernel loading, cuBLAS and cuDNN "
        "setup) **projected** at a few seconds. On where replicas start ahead of their load (min_replicas >= 1)",
    )
    width: int | None = Field(default=None, gt=0, description="its width; null (with height): the model's canvas")
    height: int | None = Field(default=None, gt=0, description="its height; null (with width): the model's canvas")
    num_frames: int | None = Field(
        default=None, gt=0, description="its frames (17n+5 within the clip lengths); null: the shortest clip"
    )
    steps: int = Field(default=2, ge=2, le=8, description="its denoising steps (one forward fewer)")

    def request(self) -> GenerationRequest:
        return GenerationRequest(
            prompt="warm-up clip",
            width=self.width,
            height=self.height,
            num_frames=self.num_frames,
            num_inference_steps=self.steps,
        )


class EngineLimits(BaseModel):
    """The bounds of one replica's engine (the ``engine:`` block of the deploy args)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_queue: int = Field(
        default=64,
        ge=1,
        description="requests waiting behind a full pack, per replica; the engine holds at most max_queue + "
        "max_active requests and refuses one more with HTTP 503",
    )
    max_active: int = Field(default=16, ge=1, description="requests in the running pack")
    max_rows_per_step: int = Field(
        default=16384,
        ge=64,
        description="rows of one packed forward: text, conditioning, audio and video rows of every request in it",
    )
    max_text_rows_per_step: int | None = Field(
        default=None,
        ge=1,
        description="prompt rows of one packed forward (each request's prompt tokens and its keyframes' vision "
        "tokens); None: only max_rows_per_step bounds them. A prompt row costs more activation memory than a media "
        "row on every Ulysses rank (every rank refines every prompt): the memory plan counts this many of them",
    )
    drain_timeout_s: float = Field(
        default=600.0, gt=0, description="on scale-down or shutdown, active requests get this long to finish"
    )
    default_deadline_s: float | None = Field(
        default=None, gt=0, description="a request's deadline in seconds when it gives none; None: no deadline"
    )
    stall_factor: float = Field(
        default=20.0,
        gt=0,
        description="health fails when work is active and no step completed within "
        "max(stall_min_s, stall_factor * expected step time)",
    )
    stall_min_s: float = Field(default=120.0, gt=0, description="the shortest stall window, in seconds")
    step_timeout_factor: float = Field(
        default=10.0,
        gt=1,
        description="under Ulysses (sp_degree > 1) a step that has not finished on every rank within "
        "max(step_timeout_min_s, step_timeout_factor * expected step time) breaks the SP group: every rank's "
        "communicator is aborted, the group is replaced and the step's requests are run again on it",
    )
    step_timeout_min_s: float = Field(
        default=30.0,
        gt=0,
        description="the shortest step bound, in seconds (see step_timeout_factor); below collective_timeout_s, "
        "so that this bound, not the collective's own timeout (NCCL's watchdog), ends a hung step",
    )
    warmup: bool = Field(
        default=True,
        description="warm-up forwards before the replica reports ready: the smallest request (and one per LoRA "
        "adapter); on CUDA then the same padded to max_rows_per_step on every rank (and per adapter), and, when "
        "step-cache tiers are offered, three forwards of copies filling the row budget that hold, reuse and skip "
        "the cache's residuals (its peak); each rank's torch.cuda.mem_get_info logged and checked against "
        "admission's memory plan: past it by more than the "
        "reserve, the replica refuses to serve (PlanExceeded). CPU replicas skip the forward at the row budget: "
        "nothing to measure, and its padding document costs seconds of CPU",
    )
    warmup_clip: ClipWarmUpPolicy = Field(
        default_factory=ClipWarmUpPolicy,
        description="with enabled, after the warm-up forwards: one whole request at the served size (the model's "
        "canvas and shortest clip unless set) through the replica's own path: prepare, every step on every rank, the "
        "decode (streamed, or its tiles over the ranks with decode_on_ranks; with stages, by one decoder replica) and "
        "the MP4, so the first user's clip pays no first-call costs at that size. Outside the request table: no "
        "event, metric or count. Needs warmup; a size the model refuses fails the replica's build",
    )
    policy: Policy = Field(
        default="fcfs",
        description="which requests each step packs: fcfs = submission order, a running request is never "
        "displaced; srpt = least remaining work (rows x steps left) first; priority = higher priority first. "
        "Under srpt and priority a running request may pause at a step boundary for another and resume later",
    )
    aging_s: float = Field(
        default=60.0,
        gt=0,
        description="waiting this long is worth one priority level (priority) and halves the remaining-work key "
        "(srpt), so nothing starves",
    )
    fair_share: bool = Field(
        default=True,
        description="tenants of equal priority take turns, one request a turn, to the tenant charged the fewest "
        "row-steps (a request's tenant comes from the ingress's auth.keys_file); a running request the policy ranks "
        "first is never displaced. Requests without a tenant are one tenant: the policy alone. false: the policy "
        "alone, whoever asks",
    )
    max_prepared: int = Field(
        default=2,
        ge=1,
        description="requests the stage worker prepares ahead of the pack (text encoding, layout); "
        "each holds its prepared state in memory until it joins",
    )
    step_cache: StepCacheTiers = Field(
        default_factory=StepCacheTiers,
        description="per-request step caching (First-Block-Cache, decided per request inside a pack): the tiers "
        "a request may name in its `cache` field, and the default for one that names none ('off' unless set). "
        "A caching request holds two [rows, hidden] residuals while it runs. Under Ulysses (sp_degree > 1) every "
        "rank holds them and the rows gathered at the cache's transitions, and a deployment offers only the tiers "
        "it lists here (none unless listed)",
    )
    stage_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="how much higher (Linux niceness, capped at 19) the stage worker's thread (prepare, decode, "
        "previews) and the replica's PNG/MP4 encoding threads run than the step loop: on a replica that shares its "
        "cores, a decode or an encode then takes CPU mostly when the steps do not need it (0: the same priority)",
    )
    encode_threads: int = Field(
        default=0,
        ge=0,
        description="threads the replica encodes finished media (PNG, MP4) on, at stage_nice; 0: asyncio's default "
        "pool (up to cores + 4 encodes at once)",
    )
    step_events_every_s: float = Field(
        default=0.0,
        ge=0,
        description="a followed request's step events (GET /v1/videos/{id}/events, the job's progress) at most this "
        "often, its last step always; each one crosses Serve's stream to the ingress. 0: every step",
    )

    preview: PreviewPolicy = Field(
        default_factory=PreviewPolicy,
        description="live previews of video requests while they denoise: every_steps and/or every_s (whichever "
        "comes first), each a strip of `frames` latent frames of the clean-latent prediction through a linear "
        "latent -> RGB map fitted from the checkpoint's video VAE when the replica loads (never a VAE decode); "
        "rendered on the stage worker, off the step loop. Off unless a bound is set",
    )

    @model_validator(mode="after")
    def _clip_needs_warmup(self) -> EngineLimits:
        if self.warmup_clip.enabled and not self.warmup:
            raise ValueError("warmup_clip.enabled: true needs warmup: true (the clip runs after the warm-up forwards)")
        return self

    @property
    def capacity(self) -> int:
        """Requests one engine holds at once: a full pack plus the queue behind it; one more gets QueueFull."""
        return self.max_active + self.max_queue


# what ``on_request_event`` reports: queued (position, eta_s; again when either changes), started, step (step, steps,
# eta_s), preview (step, steps, png), decoding (eta_s), fragment (index, frames, data: the next bytes of the clip's
# fragmented MP4 while it decodes, for a streamed request: ``Ticket.stream``)
REQUEST_EVENTS = ("queued", "started", "step", "preview", "decoding", "fragment")
CANCEL_STAGES = ("waiting", "running", "decoding")


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """The work one engine holds at one instant, and how fast it gets through it: what the replica reports to
    Serve's autoscaler (``h3serve/deploy/common/autoscaling.py``) and to Prometheus."""

    backlog_row_steps: int  # rows x denoising steps left, over every request held, waiting or running
    row_step_rate: float  # row-steps per second of busy time, measured (0.0 before the warm-up or any step)
    oldest_wait_s: float  # how long the longest-waiting request that has not started has waited (0.0: none)
    deadline_slack_s: float | None  # the least time left to its deadline of a request held (None: none has one)
    waiting: int  # requests held that have not started
    active: int  # requests held that have
