# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Where each tensor of a CPU run would live on a GPU, and CUDA's rules enforced on it.

On a host every tensor is a CPU tensor, so code that is wrong on a GPU (``record_stream`` on a
host tensor, an op mixing a device tensor with a host one, a ``.numpy()`` of a device tensor)
runs here without complaint. :class:`PlacementMode` is a ``TorchFunctionMode`` that gives each
tensor the placement it would have on a GPU and refuses what CUDA refuses:

* **Placement.** ``device``, ``pinned`` (page-locked host) or ``pageable`` (ordinary host),
  kept on the tensor's storage (views share it). Derived from how a tensor is made:
  ``device="cuda"``/``cuda:N``/an index, ``.cuda()``, ``.to("cuda")`` give ``device``; a factory
  without ``device=`` called from the tree under test (``megatron/``), ``device="cpu"``,
  ``.cpu()``/``.to("cpu")`` give ``pageable`` (``pinned`` with ``pin_memory=True``,
  ``.pin_memory()``, or a ``non_blocking`` device-to-host copy, as torch's ``_to_copy`` pins
  its output then); every other op's outputs inherit from its inputs (a host op's output is
  ``pageable``). Tensors made outside the Python API (autograd's gradients, the CPU runtime's
  own harness and kernel emulation, which stand in for device code) are ``device`` unless
  marked otherwise: :func:`mark` is how the emulation returns what a kernel returns on the
  host.
* **CUDA's view of a tensor.** ``.is_cuda``, ``.device`` (``cuda:0``), ``.is_pinned()``
  answer by placement, so megatron's ``is_cuda`` branches (``_release_tensor_storage``,
  ``maybe_move_tensor_to_cpu``, ``_record_on_current_stream``) run as on a GPU, and
  ``device=x.device`` keeps ``x``'s placement.
* **CUDA's rules.** ``Tensor.record_stream`` on a host tensor raises ``NotImplementedError``
  as torch does (it has only a CUDA kernel); an op whose tensor arguments mix ``device`` with
  host tensors that are not 0-dim raises CUDA's device-mismatch ``RuntimeError`` (copies and
  host index tensors are allowed, as CUDA allows them); ``.numpy()`` of a device tensor raises
  as torch does.
* **Host syncs, counted.** Every device-to-host synchronization (``.item()``, ``.tolist()``,
  ``bool``/``int``/``float`` of a device tensor, a blocking copy to the host, and
  ``torch.cuda.synchronize``/event and stream ``synchronize``, which :func:`count_sync` is
  called from) is counted in :data:`SYNCS` by kind and call site (the first frame outside torch
  and this runtime).

