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

Only one rank (sp_degree 1) is supported: under Ulysses the rows of a document are split over ranks,
and the decision would need a cross-rank reduction and a re-padded sub-pack. A deployment refuses a
cache policy with sp_degree > 1 (``deploy.args``) and ``packed_forward`` refuses one with ``sp`` set.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .attention_processor import Documents, attending
from .lora import rows_subset
from .packing import Pack
from .request import RequestError

OFF = "off"  # the request's ``cache`` value that turns caching off


class StepCachePolicy(BaseModel):
    """How one request caches its steps (one tier of ``engine.step_cache``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    threshold: float = Field(
        ge=0,
        description="skip the middle blocks when the relative L1 change of the first-blocks residual since the "
        "last computed step is at or under this; 0 never skips",
    )
    fn_blocks: int = Field(default=1, ge=1, description="first blocks that always run; their residual decides")
    bn_blocks: int = Field(default=0, ge=0, description="last blocks that always run (DBCache's Bn)")
    warmup_steps: int = Field(default=2, ge=1, description="first steps of a request that never skip")
    max_consecutive_skips: int = Field(
        default=3, ge=0, description="after this many skipped steps in a row the next one computes"
    )

    def check_blocks(self, num_blocks: int) -> None:
        """ValueError unless at least one middle block is left to skip among ``num_blocks``."""
        if self.fn_blocks + self.bn_blocks >= num_blocks:
            raise ValueError(
                f"fn_blocks={self.fn_blocks} + bn_blocks={self.bn_blocks} leave no block to skip "
                f"in a transformer of {num_blocks} blocks"
            )


# Built-in tiers (First-Block-Cache's F1B0 with rising thresholds): measured by benchmarks/step_cache.py.
BUILTIN_TIERS: dict[str, StepCachePolicy] = {
    "high": StepCachePolicy(threshold=0.05, warmup_steps=4, max_consecutive_skips=2),
    "medium": StepCachePolicy(threshold=0.12, warmup_steps=3, max_consecutive_skips=3),
    "low": StepCachePolicy(threshold=0.25, warmup_steps=2, max_consecutive_skips=5),
}


class StepCacheTiers(BaseModel):
    """The step-cache tiers a deployment offers; a request names one in its ``cache`` field (or ``off``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    default: str = Field(default=OFF, description="the tier of a request that names none: 'off' or a tier name")
    tiers: dict[str, StepCachePolicy] = Field(
        default_factory=lambda: dict(BUILTIN_TIERS),
        description="named policies a request may ask for with `cache`: threshold (relative L1 of the "
        "first-blocks residual), fn_blocks, bn_blocks, warmup_steps, max_consecutive_skips",
    )

    @model_validator(mode="after")
    def _names(self) -> StepCacheTiers:
        if OFF in self.tiers:
            raise ValueError(f"{OFF!r} is not a tier name: it means no caching")
        if self.default != OFF and self.default not in self.tiers:
            raise ValueError(f"default {self.default!r} is not 'off' or one of the tiers {sorted(self.tiers)}")
        return self

    @property
    def names(self) -> list[str]:
        """Every value a request's ``cache`` field may take."""
        return [OFF, *sorted(self.tiers)]

    def policy(self, name: str | None) -> StepCachePolicy | None:
        """The policy of ``name`` (None: the default); None for off; RequestError("cache") naming the allowed."""
        name = self.default if name is None else name
        if name == OFF:
            return None
        if name not in self.tiers:
            raise RequestError("cache", f"cache must be one of {', '.join(self.names)}, got {name!r}")
        return self.tiers[name]


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

    def free(self) -> None:
        self.first_residual = self.middle_residual = None

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
    block_rows: int = 0  # rows x blocks that ran in the last forward (padding rows included)
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


def cached_blocks(
    blocks: torch.nn.ModuleList,
    hidden: torch.Tensor,
    temb: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    pack: Pack,
    cache: PackCache,
) -> torch.Tensor:
    """``hidden`` [1, T, hidden] through ``blocks`` with each document's cache; called inside ``attending(pack)``.

    Documents of different policies may differ in ``fn_blocks``/``bn_blocks``: each block runs on the rows
    of the documents that need it (head, tail, or computing), on the whole pack when that is every document
    (then exactly as without a cache). Nothing is written to the documents' states until ``cache.commit()``.
    """
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
    inputs = hidden  # [1, T, hidden] h_0 (blocks never write their input in place)
    head_outputs: dict[int, torch.Tensor] = {}  # document -> [S_i, hidden] h_Fn
    sub_packs: dict[tuple[int, ...], _SubPack] = {}
    cache._pending.clear()
    cache.block_rows = cache.skipped_block_rows = 0

    def rows(i: int, of: torch.Tensor) -> torch.Tensor:
        return of[0, starts[i] : starts[i + 1]]  # [S_i, hidden], a view

    def add_cached_middle(ending: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Skipped documents whose middle ends here: h_Fn + the middle residual of their last computed step."""
        if not ending:
            return hidden
        hidden = hidden.clone()  # [1, T, hidden]; earlier tensors stay as they were (head_outputs are views)
        for i in ending:
            entry = cache.documents[i]
            assert entry is not None and entry.middle_residual is not None
            hidden[0, starts[i] : starts[i + 1]] += entry.middle_residual
        return hidden

    for b, block in enumerate(blocks):
        deciding = [i for i in range(n_docs) if heads[i] == b]
        if deciding:
            _decide(deciding, cache, hidden, inputs, rows, computes, head_outputs)
        hidden = add_cached_middle([i for i in range(n_docs) if b == tails[i] and computes[i] is False], hidden)
        active = tuple(i for i in range(n_docs) if b < heads[i] or b >= tails[i] or computes[i])
        if len(active) == n_docs:  # every document: the whole pack, padding included, as without a cache
            hidden = block(hidden, temb, adaln_indices, rotary_emb)
            cache.block_rows += pack.total_rows
        elif active:
            if active not in sub_packs:
                sub_packs[active] = _SubPack.of(pack, starts, active, adaln_indices, rotary_emb)
            hidden = sub_packs[active].run(block, hidden, temb)
            cache.block_rows += sub_packs[active].rows
        for i in set(range(n_docs)) - set(active):
            cache.skipped_block_rows += pack.lengths[i]
            cache._pending[i].skipped_block_rows += pack.lengths[i]
        for i in range(n_docs):  # a computed document's middle ended with this block: keep its residual
            if b + 1 == tails[i] and computes[i] and i in cache._pending:
                cache._pending[i].middle_residual = rows(i, hidden) - head_outputs[i]
    # skipped documents whose middle reaches the last block (bn_blocks 0)
    return add_cached_middle([i for i in range(n_docs) if tails[i] == num_blocks and computes[i] is False], hidden)


def _decide(deciding, cache: PackCache, hidden, inputs, rows, computes, head_outputs) -> None:
    """Each document in ``deciding`` (its head just ran) decides: compute its middle blocks or skip them."""
    measures: dict[int, torch.Tensor] = {}
    for i in deciding:
        entry = cache.documents[i]
        assert entry is not None  # a document without a policy never reaches a decision (its head is every block)
        residual = rows(i, hidden) - rows(i, inputs)  # [S_i, hidden] h_Fn - h_0
        head_outputs[i] = rows(i, hidden)
        if not entry.must_compute():
            measures[i] = _relative_l1(residual, entry.first_residual)
        cache._pending[i] = _Pending(skip=False, first_residual=residual)
    values = torch.stack(list(measures.values())).tolist() if measures else []  # one host sync for all of them
    for i, value in zip(measures, values, strict=True):
        entry = cache.documents[i]
        assert entry is not None
        if value <= entry.policy.threshold:  # diffusers computes when over the threshold
            cache._pending[i] = _Pending(skip=True)  # r_prev stays the last computed step's (as diffusers)
    for i in deciding:
        computes[i] = not cache._pending[i].skip


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
    """A pack whose documents carry step caches (``Pack.to`` keeps the cache: its tensors are on the model's device)."""

    step_cache: PackCache | None = None

    @classmethod
    def of(cls, pack: Pack, cache: PackCache) -> CachedPack:
        return cls(**{f.name: getattr(pack, f.name) for f in dataclasses.fields(pack)}, step_cache=cache)


def skipped_block_rows(pack: Pack) -> int:
    """Rows x blocks the pack's last forward skipped by step caching (0 for a pack without caches)."""
    return pack.step_cache.skipped_block_rows if isinstance(pack, CachedPack) and pack.step_cache else 0
