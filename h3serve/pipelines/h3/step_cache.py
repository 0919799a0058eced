"""Per-document First-Block-Cache inside one packed forward: each request decides for itself.

diffusers' ``FirstBlockCacheConfig`` hook (``diffusers/hooks/first_block_cache.py``) holds one state
per model call: the whole batch skips the remaining blocks or none of it does. In a pack every
document (one request, at its own step) keeps its own state, lives with its ``RequestState``, and
decides on its own rows:

- the first ``fn_blocks`` blocks run on every row of the pack;
- a document compares its first-blocks residual ``r = h_Fn - h_0`` (its rows only) with the one it
  had at its last *computed* step, by diffusers' relative L1 ``mean|r - r_prev| / mean|r_prev|``
  (diffusers updates ``r_prev`` only when it computes; so does this);
- at or under ``threshold`` it skips: its rows leave the pack for the middle blocks (the others run
  them in a re-packed sub-pack with its own ``cu_seqlens``: fewer rows, less work) and it adds the
  middle-blocks residual cached at its last computed step;
- the last ``bn_blocks`` blocks (DBCache's Bn) run on every row again.

Warm-up steps never skip, ``max_consecutive_skips`` forces a computed step, threshold 0 never skips.
A document without a policy always computes and keeps no state. State changes are committed only
once the whole forward succeeded (``PackCache.commit``), so a failed pack retried in halves sees the
same state it saw the first time.

LoRA adapters (``lora.adapting``) follow their documents' rows into a sub-pack: its blocks run under
``lora.rows_subset``, so each adapter's delta and timestep-table shift land on the sub-pack's rows of its
documents.

Under Ulysses (sp_degree W > 1) a document's rows move between ranks from step to step (the pack changes as
requests join and leave), so no rank can keep the residuals of "its" rows. Instead every rank holds every caching
document's full-row residuals, as at sp_degree 1: at each transition (the block input, a decision block, the end of
a document's middle, a change of the running documents) the rows are gathered onto every rank
(``all_gather_rows``), and every rank measures and keeps residuals with the same arithmetic on the same bits; at
each decision every rank then follows rank 0's decision vector (``follow_rank0``, one broadcast of a byte per
deciding document), so a rank whose arithmetic disagrees (a NaN, a non-deterministic reduction) can neither run
other sub-packs than its peers (mismatched all-to-alls: a hang) nor keep other rows. Blocks that every document
runs still run on the rank's own T/W rows; a sub-pack of the computing documents is padded to a multiple of W and
each rank runs its share under Ulysses. Ranks 1..W-1 keep their states in a ``RankCaches``, in step with rank 0's
by the ``CacheMirror`` each pack carries (``h3serve/replicas/worker_group.py``). The cost: two [T, hidden] gathered
tensors
per rank beside a block (``memory.STEP_CACHE_GATHERED_ROWS``) and an all-gather of the rows out on the ranks at
each transition; so over several ranks a deployment offers only the tiers it lists (``h3serve.deploy.common.args``).

Memory (``memory.ACTIVATION_FORMULA`` counts it; tests/test_step_cache_memory.py measures it): beside the held
residuals, a computing document holds its next ones until ``commit`` (its new first-blocks residual, and a copy of
its h_Fn rows until its middle ends, then its new middle residual). The forward lets go of what it no longer
needs as it goes: h_0 once every document decided, each h_Fn copy when its middle ends, a skipping document's
h_Fn at once, a sub-pack when the running documents change, and (under Ulysses) the gathered rows while the
rank's own rows run.

Out of memory under Ulysses (``_Hollow``): the rank lets go of its tensors and enters every collective its peers enter
by the same control flow (rank 0's decisions), with scratch buffers, so the pack fails and the group stays.

Over 600 lines on purpose: the per-document decisions at sp_degree 1 and under Ulysses (with its hollow path) and the
states every rank keeps in step (``CacheMirror``) are one protocol: they change together and are read together.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .attention_processor import Documents, SequenceParallel, attending
from .lora import rows_subset
from .packing import Pack

# the tiers live torch-free in step_cache_tiers; re-exported here, where the policies are applied
from .step_cache_tiers import BUILTIN_TIERS as BUILTIN_TIERS
from .step_cache_tiers import OFF as OFF
from .step_cache_tiers import StepCachePolicy
from .step_cache_tiers import StepCacheTiers as StepCacheTiers

logger = logging.getLogger(__name__)
T = TypeVar("T")
_KEYS = itertools.count(1)  # DocumentCache keys: unique within the process that creates them (rank 0)


@dataclasses.dataclass
class DocumentCache:
    """One request's cache state across its steps (freed when it finishes or leaves)."""

    policy: StepCachePolicy
    first_residual: torch.Tensor | None = None  # [S, hidden] h_Fn - h_0 at the last computed step
    middle_residual: torch.Tensor | None = None  # [S, hidden] middle blocks' output - input, same step
    steps: int = 0  # forwards this document took part in
    consecutive_skips: int = 0
    skipped: list[bool] = dataclasses.field(default_factory=list)  # per step: whether it skipped the middle
    skipped_block_rows: int = 0  # rows x middle blocks it did not run
    key: int = dataclasses.field(default_factory=lambda: next(_KEYS))  # names it to the other Ulysses ranks

    def free(self) -> None:
        self.first_residual = self.middle_residual = None

    @property
    def cached(self) -> bool:
        """Whether it holds the residuals of a computed step."""
        return self.first_residual is not None and self.middle_residual is not None

    @property
    def residual_bytes(self) -> int:
        """Bytes of the residuals it holds now."""
        return sum(t.nbytes for t in (self.first_residual, self.middle_residual) if t is not None)

    def must_compute(self) -> bool:
        """Whether this step computes whatever its residual says (warm-up, a forced step, no state)."""
        p = self.policy
        return (
            p.threshold <= 0
            or self.steps < p.warmup_steps
            or self.consecutive_skips >= p.max_consecutive_skips
            or self.first_residual is None
            or self.middle_residual is None
        )


