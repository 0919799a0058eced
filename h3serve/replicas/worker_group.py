"""The SP worker group of one replica: rank 0 is the replica process, ranks 1..W-1 are Ray actors.

The actors are placed in the replica's own placement group (bundle i for rank i), the way Ray Serve
LLM places multi-GPU engines; outside Serve the group reserves one. torch.distributed runs nccl on
CUDA and gloo on CPU, rendezvousing at rank 0. Rank 0 holds the whole pipeline (conditioning and
decoding run there), unless ``spec.stages`` is "remote" (stage deployments of their own condition and decode):
then rank 0, like the other ranks, holds only the transformer partitions (and the tokenizer). Rank 0 loads while its
workers load in their own processes (``create``; each rank's ``LoadReport`` says when): a start costs the slowest
rank's load, not the sum.

One step (``forward_async``). Rank 0 built the pack on its model thread; the workers get only its host metadata
through Ray (a ``StepOrder``: document lengths and counts, adapter slots, the step-cache mirror, the step's bound:
O(documents) bytes, inlined in the call, never the object store) and the pack's tensors by one broadcast from rank
0 over the group's own backend (``UlyssesGroup.send_pack``). Every rank then runs its rows and waits for its device
(``UlyssesGroup.finish``) before it reports the step finished (``RankOutcome``: its error, the collectives it had
entered, whether it left at the agreement).

One failure semantics (``classify``), decided by rank 0 as outcomes arrive:

- every rank finished -> the step succeeded;
- every rank left at one of the step's agreements (``UlyssesGroup.ready`` before the broadcast: any rank's error
  so far, an OOM making its side of the broadcast or an injected fault included; ``UlyssesGroup.agree`` after the
  row-local prologue), or a rank that ran out of memory past them entered the step's remaining collectives with
  scratch buffers (``UlyssesGroup.drain``) -> ``PackFailed``: the pack failed, every rank entered the same
  collectives, the group stays healthy;
- anything else (a rank raised after the agreement, died, or the step outlived its bound ``bound_s``) -> the group
  is broken at once: no resync over a communicator that may hold unmatched collectives. Every rank's communicator is
  aborted, never destroyed (rank 0's here, each worker's by a call on its control thread, which runs while its step
  thread is stuck), which releases ranks waiting in collectives (NCCL: their kernels exit; gloo: the peer's sockets
  close); rank 0 then waits ``abort_grace_s`` for every rank's side of the step to come back and raises
  ``WorkerGroupBroken`` naming the ranks that did not (``lost``) and whether rank 0's own thread came back
  (``recoverable``). ``h3serve.replicas.supervisor`` builds the replacement;
- a rank whose error is CUDA-fatal (``cuda_faults.fatal``: its process is poisoned) breaks the group wherever it was,
  even at the agreement: a worker is lost (killed, replaced), rank 0 makes the group unrecoverable here.

The communicator is set up and torn down by ``h3serve.replicas.nccl``: made at the join and proven by a first
all-reduce within its bound, aborted on a thread with a deadline (a rank whose abort does not return is given up).

Step caching: rank 0's per-request states live in its ``RequestState``s; each worker keeps its own
(``step_cache.RankCaches``), the same states, kept in step by the ``CacheMirror`` each step order carries; at each
decision every rank follows rank 0's (``UlyssesGroup.follow_rank0``).

Steps are strictly serial on every rank (the workers' "step" concurrency group holds one call); health pings,
aborts and test faults have their own "control" group and answer while a step runs.

Over 600 lines on purpose: both sides of one step (rank 0's ``WorkerGroup``, the actors' ``SPWorker``) and what they
exchange (``StepOrder``, ``RankOutcome``) and how rank 0 classifies outcomes change together: they are read together.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import gc
import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from typing import Any, TypeVar

import ray
import torch

from h3serve.pipelines.h3 import H3Denoiser, H3Pipeline, tiled_decode
from h3serve.pipelines.h3.lora_spec import LoraError, LoraSpecs
from h3serve.pipelines.h3.memory import MeasuredUse
from h3serve.pipelines.h3.packing import Pack, PackLayout, flatten_pack, pack_layout
from h3serve.pipelines.h3.stage_models import load_tile_decoder
from h3serve.pipelines.h3.step_cache import CachedPack, CacheMirror, CacheMirrorWriter, RankCaches
from h3serve.pipelines.h3.tiled_decode import TileRunner

from . import nccl
from .allocator import cuda_allocator_defaults, measure_device, reset_peak
from .cuda_faults import device_ping, fatal
from .faults import Fault, FaultInjector
from .placement import Placement
from .placement import free_port as free_port  # tests pick their ports with it
from .sequence_parallel import UlyssesGroup, abort_process_group
from .spec import ReplicaSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerGroupBroken(RuntimeError):
    """A rank died, hung or failed past the step's agreement: the group's communicators are aborted.

    ``recoverable``: rank 0's own side of the step came back, so a replacement group can be built in this process
    (``h3serve.replicas.supervisor``); False: rank 0 is stuck, only a new replica helps. ``lost``: worker ranks whose
    side of
    the step never came back (or whose actor died): their actors must be killed and started anew.
    """

    def __init__(
        self, reason: str, recoverable: bool = False, lost: frozenset[int] = frozenset(), after_s: float = 0.0
    ):
        super().__init__(reason)
        self.reason, self.recoverable, self.lost = reason, recoverable, frozenset(lost)
        self.after_s = after_s  # from the step's start to every rank aborted and back (or declared lost)

    def __reduce__(self):
        return type(self), (self.reason, self.recoverable, self.lost, self.after_s)


class PackFailed(RuntimeError):
    """Every rank left the step at its agreement: the pack's data failed, the group is fine.

    ``errors`` maps each rank that raised to its error text; the requests of the pack go to isolation.
    """

    def __init__(self, errors: dict[int, str]):
        self.errors = errors
        super().__init__("; ".join(f"rank {rank}: {error}" for rank, error in sorted(errors.items())))

    def __reduce__(self):
        return type(self), (self.errors,)


def describe(error: BaseException) -> str:
    """An error as text ("Type: message"): kept instead of the exception, whose traceback holds the failed
    forward's frames and activations."""
    return f"{type(error).__name__}: {error}"


