"""The real step path on PyTorch's meta device: placement, host syncs, FLOPs and live bytes at any size, no GPU.

A meta tensor has a shape, a dtype and a device but no data, so the released 33B transformer builds in a second
and every op of a step runs its shape and dtype logic at once. What a CUDA run would show, a meta run shows too:
a tensor made on the CPU and mixed with the model's tensors fails here as it fails there. What it cannot do is read
data, so three things stand in, here and nowhere else (no backend registry or model code knows them; only
``h3serve plan`` and the tests build them):

* ``MetaRun`` (a ``TorchDispatchMode`` and a ``TorchFunctionMode``) keeps the **host value** of every small tensor
  made from host data (a pack's indices, ``cu_seqlens``, the schedules), computed on the CPU beside the meta op. An
  op whose output size or value depends on data (``nonzero``, a boolean mask, ``unique``, ``.item()``, a copy to the
  host) takes its answer from those values, and is **listed as a host sync** with the line that made it: on CUDA each
  one waits for the device. A value no host data gives (a measure of the hidden state: the step cache's decision) is
  answered by ``MetaRun.unknown``, which the caller chooses. The same mode checks that every op's tensors are on the
  model's device and tracks the bytes of live tensor storages (each counted once, released when its last tensor
  dies) and their peak.
* ``MetaVarlenImpl``, the attention kernel on meta tensors only: the shape of ``forward_varlen``'s output, and the
  FLOPs of attention within each document (``torch.ops.h3meta.varlen_attention``, whose FLOP formula
  ``FlopCounterMode`` applies: 4 L^2 H D per document). It reads the document bounds from the host values, as
  flash-attn reads ``cu_seqlens`` on the device, so it adds no sync of its own.
* ``fake_group``: torch's fake process group under h3serve's real ``UlyssesGroup``; its collectives return at once
  and move nothing (the shapes are the real ones).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import os
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.flop_counter import flop_registry, register_flop_formula
from torch.utils.weak import WeakTensorKeyDictionary

import h3serve
from h3serve.attention import AttentionImpl
from h3serve.attention.impl import check_varlen_inputs

aten = torch.ops.aten
REPO = os.path.dirname(os.path.dirname(os.path.abspath(h3serve.__file__)))  # paths in the report: h3serve/...
HOST_VALUE_LIMIT = 1 << 24  # elements: larger tensors (activations) never get a host value; index tensors are far below


# -- the stand-in attention kernel -----------------------------------------------------------------------------
@torch.library.custom_op("h3meta::varlen_attention", mutates_args=())
def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Attention within each document of ``lengths`` rows: defined for meta tensors only (its fake below)."""
    raise RuntimeError("h3meta::varlen_attention stands in for a kernel on meta tensors only")


@varlen_attention.register_fake
def _varlen_attention_shape(q, k, v, lengths):
    return torch.empty_like(q)  # [T, H, D], as flash-attn's varlen output


@register_flop_formula(torch.ops.h3meta.varlen_attention)
def _varlen_attention_flops(q_shape, k_shape, v_shape, lengths, *args, out_shape=None, **kwargs) -> int:
    _, heads, head_dim = q_shape  # this rank's heads under Ulysses
    return sum(4 * n * n * heads * head_dim for n in lengths)  # QK^T and PV, 2 FLOPs per multiply-add


# FlopCounterMode counts addmm but not its in-place form, with which ``lora.adapting`` adds each delta's up-projection
def _addmm_inplace_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    (m, k), (_, n) = a_shape, b_shape
    return 2 * m * n * k  # as addmm's: the product's multiply-adds


if aten.addmm_ not in flop_registry:
    register_flop_formula(aten.addmm_)(_addmm_inplace_flops)


