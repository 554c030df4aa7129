# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What a rank of the fault matrix records: every collective it enters, and from where.

"A collective entered by one rank alone is a hang on a GPU." The CPU runtime runs the same
collectives over gloo, where a peer that never comes costs a timeout, not a hang; this module makes
each one visible, so that the fault matrix (``scripts/fault_matrix.py``,
:mod:`moe_release.runtime.megatron.fault_scenarios`) can tell which collectives every rank entered
together and which one rank entered alone, and in what context:

* :func:`install` wraps ``torch.distributed``'s collectives (barrier, all_reduce, all_gather*,
  all_to_all*, broadcast, reduce*, gather, scatter) and, through :func:`note`, the kernel
  emulations log their device-side collectives (DeepEP ``Buffer.destroy``'s intranode barrier
  and, across nodes, its NVSHMEM barrier, free and finalize, ``ElasticBuffer.destroy``, the
  HybridEP constructor's handle exchange, TE's ``ep_finalize``).
* Each entry carries the group's global ranks and its context (:func:`context`): ``finalizer``
  (inside a ``__del__`` or a ``weakref.finalize`` callback), ``gc`` (inside a garbage
  collection, from ``gc.callbacks``), ``atexit`` (inside a hook registered with ``atexit``:
  :func:`tag_atexit_hooks` wraps ``atexit.register`` before megatron-core is imported, and
  ``weakref.finalize``'s own exit hook is found on the stack), ``autograd`` (inside a backward:
  ``torch._C._current_autograd_node()`` is set, or on another thread than the main one), and
  whether an exception was pending (``sys.last_exc``/``sys.last_value``, or one being handled).