Not covered: ops that never reach Python (C++ autograd formulas) are not checked, only what
their outputs feed into; ``torch.from_numpy`` is not a torch function (its result is
``device``: megatron's MoE path does not call it).
"""

import collections
import contextlib
import os
import sys
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode

from moe_release import settings
from moe_release.runtime.cuda.host_streams import HOST_STREAMS

# the state the host streams share (see there)
from moe_release.runtime.cuda.placement_state import (
    _ATTR,
    _DEVICE_MARK,
    _STATE,
    _TORCH_DIR,
    DEVICE,
    PAGEABLE,
    PINNED,
    SYNCS,
    _short,
    call_site,
    count_sync,
    placement_of,
)

HOST = (PINNED, PAGEABLE)

CUDA_DEVICE = torch.device("cuda", 0)

_TENSOR_DICT = torch._C.TensorBase.__dict__
_IS_CUDA = _TENSOR_DICT["is_cuda"]
_DEVICE = _TENSOR_DICT["device"]
_IS_CPU = _TENSOR_DICT["is_cpu"]

_THIS_FILE = __file__
_TRACE = settings.placement_trace()


class PlacementError(RuntimeError):
    """An op that CUDA would refuse (a device mismatch)."""


def made_at(tensor: torch.Tensor) -> str:
    """Where a host tensor's storage got its placement (``file:line``; "" for device ones)."""
    try:
        return getattr(tensor.untyped_storage(), _ATTR, _DEVICE_MARK)[1]
    except (RuntimeError, NotImplementedError):
        return ""


def mark(tensor: torch.Tensor, placement: str) -> torch.Tensor:
    """Set where ``tensor`` (and every view of its storage) lives; returns it."""
    if placement not in (DEVICE, PINNED, PAGEABLE):
        raise ValueError(f"unknown placement {placement!r}")
    storage = tensor.untyped_storage()
    if placement == DEVICE:
        if hasattr(storage, _ATTR):
            delattr(storage, _ATTR)
    else:
        setattr(storage, _ATTR, (placement, _maker_site()))
    return tensor


# ---------------------------------------------------------------------------------------------
# Host syncs (:data:`SYNCS`, :func:`count_sync`, :func:`call_site` live in placement_state)


def _maker_site() -> str:
    """The innermost frame outside torch and this module (the emulation's own lines count);
    with ``MOE_RELEASE_PLACEMENT_TRACE=1`` the whole stack."""
    if _TRACE:
        import traceback

        return "\n" + "".join(traceback.format_stack(sys._getframe(2), limit=12))
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != _THIS_FILE:
            return f"{_short(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def syncs_by_site() -> Dict[str, int]:
    """The syncs counted so far, ``"kind @ site" -> count``."""
    return {f"{kind} @ {site}": n for (kind, site), n in sorted(SYNCS.items())}


def sync_counts(syncs: Dict[Tuple[str, str], int]) -> "collections.Counter[Tuple[str, str]]":
    """Syncs by (kind, file): line numbers move with the patches, files and kinds do not."""
    counts: collections.Counter[Tuple[str, str]] = collections.Counter()
    for (kind, site), n in syncs.items():
        counts[(kind, site.rsplit(":", 1)[0])] += n
    return counts


def added_syncs(patched: list, base: list) -> list:
    """The syncs (``"rank R: N x kind @ file"``) that ranks' ``patched`` results (each with a
    ``"syncs"`` entry, as :data:`SYNCS` holds them) make beyond ``base``'s."""
    added = []
    for rank, (p, b) in enumerate(zip(patched, base)):
        extra = sync_counts(p["syncs"]) - sync_counts(b["syncs"])
        added += [f"rank {rank}: {n} x {kind} @ {where}" for (kind, where), n in extra.items()]
    return added


# ---------------------------------------------------------------------------------------------
# The mode


def _is_cuda_device(device) -> Optional[bool]:
    """True for a CUDA device spec, False for the host, None for no device given."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return None


def _tensors(args) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _from_tree_under_test() -> bool:
    """Whether the nearest caller outside torch is megatron's code (its factories without
    ``device=`` land on the host on a GPU) rather than the CPU runtime or a test harness,
    which stand in for device code."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != _THIS_FILE:
            return (os.sep + "megatron" + os.sep + "core" + os.sep) in name
        frame = frame.f_back
    return False


# Factory functions: their output's placement comes from device= / pin_memory= alone.
_FACTORIES = frozenset(
    {
        torch.zeros,
        torch.ones,
        torch.full,
        torch.empty,
        torch.empty_strided,
        torch.tensor,
        torch.as_tensor,
        torch.arange,
        torch.range,
        torch.linspace,
        torch.logspace,
        torch.eye,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.scalar_tensor,
        torch.tril_indices,
        torch.triu_indices,
    }
)
_LIKE = frozenset(
    {
        torch.zeros_like,
        torch.ones_like,
        torch.full_like,
        torch.empty_like,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
    }
)
_NEW = frozenset(
    {
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.Tensor.new_empty,
        torch.Tensor.new_tensor,
        torch.Tensor.new_empty_strided,
    }
)
# Ops CUDA runs with a host argument next to a device one: copies and host index tensors.
_MIXING_ALLOWED = frozenset(
    {
        torch.Tensor.copy_,
        torch._has_compatible_shallow_copy_type,
        torch.Tensor.__getitem__,
        torch.Tensor.__setitem__,
        torch.Tensor.index_put_,
        torch.Tensor.index_put,
        torch.Tensor.set_,
        torch.Tensor.to,
        torch.Tensor.cuda,
        torch.Tensor.cpu,
        torch.Tensor.record_stream,
        torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__len__,
        torch.Tensor.__repr__,
        torch.Tensor.__format__,
        torch.Tensor.split,
        torch.split,
        torch.Tensor.tensor_split,
        torch.tensor_split,
    }
)
_SYNC_METHODS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.__bool__: "bool",
    torch.Tensor.__int__: "int",
    torch.Tensor.__float__: "float",
    torch.Tensor.__index__: "index",
}