@dataclasses.dataclass
class _Pending:
    """What one document's step will write into its ``DocumentCache`` once the forward succeeded."""

    skip: bool
    first_residual: torch.Tensor | None = None  # [S, hidden], when it computes
    middle_residual: torch.Tensor | None = None  # [S, hidden], when it computes
    skipped_block_rows: int = 0


@dataclasses.dataclass
class PackCache:
    """The cache input of one packed forward: one entry per request document (None: caching off for it)."""

    documents: list[DocumentCache | None]
    block_rows: int = 0  # rows x blocks that ran in the last forward (padding rows included; this rank's under sp)
    skipped_block_rows: int = 0  # rows x blocks skipped in the last forward
    _pending: dict[int, _Pending] = dataclasses.field(default_factory=dict)

    def commit(self) -> None:
        """Write every document's step into its state; ``packed_forward`` calls it once the forward succeeded."""
        for i, pending in self._pending.items():
            cache = self.documents[i]
            assert cache is not None
            cache.steps += 1
            cache.skipped.append(pending.skip)
            cache.skipped_block_rows += pending.skipped_block_rows
            if pending.skip:
                cache.consecutive_skips += 1
            else:
                cache.consecutive_skips = 0
                cache.first_residual, cache.middle_residual = pending.first_residual, pending.middle_residual
        self._pending.clear()