class MetaVarlenImpl(AttentionImpl):
    """Packed varlen attention on meta tensors only: the output's shape and each document's FLOPs.

    The document bounds come from ``run``'s host values of ``cu_seqlens`` (the device tensor the real kernels
    take); any other device, or bounds on another device than q, is refused.
    """

    def __init__(self, run: MetaRun, softmax_scale: float | None = None) -> None:
        super().__init__(softmax_scale)
        self.run = run
        self.dtypes: collections.Counter[torch.dtype] = collections.Counter()  # q's dtype per call

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
    ) -> torch.Tensor:
        check_varlen_inputs(q, k, v, cu_seqlens, cu_seqlens_k, max_seqlen_k)
        if q.device.type != "meta" or cu_seqlens.device != q.device or cu_seqlens_k is not None:
            raise RuntimeError(
                f"MetaVarlenImpl runs self-attention on meta tensors only; got q on {q.device}, "
                f"cu_seqlens on {cu_seqlens.device}"
            )
        bounds = self.run.value_of(cu_seqlens).tolist()  # [D+1]
        lengths = [b - a for a, b in itertools.pairwise(bounds)]
        if bounds[-1] != q.shape[0] or max(lengths) != max_seqlen:
            raise ValueError(f"cu_seqlens {bounds} / max_seqlen {max_seqlen} do not describe {q.shape[0]} rows")
        self.dtypes[q.dtype] += 1
        return varlen_attention(q, k, v, lengths)


# -- Ulysses collectives on meta tensors -----------------------------------------------------------------------
@contextlib.contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """torch's fake process group as the default group: collectives complete at once and move nothing."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- the mode --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HostSync:
    """One op that makes the host wait for the device on CUDA."""

    kind: str  # "item", "nonzero", "boolean mask", "unique", "device-to-host copy", "host-to-device copy", ...
    op: str
    shape: tuple[int, ...]
    where: str  # file:line (function) of the first frame outside torch and this module
    mid_forward: bool  # after the step's first matmul: the device drains its queue while the host waits

    def __str__(self) -> str:
        when = "mid-forward" if self.mid_forward else "before"
        return f"{self.kind:<20} {self.op:<28} {str(list(self.shape)):<14} {when:<11} {self.where}"

    @property
    def site(self) -> str:
        """Where, without the line number: ``kind at file (function)``."""
        path, _, rest = self.where.partition(":")
        return f"{self.kind} at {path} {rest.partition(' ')[2]}"


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    bytes: int  # the input tensors' bytes (what one rank sends)


class DeviceMismatch(RuntimeError):
    """An op mixed tensors of two devices: on CUDA this step fails."""


class NoHostValue(RuntimeError):
    """A data-dependent op on a tensor no host data produced, with no ``unknown`` answer given."""


_DATA_DEPENDENT: dict[Any, str] = {
    aten._local_scalar_dense.default: "item",
    aten.nonzero.default: "nonzero",
    aten.argwhere.default: "nonzero",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.masked_select.default: "masked_select",
    aten.repeat_interleave.Tensor: "repeat_interleave",
    aten.equal.default: "equal",
    aten.is_nonzero.default: "item",
}
_COPIES = (aten._to_copy.default, aten.copy_.default)
_MATMULS = {aten.mm.default, aten.addmm.default, aten.addmm_.default, aten.bmm.default, aten.baddbmm.default}
_NO_DATA = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default}


def _where() -> str:
    """The innermost frame outside torch and this module: the line whose op this is (no source read: cheap)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and f"{os.sep}torch{os.sep}" not in path:
            shown = os.path.relpath(path, REPO) if path.startswith(REPO) else path.split("site-packages/")[-1]
            return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