def formatted(error: BaseException) -> str:
    """The error with its traceback, as text (a log record holding the exception would keep its frames alive)."""
    return "".join(traceback.format_exception(error))


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank's side of one step ended (workers return it rather than raise, so rank 0 can classify)."""

    rank: int
    step: int
    error: str | None = None  # "Type: message" when the rank raised
    collectives: int = 0  # collectives the rank had entered in this step when it finished or raised
    together: bool = False  # it left at the step's agreement, as every rank did
    fatal: str | None = None  # its error poisoned its process (``cuda_faults.fatal``): the rank is lost wherever it was

    @classmethod
    def of(cls, rank: int, step: int, error: BaseException | None, sp: UlyssesGroup | None) -> RankOutcome:
        collectives, together = (sp.collectives, sp.left_together) if sp is not None else (0, False)
        if error is None:
            return cls(rank, step, None, collectives, together)
        return cls(rank, step, describe(error), collectives, together, fatal(error))

    @property
    def breaks_group(self) -> bool:
        """It raised somewhere its peers may still be in (or about to enter) a collective, or its process is
        poisoned (even where every rank left together: its next step would fail too, whatever the data)."""
        return self.error is not None and (not self.together or self.fatal is not None)


def broken_by(outcome: RankOutcome) -> str | None:
    """Why ``outcome`` breaks the group (None: it finished, or left at the agreement with every rank)."""
    if not outcome.breaks_group:
        return None
    if outcome.fatal is not None:
        return (
            f"rank {outcome.rank} hit a CUDA-fatal error in step {outcome.step} after {outcome.collectives} "
            f"collective(s): its process is lost: {outcome.fatal}"
        )
    return (
        f"rank {outcome.rank} failed in step {outcome.step} after {outcome.collectives} collective(s), "
        f"past the step's agreement: {outcome.error}"
    )


@dataclasses.dataclass(frozen=True)
class StepOrder:
    """What a worker receives through Ray for one step: host metadata only, O(documents) bytes."""

    step: int
    layout: PackLayout  # the pack's host fields and where its tensors lie in the broadcast buffer
    mirror: CacheMirror | None  # the step caches' keys and counters, and what rank 0 freed
    bound_s: float  # how long this rank's device may take to finish the step

    @property
    def nbytes(self) -> int:
        """Its size as Ray's serializer sends it (pickle protocol 5; no out-of-band buffers: it holds no tensor)."""
        return len(pickle.dumps(self, protocol=5))


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """One rank's checkpoint load, on the wall clock (``time.time()``: the ranks are processes of one node's clock, or
    of nodes kept in sync): rank 0 loads while its workers load, never before them."""

    rank: int
    requested: float  # when rank 0 asked for it (rank 0's own: when it began); a worker's process starts in between
    started: float
    finished: float

    @property
    def seconds(self) -> float:
        return self.finished - self.started


def _load_kwargs(spec: ReplicaSpec) -> dict:
    return dict(
        device=spec.device,
        dtype=spec.dtype,
        expected=spec.geometry,
        loras=spec.loras,
    )


def build_rank0(spec: ReplicaSpec) -> H3Pipeline:
    """Rank 0's pipeline with exactly the resolved backend; fails closed if this node cannot run it. With
    ``spec.stages`` "remote" it loads no text encoder and no VAE (``H3Pipeline.load_denoiser_only``)."""
    cuda_allocator_defaults(spec.device)  # before anything touches CUDA in this process
    return H3Pipeline.load(
        spec.checkpoint,
        spec.resolution.backend,
        name=spec.model_name,
        stages=spec.stages,
        vae_dtype=spec.vae_dtype,
        **_load_kwargs(spec),
    )


def build_worker(spec: ReplicaSpec) -> H3Denoiser:
    cuda_allocator_defaults(spec.device)
    return H3Denoiser.load(spec.checkpoint, spec.resolution.backend, **_load_kwargs(spec))