def _device_of(placement: str) -> torch.device:
    return CUDA_DEVICE if placement == DEVICE else torch.device("cpu")


def _mismatch(func, devices) -> PlacementError:
    name = getattr(func, "__name__", repr(func))
    return PlacementError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"cuda:0 and cpu! (when checking arguments for {name}; CPU runtime placement rule, "
        f"at {call_site()}: {', '.join(devices)})"
    )


# Ops that read no tensor data (metadata only): no stream ordering to check.
_NO_DATA = frozenset(
    {
        torch._has_compatible_shallow_copy_type,
        torch.Tensor.untyped_storage,
        torch.Tensor.data_ptr,
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.stride,
        torch.Tensor.__len__,
        torch.Tensor.record_stream,
        torch.Tensor.set_,
        torch.Tensor.element_size,
        torch.Tensor.is_contiguous,
        torch.Tensor.storage_offset,
        torch.Tensor.numpy,  # a view: the array's reads are numpy's, not tracked
        # Autograd metadata: they set a flag on the tensor and launch no kernel (in-place by
        # name only).
        torch.Tensor.requires_grad_,
        torch.Tensor.retain_grad,
        torch.Tensor.detach_,
    }
)
# Factories that leave memory uninitialized: they write nothing a stream could race on.
_UNINITIALIZED = frozenset(
    {torch.empty, torch.empty_strided, torch.empty_like, torch.Tensor.new_empty,
     torch.Tensor.new_empty_strided}
)  # fmt: skip
_WRITE = "_moe_release_last_write"  # on the storage: (stream, sequence number)


def _in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (
        (name.endswith("_") and not name.startswith("__"))
        or (name.startswith("__i") and name not in ("__index__", "__int__", "__invert__"))
        or name == "__setitem__"
    )


def _stamp(tensors) -> None:
    """The current stream writes ``tensors`` (one operation)."""
    stream = HOST_STREAMS.current
    seq = stream.tick()
    for t in tensors:
        try:
            setattr(t.untyped_storage(), _WRITE, (stream, seq))
        except (RuntimeError, NotImplementedError):
            pass


def _written(tensor: torch.Tensor, func) -> torch.Tensor:
    """Stamp a factory's device output as written by the current stream (unless it is left
    uninitialized)."""
    if func not in _UNINITIALIZED and placement_of(tensor) == DEVICE:
        _stamp([tensor])
    return tensor