class MetaRun:
    """``with MetaRun() as run:`` every op runs on meta as usual, and ``run`` records what it did.

    ``run.violations``: ops that made a tensor off the model's device (an op mixing devices raises
    ``DeviceMismatch`` at once, as CUDA would). ``run.syncs``: the host syncs, in order. ``run.live`` / ``run.peak``:
    bytes of the tensor storages made under the mode and still referenced (the model's weights are ``exclude``d).
    ``run.unknown(kind, tensor)``: the host value of a data-dependent op on data no host op produced (None: raise).
    ``run.checking``: whether placement is checked (a request's tensors are prepared off the step path).
    """

    def __init__(self, device: str | torch.device = "meta", unknown: Callable[[str, torch.Tensor], Any] | None = None):
        self.device = torch.device(device)
        self.unknown = unknown
        self.checking = True
        self.host = WeakTensorKeyDictionary()  # meta tensor -> its value on the CPU
        self.violations: list[str] = []
        self.syncs: list[HostSync] = []
        self.collectives: list[Collective] = []
        self.ops = 0
        self.matmuls = 0  # matmul and attention ops so far
        self.memory_bytes = 0  # bytes read and written by the ops that are neither matmuls, views nor collectives
        self._fused_depth = 0
        self._refs: collections.Counter[int] = collections.Counter()  # storage -> live tensors on it
        self._sizes: dict[int, int] = {}
        self._excluded: set[int] = set()
        self.live = self.peak = 0
        self.peak_where = ""
        self._modes = (_Factories(self), _Dispatch(self))

    def __enter__(self) -> MetaRun:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    # -- what callers use ---------------------------------------------------------------------------------
    def exclude(self, module: torch.nn.Module) -> None:
        """The module's parameters and buffers are not activations: views of them are never counted."""
        self.exclude_tensors([*module.parameters(), *module.buffers()])

    def exclude_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._excluded.add(tensor.untyped_storage()._cdata)

    def value_of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host value of a meta tensor made from host data (NoHostValue if none)."""
        if tensor.device.type == "cpu":
            return tensor
        value = self.host.get(tensor)
        if value is None:
            raise NoHostValue(f"no host value for a {tuple(tensor.shape)} {tensor.dtype} tensor")
        return value

    def reset_peak(self) -> int:
        """Start a new peak from the bytes live now; returns them."""
        self.peak, self.peak_where = self.live, "(start)"
        return self.live

    @contextlib.contextmanager
    def unchecked(self) -> Iterator[None]:
        """Ops inside are tracked but their placement is not checked and their syncs not listed (a request's
        tensors prepared before the step path, as a conditioner stage prepares them)."""
        checking, syncs = self.checking, len(self.syncs)
        self.checking = False
        try:
            yield
        finally:
            self.checking = checking
            del self.syncs[syncs:]

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _track(self, out: Any) -> None:
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            key = storage._cdata
            if key in self._excluded or storage.nbytes() == 0:
                continue
            if key not in self._refs:
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
            self._refs[key] += 1
            weakref.finalize(tensor, self._release, key)
        if self.live > self.peak:
            self.peak, self.peak_where = self.live, _where()

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._sizes.pop(key)

    def _sync(self, kind: str, func: Any, tensor: torch.Tensor | None) -> None:
        if self.checking:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()
            self.syncs.append(HostSync(kind, str(func).removeprefix("aten."), shape, _where(), self.matmuls > 0))

    def _check(self, func: Any, tensors: list[torch.Tensor]) -> None:
        if not self.checking:
            return
        # a 0-d CPU tensor is a scalar to every device (torch wraps it): not a mismatch
        off = {
            str(t.device) for t in tensors if t.device != self.device and not (t.device.type == "cpu" and t.dim() == 0)
        }
        if off and any(t.device == self.device for t in tensors):
            message = f"{func} mixes {', '.join(sorted(off))} tensors with {self.device} ones at {_where()}"
            self.violations.append(message)
            raise DeviceMismatch(message)
        if off:
            self.violations.append(f"{func} made a tensor on {', '.join(sorted(off))} at {_where()}")

    def _host_args(self, args: Any) -> Any | None:
        """``args`` with every model-device tensor replaced by its host value and device arguments by the CPU;
        None when a tensor has none."""
        flat, spec = tree_flatten(args)
        out = []
        for a in flat:
            if isinstance(a, torch.Tensor) and a.device == self.device:
                value = self.host.get(a)
                if value is None:
                    return None
                a = value
            elif isinstance(a, torch.device) and a == self.device:
                a = torch.device("cpu")
            elif isinstance(a, str) and a == self.device.type:
                a = "cpu"
            out.append(a)
        return tree_unflatten(out, spec)

    def _remember(self, out: Any, host_out: Any) -> None:
        for tensor, value in zip(tree_flatten(out)[0], tree_flatten(host_out)[0], strict=True):
            if isinstance(tensor, torch.Tensor) and isinstance(value, torch.Tensor) and tensor.device == self.device:
                self.host[tensor] = value

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An in-place op the host could not follow: the tensors it wrote have no host value any more."""
        for argument, value in zip(func._schema.arguments, args, strict=False):  # trailing defaults not passed
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                self.host.pop(value, None)
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                self.host.pop(value, None)

    # -- one op ---------------------------------------------------------------------------------------------
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.ops += 1
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in _COPIES:
            out = self._copy(func, args, kwargs)
        elif func.namespace == "c10d":  # a collective: it runs on the fake group, shapes only
            self._check(func, tensors)
            self.collectives.append(
                Collective(func.__name__, sum(t.numel() * t.element_size() for t in tensors[1:] or tensors))
            )
            out = func(*args, **kwargs)
        else:
            self._check(func, tensors)
            on_device = any(t.device == self.device for t in tensors)
            if on_device and (func in _DATA_DEPENDENT or (func is aten.index.Tensor and _has_mask(args[1]))):
                out = self._data_dependent(func, args, kwargs, tensors)
            else:
                out = func(*args, **kwargs)
                self._follow(func, args, kwargs, out, tensors)
            if self.checking:
                made = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.device != self.device]
                if made:
                    self.violations.append(f"{func} made a tensor on {made[0].device} at {_where()}")
        self._account(func, tensors, out)
        self._track(out)
        return out

    def _account(self, func: Any, tensors: list[torch.Tensor], out: Any) -> None:
        """Matmuls counted; every other op on the device that moves data adds the bytes it reads and writes (the
        traffic of eager, unfused elementwise work: norms, RoPE, modulation, activations, residuals, copies)."""
        if func in _MATMULS or func.namespace == "h3meta":
            self.matmuls += 1
            return
        if func.namespace == "c10d" or func in _NO_DATA or self._fused_depth:
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not outs or not all(t.device == self.device for t in tensors + outs):
            return
        in_place = any(r.alias_info is not None and r.alias_info.is_write for r in func._schema.returns)
        read = {t.untyped_storage()._cdata for t in tensors}
        if not in_place and any(t.untyped_storage()._cdata in read for t in outs):
            return  # a view (``_unsafe_view`` too): no data moves
        self.memory_bytes += sum(t.numel() * t.element_size() for t in tensors + outs)

    @contextlib.contextmanager
    def fused(self, model: torch.nn.Module, kinds: tuple[type, ...] = (torch.nn.RMSNorm,)) -> Iterator[None]:
        """Each module of ``kinds`` counts as one kernel (it reads its input and weight, writes its output), not as
        the ops meta decomposes it into: on CUDA ``torch.rms_norm`` runs the fused ``_fused_rms_norm`` kernel."""

        def enter(module, args):
            self._fused_depth += 1

        def leave(module, args, out):
            self._fused_depth -= 1
            moved = [args[0], out, *(p for p in module.parameters(recurse=False))]
            self.memory_bytes += sum(t.numel() * t.element_size() for t in moved if isinstance(t, torch.Tensor))

        modules = [m for m in model.modules() if isinstance(m, kinds)]
        handles = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _follow(self, func: Any, args: tuple, kwargs: dict, out: Any, tensors: list[torch.Tensor]) -> None:
        """Compute the op on the host values too, when every input has one and the result is small."""
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        small = all(t.numel() <= HOST_VALUE_LIMIT for t in tensors + outs)
        host = self._host_args((args, kwargs)) if small and outs else None
        if host is None or not all(t.device == self.device for t in outs):
            if func._schema.is_mutable:
                self._forget_written(func, args, kwargs)
            return
        with _disable_current_modes():
            host_out = func(*host[0], **host[1])
        self._remember(out, host_out)

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if func is aten.index.Tensor:  # a boolean mask: its nonzero on the host, then an ordinary gather
            self._sync("boolean mask", func, next(t for t in args[1] if t is not None and t.dtype == torch.bool))
            indices = []
            for index in args[1]:
                if index is not None and index.dtype == torch.bool:
                    with _disable_current_modes():
                        found = self.value_of(index).nonzero().unbind(1)  # one [n] index per mask dimension
                    for value in found:
                        meta = torch.empty(value.shape, dtype=value.dtype, device=self.device)
                        self.host[meta] = value
                        indices.append(meta)
                else:
                    indices.append(index)
            out = func(args[0], indices, *args[2:], **kwargs)
            self._follow(func, (args[0], indices, *args[2:]), kwargs, out, [args[0], *indices])
            return out
        kind = _DATA_DEPENDENT[func]
        self._sync(kind, func, tensors[0] if tensors else None)
        host = self._host_args((args, kwargs))
        if host is None:
            if self.unknown is None or func is not aten._local_scalar_dense.default:
                raise NoHostValue(f"{func} needs the data of a tensor no host data produced, at {_where()}")
            return self.unknown(kind, tensors[0])
        with _disable_current_modes():
            host_out = func(*host[0], **host[1])
        out = tree_map(
            lambda v: (
                torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=self.device)
                if isinstance(v, torch.Tensor)
                else v
            ),
            host_out,
        )
        self._remember(out, host_out)
        return out

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func is aten.copy_.default:
            destination, source = args[0], args[1]
        else:
            source = args[0]
            destination = None
        target = destination.device if destination is not None else kwargs.get("device") or source.device
        target = torch.device(target)
        if source.device == self.device and target.type == "cpu":  # device -> host: the host waits
            self._sync("device-to-host copy", func, source)
            value = self.host.get(source)
            if value is None:
                if self.unknown is None:
                    raise NoHostValue(f"{func} copies a tensor no host data produced, at {_where()}")
                value = self.unknown("device-to-host copy", source)
            with _disable_current_modes():
                return (
                    func(destination, value, *args[2:], **kwargs)
                    if destination is not None
                    else func(value, *args[1:], **kwargs)
                )
        if source.device.type == "cpu" and source.dim() > 0 and target == self.device:
            # host -> device from pageable memory: copy_ without non_blocking synchronizes the stream on CUDA
            self._sync("host-to-device copy", func, source)
        if destination is not None and destination.device != self.device and self.checking:
            self.violations.append(f"{func} writes into a tensor on {destination.device} at {_where()}")
        out = func(*args, **kwargs)
        self._follow(func, args, kwargs, out, [source] + ([destination] if destination is not None else []))
        return out