def init_distributed(
    spec: ReplicaSpec, rank: int, master: str, before_first_collective: Callable[[], None] | None = None
) -> UlyssesGroup:
    """Join the SP group at ``master``, its communicator up and proven by a first all-reduce within
    ``collective_timeout_s`` (``nccl.join``; JoinFailed otherwise)."""
    if not abort_process_group():  # a previous group in this process (a destroy may wait on a wedged peer)
        raise nccl.AbortTimedOut(f"rank {rank}: the previous communicator's abort did not return")
    device = torch.device("cpu")
    if spec.device == "cuda":
        torch.cuda.set_device(0)  # Ray exposes exactly this rank's GPU as device 0
        device = torch.device("cuda", 0)
        nccl.nccl_environment(spec.collective_timeout_s, nccl.ABORT_DEADLINE_S)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    nccl.join(backend, master, rank, spec.sp_degree, spec.collective_timeout_s, device, before_first_collective)
    return UlyssesGroup(spec.sp_degree, rank, spec.num_heads, device=device)


@ray.remote(concurrency_groups={"step": 1, "control": 1, "decode": 1})
class SPWorker:
    """Ranks 1..W-1. Model work runs in the "step" group, one call at a time, so two forwards never
    interleave their collectives; ``ping``, ``abort`` and ``arm`` have their own group and answer while a
    forward runs (or is stuck). A share of rank 0's decode (``spec.decode_on_ranks``) has its own "decode" group:
    it never queues a step behind it (the step's bound keeps running), as rank 0's decode runs beside its steps."""

    def __init__(self, spec: ReplicaSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.denoiser: H3Denoiser | None = None
        self.sp: UlyssesGroup | None = None
        self.master: str | None = None  # the rendezvous of ``sp``: names the communicator an abort is meant for
        self.step_caches = RankCaches()  # this rank's copy of each caching request's state, by key
        self.join_faults = FaultInjector(rank)  # tests only: faults armed for this process's next join
        self.vae: torch.nn.Module | None = None  # the video VAE, for tiles of rank 0's decodes (decode_on_ranks)
        self.decode_stream: torch.cuda.Stream | None = None  # on CUDA: tiles decode beside the steps' stream

    @ray.method(concurrency_group="step")
    def build(self, requested: float) -> LoadReport:
        """Load this rank's model (``requested``: when rank 0 asked, on its clock); when the load started and
        finished."""
        started = time.time()
        self.denoiser = build_worker(self.spec)
        if self.spec.decode_on_ranks:
            self.vae = load_tile_decoder(self.spec.checkpoint, self.spec.device, self.spec.vae_dtype)
            if self.spec.device == "cuda":
                self.decode_stream = torch.cuda.Stream(device=torch.device("cuda", 0))
        return LoadReport(self.rank, requested, started, time.time())

    @ray.method(concurrency_group="decode")
    def decode_tiles(self, tiles: list[torch.Tensor]) -> list[torch.Tensor]:
        """A run of rank 0's clip tiles [1, C, t, h, w] (host), decoded as diffusers' tiled decode does each
        (``tiled_decode.decode_tiles``), back on the host."""
        assert self.vae is not None, "this worker holds no VAE: decode_on_ranks is off"
        if self.decode_stream is None:
            return [tile.cpu() for tile in tiled_decode.decode_tiles(self.vae, tiles)]
        with torch.cuda.stream(self.decode_stream):
            decoded = [tile.cpu() for tile in tiled_decode.decode_tiles(self.vae, tiles)]
        return decoded

    @ray.method(concurrency_group="step")
    def join(self, master: str) -> tuple[int, str]:
        """Rendezvous on a new communicator (after a replacement too: the states of the old group's caches go);
        this rank's process id and node."""
        self.sp = init_distributed(self.spec, self.rank, master, lambda: self.join_faults.at("join"))
        self.master = master
        self.step_caches = RankCaches()
        return os.getpid(), ray.util.get_node_ip_address()

    @ray.method(concurrency_group="step")
    def forward(self, order: StepOrder) -> RankOutcome:
        """This rank's share of step ``order.step``; an error is returned (classified), not raised."""
        assert self.denoiser is not None and self.sp is not None, "build() and join() first"
        sp, cache = self.sp, None
        sp.begin_step()
        try:
            try:  # before the first collective: an error here is carried to the agreement
                sp.faults.at("before_first_collective")
                if order.mirror is not None:  # this rank's states of the documents; first drops what rank 0 freed
                    cache = self.step_caches.pack_cache(order.mirror)
                    if not order.mirror.documents:  # it only said what rank 0 freed: the pack caches nothing
                        cache = None
            except Exception as e:
                sp.early_error = e
            pack = sp.receive_pack(order.layout)  # rank 0's broadcast: [nbytes] on this rank's device
            if cache is not None:
                pack = CachedPack.of(pack, cache)
            self.denoiser.forward(pack, sp)
            sp.finish(order.bound_s)
        except Exception as e:
            logger.error("rank %d: step %d failed\n%s", self.rank, order.step, formatted(e))
            return RankOutcome.of(self.rank, order.step, e, sp)
        return RankOutcome.of(self.rank, order.step, None, sp)

    @ray.method(concurrency_group="step")
    def mirror_adapters(self, loras: LoraSpecs, retiring: dict[str, int]) -> list[str]:
        """Rank 0's run-time adapters here, in its slots (``H3Denoiser.mirror_adapters``); between two steps, never
        during one (the "step" group runs one call at a time)."""
        assert self.denoiser is not None, "build() first"
        return self.denoiser.mirror_adapters(loras, retiring)

    @ray.method(concurrency_group="step")
    def device_memory(self, reset: bool = False) -> MeasuredUse | None:
        """This rank's device use after its last step (None on the CPU); ``reset``: then start its peak count anew."""
        device = self.sp.device if self.sp is not None else torch.device("cpu")
        use = measure_device(self.rank, device)
        if reset:
            reset_peak(device)
        return use

    @ray.method(concurrency_group="step")
    def step_cache_bytes(self) -> dict[int, int]:
        """Each step-cache state this rank holds (by key): the bytes of its residuals."""
        return {key: state.residual_bytes for key, state in self.step_caches.documents.items()}

    @ray.method(concurrency_group="step")
    def step_cache_skipped(self) -> dict[int, list[bool]]:
        """Each step-cache state this rank holds (by key): whether it skipped the middle blocks, step by step."""
        return {key: list(state.skipped) for key, state in self.step_caches.documents.items()}

    @ray.method(concurrency_group="control")
    def ping(self, timeout_s: float = 2.0) -> int:
        """This rank, once a one-element kernel ran on its device within ``timeout_s`` (a poisoned or wedged device
        fails here, not only a dead process)."""
        device = self.sp.device if self.sp is not None else torch.device("cpu")
        device_ping(device, timeout_s)
        return self.rank

    @ray.method(concurrency_group="control")
    def abort(self, master: str, deadline_s: float = nccl.ABORT_DEADLINE_S) -> bool:
        """Abort this rank's communicator of the rendezvous at ``master`` (no collective): a step stuck in one of its
        collectives is released. A late call for an older communicator leaves the current one alone. False when the
        abort did not return within ``deadline_s``: this process is given up (killed and replaced)."""
        returned = True
        if self.sp is not None and self.master == master:
            returned = self.sp.abort(deadline_s)
        gc.collect()  # a gloo group nothing holds any more closes its sockets: the peers stuck on them are released
        return returned

    @ray.method(concurrency_group="control")
    def arm(self, fault: Fault) -> None:
        """Tests only (``h3serve.replicas.faults``): arm ``fault`` on this rank's current communicator."""
        if fault.point == "join":  # for the next communicator this process joins
            self.join_faults.arm(fault)
            return
        assert self.sp is not None, "join() first"
        self.sp.faults.arm(fault)

    @ray.method(concurrency_group="control")
    def disagreements(self) -> int:
        """Step-cache decisions where this rank's own differed from rank 0's (it followed rank 0)."""
        return self.sp.disagreements if self.sp is not None else 0


class WorkerGroup:
    """Rank 0's view of the group: build, run one step on every rank, classify how it ended, check health."""

    abort_grace_s = 10.0  # after an abort, how long rank 0 waits for every rank's side of the step to come back

    def __init__(
        self,
        spec: ReplicaSpec,
        pipeline: H3Pipeline,
        workers: list,
        sp: UlyssesGroup | None,
        placement: Placement | None,
        steps: int = 0,
    ):
        self.spec, self.pipeline, self.workers, self.sp, self.placement = spec, pipeline, workers, sp, placement
        self.broken_reason: str | None = None
        self.broken_at: float | None = None  # time.monotonic() of the break
        self.broken_in_step = False  # a step broke it: the caller is aborting it and will replace it
        self.stepping = False  # a step is in flight: it classifies a rank's death itself, within its bound
        self.steps = steps  # steps launched; every rank numbers them alike
        self.step_cache_mirror = CacheMirrorWriter()  # what the workers hold of the requests' step caches
        self.master = ""  # the rendezvous address of this group's communicator
        self.processes: dict[int, tuple[int, str]] = {}  # worker rank -> its process id and node
        self.loads: dict[int, LoadReport] = {}  # the loads that built this group (a kept worker's is not here)
        # tiles of rank 0's decodes (decode_on_ranks), by who decoded them: "own", "workers", "taken_back"
        self.tiles_decoded: collections.Counter[str] = collections.Counter()
        self._blocking: concurrent.futures.ThreadPoolExecutor | None = None  # rank 0's thread for ``__call__``
        # packs are now aligned for, and run on, the whole group
        pipeline.row_multiple = spec.sp_degree
        pipeline.forward = self

    @property
    def sp_degree(self) -> int:
        return self.spec.sp_degree

    @property
    def default_bound_s(self) -> float:
        """A step's bound when the caller gives none (warm-up, tests): nothing measured yet, the collective timeout."""
        return self.spec.collective_timeout_s

    # -- building ---------------------------------------------------------------------------
    @classmethod
    def create(
        cls, spec: ReplicaSpec, startup_timeout_s: float = 600.0, placement_timeout_s: float = 120.0
    ) -> WorkerGroup:
        """Rank 0 and its workers load at the same time: the workers' actors start and load in their bundles while
        rank 0 loads here; the group meets once every rank has loaded. Any rank's failure (rank 0's first: its error is
        the one raised) kills every actor and releases the reservation."""
        if spec.sp_degree == 1:
            pipeline, own = _load_rank0(spec)
            group = cls(spec, pipeline, [], None, None)
            group.loads = {0: own}
            return group
        placement = Placement.reserve(spec, placement_timeout_s)
        launched: dict[int, tuple[Any, ray.ObjectRef]] = {}
        try:
            launched = cls.spawn(spec, placement, range(1, spec.sp_degree))
            pipeline, own = _load_rank0(spec)  # while the workers load in their own processes
            loads = _loaded(ray.get([ref for _, ref in launched.values()], timeout=startup_timeout_s))
            workers = {rank: actor for rank, (actor, _) in launched.items()}
            return cls.join(spec, pipeline, placement, workers, {0: own, **loads}, kept=0)
        except BaseException:
            for actor, _ in launched.values():
                ray.kill(actor, no_restart=True)
            placement.release()
            raise

    @staticmethod
    def spawn(spec: ReplicaSpec, placement: Placement, ranks: Iterable[int]) -> dict[int, tuple[Any, ray.ObjectRef]]:
        """New actors for worker ``ranks`` in their bundles, each loading its model now (rank -> the actor and its
        ``build`` to come: a ``LoadReport``, or the load's error, BackendUnavailable included)."""
        launched = {}
        for rank in ranks:
            bundle = placement.bundle(rank)
            actor = SPWorker.options(  # type: ignore[attr-defined]  # a Ray actor class
                num_cpus=bundle.get("CPU", 0),
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=placement.strategy(rank),
            ).remote(spec, rank)
            launched[rank] = (actor, actor.build.remote(time.time()))
        return launched

    @classmethod
    def join(
        cls,
        spec: ReplicaSpec,
        pipeline: H3Pipeline,
        placement: Placement,
        workers: Mapping[int, Any],
        loads: Mapping[int, LoadReport],
        kept: int,
        steps: int = 0,
    ) -> WorkerGroup:
        """Every rank (``workers``: rank -> actor, each loaded) meets rank 0 on a new communicator; on failure every
        actor is killed (the reservation stays the caller's)."""
        ordered = [workers[rank] for rank in range(1, spec.sp_degree)]
        try:
            master = f"{ray.util.get_node_ip_address()}:{free_port()}"
            joins = [w.join.remote(master) for w in ordered]
            sp = init_distributed(spec, 0, master)
            processes = ray.get(joins, timeout=spec.collective_timeout_s)
        except BaseException:
            for w in ordered:
                ray.kill(w, no_restart=True)
            abort_process_group()
            raise
        logger.info(
            "SP group of %d ranks up (%s; %d worker(s) kept, %d new)",
            spec.sp_degree,
            spec.resolution.backend,
            kept,
            len(ordered) - kept,
        )
        group = cls(spec, pipeline, ordered, sp, placement, steps)
        group.master = master
        group.processes = dict(zip(range(1, spec.sp_degree), processes, strict=True))
        group.loads = dict(loads)
        return group

    # -- a decode split over the ranks -------------------------------------------------------------
    tile_timeout_s = 600.0  # how long rank 0 waits for a worker's run of tiles before decoding it itself

    def tile_runner(self) -> TileRunner | None:
        """With ``spec.decode_on_ranks``: a ``tiled_decode.TileRunner`` for one of rank 0's decodes (it runs on the
        decode's thread) that splits the clip's tiles in ``sp_degree`` runs, the first decoded by rank 0's VAE while
        each worker decodes one of the others; a run a worker does not return (lost, failed, past
        ``tile_timeout_s``) is decoded by rank 0 all the same. None: rank 0 decodes alone (off, one rank, or the
        group is broken: its workers are being replaced)."""
        if not self.spec.decode_on_ranks or not self.workers or self.broken_reason:
            return None
        vae, workers = self.pipeline.stages.after.vae, list(self.workers)

        def run_tiles(tiles: list[torch.Tensor]) -> list[torch.Tensor]:
            own, *others = tiled_decode.split(tiles, len(workers) + 1)
            calls = [
                (run, w.decode_tiles.remote([t.cpu() for t in run]))
                for w, run in zip(workers, others, strict=True)
                if run
            ]
            decoded = tiled_decode.decode_tiles(vae, own)
            self.tiles_decoded["own"] += len(own)
            for run, call in calls:
                try:
                    decoded.extend(ray.get(call, timeout=self.tile_timeout_s))
                    self.tiles_decoded["workers"] += len(run)
                except Exception as e:  # the worker died or failed under it: its tiles are decoded here all the same
                    logger.warning("a worker's run of %d tiles failed (%s): decoding them on rank 0", len(run), e)
                    decoded.extend(tiled_decode.decode_tiles(vae, run))
                    self.tiles_decoded["taken_back"] += len(run)
            return decoded

        return run_tiles

    # -- one step -----------------------------------------------------------------------------
    def launch(self, pack: Pack, bound_s: float) -> list[ray.ObjectRef]:
        """Start step ``steps`` on ranks 1..W-1 (host metadata only); run ``forward_rank0`` next, on rank 0."""
        if self.broken_reason:
            raise WorkerGroupBroken(self.broken_reason, recoverable=True, lost=frozenset(range(1, self.sp_degree)))
        self.steps += 1
        if not self.workers:
            return []
        # the step-cache states' keys and counters, not their tensors; and those rank 0 freed since its last pack
        mirror = self.step_cache_mirror.mirror(pack.step_cache if isinstance(pack, CachedPack) else None)
        order = StepOrder(self.steps, pack_layout(pack), mirror, bound_s)
        return [w.forward.remote(order) for w in self.workers]

    def forward_rank0(
        self, pack: Pack, bound_s: float | None = None, flat: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0's share of the launched step: broadcast the pack (``flat``: its buffer, made before the launch; None:
        made here), run its rows, gather every rank's output, wait for the device. Raises whatever it raised
        (``forward_async`` classifies it)."""
        sp = self.sp
        if sp is None:
            out = self.pipeline.denoiser.forward(pack)
        else:
            sp.begin_step()
            try:
                sp.faults.at("before_first_collective")
            except Exception as e:  # carried to the agreement, where every rank leaves the step with it
                sp.early_error = e
            sp.send_pack(pack, flat)
            out = self.pipeline.denoiser.forward(pack, sp)
            sp.finish(self.default_bound_s if bound_s is None else bound_s)
        assert out is not None  # rank 0 gathers every rank's rows
        return out

    async def forward_async(
        self, pack: Pack, run_blocking: Callable[..., Awaitable[Any]], bound_s: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step with rank 0 on ``run_blocking`` (the engine's model thread), every wait within ``bound_s``.
        Raises PackFailed (the pack's data, on every rank alike) or WorkerGroupBroken (communicators aborted)."""
        started = time.monotonic()
        flat = None
        if self.workers:  # the broadcast's second copy of the pack, before any rank waits in it: an OOM is the pack's
            try:
                _, flat = await run_blocking(flatten_pack, pack)
            except Exception as e:
                raise self._rank0_failed(self.steps + 1, e) from None
        refs = self.launch(pack, bound_s)
        step = self.steps
        local: asyncio.Future = asyncio.ensure_future(run_blocking(self.forward_rank0, pack, bound_s, flat))
        del flat  # rank 0's thread holds it for the broadcast only
        if not refs:  # one rank: no collective, so nothing to bound but the stall watchdog
            try:
                return await local
            except Exception as e:
                raise self._rank0_failed(step, e) from None
        self.stepping = True
        try:
            return await self._await_step(step, started, bound_s, local, refs)
        finally:
            self.stepping = False

    def _rank0_failed(self, step: int, error: BaseException) -> PackFailed | WorkerGroupBroken:
        """Rank 0's error where no peer waits on it: the pack's data (PackFailed), or, CUDA-fatal, this process's:
        WorkerGroupBroken, not recoverable here (the replica is replaced; its requests run again elsewhere)."""
        logger.warning("rank 0: step %d failed\n%s", step, formatted(error))
        why = fatal(error)
        if why is None:
            return PackFailed({0: describe(error)})
        reason = f"rank 0 hit a CUDA-fatal error in step {step}: its process is lost: {why}"
        self.mark_broken(reason)
        return WorkerGroupBroken(reason, recoverable=False)

    async def _await_step(
        self, step: int, started: float, bound_s: float, local: asyncio.Future, refs: list[ray.ObjectRef]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's side of step ``step`` within ``bound_s`` of ``started``, classified (see ``forward_async``)."""
        workers = {asyncio.wrap_future(ref.future()): rank for rank, ref in enumerate(refs, start=1)}
        outcomes: dict[int, RankOutcome] = {}
        pending: set[asyncio.Future] = {local, *workers}
        reason: str | None = None
        while pending and reason is None:
            done, pending = await asyncio.wait(
                pending, timeout=max(0.0, started + bound_s - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                ranks = sorted([0] * (local in pending) + [workers[f] for f in pending if f is not local])
                reason = f"step {step} did not finish within its bound of {bound_s:.3g} s (ranks {ranks} still in it)"
            for future in done:
                if future is local:
                    error = future.exception()
                    if error is not None:
                        logger.warning("rank 0: step %d failed\n%s", step, formatted(error))
                    outcome = RankOutcome.of(0, step, error, self.sp)
                elif (died := future.exception()) is not None:  # a worker returns its error: only a lost one raises
                    reason = reason or f"rank {workers[future]} was lost in step {step}: {describe(died)}"
                    continue
                else:
                    outcome = future.result()
                outcomes[outcome.rank] = outcome
                reason = reason or broken_by(outcome)
        if reason is not None:
            fatal_ranks = frozenset(o.rank for o in outcomes.values() if o.fatal is not None)
            broken = await self._break(reason, local, workers, fatal_ranks)
            broken.after_s = time.monotonic() - started
            raise broken
        errors = {o.rank: o.error for o in outcomes.values() if o.error is not None}
        if errors:  # every collective matched (an agreement, or a drained OOM): the pack failed, the group is fine
            if (own := local.exception()) is not None:
                own.__traceback__ = None  # the failed forward's frames go
            raise PackFailed(errors)
        return local.result()

    async def _break(
        self,
        reason: str,
        local: asyncio.Future,
        workers: dict[asyncio.Future, int],
        fatal_ranks: frozenset[int] = frozenset(),
    ) -> WorkerGroupBroken:
        """Abort every rank's communicator (each on a thread with a deadline), then wait for every rank's side of the
        step to come back: the workers' within ``abort_grace_s`` (one that does not, whose abort did not return, or
        whose process a CUDA-fatal error poisoned (``fatal_ranks``) is killed: a dead peer's sockets close, which is
        what releases rank 0 from a gloo collective), then rank 0's within ``abort_grace_s`` more. Not recoverable
        here when rank 0's own abort did not return or rank 0 is poisoned. The error says who did not come back."""
        self.broken_in_step = True  # first: a health check from now on knows the break is being handled
        self.mark_broken(reason)
        aborted, aborts = await asyncio.get_running_loop().run_in_executor(None, self.abort)  # gc.collect: off the loop
        done: set[asyncio.Future] = set()
        if workers:
            done, _ = await asyncio.wait(workers, timeout=self.abort_grace_s)
        lost = {rank for f, rank in workers.items() if f not in done or f.exception() is not None}
        lost |= {rank for rank in fatal_ranks if rank}
        died = [
            f"rank {rank} was lost: {describe(e)}" for f, rank in workers.items() if f in done and (e := f.exception())
        ]
        if died and "was lost" not in reason:  # what the others saw of it came first: name the cause too
            reason = "; ".join([reason, *died])
        for rank in sorted(lost):
            logger.error(
                "rank %d did not come back from step %d after the abort, or is poisoned: killed", rank, self.steps
            )
            self.kill(rank)
        # the ranks whose step came back: each one's abort, bounded on its side by the grace, must have returned too
        stuck = await _stuck_aborts({r: ref for r, ref in aborts.items() if r not in lost}, self.abort_grace_s)
        for rank in sorted(stuck):
            logger.error("rank %d's abort did not return within %g s: killed", rank, self.abort_grace_s)
            self.kill(rank)
        lost |= stuck
        back: set[asyncio.Future] = set()
        if aborted and 0 not in fatal_ranks:
            back, _ = await asyncio.wait([local], timeout=self.abort_grace_s)
        for future in [local, *workers]:
            future.add_done_callback(_consume)
        if not aborted:
            reason = f"{reason}; rank 0's abort did not return within {self.abort_grace_s:g} s"
        elif not back and 0 not in fatal_ranks:
            logger.error("rank 0's side of step %d did not come back after the abort", self.steps)
        return WorkerGroupBroken(reason, recoverable=bool(back), lost=frozenset(lost))

    def __call__(self, pack: Pack, bound_s: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step, blocking (the pipeline's forward, warm-up, tests): ``forward_async`` with rank 0 on a thread of
        this group's own. Raises PackFailed or WorkerGroupBroken as it does."""
        if not self.workers:  # one rank: nothing to wait for but this thread
            self.launch(pack, self.default_bound_s)  # numbers the step
            try:
                return self.forward_rank0(pack)
            except Exception as e:
                raise self._rank0_failed(self.steps, e) from None
        if self._blocking is None:
            self._blocking = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="h3-rank0")
        executor = self._blocking

        def on_rank0_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
            return asyncio.get_running_loop().run_in_executor(executor, fn, *args)

        bound = self.default_bound_s if bound_s is None else bound_s
        return run_sync(self.forward_async(pack, on_rank0_thread, bound))

    def abort(self) -> tuple[bool, dict[int, ray.ObjectRef]]:
        """Abort every rank's communicator without a collective: the workers' by a call on their control thread (a
        dead one's call just fails), rank 0's here, each within ``abort_grace_s``. Ranks stuck in a collective of this
        group are released. Whether rank 0's abort returned, and each worker's answer to come (False: stuck)."""
        aborts = {rank: w.abort.remote(self.master, self.abort_grace_s) for rank, w in enumerate(self.workers, 1)}
        returned = self.sp.abort(self.abort_grace_s) if self.sp is not None else True
        gc.collect()  # a gloo group nothing holds any more closes its sockets
        return returned, aborts

    def kill(self, rank: int) -> None:
        """End worker ``rank``'s process now. Ray's kill asks the process to exit, which a frozen one never does; the
        replica's placement group is STRICT_PACK, so a worker on this node also gets SIGKILL by its process id."""
        ray.kill(self.workers[rank - 1], no_restart=True)
        pid, node = self.processes.get(rank, (0, ""))
        if pid and node == ray.util.get_node_ip_address():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # gone already
                pass

    def mirror_adapters(self, loras: LoraSpecs, retiring: Mapping[str, int], timeout_s: float = 600.0) -> None:
        """Every worker holds ``loras`` (served, or about to be) and ``retiring`` in rank 0's slots; from now a worker
        this group starts again (``GroupSupervisor.replace``) loads ``loras`` too. LoraError (naming the rank) when a
        worker cannot read one: the workers are then put back as they were, as far as they answer."""
        calls = [w.mirror_adapters.remote(loras, dict(retiring)) for w in self.workers]
        for rank, call in enumerate(calls, start=1):
            try:
                ray.get(call, timeout=timeout_s)
            except LoraError as e:  # Ray's error for a task that raised one is an instance of it too
                cause = getattr(e, "cause", e)
                before = self.pipeline.denoiser
                undo = [w.mirror_adapters.remote(before.loras, dict(before.retiring)) for w in self.workers]
                ray.wait(undo, num_returns=len(undo), timeout=timeout_s)
                raise LoraError(f"SP rank {rank}: {cause}") from None
        self.spec = self.spec.model_copy(update={"loras": loras})

    def mark_broken(self, reason: str) -> None:
        if not self.broken_reason:
            self.broken_reason, self.broken_at = reason, time.monotonic()
            logger.error("SP group broken: %s", reason)

    def device_memory(self, reset: bool = False, timeout_s: float = 60.0) -> list[MeasuredUse | None]:
        """Every rank's device use now, in rank order (None on the CPU); ``reset``: then each starts its peak count
        anew."""
        device = self.sp.device if self.sp is not None else self.pipeline.denoiser.device
        own = measure_device(0, device)
        if reset:
            reset_peak(device)
        return [own, *ray.get([w.device_memory.remote(reset) for w in self.workers], timeout=timeout_s)]

    # -- tests ----------------------------------------------------------------------------
    def arm(self, fault: Fault) -> None:
        """Tests only (``h3serve.replicas.faults``): arm ``fault`` on its rank (this process for rank 0, which cannot
        kill
        itself here: rank 0 is the replica, whose death Serve handles)."""
        if fault.rank == 0:
            if fault.action == "kill" or fault.point == "join" or self.sp is None:
                raise ValueError(f"cannot arm {fault} in this process")
            self.sp.faults.arm(fault)
        else:
            ray.get(self.workers[fault.rank - 1].arm.remote(fault), timeout=10)

    # -- health ---------------------------------------------------------------------------
    def check_health(self, timeout_s: float = 5.0) -> None:
        """Raise WorkerGroupBroken if any rank is gone or the group already failed (answers while a step runs)."""
        if self.broken_reason:
            raise WorkerGroupBroken(self.broken_reason)
        # rank 0's own device: a poisoned or wedged one fails health here (DeviceUnhealthy, or the CUDA error itself),
        # whatever the workers say, so Serve replaces the replica
        device_ping(self.sp.device if self.sp is not None else self.pipeline.denoiser.device, timeout_s / 2)
        if not self.workers:
            return
        try:
            ray.get([w.ping.remote(timeout_s / 2) for w in self.workers], timeout=timeout_s)
        except Exception as e:
            self.mark_broken(f"SP worker did not answer a health check: {type(e).__name__}: {e}")
            raise WorkerGroupBroken(self.broken_reason or "") from e

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.placement is not None:
            self.placement.release()
            self.placement = None
        if self.sp is not None:
            self.sp.abort()  # never destroy: a wedged communicator may block a destroy
            self.sp = None
        if self._blocking is not None:
            self._blocking.shutdown(wait=False)
            self._blocking = None


def _load_rank0(spec: ReplicaSpec) -> tuple[H3Pipeline, LoadReport]:
    started = time.time()
    pipeline = build_rank0(spec)
    return pipeline, LoadReport(0, started, started, time.time())


def _loaded(reports: list[LoadReport]) -> dict[int, LoadReport]:
    return {report.rank: report for report in reports}


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end from synchronous code, inside a running event loop or not."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # this thread's loop is busy running our caller
        return pool.submit(asyncio.run, coroutine).result()


async def _stuck_aborts(aborts: Mapping[int, ray.ObjectRef], grace_s: float) -> set[int]:
    """Worker ranks whose abort did not return within its deadline (it answered False), or did not answer at all."""
    if not aborts:
        return set()
    futures = {asyncio.wrap_future(ref.future()): rank for rank, ref in aborts.items()}
    done, _ = await asyncio.wait(futures, timeout=grace_s + 2.0)  # each worker bounds its own abort by grace_s
    for future in futures:
        future.add_done_callback(_consume)
    return {rank for f, rank in futures.items() if f not in done or f.exception() is not None or f.result() is False}


def _consume(future: asyncio.Future) -> None:
    """Retrieve a result nobody awaits any more, so asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()
