# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The production-shape mode: megatron-core's real code at production sizes, without the memory.

Every tensor made under :class:`ProductionShapeMode` is a ``FakeTensor`` (shape, dtype, strides
and a storage size, no data). Beside the data, the mode keeps a *value* (a real host tensor) for
the tensors whose values decide sizes: the routing integers and masks. A value is known when the
op that made it had known inputs (or none: ``arange``, ``zeros``, ``torch.tensor``), and is then
computed for real from them, so ``.tolist()``, ``nonzero``, ``bincount``, bool indexing and the
split sizes of an all-to-all get real answers. Values come into the program through the routing:
the router's (and a dispatcher's) top-k over the experts returns the indices a
:class:`RoutingPolicy` chose (balanced, seeded random, or recorded from a real run).

What is never guessed: a value made from data (a float tensor's contents), an uninitialized
``empty``, a random op, or a tensor partly written with unknown values has no value, and any
attempt to read it as a size (``item``, ``tolist``, ``numpy``, a data-dependent shape) raises
:class:`Refused` naming the op that reads it and the op that made it. An op the fake kernels
cannot size is refused the same way.

Ranks: every rank of the job runs the mode (``moe_release.runtime.ranks.launcher`` spawns them over
gloo). Collectives on tensors with values move the values for real (so a rank learns what its peers
route, from their own routing); collectives on data move nothing and return at once, their outputs
already shaped by the caller.

Bytes: :class:`LiveBytes` keeps a weak reference to each storage an op returns and sums the
``nbytes`` of those alive, after every op (``trace``) and on demand; a fake storage has the
``nbytes`` of the real one. :class:`RealRun` is the same routing and counter on real tensors:
the same program at small sizes gives the same trace both ways (the mode's own test).
"""

import contextlib
import functools
import sys
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes
from torch.utils._pytree import tree_map

from moe_release import settings
from moe_release.runtime.shapes.live_bytes import LiveBytes, _tensors, bytes_of, compare_traces
from moe_release.runtime.shapes.real_run import _C10D, RealRun, _completed_work, _CountingMode
from moe_release.runtime.shapes.routing import (
    BalancedRouting,
    RandomRouting,
    RecordedRouting,
    Refused,
    Routing,
    RoutingPolicy,
    routing_policy,
)

aten = torch.ops.aten

# The mode's parts, importable from here as before the split.
__all__ = [
    "BalancedRouting",
    "LiveBytes",
    "ProductionShapeMode",
    "RandomRouting",
    "RealRun",
    "RecordedRouting",
    "Refused",
    "Routing",
    "RoutingPolicy",
    "bytes_of",
    "compare_traces",
    "routing_policy",
]

# ---------------------------------------------------------------------------------------------
# The production-shape mode

# Ops whose tensor inputs give only metadata (shape, dtype, device): the output's value is known
# without the inputs' values.
_METADATA_ONLY = {
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}
# Ops whose outputs have no value: uninitialized memory or random draws.
_NO_VALUE = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.empty_strided.default,
    aten.normal_.default,
    aten.uniform_.default,
    aten.bernoulli_.float,
    aten.bernoulli.default,
    aten.randn.default,
    aten.rand.default,
    aten.randint.low,
    aten.randperm.default,
    aten.randn_like.default,
    aten.rand_like.default,
    aten.native_dropout.default,
}
# Factories filling their output with one number: the value is kept as that number.
_CONSTANT_FILLS = {
    aten.zeros_like.default: lambda a, k: 0,
    aten.ones_like.default: lambda a, k: 1,
    aten.full_like.default: lambda a, k: a[1],
    aten.new_zeros.default: lambda a, k: 0,
    aten.new_ones.default: lambda a, k: 1,
    aten.new_full.default: lambda a, k: a[2],
    aten.zeros.default: lambda a, k: 0,
    aten.ones.default: lambda a, k: 1,
    aten.full.default: lambda a, k: a[1],
}
# In-place ops that overwrite every element of their destination (no read of it).
_FULL_WRITES = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}
# Floating outputs of factories above this many elements keep no value.
SMALL_FLOAT = 1 << 16


class _Values:
    """Real values by fake storage, byte for byte: a host ``uint8`` copy of the storage, viewed
    by each fake tensor's dtype, size, stride and offset (views, dtype views and in-place writes
    share it), and a mask of the bytes written with known values (None: all of them). A read
    of a tensor any of whose bytes is not known has no value."""

    def __init__(self) -> None:
        self._entries: Dict[int, list] = {}  # id(storage) -> [weakref, base, mask or None]
        self.origin: Dict[int, str] = {}

    def _entry(self, t: torch.Tensor):
        s = t.untyped_storage()
        entry = self._entries.get(id(s))
        if entry is None or entry[0]() is not s:
            return None
        return entry

    @staticmethod
    def _elements(t: torch.Tensor, nbytes: int) -> Optional[torch.Tensor]:
        """Indices (in ``t.dtype`` units) of the storage elements ``t`` covers."""
        size = t.element_size()
        if nbytes % size:
            return None
        return torch.arange(nbytes // size).as_strided(t.shape, t.stride(), t.storage_offset())

    def constant(self, t: torch.Tensor, fill) -> None:
        """``t`` (a new storage) holds ``fill`` everywhere: kept as one number until written."""
        s = t.untyped_storage()
        key = id(s)

        def gone(r, key=key, table=self._entries):
            e = table.get(key)
            if e is not None and e[0] is r:
                del table[key]

        self._entries[key] = [weakref.ref(s, gone), None, None, (fill, t.dtype)]
        self.origin.pop(key, None)

    def is_constant(self, t: torch.Tensor) -> bool:
        entry = self._entry(t)
        return entry is not None and entry[1] is None

    def _materialize(self, entry, nbytes: int) -> None:
        fill, dtype = entry[3]
        size = torch.empty((), dtype=dtype).element_size()
        entry[1] = torch.full((nbytes // size,), fill, dtype=dtype).view(torch.uint8)
        entry[2] = None

    def get(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        entry = self._entry(t)
        if entry is None:
            return None
        if entry[1] is None:
            fill, dtype = entry[3]
            return torch.full((), fill, dtype=dtype).expand(t.shape) if dtype == t.dtype else None
        base, mask = entry[1], entry[2]
        size = t.element_size()
        if base.numel() % size:
            return None
        if mask is not None:
            covered = self._elements(t, base.numel()).flatten()
            if not bool(mask.view(-1, size)[covered].all()):
                return None
        return base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def has(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def base_for(self, t: torch.Tensor) -> torch.Tensor:
        """A writable view of ``t``'s bytes (created unknown if the storage has none); call
        :meth:`written` once the write is done."""
        s = t.untyped_storage()
        entry = self._entry(t)
        if entry is None:
            nbytes = s.nbytes()
            key = id(s)

            def gone(r, key=key, table=self._entries):
                e = table.get(key)
                if e is not None and e[0] is r:
                    del table[key]

            entry = [weakref.ref(s, gone), torch.zeros(nbytes, dtype=torch.uint8),
                     torch.zeros(nbytes, dtype=torch.bool), None]  # fmt: skip
            self._entries[key] = entry
            self.origin.pop(key, None)
        if entry[1] is None:
            self._materialize(entry, s.nbytes())
        base = entry[1]
        if base.numel() % t.element_size():
            raise Refused(f"a {t.dtype} view of a storage of {base.numel()} bytes")
        return base.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

    def written(self, t: torch.Tensor, known: bool = True, why: str = "") -> None:
        """``t``'s bytes now hold known values (or unknown ones, ``why``)."""
        entry = self._entry(t)
        if entry is None:
            if not known:
                self.origin[id(t.untyped_storage())] = why
            return
        if not known and (_covers(t) or not _wants_value_of_storage(t)):
            # All of it unknown now, or data no size is read from (a large floating storage,
            # as _wants_value keeps none): dropped whole, never materialized or masked.
            self.forget(t, why)
            return
        if entry[1] is None:
            if known:
                return
            self._materialize(entry, t.untyped_storage().nbytes())
        base, mask = entry[1], entry[2]
        if _covers(t):  # known: an unknown write that covers the storage was forgotten above
            entry[2] = None
            return
        if mask is None:
            if known:
                return
            mask = entry[2] = torch.ones(base.numel(), dtype=torch.bool)
        covered = self._elements(t, base.numel()).flatten()
        mask.view(-1, t.element_size())[covered] = known
        if known and bool(mask.all()):
            entry[2] = None
        if not known:
            self.origin[id(t.untyped_storage())] = why

    def attach(self, t: torch.Tensor, value: torch.Tensor) -> None:
        if tuple(value.shape) != tuple(t.shape):
            raise Refused(f"value of shape {tuple(value.shape)} for a tensor of {tuple(t.shape)}")
        self.base_for(t).copy_(value)
        self.written(t)

    def forget(self, t: torch.Tensor, why: str) -> None:
        key = id(t.untyped_storage())
        self._entries.pop(key, None)
        self.origin[key] = why

    def why_unknown(self, t: torch.Tensor) -> str:
        return self.origin.get(id(t.untyped_storage()), "data (no value kept)")


def _why(reason: str) -> str:
    """A chain of ops (``a <- b <- ... <- first unknown``) cut to its ends."""
    links = reason.split(" <- ")
    if len(links) > 6 and not settings.production_shape_chains():
        links = links[:3] + [f"... {len(links) - 5} ops ..."] + links[-2:]
    return " <- ".join(links)


def _wants_value_of_storage(t: torch.Tensor) -> bool:
    """:func:`_wants_value` of ``t``'s whole storage, read as ``t.dtype``."""
    return _keeps_value(t.dtype, t.untyped_storage().nbytes() // t.element_size())


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


@functools.cache
def _writes(func) -> Tuple[int, ...]:
    """Positions of the arguments ``func`` writes (schema alias annotations)."""
    return tuple(
        i
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def _wants_value(t: torch.Tensor) -> bool:
    return _keeps_value(t.dtype, t.numel())


def _keeps_value(dtype: torch.dtype, numel: int) -> bool:
    """Values are kept for integers and masks, and for floating tensors of at most
    ``SMALL_FLOAT`` elements (data above that never becomes a size)."""
    return not (dtype.is_floating_point or dtype.is_complex) or numel <= SMALL_FLOAT


class ProductionShapeMode(_CountingMode):
    """Fake tensors for data, real values for the routing; refuses what it cannot follow.

    ``mis_size`` (tests only) seeds a wrong size: ``(op name, occurrence)`` gives that call's
    first output one extra row, to show the equality with the real run catches it."""

    def __init__(
        self,
        routing: Routing,
        counter: LiveBytes,
        mis_size: Optional[Tuple[str, int]] = None,
    ) -> None:
        super().__init__(routing, counter)
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.values = _Values()
        self.mis_size = mis_size
        self._calls: Dict[str, int] = {}

    # -- entering: the host-read functions and the collectives -----------------------------
    def _contexts(self) -> List[Any]:
        return [_HostReads(self), _fake_tolist(self), _fake_numpy(self), _fake_data_ptr(),
                _emulation_host_staging(), *super()._contexts()]  # fmt: skip

    def value(self, t: torch.Tensor, reader: str) -> torch.Tensor:
        """``t``'s value, or :class:`Refused` naming ``reader`` and why it has none."""
        if not _is_fake(t):
            return t
        v = self.values.get(t)
        if v is None:
            why = _why(self.values.why_unknown(t))
            raise Refused(
                f"production-shape mode: {reader} reads the values of a {t.dtype} tensor of shape "
                f"{tuple(t.shape)} whose values are not known (made by {why})"
            )
        return v

    def fake_of(self, real: torch.Tensor) -> torch.Tensor:
        with self.fake:
            out = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype)
        if _wants_value(real):
            self.values.attach(out, real)
        return out

    # -- ops -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        if not all(_is_fake(t) for t in inputs):
            # Real tensors reaching an op (``torch.tensor(...)``'s lift_fresh, constants) become
            # fake tensors with their values.
            args, kwargs = tree_map(
                lambda a: self.fake_of(a) if isinstance(a, torch.Tensor) and not _is_fake(a) else a,
                (args, kwargs),
            )
            inputs = _tensors((args, kwargs))
        name = str(func)
        if self.routing.applies(func, args, kwargs):
            with self.fake:
                out = func(*args, **kwargs)
            self.values.attach(out[1], self.routing.indices(args[0].shape[0]))
            self.values.forget(out[0], "top-k scores (data)")
        elif func.namespace == "c10d":
            out = _c10d(self, func, name, args, kwargs)
        elif func is aten._local_scalar_dense.default:
            out = self.value(args[0], name).item()
        else:
            out = self._op(func, name, args, kwargs, inputs)
        out = self._seeded_error(name, out)
        self.counter.note(func, args, kwargs, out, inputs)
        return out

    def _op(self, func, name, args, kwargs, inputs):
        written = [args[i] for i in _writes(func) if i < len(args)] + [
            v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k == "out"
        ]
        try:
            with self.fake:
                out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return self._data_dependent(func, name, args, kwargs)
        except UnsupportedOperatorException as exc:
            raise Refused(f"production-shape mode: the fake kernels cannot size {name}") from exc
        outs = [t for t in _tensors(out) if _is_fake(t)]
        if func in _NO_VALUE:
            for t in _new_storages(outs, inputs):
                self.values.forget(t, f"{name} (no value)")
            return out
        full_write = func in _FULL_WRITES
        if func in _METADATA_ONLY:
            readers = []
        elif full_write:
            readers = [t for t in inputs if not any(t is w for w in written)]
        else:
            readers = inputs
        unknown = next((t for t in readers if not self.values.has(t)), None)
        if unknown is not None:
            why = f"{name} <- {self.values.why_unknown(unknown)}"
            for t in written:
                self.values.written(t, known=False, why=why)
            for t in _new_storages(outs, inputs):  # a view keeps its storage's values
                self.values.forget(t, why)
            return out
        fill = _CONSTANT_FILLS.get(func)
        if fill is not None and len(outs) == 1 and not written:
            self.values.constant(outs[0], fill(args, kwargs))
            return out
        # A large floating output computed from constants only (zeros_like of the hidden states,
        # converted) keeps no value; one computed from the routing always does.
        from_constants = all(self.values.is_constant(t) for t in readers)
        keep = _wants_value if from_constants else (lambda t: True)
        if not written and not any(keep(t) for t in outs):
            return out
        real = self._real(func, args, kwargs, written)
        if written:
            for t in written:  # written in place, in the value storages
                self.values.written(t)
            return out
        real_outs = _tensors(real)
        if len(real_outs) != len(outs):
            raise Refused(f"production-shape mode: {name} returned a different structure")
        for f, r in zip(outs, real_outs):
            if tuple(f.shape) != tuple(r.shape):
                raise Refused(
                    f"production-shape mode: {name} sizes {tuple(f.shape)} fake and "
                    f"{tuple(r.shape)} real"
                )
            if self.values.has(f):
                continue  # a view of a storage with values: the real op made the same view
            if keep(f):
                self.values.attach(f, r)
        return out

    def _real(self, func, args, kwargs, written):
        """``func`` on the values (metadata-only inputs: on stand-ins without memory)."""

        def real(a):
            if not isinstance(a, torch.Tensor):
                return a
            if any(a is w for w in written):
                return self.values.base_for(a)
            if func in _METADATA_ONLY:
                return torch.empty((), dtype=a.dtype).expand(a.shape)
            return self.value(a, str(func))

        return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _data_dependent(self, func, name, args, kwargs):
        """An op whose output size depends on values: computed from the values where all are
        known; bool indices of a tensor without values become integer indices."""
        inputs = _tensors((args, kwargs))
        if all(self.values.has(t) for t in inputs):
            real = func(*tree_map(lambda a: self.value(a, name) if isinstance(a, torch.Tensor)
                                  else a, args),
                        **tree_map(lambda a: self.value(a, name) if isinstance(a, torch.Tensor)
                                   else a, kwargs))  # fmt: skip
            return tree_map(lambda r: self.fake_of(r) if isinstance(r, torch.Tensor) else r, real)
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default):  # fmt: skip
            indices = [self._integer_index(i, name) for i in args[1]]
            expanded = []
            for i in indices:
                expanded.extend(i if isinstance(i, tuple) else [i])
            new_args = (args[0], expanded, *args[2:])
            return self._op(func, name, new_args, kwargs, _tensors((new_args, kwargs)))
        if func is aten.masked_select.default:
            x, mask = args
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            count = int(self.value(mask, name).expand(shape).sum())
            with self.fake:
                out = torch.empty((count,), dtype=x.dtype, device=x.device)
            self.values.forget(out, f"{name} of data")
            return out
        why = _why(next(self.values.why_unknown(t) for t in inputs if not self.values.has(t)))
        raise Refused(
            f"production-shape mode: {name} has a size that depends on values the mode does not "
            f"know (made by {why})"
        )

    def _integer_index(self, index, name):
        if index is None or index.dtype not in (torch.bool, torch.uint8):
            return index
        rows = torch.nonzero(self.value(index, name))
        return tuple(self.fake_of(c) for c in rows.unbind(1))

    def _seeded_error(self, name, out):
        """The seeded wrong size: the output of the chosen call gets a storage one row larger
        (the tensor itself keeps its shape, so the program runs on)."""
        if self.mis_size is None or name != self.mis_size[0]:
            return out
        n = self._calls[name] = self._calls.get(name, 0) + 1
        if n != self.mis_size[1] or not isinstance(out, torch.Tensor) or not out.dim():
            return out
        with self.fake:
            bigger = torch.empty((out.shape[0] + 1, *out.shape[1:]), dtype=out.dtype)
            return bigger[: out.shape[0]]


def _new_storages(outs: List[torch.Tensor], inputs: List[torch.Tensor]) -> List[torch.Tensor]:
    """The outputs whose storage is none of the inputs' (not views, not written in place)."""
    seen = {id(t.untyped_storage()) for t in inputs}
    return [t for t in outs if id(t.untyped_storage()) not in seen]


def _covers(t: torch.Tensor) -> bool:
    """Whether writing every element of ``t`` writes every byte of its storage."""
    try:
        nbytes = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return t.is_contiguous() and t.storage_offset() == 0 and t.numel() * t.element_size() == nbytes


@contextlib.contextmanager
def _fake_tolist(mode: "ProductionShapeMode") -> Iterator[None]:
    """``FakeTensor.tolist`` (a Python method, iterating ``item()``) reads the value at once,
    with no op dispatched, as a real tensor's ``tolist`` does."""
    original = FakeTensor.tolist

    def tolist(self):
        with _no_dispatch_modes():
            return mode.value(self, "Tensor.tolist").tolist()

    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        FakeTensor.tolist = original


@contextlib.contextmanager
def _fake_numpy(mode: "ProductionShapeMode") -> Iterator[None]:
    """``FakeTensor.numpy`` where no torch function mode sees the call (a recomputed forward
    inside backward: the all-to-all dispatcher's split sizes): as :class:`_HostReads` does."""
    original = FakeTensor.__dict__.get("numpy")

    def numpy(self, *args, **kwargs):
        return _HostReads(mode).__torch_function__(torch.Tensor.numpy, (type(self),), (self,))

    FakeTensor.numpy = numpy
    try:
        yield
    finally:
        if original is None:
            del FakeTensor.numpy
        else:
            FakeTensor.numpy = original


@contextlib.contextmanager
def _fake_data_ptr() -> Iterator[None]:
    """A fake storage's ``data_ptr()`` is 0 for all; code keying state by it (the NCCL EP
    emulation's handles) then mixes storages up. Under the mode a fake (meta) storage answers
    the id of its Python object, which torch keeps for the storage's life: unique among live
    storages, as an address is."""
    original = torch.UntypedStorage.data_ptr

    def data_ptr(self):
        return id(self) if self.device.type == "meta" else original(self)

    torch.UntypedStorage.data_ptr = data_ptr
    try:
        yield
    finally:
        torch.UntypedStorage.data_ptr = original


class _ArrayHolder:
    """The base of a numpy array of a fake tensor's value: holds the tensor (as a real array's
    base holds the tensor's memory)."""

    def __init__(self, value, tensor: torch.Tensor) -> None:
        self.value = value
        self.tensor = tensor
        self.__array_interface__ = value.__array_interface__


class _HostReads(TorchFunctionMode):
    """``Tensor.tolist`` and ``Tensor.numpy`` of a fake tensor read its value (or refuse)."""

    def __init__(self, mode: ProductionShapeMode) -> None:
        super().__init__()
        self.mode = mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "tolist" and args and _is_fake(args[0]):
            with _no_dispatch_modes():
                return self.mode.value(args[0], "Tensor.tolist").tolist()
        if name == "numpy" and args and _is_fake(args[0]):
            # A real ``numpy()`` shares the tensor's memory and keeps its storage alive; the
            # array returned here keeps the fake tensor alive the same way.
            import numpy

            held = args[0].detach()  # as torch's numpy() does (an op the counter sees)
            with _no_dispatch_modes():
                value = self.mode.value(held, "Tensor.numpy").clone().numpy()
            return numpy.asarray(_ArrayHolder(value, held))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Collectives (c10d ops, as the process group dispatches them)


def _c10d(mode: "ProductionShapeMode", func, name: str, args, kwargs):
    """A collective on fake tensors: on their values for real (every rank's values meet), or,
    where they hold data, no data moved (a completed work; outputs keep no value)."""
    op = func._schema.name.split("::")[-1]
    if op == "barrier":
        real = tree_map(lambda a: torch.empty(0) if _is_fake(a) else a, (args, kwargs))
        return func(*real[0], **real[1])
    if op not in _C10D:
        raise Refused(f"production-shape mode: no rule for the collective {name}")
    out_at, in_at = _C10D[op]
    outs = _tensors(args[out_at])
    ins = outs if in_at is None else _tensors(args[in_at])
    known = [mode.values.has(t) or not _is_fake(t) for t in ins]
    if all(known) and ins:
        fakes: Dict[int, torch.Tensor] = {}

        def real(a):
            if not _is_fake(a):
                return a
            is_out = any(a is t for t in outs)
            r = mode.values.base_for(a) if is_out else mode.value(a, name)
            fakes[id(r)] = a
            return r

        result = func(*tree_map(real, args), **tree_map(real, kwargs))
        for t in outs:
            mode.values.written(t)
        return tree_map(lambda r: fakes.get(id(r), r) if isinstance(r, torch.Tensor) else r,
                        result)  # fmt: skip
    if any(known):
        raise Refused(f"production-shape mode: {name} mixes tensors with and without values")
    for t in outs:
        mode.values.written(t, known=False, why=f"{name} of data")
    work = _completed_work()
    returns = func._schema.returns
    if len(returns) == 1:
        return work
    return (args[out_at], work)


@contextlib.contextmanager
def _emulation_host_staging() -> Iterator[None]:
    """The kernel emulations stage a collective through host memory when a tensor's *storage*
    is not on the host; a fake tensor's storage is on ``meta`` while the tensor is a host one.
    Under the mode they ask the tensor's device, which is what the storage's is in a real run."""

    common = sys.modules.get("moe_release.runtime.kernels.emulation_common")
    if common is None:
        yield
        return
    original = common.staged_through_host

    def staged_through_host(t, group):
        if _is_fake(t):
            return t.device.type != "cpu" and dist.get_backend(group) == "gloo"
        return original(t, group)

    common.staged_through_host = staged_through_host
    try:
        yield
    finally:
        common.staged_through_host = original