def _storage_key(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _writes(func, args, kwargs, inputs, out) -> list:
    """The tensors a device op writes: its in-place target and ``out=`` tensors, and each output
    with storage of its own. An output on an input's storage (a view, ``contiguous()`` of a
    contiguous tensor, an autograd Function returning its input) is an alias made without a
    kernel: it writes nothing, so it must not look written on the current stream."""
    written = []
    if args and _in_place(func) and isinstance(args[0], torch.Tensor):
        written.append(args[0])
    written.extend(_tensors((kwargs.get("out"),)))
    aliased = {_storage_key(t) for t in inputs}
    for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
        if _storage_key(t) not in aliased:
            written.append(t)
    return written


def _aliases_only(func, args, kwargs, inputs, out) -> bool:
    """Whether an op made only aliases of its inputs (views, ``contiguous()`` of a contiguous
    tensor, ``Function.apply`` returning its input): no kernel ran, nothing was read or
    written. In-place and ``out=`` ops write, and are never alias-only."""
    if _in_place(func) or kwargs.get("out") is not None:
        return False
    outs = list(_tensors(out if isinstance(out, (list, tuple)) else (out,)))
    aliased = {_storage_key(t) for t in inputs}
    return bool(outs) and all(_storage_key(t) in aliased for t in outs)


def _check_read(tensor: torch.Tensor, reader, func) -> None:
    """Refuse a read of ``tensor`` by ``reader`` (a stream; None for the host) that CUDA
    would not order after the tensor's last write on another stream."""
    try:
        write = getattr(tensor.untyped_storage(), _WRITE, None)
    except (RuntimeError, NotImplementedError):
        return
    if write is None or HOST_STREAMS.ordered_after(write[0], write[1], reader):
        return
    name = getattr(func, "__name__", repr(func))
    where = "the host" if reader is None else f"stream {reader.name!r}"
    raise StreamOrderError(
        f"{name} on {where} reads a tensor {tuple(tensor.shape)} written on stream "
        f"{write[0].name!r} without waiting for it (no wait_stream/wait_event/synchronize "
        f"orders the read after the write: on a GPU this is a race); at {call_site()}"
    )


class StreamOrderError(RuntimeError):
    """A read that CUDA would not order after the write it depends on (a race on a GPU)."""


# The generator of the (emulated) GPU: random ops on device tensors draw from it, as CUDA's
# draw from the device generator and not the host's; torch.cuda's and megatron's CUDA RNG
# state calls read and set it (moe_release.runtime.cuda.compat.install_cpu_rng_shim).
CUDA_GENERATOR = torch.Generator()

_RANDOM = frozenset(
    {
        torch.nn.functional.dropout,
        torch.dropout,
        torch.bernoulli,
        torch.Tensor.bernoulli,
        torch.Tensor.bernoulli_,
        torch.Tensor.uniform_,
        torch.Tensor.normal_,
        torch.Tensor.random_,
        torch.Tensor.exponential_,
        torch.normal,
        torch.multinomial,
        torch.Tensor.multinomial,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
    }
)


def _draws_on_device(args, kwargs) -> bool:
    tensors = list(_tensors(args))
    if tensors:
        return any(placement_of(t) == DEVICE for t in tensors)
    return bool(_is_cuda_device(kwargs.get("device")))


@contextlib.contextmanager
def device_rng():
    """Run a random op on the device generator :data:`CUDA_GENERATOR` (the host generator's
    state is set aside meanwhile)."""
    host = torch.default_generator.get_state()
    torch.default_generator.set_state(CUDA_GENERATOR.get_state())
    try:
        yield
    finally:
        CUDA_GENERATOR.set_state(torch.default_generator.get_state())
        torch.default_generator.set_state(host)


class PlacementMode(TorchFunctionMode):
    """Track placement, answer CUDA's view of a tensor, enforce CUDA's rules, count syncs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _IS_CUDA:
            return placement_of(args[0]) == DEVICE
        if owner is _DEVICE:
            return _device_of(placement_of(args[0]))
        if owner is _IS_CPU:
            return placement_of(args[0]) != DEVICE
        if owner is not None and type(owner).__name__ == "getset_descriptor":
            return func(*args, **kwargs)  # attribute access (``.data = ...``, ``.grad``, ...)
        if func in _RANDOM and kwargs.get("generator") is None and _draws_on_device(args, kwargs):
            with device_rng():
                return self._dispatch(func, owner, args, kwargs)
        return self._dispatch(func, owner, args, kwargs)

    def _dispatch(self, func, owner, args, kwargs):
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        if func in _LIKE or func in _NEW:
            return self._like(func, args, kwargs)
        if func is torch.Tensor.cuda:
            return self._to(args[0], True, kwargs.get("non_blocking", False), (), {})
        if func is torch.Tensor.cpu:
            return self._to(args[0], False, False, (), {})
        if func is torch.Tensor.to:
            return self._tensor_to(args, kwargs)
        if func is torch.Tensor.pin_memory:
            if placement_of(args[0]) == DEVICE:
                raise RuntimeError("cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors "
                                   "can be pinned")  # fmt: skip
            return mark(args[0].clone(), PINNED)
        if func is torch.Tensor.is_pinned:
            return placement_of(args[0]) == PINNED
        if func is torch.Tensor.numpy and placement_of(args[0]) == DEVICE:
            raise TypeError(
                "can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
                "the tensor to host memory first."
            )
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return self._backward(func, args, kwargs)
        kind = _SYNC_METHODS.get(func)
        if kind is not None:
            if placement_of(args[0]) == DEVICE:
                # Reads on the current stream and waits for it (cudaMemcpy's implicit sync).
                _check_read(args[0], HOST_STREAMS.current, func)
                count_sync(kind)
                HOST_STREAMS.host_waits_for(HOST_STREAMS.current)
            else:
                _check_read(args[0], None, func)
            return func(*args, **kwargs)
        return self._op(func, args, kwargs)

    # -- factories -------------------------------------------------------------------------
    def _factory(self, func, args, kwargs):
        device = kwargs.get("device")
        on_cuda = _is_cuda_device(device)
        pinned = bool(kwargs.pop("pin_memory", False))
        if on_cuda:
            kwargs["device"] = "cpu"
            placement = DEVICE
        elif on_cuda is False or _from_tree_under_test():
            placement = PINNED if pinned else PAGEABLE
        else:
            placement = PINNED if pinned else DEVICE
        if func is torch.as_tensor and args and isinstance(args[0], torch.Tensor):
            src = placement_of(args[0])
            if on_cuda is None:
                return func(*args, **kwargs)
            if src != placement:
                return self._to(args[0], placement == DEVICE, False, (), {"dtype": kwargs.get(
                    "dtype")} if kwargs.get("dtype") else {})  # fmt: skip
            return func(*args, **kwargs)
        return _written(mark(func(*args, **kwargs), placement), func)

    def _like(self, func, args, kwargs):
        device = kwargs.get("device")
        on_cuda = _is_cuda_device(device)
        pinned = bool(kwargs.pop("pin_memory", False))
        if on_cuda is None:
            placement = placement_of(args[0])
            if placement == PINNED:
                placement = PAGEABLE
        else:
            placement = DEVICE if on_cuda else PAGEABLE
            kwargs["device"] = "cpu"
        if pinned:
            placement = PINNED
        return _written(mark(func(*args, **kwargs), placement), func)

    # -- moves -----------------------------------------------------------------------------
    def _to(self, tensor, to_cuda: bool, non_blocking: bool, args, kwargs):
        src = placement_of(tensor)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("device", "non_blocking", "copy")}
        if (src == DEVICE) == to_cuda:
            if not (args or kwargs):
                return tensor
            out = tensor.to(*args, **kwargs)
            if src == DEVICE and out is not tensor:
                _check_read(tensor, HOST_STREAMS.current, torch.Tensor.to)
                _stamp([out])
            return out
        stream = HOST_STREAMS.current
        _check_read(tensor, stream, torch.Tensor.to)
        out = tensor.to(*args, **kwargs, copy=True) if (args or kwargs) else tensor.clone()
        if to_cuda:
            _stamp([out])
            return mark(out, DEVICE)
        if non_blocking:
            # torch's _to_copy pins the output of a non-blocking device-to-host copy, which
            # the stream writes later: the host must wait for it before reading.
            _stamp([out])
            return mark(out, PINNED)
        count_sync("copy to host")
        HOST_STREAMS.host_waits_for(stream)
        return mark(out, PAGEABLE)

    def _tensor_to(self, args, kwargs):
        """``Tensor.to`` in each of its forms: ``(device, dtype, non_blocking, copy)``,
        ``(dtype, non_blocking, copy)``, ``(other, non_blocking, copy)``, positional or not."""
        tensor, rest = args[0], list(args[1:])
        kwargs = dict(kwargs)
        device = kwargs.pop("device", None)
        if device is None and rest:
            first = rest[0]
            if isinstance(first, torch.Tensor):
                rest.pop(0)
                device = _device_of(placement_of(first))
                kwargs.setdefault("dtype", first.dtype)
            elif isinstance(first, (str, int, torch.device)) and not isinstance(first, bool):
                device = rest.pop(0)
        if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
            dtype = rest.pop(0)
            if dtype is not None:
                kwargs.setdefault("dtype", dtype)
        non_blocking = kwargs.pop("non_blocking", False)
        if rest:
            non_blocking = bool(rest.pop(0))
        if rest:
            kwargs["copy"] = bool(rest.pop(0))
        if kwargs.get("dtype", 0) is None:
            del kwargs["dtype"]
        on_cuda = _is_cuda_device(device)
        if on_cuda is None:
            out = tensor.to(non_blocking=non_blocking, **kwargs) if kwargs else tensor
            if out is not tensor and placement_of(tensor) != DEVICE:
                self._inherit(out, [tensor])
            return out
        return self._to(tensor, on_cuda, non_blocking, (), kwargs)

    def _backward(self, func, args, kwargs):
        """``Tensor.backward``/``torch.autograd.backward`` with the rules in force inside: the
        backward runs Python (custom autograd functions, hooks) and a handler runs with the mode
        popped, so the engine is run here, as torch.autograd.backward runs it, with the mode
        pushed back (calling ``func`` again would only come back to this handler)."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        names = ("gradient", "retain_graph", "create_graph", "inputs")
        if func is torch.autograd.backward:
            names = ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
        bound = dict(zip(names, args[1:]))
        bound.update(kwargs)
        tensors = args[0] if args else bound.pop("tensors")
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        grads = bound.get("gradient", bound.get("grad_tensors"))
        grads = _make_grads(
            tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)), is_grads_batched=False
        )
        create_graph = bound.get("create_graph", False)
        retain_graph = bound.get("retain_graph")
        inputs = bound.get("inputs")
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs) if inputs else ()
        with self:
            _engine_run_backward(
                tensors,
                grads,
                create_graph if retain_graph is None else retain_graph,
                create_graph,
                inputs,
                allow_unreachable=True,
                accumulate_grad=True,
            )

    # -- every other op --------------------------------------------------------------------
    def _op(self, func, args, kwargs):
        inputs = list(_tensors(args)) + list(_tensors(kwargs.values()))
        if not inputs:
            return func(*args, **kwargs)
        placements = [placement_of(t) for t in inputs]
        on_device = DEVICE in placements
        if on_device and func not in _MIXING_ALLOWED:
            host = [
                f"{p} {tuple(t.shape)} made at {made_at(t)}"
                for t, p in zip(inputs, placements)
                if p != DEVICE and t.dim() > 0
            ]
            if host:
                raise _mismatch(func, host)
        # A device op runs on the current stream; a host op on the host, at once.
        reader = HOST_STREAMS.current if on_device else None
        out = func(*args, **kwargs)
        # Checked after the call (the host runs it at once, so the order cannot matter here):
        # whether the op launched a kernel shows in its outputs. A view, or an autograd Function
        # returning its input, makes aliases only and neither reads nor writes data on a GPU.
        if func not in _NO_DATA and not _aliases_only(func, args, kwargs, inputs, out):
            for t in inputs:
                _check_read(t, reader, func)
            if on_device:
                _stamp(_writes(func, args, kwargs, inputs, out))
        if not on_device:
            self._inherit(out, inputs)
        return out

    @staticmethod
    def _inherit(out, inputs) -> None:
        """A host op's new outputs are pageable host tensors (views keep their storage's)."""
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        for t in _tensors(out if isinstance(out, (list, tuple)) else (out,)):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.data_ptr() not in storages and not hasattr(storage, _ATTR):
                setattr(storage, _ATTR, (PAGEABLE, _maker_site()))