* :class:`Fabric` is the rendezvous a device-side collective makes among a buffer's NVLink
  peers. The real one runs over IPC-mapped memory, not over a process group, so it works (and
  hangs) whether or not the group still exists: here it is a barrier on the job's default store
  (a ``PrefixStore`` keyed by a per-buffer id, equal on every rank because constructions are
  collective), bounded by :func:`device_barrier_timeout`, after which it raises
  :class:`DeviceBarrierTimeout` ("a GPU would trap": DeepEP's barrier kernel times out and
  traps, ``csrc/kernels/utils.cuh``'s ``NUM_TIMEOUT_CYCLES``).

Every entry is also appended, as one JSON line, to ``MOE_RELEASE_FAULT_LOG`` where that is set
(a file per rank): entries made while the interpreter exits (atexit hooks, finalization) are
kept there, written with a file descriptor opened at install.

Only the standard library and torch are imported: the emulations import this module before
megatron-core is imported.
"""

import atexit
import gc
import json
import os
import sys
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_release import settings

# torch.distributed's collectives (point-to-point sends are not collectives and are not logged).
COLLECTIVES = (
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather_object",
    "all_gather_coalesced",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
)

# Contexts no collective may be entered from (the pass rule of docs/fault-matrix.md), besides
# "atexit" after an exception and the lifecycle collectives of a backward.
BANNED_CONTEXTS = ("finalizer", "gc")

# What frees a communication buffer's memory (that its peers map): only an explicit release
# that every peer makes, on the main thread, may (context "release"), or the process's exit.
# HybridEP's destructor waits on no peer: it is no collective (not in LIFECYCLE below).
FREES = (
    "deepep destroy barrier",
    "deepep nvshmem barrier",
    "deepep nvshmem free",
    "deepep nvshmem finalize",
    "deepepv2 destroy barrier",
    "deepepv2 window deregister",
    "hybridep release_buffer",
    "ncclep ep_finalize",
    "ncclep gin window deregister",
)

# The constructions among them: a backward may make a buffer (a recompute after a reset, DeepEP's
# backward fetching one), as every rank of the group runs the same backward.
CONSTRUCTIONS = (
    "hybridep handle exchange",
    "deepepv2 construct barrier",
    "ncclep ep_bootstrap",
    "deepep nvshmem init",
    "deepepv2 window register",
    "hybridep rdma info exchange (combine)",
    "hybridep rdma info exchange (dispatch)",
    "ncclep gin window register",
)

# Collectives that create, release or synchronize a communication buffer (not a data move of a
# dispatch or combine): none but a construction may run inside a backward.
LIFECYCLE = (
    "barrier",
    "monitored_barrier",
    "deepep destroy barrier",
    "deepep nvshmem init",
    "deepep nvshmem barrier",
    "deepep nvshmem free",
    "deepep nvshmem finalize",
    "deepepv2 destroy barrier",
    "deepepv2 construct barrier",
    "deepepv2 window register",
    "deepepv2 window deregister",
    "hybridep handle exchange",
    "hybridep rdma info exchange (combine)",
    "hybridep rdma info exchange (dispatch)",
    "ncclep ep_finalize",
    "ncclep ep_bootstrap",
    "ncclep gin window register",
    "ncclep gin window deregister",
)

# The entries of this process (the first MAX_ENTRIES: a long job's log is its file's).
ENTRIES: List[Dict[str, Any]] = []
MAX_ENTRIES = 100_000
_STATE: Dict[str, Any] = {"installed": False, "fd": None, "gc": 0, "atexit": 0, "seq": 0}
_LOCAL = threading.local()


def device_barrier_timeout() -> float:
    """Seconds a device-side barrier waits for its peers before it "traps"
    (``MOE_RELEASE_DEVICE_BARRIER_TIMEOUT``, default 30: DeepEP's kernels give up after about
    100 s of GPU cycles; the emulation's default is shorter so a job fails within its deadline)."""
    return settings.device_barrier_timeout()


class DeviceBarrierTimeout(RuntimeError):
    """A device-side barrier whose peers did not all arrive: a GPU would trap."""


def printf(text: str, _write=os.write) -> None:
    """``printf`` + ``fflush(stdout)`` of a C++ destructor: through ``sys.stdout`` while there is
    one (a redirect sees it), else to file descriptor 1, as during the interpreter's
    finalization, where ``print`` writes nothing."""
    stream = getattr(sys, "stdout", None)
    if stream is not None and not sys.is_finalizing():
        try:
            print(text, file=stream, flush=True)
            return
        except (OSError, ValueError):
            pass
    _write(1, (text + "\n").encode())


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def context() -> Tuple[List[str], bool]:
    """The contexts of the current call (see the module docstring) and whether an exception
    is pending."""
    where = []
    frame = sys._getframe(1)
    finalizer = atexit_hook = release = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "reset_fused_a2a_buffers" and frame.f_locals.get("collective"):
            release = True  # fused_a2a's explicit release, which every peer calls
        if code.co_name == "__del__":
            finalizer = True
        elif code.co_filename.endswith("weakref.py"):
            if code.co_name == "_exitfunc":
                atexit_hook = True
            elif code.co_name == "__call__":
                finalizer = True
        frame = frame.f_back
    if release:
        where.append("release")
    if sys.is_finalizing():
        where.append("exit")
    if finalizer:
        where.append("finalizer")
    if _STATE["gc"]:
        where.append("gc")
    if _STATE["atexit"] or atexit_hook:
        where.append("atexit")
    in_backward = False
    try:
        in_backward = torch._C._current_autograd_node() is not None
    except AttributeError:  # an older torch
        pass
    if in_backward or not _main_thread():
        where.append("autograd" if in_backward else "thread")
    pending = (
        getattr(sys, "last_exc", None) is not None
        or getattr(sys, "last_value", None) is not None
        or sys.exc_info()[0] is not None
    )
    return where, pending


def group_ranks(group) -> Optional[Tuple[int, ...]]:
    """The global ranks of ``group`` (None: the default group), or None if it is gone."""
    try:
        if group is None or group is getattr(dist.GroupMember, "WORLD", None):
            return tuple(range(dist.get_world_size())) if dist.is_initialized() else None
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, RuntimeError, ValueError, AttributeError):
        return None


def note(op: str, ranks: Optional[Tuple[int, ...]], **extra: Any) -> Dict[str, Any]:
    """Log one collective entry ``op`` over the global ``ranks``; returns the entry."""
    where, pending = context()
    _STATE["seq"] += 1
    entry = {
        "seq": _STATE["seq"],
        "op": op,
        "ranks": list(ranks) if ranks is not None else None,
        "context": where,
        "exception_pending": pending,
        "thread": threading.current_thread().name,
        "t": time.time(),
    }
    entry.update(extra)
    if len(ENTRIES) < MAX_ENTRIES:
        ENTRIES.append(entry)
    _write(entry)
    return entry


def _write(entry: Dict[str, Any], _dumps=json.dumps, _os_write=os.write) -> None:
    fd = _STATE["fd"]
    if fd is None:
        return
    try:
        _os_write(fd, (_dumps(entry, default=str) + "\n").encode())
    except (OSError, ValueError, TypeError):
        pass


def record(kind: str, **fields: Any) -> None:
    """Append a non-collective record (a marker, a warning) to the rank's log file."""
    entry = {"kind": kind, "t": time.time()}
    entry.update(fields)
    _write(entry)


def _wrap(module, name: str, original: Callable) -> Callable:
    import functools
    import inspect

    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError):
        signature = None

    @functools.wraps(original)
    def logged(*args, **kwargs):
        if getattr(_LOCAL, "depth", 0):  # a collective calling another: log the outer one
            return original(*args, **kwargs)
        group = kwargs.get("group")
        if group is None and signature is not None:
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:
                group = None
        note(name, group_ranks(group))
        _LOCAL.depth = 1
        try:
            return original(*args, **kwargs)
        finally:
            _LOCAL.depth = 0

    logged._moe_release_original = original
    return logged


def _gc_callback(phase: str, info: dict) -> None:
    _STATE["gc"] += 1 if phase == "start" else -1
    _STATE["gc"] = max(_STATE["gc"], 0)