def _has_mask(indices: list[torch.Tensor | None]) -> bool:
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


class _Dispatch(TorchDispatchMode):
    def __init__(self, run: MetaRun) -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.run.dispatch(func, args, kwargs or {})


# torch.tensor(data, device=...) builds its tensor without dispatching an op: made on the host here, then copied,
# so its host value is kept (the copy is the host-to-device copy CUDA makes of it too)
_FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray}


class _Factories(TorchFunctionMode):
    def __init__(self, run: MetaRun) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in _FACTORIES and device is not None and torch.device(device) == self.run.device:
            # data given as device tensors (a list of 0-d results, say) is read from their host values
            data = tree_map(lambda a: self.run.value_of(a) if isinstance(a, torch.Tensor) else a, args)
            with _disable_current_modes():
                host = func(*data, **{**kwargs, "device": "cpu"})
            return host.to(self.run.device)
        if func in _FACTORIES and device is None and self.run.checking and not isinstance(args[0], torch.Tensor):
            self.run.violations.append(f"{func.__name__}() made a tensor on the default device at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def dtype_log(model: torch.nn.Module) -> Iterator[dict[str, tuple[torch.dtype, torch.dtype]]]:
    """Each ``nn.Linear`` of ``model`` called inside: its name -> (input dtype, weight dtype)."""
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(module, args, name=name):
                seen[name] = (args[0].dtype, module.weight.dtype)

            handles.append(module.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