def active() -> bool:
    """Whether the placement rules are in force in this process."""
    return _STATE.mode is not None


def install() -> bool:
    """Enter :class:`PlacementMode` for the rest of the process (a rank of a CPU run), and
    route ``torch.cuda.current_device``/``synchronize`` to their host stand-ins. Idempotent;
    no-op where CUDA is available (the real rules apply there)."""
    if _STATE.mode is not None or torch.cuda.is_available():
        return False
    from moe_release.runtime.cuda.host_streams import install_record_stream_stand_in

    install_record_stream_stand_in()
    mode = PlacementMode()
    mode.__enter__()
    _STATE.mode = mode
    for name, stand_in in _cuda_stand_ins().items():
        setattr(torch.cuda, name, stand_in)
    return True


def _cuda_stand_ins() -> dict:
    """What ``torch.cuda`` answers under the rules: device 0, the host streams and events of
    :mod:`moe_release.runtime.cuda.host_streams` (megatron's ``is_cuda`` branches call them), a
    counted
    ``synchronize``."""
    from moe_release.runtime.cuda.host_streams import HOST_STREAMS, HostEvent, HostStream

    return {
        "get_rng_state": lambda device="cuda": CUDA_GENERATOR.get_state(),
        "set_rng_state": lambda new_state, device="cuda": CUDA_GENERATOR.set_state(new_state),
        "manual_seed": lambda seed: CUDA_GENERATOR.manual_seed(seed),
        "current_device": _current_device,
        "synchronize": _synchronize,
        # The host streams never capture a graph: CUDA's answer outside a capture (torch's
        # own call needs a CUDA driver; megatron's batched p2p asks it after every exchange).
        "is_current_stream_capturing": lambda: False,
        "current_stream": HOST_STREAMS.current_stream,
        "default_stream": lambda device=None: HOST_STREAMS.default,
        "stream": HOST_STREAMS.stream,
        "Stream": HostStream,
        "Event": HostEvent,
        "mem_get_info": _mem_get_info,
        "memory_allocated": _memory_stat("memory_allocated"),
        "max_memory_allocated": _memory_stat("max_memory_allocated"),
        "reset_peak_memory_stats": _memory_stat("reset_peak_memory_stats"),
    }