def tag_atexit_hooks() -> None:
    """Wrap ``atexit.register`` (idempotent) so that every hook registered from now on runs with
    the ``atexit`` context set: call it before megatron-core is imported (the zygote and the
    launcher do)."""
    if getattr(atexit.register, "_moe_release_tagged", False):
        return
    register, unregister = atexit.register, atexit.unregister
    wrappers: Dict[int, Callable] = {}

    def tagged_register(func, *args, **kwargs):
        def hook():
            _STATE["atexit"] += 1
            try:
                return func(*args, **kwargs)
            finally:
                _STATE["atexit"] -= 1

        hook.__wrapped__ = func
        wrappers.setdefault(id(func), hook)
        register(wrappers[id(func)])
        return func

    def tagged_unregister(func):
        hook = wrappers.pop(id(func), None)
        unregister(hook if hook is not None else func)

    tagged_register._moe_release_tagged = True
    atexit.register, atexit.unregister = tagged_register, tagged_unregister


def install(log_path: Optional[str] = None) -> None:
    """Log every torch.distributed collective of this process (idempotent), with its context;
    append each entry to ``log_path`` (default ``MOE_RELEASE_FAULT_LOG``) as it is made."""
    log_path = log_path or settings.fault_log()
    if log_path and _STATE["fd"] is None:
        _STATE["fd"] = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if _STATE["installed"]:
        return
    from torch.distributed import distributed_c10d

    for name in COLLECTIVES:
        for module in (dist, distributed_c10d):
            original = getattr(module, name, None)
            if original is None or hasattr(original, "_moe_release_original"):
                continue
            setattr(module, name, _wrap(module, name, original))
    gc.callbacks.append(_gc_callback)
    tag_atexit_hooks()
    _STATE["installed"] = True


def installed() -> bool:
    """Whether :func:`install` ran in this process."""
    return _STATE["installed"]


def reset() -> None:
    """Forget the entries logged so far (a new job)."""
    ENTRIES.clear()


# -- the device fabric -------------------------------------------------------------------------


class Fabric:
    """The NVLink peers of one buffer, as its constructor mapped them (see the module
    docstring): :meth:`barrier` is the rendezvous a device-side barrier makes, over the default
    store the job started with, whatever became of the buffer's process group since.

    Which peers' barrier it is comes from the constructor's own exchange, as the real one's
    barrier signals come from the IPC handles its constructor all-gathers over the group
    (deep_ep 94a9f8f ``deep_ep/buffer.py:94-100``): :func:`exchange` runs that all-gather of a
    token fresh per construction, and the tokens name the fabric. So a replaced peer (a fresh
    process, which made none of the old buffers) meets the survivors' new buffers only.

    ``ranks`` (global ranks, default: the whole group) names the peers when they are a part of
    the group: a node's NVLink peers, or an NVSHMEM job's PEs (DeepEP across nodes)."""

    def __init__(
        self,
        group,
        what: str,
        tokens: Optional[List[str]] = None,
        ranks: Optional[Sequence[int]] = None,
    ) -> None:
        self.ranks = tuple(ranks) if ranks is not None else (group_ranks(group) or (0,))
        tokens = tokens if tokens is not None else exchange(group)
        self.prefix = f"moe_release_fabric/{what}/{'-'.join(map(str, self.ranks))}/" + (
            "/".join(tokens) + "/"
        )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.store = None
        if dist.is_initialized() and len(self.ranks) > 1:
            self.store = dist.distributed_c10d._get_default_store()
        self.rounds = 0

    def barrier(self, kind: str) -> None:
        """Log ``kind`` (a device-side collective over the peers) and wait until every peer has
        entered it, at most :func:`device_barrier_timeout` seconds: then raise
        :class:`DeviceBarrierTimeout`, as the kernel traps."""
        note(kind, self.ranks)
        if self.store is None:
            return
        key = f"{self.prefix}{self.rounds}"
        self.rounds += 1
        timeout = device_barrier_timeout()
        start = time.monotonic()
        try:
            if self.store.add(key + "/arrived", 1) == len(self.ranks):
                self.store.set(key + "/done", "1")
            self.store.wait([key + "/done"], timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - a timeout, or the store's host is gone
            waited = time.monotonic() - start
            message = (
                f"{kind}: device barrier among ranks {list(self.ranks)} timed out after "
                f"{waited:.1f} s (a peer never arrived: {type(exc).__name__}), a GPU would trap"
            )
            record("device_barrier_timeout", op=kind, ranks=list(self.ranks), waited=waited)
            raise DeviceBarrierTimeout(message) from None


def exchange(group) -> List[str]:
    """What a buffer's constructor all-gathers over ``group`` (its IPC handles): here a token
    fresh per construction, from each rank."""
    token = os.urandom(6).hex()
    if not dist.is_initialized() or (group_ranks(group) or (0,)) == (dist.get_rank(),):
        return [token]
    tokens: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(tokens, token, group=group)
    return [str(t) for t in tokens]


# -- what the emulations hold -------------------------------------------------------------------

# Every communication buffer or context an emulation constructed in this process.
BUFFERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def register_buffer(buffer: Any) -> None:
    """Add ``buffer`` to :data:`BUFFERS` (the emulations' constructors call it)."""
    BUFFERS.add(buffer)