def _relative_l1(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """diffusers' first-block-cache measure: mean|r - r_prev| / mean|r_prev| (a 0-d fp32 tensor)."""
    residual, previous = residual.float(), previous.float()
    return (residual - previous).abs().mean() / previous.abs().mean()


def _plan(blocks: torch.nn.ModuleList, pack: Pack, cache: PackCache):
    """Each document's rows, head and tail in blocks, and decision so far (None: undecided); resets ``cache``'s step."""
    n_docs, num_blocks = len(pack.lengths), len(blocks)
    if len(cache.documents) != n_docs:
        raise ValueError(f"a pack of {n_docs} documents got {len(cache.documents)} cache entries")
    for entry in cache.documents:
        if entry is not None:
            entry.policy.check_blocks(num_blocks)
    starts = [0, *itertools.accumulate(pack.lengths)]  # host ints: document i is rows [starts[i], starts[i+1])
    heads = [e.policy.fn_blocks if e is not None else num_blocks for e in cache.documents]  # blocks before deciding
    tails = [num_blocks - e.policy.bn_blocks if e is not None else num_blocks for e in cache.documents]
    computes: list[bool | None] = [None if e is not None else True for e in cache.documents]  # None: undecided
    cache._pending.clear()
    cache.block_rows = cache.skipped_block_rows = 0
    return n_docs, num_blocks, starts, heads, tails, computes


def cached_blocks(
    blocks: torch.nn.ModuleList,
    hidden: torch.Tensor,
    temb: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    pack: Pack,
    cache: PackCache,
    sharded: ShardedRows | None = None,
) -> torch.Tensor:
    """``hidden`` [1, T, hidden] through ``blocks`` with each document's cache; called inside ``attending(pack)``.

    Documents of different policies may differ in ``fn_blocks``/``bn_blocks``: each block runs on the rows
    of the documents that need it (head, tail, or computing), on the whole pack when that is every document
    (then exactly as without a cache). Nothing is written to the documents' states until ``cache.commit()``.
    With ``sharded`` (Ulysses over more than one rank), ``hidden`` is this rank's rows [1, T/W, hidden] and the
    result is too (``_sharded_cached_blocks``).
    """
    if sharded is not None and sharded.sp.sp_degree > 1:
        return _sharded_cached_blocks(blocks, hidden, temb, adaln_indices, rotary_emb, pack, cache, sharded)
    n_docs, num_blocks, starts, heads, tails, computes = _plan(blocks, pack, cache)
    inputs: torch.Tensor | None = hidden  # [1, T, hidden] h_0 (blocks never write their input in place)
    head_outputs: dict[int, torch.Tensor] = {}  # computing document -> [S_i, hidden] h_Fn copy, to its middle's end
    sub_packs: dict[tuple[int, ...], _SubPack] = {}  # at most one: the running documents' (its per-row tensors)

    def rows(i: int, of: torch.Tensor) -> torch.Tensor:
        return of[0, starts[i] : starts[i + 1]]  # [S_i, hidden], a view

    def add_cached_middle(ending: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Skipped documents whose middle ends here: h_Fn + the middle residual of their last computed step."""
        if not ending:
            return hidden
        hidden = hidden.clone()  # [1, T, hidden]; the tensor we were given stays as it was
        for i in ending:
            entry = cache.documents[i]
            assert entry is not None and entry.middle_residual is not None
            hidden[0, starts[i] : starts[i + 1]] += entry.middle_residual
        return hidden

    for b, block in enumerate(blocks):
        deciding = [i for i in range(n_docs) if heads[i] == b]
        if deciding:
            assert inputs is not None
            _decide(deciding, cache, hidden, inputs, rows, computes, head_outputs)
            if all(c is not None for c in computes):
                inputs = None  # no decision left: h_0 is not needed any more (the caller may still hold it)
        hidden = add_cached_middle([i for i in range(n_docs) if b == tails[i] and computes[i] is False], hidden)
        active = tuple(i for i in range(n_docs) if b < heads[i] or b >= tails[i] or computes[i])
        if len(active) == n_docs:  # every document: the whole pack, padding included, as without a cache
            hidden = block(hidden, temb, adaln_indices, rotary_emb)
            cache.block_rows += pack.total_rows
        elif active:
            if active not in sub_packs:
                sub_packs.clear()  # one sub-pack at a time: its indices and rotary angles are per row
                sub_packs[active] = _SubPack.of(pack, starts, active, adaln_indices, rotary_emb)
            hidden = sub_packs[active].run(block, hidden, temb)
            cache.block_rows += sub_packs[active].rows
        for i in set(range(n_docs)) - set(active):
            cache.skipped_block_rows += pack.lengths[i]
            cache._pending[i].skipped_block_rows += pack.lengths[i]
        for i in range(n_docs):  # a computed document's middle ended with this block: keep its residual
            if b + 1 == tails[i] and computes[i] and i in cache._pending:
                cache._pending[i].middle_residual = rows(i, hidden) - head_outputs.pop(i)
    # skipped documents whose middle reaches the last block (bn_blocks 0)
    return add_cached_middle([i for i in range(n_docs) if tails[i] == num_blocks and computes[i] is False], hidden)


def _decide(deciding, cache: PackCache, hidden, inputs, rows, computes, head_outputs, follow=None) -> None:
    """Each document in ``deciding`` (its head just ran) decides: compute its middle blocks or skip them.

    ``follow`` (under Ulysses, ``SequenceParallel.follow_rank0``) replaces this rank's decisions by rank 0's."""
    residuals: dict[int, torch.Tensor] = {}
    measures: dict[int, torch.Tensor] = {}
    for i in deciding:
        entry = cache.documents[i]
        assert entry is not None  # a document without a policy never reaches a decision (its head is every block)
        residuals[i] = rows(i, hidden) - rows(i, inputs)  # [S_i, hidden] h_Fn - h_0
        if not entry.must_compute():
            measures[i] = _relative_l1(residuals[i], entry.first_residual)
    values = torch.stack(list(measures.values())).tolist() if measures else []  # one host sync for all of them
    skip = dict.fromkeys(deciding, False)
    for i, value in zip(measures, values, strict=True):
        entry = cache.documents[i]
        assert entry is not None
        skip[i] = value <= entry.policy.threshold  # diffusers computes when over the threshold
    if follow is not None:  # every rank runs rank 0's choice, whatever its own arithmetic said
        skip = dict(zip(deciding, follow([skip[i] for i in deciding]), strict=True))
    for i in deciding:  # first: once rank 0's choice is known, the step's collectives are (``_Hollow`` needs them)
        computes[i] = not skip[i]
    for i in deciding:
        # a skip keeps r_prev at the last computed step's (as diffusers); a compute keeps its new residual
        cache._pending[i] = _Pending(skip=True) if skip[i] else _Pending(skip=False, first_residual=residuals.pop(i))
        if computes[i]:  # its middle residual is taken against h_Fn: a copy of its rows, not a view holding the pack's
            head_outputs[i] = rows(i, hidden).clone()  # [S_i, hidden]


@dataclasses.dataclass(frozen=True)
class ShardedRows:
    """What step caching needs under Ulysses beyond this rank's rows: the group, every row's AdaLN index, RoPE."""

    sp: SequenceParallel
    adaln_indices: torch.Tensor  # [T] every pack row's AdaLN table row (timestep index * 3 + tag)
    rope: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [n, 3] -> cos, sin [n, rope dim]
    inner: int  # heads x head_dim: what a block's all-to-alls carry per row


def _sharded_cached_blocks(
    blocks: torch.nn.ModuleList,
    local: torch.Tensor,
    temb: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    pack: Pack,
    cache: PackCache,
    sharded: ShardedRows,
) -> torch.Tensor:
    """``cached_blocks`` over W Ulysses ranks: ``local`` is this rank's rows [1, T/W, hidden], and so is the result.

    A document's rows move between ranks from step to step (the pack changes), so no rank can keep the residuals
    of "its" rows: every rank holds every caching document's full-row residuals, as at sp_degree 1. At each
    transition (the block input, a decision block, a document's middle ending, a change of the running documents)
    the rows out on the ranks are gathered (``all_gather_rows``) into ``full`` [1, T, hidden], the same bits on
    every rank; every rank then measures and keeps residuals with the same arithmetic on the same rows, and
    follows rank 0's decisions (``SequenceParallel.follow_rank0``). Between transitions a block runs on the rank's own
    [lo, hi) rows when every document runs it (as without a cache), else on the rank's share of a sub-pack of
    the running documents' rows, padded to a multiple of W (``_ShardedSubPack``).

    Out of memory anywhere in here, the rank goes on hollow (``_Hollow``): it lets go of its tensors and enters every
    collective its peers enter, by the same control flow (rank 0's decisions), with scratch buffers, then raises the
    error; ``packed_forward`` drains the step's gather and outcome agreement after it: the pack fails, not the group.
    """
    sp = sharded.sp
    n_docs, num_blocks, starts, heads, tails, computes = _plan(blocks, pack, cache)
    local_rows, width = int(local.shape[1]), int(local.shape[2])
    hollow = _Hollow(sp, sharded.inner, width, local.dtype)
    if all(entry is None for entry in cache.documents):  # nobody caches: exactly the forward without a cache
        for b, block in enumerate(blocks):
            entered = sp.all_to_alls
            try:
                local = block(local, temb, adaln_indices, rotary_emb)
            except torch.OutOfMemoryError as e:
                hollow.fail(e)
                sp.fill_block(local_rows, sharded.inner, local.dtype, sp.all_to_alls - entered)
                for _ in range(b + 1, num_blocks):
                    sp.fill_block(local_rows, sharded.inner, local.dtype)
                raise e from None
            cache.block_rows += local_rows
        return local
    lo = sp.rank * local_rows  # this rank's first pack row

    def rows(i: int, of: torch.Tensor) -> torch.Tensor:
        return of[0, starts[i] : starts[i + 1]]  # [S_i, hidden], a view

    def share(active: tuple[int, ...] | None) -> int:
        """The rows this rank runs of the running documents ``active`` (None: its own [lo, hi) rows)."""
        if active is None:
            return local_rows
        return -(-sum(pack.lengths[i] for i in active) // sp.sp_degree)  # the sub-pack padded to a multiple of W

    def all_rows(x: torch.Tensor) -> torch.Tensor:
        return sp.all_gather_rows(x[0])[None]  # [1, T, hidden]

    # [1, T, hidden]: every row as of the last transition; None while this rank's own rows run (nothing reads it)
    full: torch.Tensor | None = hollow.attempt(local_rows, all_rows, local)
    inputs: torch.Tensor | None = full  # h_0, on every rank, until the last document decided
    out: torch.Tensor | None = local  # the rows out on the ranks: [1, T/W, hidden] or a sub-pack's share
    del local
    away = True  # rows are out on the ranks (``out``; hollow: only their count matters)
    running: tuple[int, ...] | None = None  # whose sub-pack share is out (None: this rank's [lo, hi) rows)
    head_outputs: dict[int, torch.Tensor] = {}  # computing document -> [S_i, hidden] h_Fn (a copy)
    sub_packs: dict[tuple[int, ...], _ShardedSubPack] = {}

    def let_go() -> None:
        """Out of memory: every tensor of the step goes (what the peers still need is collectives, with scratch)."""
        nonlocal full, inputs, out
        full = inputs = out = None
        head_outputs.clear()
        sub_packs.clear()
        for i, pending in cache._pending.items():
            cache._pending[i] = _Pending(pending.skip, skipped_block_rows=pending.skipped_block_rows)

    hollow.on_fail = let_go

    def gather() -> torch.Tensor | None:
        """``full`` with the rows out on the ranks written back (every rank gets the same bits); None once hollow."""
        if not away:
            return full
        if running is None:
            return hollow.attempt(share(None), all_rows, out)  # [1, T, hidden]
        sub = sub_packs.get(running)  # a sub-pack's share: the others' rows are in ``full``
        return hollow.attempt(share(running), lambda: sub.gathered_into(full, out))  # type: ignore[union-attr,arg-type]

    def middles_end(b: int) -> None:
        """Documents whose middle blocks end before block ``b``: keep a computed residual, add a cached one."""
        assert full is not None  # called right after a gather
        for i in range(n_docs):
            if tails[i] == b and computes[i] and i in cache._pending:
                cache._pending[i].middle_residual = rows(i, full) - head_outputs.pop(i)
        for i in range(n_docs):  # in place: after a decision's gather nothing else views ``full`` (h_Fn is copied)
            if tails[i] == b and computes[i] is False:
                entry = cache.documents[i]
                assert entry is not None and entry.middle_residual is not None
                rows(i, full).add_(entry.middle_residual)

    for b, block in enumerate(blocks):
        deciding = [i for i in range(n_docs) if heads[i] == b]
        ending = any(tails[i] == b and i in cache._pending for i in range(n_docs))
        if deciding or ending:  # a transition: every rank needs every row
            full, out, running, away = gather(), None, None, False
            hollow.attempt(None, middles_end, b)
            if deciding:
                follow = sp.follow_rank0  # (no tuple of the arguments: it would hold h_0 past the last decision)
                hollow.decide(
                    deciding,
                    cache,
                    computes,
                    _decide,
                    deciding,
                    cache,
                    full,
                    inputs,
                    rows,
                    computes,
                    head_outputs,
                    follow,
                )
                if all(c is not None for c in computes):
                    inputs = None  # no decision left: h_0 is not needed any more
        active = tuple(i for i in range(n_docs) if b < heads[i] or b >= tails[i] or computes[i])
        if len(active) == n_docs:  # every document: this rank's own rows, as without a cache
            if not away or running is not None:
                full, running = gather(), None
                out, away = None if full is None else full[:, lo : lo + local_rows], True  # [1, T/W, hidden], a view
            out = hollow.run(local_rows, block, out, temb, adaln_indices, rotary_emb)
            full = None  # the next transition gathers every row afresh from ``out``: let the old ones go
            cache.block_rows += local_rows
        elif active:
            if active not in sub_packs and not hollow.failed:
                sub_packs.clear()  # one sub-pack at a time: its indices and rotary angles are per row
                made = hollow.attempt(None, _ShardedSubPack.of, pack, starts, active, sharded)
                if made is not None:
                    sub_packs[active] = made
                del made
            if running != active or not away:
                full, running, away = gather(), active, True
                sub = sub_packs.get(active)
                out = None if full is None or sub is None else hollow.attempt(None, full.index_select, 1, sub.mine)
            sub = sub_packs.get(active)
            out = hollow.run(share(active), sub.run if sub is not None else block, block, out, temb)
            cache.block_rows += share(active)
        elif away:  # nobody runs this block: the rows out on the ranks come home
            full, out, running, away = gather(), None, None, False
        for i in set(range(n_docs)) - set(active):
            cache.skipped_block_rows += pack.lengths[i]
            cache._pending[i].skipped_block_rows += pack.lengths[i]
    if any(tails[i] == num_blocks and i in cache._pending for i in range(n_docs)):
        full, out, running, away = gather(), None, None, False
        hollow.attempt(None, middles_end, num_blocks)
    if away and running is None:  # this rank's own rows are out: nothing to gather
        if hollow.error is not None:
            raise hollow.error
        assert out is not None
        return out  # [1, T/W, hidden]
    full = gather()
    if hollow.error is not None:  # every collective of the blocks entered: the caller drains the rest of the step
        raise hollow.error
    assert full is not None
    return full[:, lo : lo + local_rows]  # [1, T/W, hidden]


class _Hollow:
    """What a rank that ran out of memory in a step-caching step still owes its peers: every collective they enter.

    Each step of ``_sharded_cached_blocks`` that allocates goes through it. Once one ran out of memory (``fail``:
    the step's tensors go), the rest only enter collectives: a block's all-to-alls, a gather's all-gather, a decision's
    broadcast (rank 0's choice followed, or, on rank 0, "compute" sent), with scratch buffers of the peers' shapes,
    by the same control flow. Nothing is spent while nothing fails: no collective or host sync is added.
    """

    def __init__(self, sp: SequenceParallel, inner: int, width: int, dtype: torch.dtype):
        self.sp, self.inner, self.width, self.dtype = sp, inner, width, dtype
        self.error: torch.OutOfMemoryError | None = None
        self.on_fail: Callable[[], None] = lambda: None

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, error: torch.OutOfMemoryError) -> None:
        error.__traceback__ = None  # its frames hold the failed step's activations: they go before the scratch comes
        self.error = error
        self.on_fail()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the failed step's blocks back to the device before the scratch is made
        logger.warning(
            "rank %d: out of memory in a step-caching step after %d collective(s): entering the rest with scratch "
            "buffers, so the pack fails alone (%s)",
            self.sp.rank,
            self.sp.collectives,
            error,
        )

    def attempt(self, gathers: int | None, make: Callable[..., T], *args: Any) -> T | None:
        """``make(*args)``; out of memory (or hollow already): None, having entered its all-gather of ``gathers``
        rows (None: it has none) unless it had."""
        if self.failed:
            if gathers is not None:
                self.sp.fill_all_gather(gathers, self.width, self.dtype)
            return None
        entered = self.sp.collectives
        try:
            return make(*args)
        except torch.OutOfMemoryError as e:
            self.fail(e)
            if gathers is not None and self.sp.collectives == entered:
                self.sp.fill_all_gather(gathers, self.width, self.dtype)
            return None

    def run(self, rows: int, block: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor | None:
        """``block(*args)`` on ``rows`` rows of this rank; out of memory (or hollow already): the all-to-alls it has
        left."""
        entered = self.sp.all_to_alls
        if not self.failed:
            try:
                return block(*args)
            except torch.OutOfMemoryError as e:
                self.fail(e)
        self.sp.fill_block(rows, self.inner, self.dtype, self.sp.all_to_alls - entered)
        return None

    def decide(
        self,
        deciding: list[int],
        cache: PackCache,
        computes: list[bool | None],
        decide: Callable[..., None],
        *args: Any,
    ) -> None:
        """``decide(*args)``; out of memory (or hollow already): rank 0's decisions followed all the same, no
        residual kept."""
        if not self.failed:
            try:
                return decide(*args)
            except torch.OutOfMemoryError as e:
                self.fail(e)
        if computes[deciding[0]] is None:  # rank 0's choice is not known here yet: its broadcast is still owed
            skips = self.sp.follow_rank0([False] * len(deciding))  # rank 0 hollow: every document computes
            for i, skip in zip(deciding, skips, strict=True):
                computes[i] = not skip
        for i in deciding:
            cache._pending.setdefault(i, _Pending(skip=not computes[i]))
        return None


@dataclasses.dataclass
class _ShardedSubPack:
    """Some documents' rows re-packed and split over the Ulysses ranks: this rank runs a contiguous share.

    The active rows are padded to a multiple of W with one padding document of copies of the first active row
    (it attends only to itself and its output is dropped), as a pack is padded for Ulysses.
    """

    index: torch.Tensor  # [T_sub] int64 pack rows of the active documents, in pack order
    mine: torch.Tensor  # [T_sub'/W] int64 pack rows this rank runs (T_sub' = T_sub padded to a multiple of W)
    documents: Documents  # the sub-pack's bounds, its padding document included; rows sharded over ``sp``
    adaln_indices: torch.Tensor  # [T_sub'/W]
    rotary_emb: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T_sub'/W, rope dim]
    sp: SequenceParallel

    @property
    def rows(self) -> int:
        """The rows this rank runs (its share of the padded sub-pack)."""
        return int(self.mine.shape[0])

    @classmethod
    def of(cls, pack: Pack, starts: list[int], active: tuple[int, ...], sharded: ShardedRows) -> _ShardedSubPack:
        sp, device = sharded.sp, sharded.adaln_indices.device
        lengths = [pack.lengths[i] for i in active]
        used = sum(lengths)
        padding = -used % sp.sp_degree
        index = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in active])  # [T_sub]
        padded = torch.cat([index, index[:1].expand(padding)])  # [T_sub']
        share = (used + padding) // sp.sp_degree
        mine = padded[sp.rank * share : (sp.rank + 1) * share]  # [T_sub'/W]
        bounds = [0, *itertools.accumulate(lengths)] + ([used + padding] if padding else [])
        return cls(
            index,
            mine,
            Documents(
                torch.tensor(bounds, dtype=torch.int32, device=device),  # [D_sub+1]
                max(lengths + ([padding] if padding else [])),
                sp,
            ),
            sharded.adaln_indices.index_select(0, mine),
            sharded.rope(pack.position_ids.index_select(0, mine)),  # RoPE is per row: these rows' angles only
            sp,
        )

    def run(self, block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """``block`` on this rank's share [1, T_sub'/W, hidden] of the sub-pack, under Ulysses."""
        with attending(self.documents), rows_subset(self.mine):  # an adapter's delta follows its rows here too
            return block(hidden, temb, self.adaln_indices, self.rotary_emb)

    def gathered_into(self, full: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
        """``full`` [1, T, hidden] with every rank's share of this sub-pack written back, in place (the padding
        dropped): nothing else views ``full``, and a copy would hold a third [T, hidden] at the transition."""
        rows = self.sp.all_gather_rows(share[0])  # [T_sub', hidden] in rank order: the padded sub-pack's order
        return full.index_copy_(1, self.index, rows[None, : self.index.shape[0]])  # [1, T, hidden]


@dataclasses.dataclass
class _SubPack:
    """The rows of some documents of a pack, re-packed: their own bounds, AdaLN rows and rotary angles."""

    index: torch.Tensor  # [T_sub] int64 rows of the pack
    documents: Documents
    adaln_indices: torch.Tensor  # [T_sub]
    rotary_emb: tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T_sub, rope dim]

    @property
    def rows(self) -> int:
        return int(self.index.shape[0])

    @classmethod
    def of(cls, pack: Pack, starts: list[int], active: tuple[int, ...], adaln_indices, rotary_emb) -> _SubPack:
        device = adaln_indices.device
        lengths = [pack.lengths[i] for i in active]
        index = torch.cat([torch.arange(starts[i], starts[i + 1], device=device) for i in active])
        bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)  # [D_sub+1]
        cos, sin = rotary_emb
        return cls(
            index,
            Documents(bounds, max(lengths)),
            adaln_indices.index_select(0, index),
            (cos.index_select(0, index), sin.index_select(0, index)),
        )

    def run(self, block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """``block`` on these rows only; the other rows of ``hidden`` [1, T, hidden] pass through unchanged."""
        with attending(self.documents), rows_subset(self.index):  # an adapter's delta follows its rows here too
            out = block(hidden.index_select(1, self.index), temb, self.adaln_indices, self.rotary_emb)
        return hidden.index_copy(1, self.index, out)  # [1, T, hidden]


@dataclasses.dataclass
class CachedPack(Pack):
    """A pack whose documents carry step caches (``Pack.to`` keeps the cache: its tensors are on the model's device).

    On rank 0 ``step_cache`` holds the documents' states. What travels to the other Ulysses ranks carries
    ``mirror`` instead (no tensors); each of them turns it into its own states (``RankCaches.pack_cache``).
    """

    step_cache: PackCache | None = None
    mirror: CacheMirror | None = None

    @classmethod
    def of(cls, pack: Pack, cache: PackCache | None = None, mirror: CacheMirror | None = None) -> CachedPack:
        return cls(**{f.name: getattr(pack, f.name) for f in dataclasses.fields(Pack)}, step_cache=cache, mirror=mirror)


# --- the same states on every Ulysses rank ------------------------------------------------------------------
# Under Ulysses every rank runs ``cached_blocks`` and must hold the same state for each caching document: rank 0's
# lives in the request's ``RequestState``; ranks 1..W-1 keep theirs in a ``RankCaches`` keyed by
# ``DocumentCache.key``. With each pack, rank 0 sends a ``CacheMirror``: each document's key, policy and counters,
# and the keys it freed since its last pack. Every rank commits its own states once its forward succeeded, after
# the forward's last collective, so the ranks commit the same steps; a rank whose state disagrees with rank 0's
# refuses the pack rather than decide differently.


@dataclasses.dataclass(frozen=True)
class MirroredDocument:
    """What another rank checks its state of document ``key`` against (rank 0's, as the pack starts)."""

    key: int
    policy: StepCachePolicy
    steps: int
    consecutive_skips: int
    cached: bool  # it holds the residuals of a computed step

    @classmethod
    def of(cls, cache: DocumentCache) -> MirroredDocument:
        return cls(cache.key, cache.policy, cache.steps, cache.consecutive_skips, cache.cached)


@dataclasses.dataclass(frozen=True)
class CacheMirror:
    """Rank 0's step caches of one pack as the other ranks receive them with it: no tensors."""

    documents: tuple[MirroredDocument | None, ...]  # one per document of the pack (None: caching off for it);
    # empty: the pack runs without caches, the mirror only carries what was freed
    freed: tuple[int, ...]  # keys rank 0 freed since its previous pack: drop them before this one


class CacheMirrorWriter:
    """Rank 0's side: the ``CacheMirror`` of each pack, with the states it freed since the last one.

    A state counts as freed once it holds no residuals (``free``: its request finished, failed or was cancelled;
    or its only step so far failed) or its request is gone (garbage-collected); a request that comes back later is
    mirrored afresh from its counters.
    """

    def __init__(self) -> None:
        self._told: dict[int, weakref.ref[DocumentCache]] = {}  # key -> the state the other ranks hold for it

    def mirror(self, cache: PackCache | None) -> CacheMirror | None:
        """The mirror of a pack with ``cache`` (None: a pack without caches; then None unless states were freed)."""
        freed = tuple(key for key, ref in self._told.items() if (state := ref()) is None or not state.cached)
        for key in freed:
            del self._told[key]
        if cache is None:
            return CacheMirror((), freed) if freed else None
        for state in cache.documents:
            if state is not None:
                self._told[state.key] = weakref.ref(state)
        return CacheMirror(tuple(None if d is None else MirroredDocument.of(d) for d in cache.documents), freed)

    @property
    def told(self) -> list[int]:
        """Keys whose states the other ranks hold now (until the next pack tells them of the freed ones)."""
        return sorted(self._told)


class RankCaches:
    """Ranks 1..W-1: each request's ``DocumentCache``, created when a pack first names it, freed when rank 0 did."""

    def __init__(self) -> None:
        self.documents: dict[int, DocumentCache] = {}

    def pack_cache(self, mirror: CacheMirror) -> PackCache:
        """This rank's ``PackCache`` for the pack ``mirror`` came with (after dropping what rank 0 freed)."""
        for key in mirror.freed:
            dropped = self.documents.pop(key, None)
            if dropped is not None:
                dropped.free()
        entries: list[DocumentCache | None] = []
        for told in mirror.documents:
            if told is None:
                entries.append(None)
                continue
            state = self.documents.get(told.key)
            if state is None and not told.cached:  # new here, or freed and back: rank 0's counters, no residuals
                state = DocumentCache(
                    told.policy, steps=told.steps, consecutive_skips=told.consecutive_skips, key=told.key
                )
                self.documents[told.key] = state
            if state is None or MirroredDocument.of(state) != told:
                here = MirroredDocument.of(state) if state is not None else "no state"
                raise RuntimeError(f"step cache {told.key} is out of step with rank 0: {here} here, {told} on rank 0")
            entries.append(state)
        return PackCache(entries)


def skipped_block_rows(pack: Pack) -> int:
    """Rows x blocks the pack's last forward skipped by step caching (0 for a pack without caches)."""
    return pack.step_cache.skipped_block_rows if isinstance(pack, CachedPack) and pack.step_cache else 0