def _memory_stat(name: str):
    """``torch.cuda.<name>`` of the emulated GPU: the counting host allocator's figure
    (moe_release.runtime.measure.cpu_memory, every CPU tensor storage since its install). Refused
    while no counter is installed: without a CUDA context torch answers 0, and a memory figure of 0
    that
    a GPU would not print hides a missing measurement."""

    def stand_in(device=None):
        from moe_release.runtime.measure import cpu_memory

        if not cpu_memory.installed():
            raise RuntimeError(
                f"CPU runtime: torch.cuda.{name}() of the emulated GPU needs the counting host "
                "allocator; call moe_release.runtime.measure.cpu_memory.install() before "
                "allocating what is measured"
            )
        return getattr(cpu_memory, name)()

    stand_in.__name__ = name
    return stand_in


# The emulated GPU's memory for ``torch.cuda.mem_get_info``: an H100's 80 GiB.
DEVICE_MEMORY = 80 * 2**30


def _mem_get_info(device=None) -> Tuple[int, int]:
    """``torch.cuda.mem_get_info`` of the emulated GPU: ``(free, total)`` with ``free`` the total
    less the counting host allocator's live bytes, settled (gloo's threads free finished
    collectives' buffers late). Differs from cudaMemGetInfo: no caching allocator keeps freed
    blocks reserved here, and the page-locked host memory the emulations allocate (DeepEP's
    receive counters) counts as the device's. Refused without the counter, as
    :func:`_memory_stat` is."""
    from moe_release.runtime.measure import cpu_memory

    _memory_stat("memory_allocated")(device)  # refuses without the counter
    return DEVICE_MEMORY - cpu_memory.settled(), DEVICE_MEMORY


@contextlib.contextmanager
def rules() -> Iterator[PlacementMode]:
    """The placement rules for a block (tests); :func:`install` enters them for good."""
    from moe_release.runtime.cuda.host_streams import install_record_stream_stand_in

    install_record_stream_stand_in()
    stand_ins = _cuda_stand_ins()
    saved_mode, saved = _STATE.mode, {name: getattr(torch.cuda, name) for name in stand_ins}
    mode = PlacementMode()
    with mode:
        _STATE.mode = mode
        for name, stand_in in stand_ins.items():
            setattr(torch.cuda, name, stand_in)
        try:
            yield mode
        finally:
            _STATE.mode = saved_mode
            for name, real in saved.items():
                setattr(torch.cuda, name, real)


def _current_device() -> int:
    return 0


def _synchronize(device=None) -> None:
    count_sync("torch.cuda.synchronize")
    HOST_STREAMS.device_synchronize()
