# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Retained-state probe: what MoE token dispatchers still reference after a step, and its cost.

Two views, meant to be read together:

* attribution (:func:`attribute_layer`): from every tensor a dispatcher or its comm manager
  references (including tuples such as the dispatch handle), walk the autograd graph
  (``next_functions``, saved tensors of built-in nodes, ``ctx`` attributes and saved tensors
  of custom Functions, leaves and their ``.grad``) and name what is pinned, counting each
  storage once. Graph-held tensors have no Python attribute, so this is what finds them.
* allocator (:func:`release_delta`): drop those references, collect, and measure what the
  allocator really gets back (``torch.cuda.memory_allocated`` on GPU, glibc ``mallinfo2`` on
  the host, where c10's CPU allocator allocates through malloc).

Imports only torch and the standard library; safe to use in tests and reports.
"""

import ctypes
import ctypes.util
import gc
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

# Manager/dispatcher attributes that are configuration, not per-step state.
_SKIP_ATTRS = {"config", "group", "tp_group", "ep_group", "tp_ep_group", "pg_collection"}
# Tensors a dispatcher or manager allocates once and keeps by design (not per-step state):
# HybridEP's over-budget flag, the all-to-all dispatcher's static permutation indices.
PERSISTENT_ATTRS = frozenset(
    {"over_budget", "sort_input_by_local_experts", "restore_output_by_local_experts"}
)


@dataclass
class PinnedTensor:
    """One storage reachable from a dispatcher, with the first path that reached it."""

    path: str
    kind: str
    nbytes: int
    shape: Tuple[int, ...]
    dtype: str
    shared_with_model: bool


@dataclass
class LayerReport:
    """What one MoE layer's dispatcher and manager still reference."""

    name: str
    dispatcher: str
    manager: Optional[str]
    direct: Dict[str, str] = field(default_factory=dict)
    pinned: List[PinnedTensor] = field(default_factory=list)
    release_bytes: Optional[int] = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes reachable only through the dispatcher (model parameters and grads excluded)."""
        return sum(p.nbytes for p in self.pinned if not p.shared_with_model)

    def by_kind(self) -> Dict[str, int]:
        """Pinned bytes per kind, model-owned storages excluded."""
        out: Dict[str, int] = {}
        for p in self.pinned:
            if not p.shared_with_model:
                out[p.kind] = out.get(p.kind, 0) + p.nbytes
        return out


def find_moe_dispatchers(model: torch.nn.Module) -> List[Tuple[str, object]]:
    """``(module name, token dispatcher)`` of every module holding a ``token_dispatcher``."""
    return [
        (name, module.token_dispatcher)
        for name, module in model.named_modules()
        if getattr(module, "token_dispatcher", None) is not None
    ]


def _storage_key(t: torch.Tensor) -> Tuple[str, int]:
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr())


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')} {t.untyped_storage().nbytes()} B"


def _attr_tensors(obj, prefix: str, depth: int = 0):
    """Tensors directly referenced by an object's attributes (recursing into tuples/lists)."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)) and depth < 3:
        for i, item in enumerate(obj):
            yield from _attr_tensors(item, f"{prefix}[{i}]", depth + 1)
    elif isinstance(obj, dict) and depth < 3:
        for k, item in obj.items():
            yield from _attr_tensors(item, f"{prefix}[{k!r}]", depth + 1)
    elif depth == 0 and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            # Persistent tensors (over-budget flag, static indices) are not per-step state.
            if k in _SKIP_ATTRS or k in PERSISTENT_ATTRS or isinstance(v, torch.nn.Module):
                continue
            yield from _attr_tensors(v, f"{prefix}.{k}", depth + 1)


def _node_tensors(node):
    """``(label, tensor-or-tuple)`` held by one autograd node."""
    name = type(node).__name__
    if name == "AccumulateGrad":
        yield "variable", node.variable
        return
    for attr in dir(node):
        if attr.startswith("_saved_"):
            try:
                value = getattr(node, attr)
            except RuntimeError:  # freed after backward
                continue
            yield attr[len("_saved_") :], value
    # Custom Functions: the node is the ctx; their Python attributes (e.g. handle) and
    # save_for_backward tensors are what a checkpoint or dispatch keeps alive.
    if hasattr(node, "__dict__"):
        yield from vars(node).items()
        try:
            for i, t in enumerate(node.saved_tensors):
                yield f"saved_tensors[{i}]", t
        except (RuntimeError, AttributeError):
            pass


def _kind(path: str, node_name: str, label: str, leaf_grad: bool) -> str:
    if leaf_grad:
        return "leaf .grad"
    if node_name.startswith("CheckpointFunction") and label.startswith("saved_tensors"):
        return "checkpoint input"
    if label == "handle" or ".handle" in path:
        return "dispatch handle"
    if label == "variable":
        return "input leaf"
    return "graph-saved tensor"


def attribute_layer(
    name: str, dispatcher, model_storages: Optional[set] = None, max_nodes: int = 100000
) -> LayerReport:
    """Walk everything the dispatcher and its manager reference; see the module docstring."""
    model_storages = model_storages or set()
    manager = getattr(dispatcher, "_comm_manager", None)
    report = LayerReport(
        name=name,
        dispatcher=type(dispatcher).__name__,
        manager=type(manager).__name__ if manager is not None else None,
    )
    roots = list(_attr_tensors(dispatcher, "dispatcher"))
    if manager is not None:
        roots += list(_attr_tensors(manager, "manager"))
    seen_storages = set()
    seen_nodes = set()

    def add(t: torch.Tensor, path: str, kind: str):
        if t.device.type == "meta":
            return
        key = _storage_key(t)
        if key in seen_storages:
            return
        seen_storages.add(key)
        report.pinned.append(
            PinnedTensor(
                path=path,
                kind=kind,
                nbytes=t.untyped_storage().nbytes(),
                shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
                shared_with_model=key in model_storages,
            )
        )

    stack = []
    for path, t in roots:
        report.direct[path] = _describe(t)
        add(t, path, "direct reference")
        if t.grad_fn is not None:
            stack.append((t.grad_fn, path))
    while stack and len(seen_nodes) < max_nodes:
        node, path = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        node_name = type(node).__name__
        here = f"{path} <- {node_name}"
        for label, value in _node_tensors(node):
            for sub, t in _attr_tensors(value, label, depth=1):
                add(t, f"{here}.{sub}", _kind(f"{here}.{sub}", node_name, label, False))
                if t.grad is not None:
                    add(t.grad, f"{here}.{sub}.grad", "leaf .grad")
                if t.grad_fn is not None and id(t.grad_fn) not in seen_nodes:
                    stack.append((t.grad_fn, f"{here}.{sub}"))
        for next_node, _ in getattr(node, "next_functions", ()):
            if next_node is not None:
                stack.append((next_node, here))
    return report


def reachable_storages(value, max_nodes: int = 100000) -> Dict[Tuple[str, int], int]:
    """``{storage key: nbytes}`` of every storage reachable from ``value`` (a tensor, or
    tuples/lists/dicts of them): the tensors themselves, their ``.grad``, and what their
    autograd graphs save, walked as :func:`attribute_layer` walks a dispatcher's."""
    return {k: v[0] for k, v in reachable_tensors(value, max_nodes).items()}


def reachable_tensors(
    value, max_nodes: int = 100000
) -> Dict[Tuple[str, int], Tuple[int, Tuple[int, ...], str]]:
    """As :func:`reachable_storages`, with the first tensor found on each storage:
    ``{storage key: (nbytes, shape, dtype)}``."""
    found: Dict[Tuple[str, int], Tuple[int, Tuple[int, ...], str]] = {}
    seen_nodes = set()
    stack = []

    def add(t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        key = _storage_key(t)
        if key not in found:
            found[key] = (t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype))
        if t.grad is not None and _storage_key(t.grad) not in found:
            g = t.grad
            found[_storage_key(g)] = (g.untyped_storage().nbytes(), tuple(g.shape), str(g.dtype))
        if t.grad_fn is not None:
            stack.append(t.grad_fn)

    for _, t in _attr_tensors(value, "value", depth=1):
        add(t)
    while stack and len(seen_nodes) < max_nodes:
        node = stack.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        for _, held in _node_tensors(node):
            for _, t in _attr_tensors(held, "", depth=1):
                add(t)
        for next_node, _ in getattr(node, "next_functions", ()):
            if next_node is not None:
                stack.append(next_node)
    return found


def model_storage_keys(model: torch.nn.Module) -> set:
    """Storages of the model's parameters, their grads and buffers (not pinned by dispatchers)."""
    keys = set()
    for p in model.parameters():
        keys.add(_storage_key(p))
        if p.grad is not None:
            keys.add(_storage_key(p.grad))
        main_grad = getattr(p, "main_grad", None)
        if isinstance(main_grad, torch.Tensor):
            keys.add(_storage_key(main_grad))
    for b in model.buffers():
        keys.add(_storage_key(b))
    return keys


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    name = ctypes.util.find_library("c")
    lib = ctypes.CDLL(name) if name else None
    if lib is None or not hasattr(lib, "mallinfo2"):
        return None
    lib.mallinfo2.restype = _MallInfo2
    return lib


_LIBC = _libc()

# An exact host counter (bytes of live CPU tensor storage), when the process has one installed;
# see set_host_allocated_bytes. Without one, glibc's malloc statistics stand in.
_HOST_ALLOCATED_BYTES: Optional[Callable[[], int]] = None


def set_host_allocated_bytes(counter: Optional[Callable[[], int]]) -> None:
    """Use ``counter()`` for host allocator accounting (e.g. a counting CPU allocator)."""
    global _HOST_ALLOCATED_BYTES
    _HOST_ALLOCATED_BYTES = counter


def allocated_bytes(device: Optional[torch.device] = None) -> int:
    """Bytes the allocator has handed out: CUDA caching allocator; on host the registered
    counter, or else glibc malloc's in-use bytes."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    if _HOST_ALLOCATED_BYTES is not None:
        return _HOST_ALLOCATED_BYTES()
    if _LIBC is None:
        raise RuntimeError("host allocator accounting needs glibc's mallinfo2")
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def release_delta(
    dispatcher, device: Optional[torch.device] = None, keep: Iterable[str] = PERSISTENT_ATTRS
) -> int:
    """Drop every per-step tensor reference of the dispatcher and its manager; bytes freed.

    Destructive: meant for the end of a measured step. Handles and other tuples holding tensors
    are dropped too; the attributes named in ``keep`` (persistent by design) are not.
    """
    keep = frozenset(keep)
    gc.collect()
    before = allocated_bytes(device)
    for obj in (dispatcher, getattr(dispatcher, "_comm_manager", None)):
        if obj is None:
            continue
        for k, v in list(vars(obj).items()):
            if k in _SKIP_ATTRS or k in keep or isinstance(v, torch.nn.Module):
                continue
            if next(_attr_tensors(v, k, depth=1), None) is not None:
                setattr(obj, k, None)
    gc.collect()
    return before - allocated_bytes(device)


def probe_model(model: torch.nn.Module, release: bool = False) -> List[LayerReport]:
    """Attribution for every MoE layer of ``model``; with ``release`` also the allocator delta
    of dropping each layer's references (layers in order, each measured on its own)."""
    keys = model_storage_keys(model)
    reports = [attribute_layer(n, d, keys) for n, d in find_moe_dispatchers(model)]
    if release:
        device = next((p.device for p in model.parameters()), None)
        for report, (_, d) in zip(reports, find_moe_dispatchers(model)):
            report.release_bytes = release_delta(d, device)
    return reports


def format_report(reports: Iterable[LayerReport], top: int = 8) -> str:
    """Human-readable report: per layer, direct references, pinned bytes by kind, biggest items."""
    lines = []
    for r in reports:
        lines.append(f"{r.name}: {r.dispatcher} / {r.manager}")
        for path, desc in r.direct.items():
            lines.append(f"  refs {path}: {desc}")
        kinds = ", ".join(f"{k} {v} B" for k, v in sorted(r.by_kind().items()))
        lines.append(f"  pinned (not model-owned): {r.pinned_bytes} B [{kinds}]")
        if r.release_bytes is not None:
            lines.append(f"  allocator delta on release: {r.release_bytes} B")
        biggest = sorted((p for p in r.pinned if not p.shared_with_model), key=lambda p: -p.nbytes)[
            :top
        ]
        for p in biggest:
            lines.append(f"    {p.nbytes:>9} B {p.kind:<26} {p.shape} {p.dtype}  {p.path[-110:]}")
    return "\n".join(lines)
