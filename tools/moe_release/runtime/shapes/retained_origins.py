# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What keeps each byte alive after a step: the retained bytes split into named terms.

:func:`origins` takes the storages a :class:`~moe_release.runtime.shapes.production_shape.LiveBytes`
counter still sees after backward (those not alive before the step) and finds, for each, the first
holder a breadth-first walk reaches it by, in this order of roots:

- ``communication buffer``: the flex dispatcher's kernel buffers (``fused_a2a``'s globals);
- ``workspace``: megatron's ``GlobalMemoryBuffer`` (``parallel_state._GLOBAL_MEMORY_BUFFER``),
  a persistent buffer shared by every layer and reused on every call;
- the measured layers: ``attribute`` (a module's, dispatcher's or comm manager's field),
  ``module buffer``, ``numpy array`` (an array's memory: on a real tensor the array's base, in
  the production-shape mode the fake tensor it stands for), and through the autograd graph of
  any tensor reached: ``autograd ctx`` (a custom Function's ``ctx`` attribute, which outlives
  backward), ``autograd saved`` (a saved tensor not yet freed), ``graph leaf`` (a leaf an
  ``AccumulateGrad`` node keeps, and its ``.grad``);
- ``module global``: any other global of a megatron-core or emulation module;
- ``unreached``: held by a Python object none of these reach (named by its type), or only from
  C++ (named by the op that made it).

A term is (kind, holder, via, root, made by): the holder is the last object on the path
(``Class.attr``, ``Node.attr``), ``via`` the last attribute before the path entered the autograd
graph, ``root`` where the walk started (``layer1``: the first measured layer), ``made by`` the op
that returned the storage first. The terms' bytes sum to the retained bytes
(``before_changed`` counts storages alive before the step that changed size since).

:func:`measure_origins` is :func:`moe_release.runtime.shapes.production_shape_run.measure` with the
split, and with the layers' input made from the previous layer (``input_from="previous layer"``: the
data plus a parameter, so the retained graph ends at a parameter as it does in a model) or, as
``measure`` makes it, a leaf that requires grad (``"leaf"``: a graph reaching it keeps it and its
``.grad``, 2 x T x H elements a model's MoE layer does not have without recompute).
"""

import collections
import functools
import gc
import sys
import types
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from moe_release import settings

# Types whose instances' attributes the walk follows (beyond containers, modules and tensors).
_WALKED_MODULES = ("megatron", "moe_release.runtime", "deep_ep", "hybrid_ep", "transformer_engine")
_SKIPPED_MODULES = ("moe_release.runtime.shapes.production_shape", __name__)
_INPUTS = ("previous layer", "leaf")


def _key(t: torch.Tensor) -> Optional[int]:
    try:
        return id(t.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return None


def _walked_type(obj: Any) -> bool:
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith(_WALKED_MODULES) and not module.startswith(_SKIPPED_MODULES)


def _node_name(node: Any) -> str:
    try:
        return node.name().rsplit("::", 1)[-1]
    except (AttributeError, RuntimeError):
        return type(node).__name__


def _children(obj: Any, kind: str, holder: str) -> Iterator[Tuple[Any, str, str]]:
    """``(child, kind, holder)`` for each object ``obj`` references that the walk follows."""
    if isinstance(obj, torch.Tensor):
        if obj.is_leaf and obj.grad is not None:
            yield obj.grad, kind, f"{holder}.grad"
        if obj.grad_fn is not None:
            yield obj.grad_fn, kind, holder
        for name, value in getattr(obj, "__dict__", {}).items():
            yield value, kind, f"{holder}.{name}"
        return
    if hasattr(obj, "next_functions") and hasattr(obj, "register_hook"):  # an autograd node
        name = _node_name(obj)
        variable = getattr(obj, "variable", None) if name == "AccumulateGrad" else None
        if isinstance(variable, torch.Tensor):
            yield variable, "graph leaf", "AccumulateGrad.variable"
        for attr in dir(obj):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(obj, attr)
                except RuntimeError:  # freed by the backward
                    continue
                yield value, "autograd saved", f"{name}.{attr[len('_saved_') :]}"
        if isinstance(obj, torch.autograd.function.BackwardCFunction):
            try:
                saved = obj.saved_tensors
            except RuntimeError:
                saved = ()
            for i, value in enumerate(saved):
                yield value, "autograd saved", f"{name}.saved_tensors[{i}]"
            for attr, value in vars(obj).items():
                yield value, "autograd ctx", f"{name}.{attr}"
        for fn, _ in obj.next_functions:
            if fn is not None:
                yield fn, kind, holder
        return
    if isinstance(obj, torch.nn.Module):
        cls = type(obj).__name__
        for attr, value in vars(obj).items():
            if attr == "_buffers":
                for name, buf in value.items():
                    yield buf, "module buffer", f"{cls}.{name}"
            elif attr == "_parameters":
                for name, param in value.items():
                    yield param, "parameter", f"{cls}.{name}"
            elif attr == "_modules":
                for name, module in value.items():
                    yield module, kind, f"{cls}.{name}"
            else:
                yield value, kind, f"{cls}.{attr}"
        return
    if isinstance(obj, dict):
        for k, value in list(obj.items()):
            yield value, kind, f"{holder}[{k!r}]"
        return
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        for i, value in enumerate(list(obj)):
            yield value, kind, f"{holder}[{i}]"
        return
    if type(obj).__module__ == "numpy" and hasattr(obj, "__array_interface__"):
        base = getattr(obj, "base", None)
        if base is not None:
            yield base, "numpy array", holder
        return
    if type(obj).__name__ == "_ArrayHolder":  # the production-shape mode's numpy base
        yield obj.tensor, "numpy array", holder
        return
    if isinstance(obj, functools.partial):
        yield (obj.args, obj.keywords), kind, holder
        return
    if isinstance(obj, types.FunctionType):
        for cell in obj.__closure__ or ():
            try:
                yield cell.cell_contents, kind, f"{holder}.<closure>"
            except ValueError:  # an empty cell
                continue
        return
    if _walked_type(obj) or isinstance(obj, types.SimpleNamespace):
        cls = type(obj).__name__
        for attr, value in getattr(obj, "__dict__", {}).items():
            yield value, kind, f"{cls}.{attr}"


def _walk(roots: Iterable[Tuple[Any, str, str]], seen: Dict[int, Any]):
    """Breadth first from ``roots`` (``(object, kind, holder)``): ``(tensor, kind, holder,
    via, root)`` for each tensor reached, once. ``via``: the holder the path left the roots'
    objects by (the last holder that is not an autograd one); ``root``: the root's holder."""
    queue = collections.deque((obj, kind, holder, holder, holder) for obj, kind, holder in roots)
    while queue:
        obj, kind, holder, via, root = queue.popleft()
        if obj is None or isinstance(obj, (str, bytes, int, float, bool, type, types.ModuleType)):
            continue
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj  # kept alive while walking: an id is not reused
        if isinstance(obj, torch.Tensor):
            yield obj, kind, holder, via, root
        for child, child_kind, child_holder in _children(obj, kind, holder):
            graph = child_kind.startswith(("autograd", "graph"))
            queue.append((child, child_kind, child_holder, via if graph else child_holder, root))


def _global_roots(prefixes: Sequence[str]) -> List[Tuple[Any, str, str]]:
    roots = []
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefixes) or name.startswith(_SKIPPED_MODULES) or module is None:
            continue
        short = name.rsplit(".", 1)[-1]
        for attr, value in list(vars(module).items()):
            if isinstance(value, (type, types.ModuleType, types.FunctionType)) or callable(value):
                continue
            kind = "workspace" if type(value).__name__ == "GlobalMemoryBuffer" else "module global"
            roots.append((value, kind, f"{short}.{attr}"))
    roots.sort(key=lambda r: r[1] != "workspace")  # the workspace claims its storages first
    return roots


def _comm_buffer_roots() -> List[Tuple[Any, str, str]]:
    from moe_release.runtime.cuda.compat import held_comm_buffers

    fused_a2a = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused_a2a is None:
        return []
    return [
        (buffer, "communication buffer", type(buffer).__name__)
        for buffer in held_comm_buffers(fused_a2a)
    ]


def _gc_holders(unclaimed: Dict[int, Any]) -> Dict[int, str]:
    """For storages the walk did not reach: the types of the Python objects that hold a
    tensor of them (gc's referrers), where any does."""
    found: Dict[int, str] = {}
    objects = gc.get_objects()
    here = sys._getframe()
    for obj in objects:
        with warnings.catch_warnings():  # isinstance of deprecated aliases (dist.reduce_op)
            warnings.simplefilter("ignore")
            if not isinstance(obj, torch.Tensor):
                continue
        key = _key(obj)
        if key not in unclaimed or key in found:
            continue
        names = sorted(
            {type(r).__name__ for r in gc.get_referrers(obj) if r is not objects and r is not here}
        )
        if names:
            found[key] = "held by " + ", ".join(names)
    del objects
    return found


def origins(
    counter: Any,
    before: Dict[int, int],
    layers: Sequence[torch.nn.Module],
    extra_roots: Sequence[Tuple[Any, str, str]] = (),
) -> Dict[str, Any]:
    """The storages alive now that were not alive before the step (``before``: storage key to
    bytes, from ``counter.keyed()`` then), split into terms by their first holder (see the
    module docstring). Returns ``total`` (the retained bytes), ``terms`` (a list of dicts:
    kind, holder, via, root, made_by, made_at, bytes, storages; by root, largest first) and
    ``before_changed`` (bytes by which the storages alive before changed)."""
    gc.collect()
    live = counter.keyed()
    retained = {k: s for k, s in live.items() if k not in before}
    before_changed = sum(s.nbytes() for k, s in live.items() if k in before) - sum(
        n for k, n in before.items()
    )
    claims: Dict[int, Tuple[str, str, str, str]] = {}
    seen: Dict[int, Any] = {}
    groups = [
        _comm_buffer_roots(),
        [r for r in _global_roots(("megatron.",)) if r[1] == "workspace"],
        [(layer, "attribute", f"layer{i + 1}") for i, layer in enumerate(layers)],
        list(extra_roots),
        _global_roots(("megatron.", "moe_release.runtime.", "deep_ep")),
    ]
    for group in groups:
        for tensor, kind, holder, via, root in _walk(group, seen):
            key = _key(tensor)
            if key in retained and key not in claims:
                claims[key] = (kind, holder, via, root)
    seen.clear()
    unclaimed = {k: s for k, s in retained.items() if k not in claims}
    if unclaimed:
        held = _gc_holders(unclaimed)
        for key in unclaimed:
            claims[key] = ("unreached", held.get(key, "outside Python"), "", "")
    made_at = counter.made_at or {}
    terms: Dict[Tuple[str, ...], Dict[str, Any]] = {}
    for key, s in retained.items():
        kind, holder, via, root = claims[key]
        made_by = counter.made_by.get(key, "?")
        at = made_at.get(key, "")
        term = terms.setdefault(
            (kind, holder, via, root, made_by, at),
            dict(kind=kind, holder=holder, via=via, root=root, made_by=made_by, made_at=at,
                 bytes=0, storages=0),
        )  # fmt: skip
        term["bytes"] += s.nbytes()
        term["storages"] += 1
    ordered = sorted(terms.values(), key=lambda t: (t["root"], -t["bytes"], t["kind"], t["holder"]))
    return {
        "total": sum(t["bytes"] for t in ordered) + before_changed,
        "terms": ordered,
        "before_changed": before_changed,
    }


def format_terms(terms: Sequence[Dict[str, Any]], width: int = 100) -> str:
    """One line per term: bytes, kind, holder, via, made by."""
    lines = []
    for t in terms:
        via = f" via {t['via']}" if t["via"] and t["via"] != t["holder"] else ""
        at = f" at {t['made_at']}" if t["made_at"] else ""
        line = (
            f"{t['bytes']:>15,}  {t['root']:<8} {t['kind']}: {t['holder']}{via} "
            f"({t['made_by']}{at})"
        )
        lines.append(line if len(line) <= width or width <= 0 else line[: width - 1] + "…")
    return "\n".join(lines)


def measure_origins(
    mode: str,
    dispatcher: str,
    backend: Optional[str],
    ep: int,
    tokens: Union[int, Sequence[int]],
    hidden: int = 16,
    experts: int = 4,
    topk: int = 2,
    ffn: int = 32,
    layers: int = 2,
    recompute: bool = False,
    dtype: str = "float32",
    routing: Optional[Dict[str, Any]] = None,
    input_from: str = "previous layer",
    sites: bool = False,
) -> Dict[str, Any]:
    """One forward and backward of ``layers`` MoE layers on this rank, real or in the
    production-shape mode, as :func:`moe_release.runtime.shapes.production_shape_run.measure` runs
    them (``recompute``: ``recompute_granularity="selective"``, ``recompute_modules=["moe"]``), and
    the bytes retained after it split by :func:`origins` (``sites``: with each storage's line).
    Returns what ``measure`` returns (without the trace) and ``origins``."""
    import time

    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_release.runtime.cuda import placement
    from moe_release.runtime.megatron.moe_harness import (
        init_megatron,
        local_moe_submodules,
        on_device,
    )
    from moe_release.runtime.shapes.production_shape import (
        LiveBytes,
        ProductionShapeMode,
        RealRun,
        Routing,
        bytes_of,
        routing_policy,
    )
    from moe_release.runtime.shapes.production_shape_run import (
        MODES,
        _comm_buffer_tensors,
        layer_config,
    )

    if mode not in MODES or input_from not in _INPUTS:
        raise ValueError(f"mode must be one of {MODES}, input_from one of {_INPUTS}")
    if placement.active():
        raise RuntimeError("measure_origins runs without the placement rules (run_origins)")
    start = time.monotonic()
    init_megatron(ep=ep, seed=1234)
    torch.manual_seed(4321)
    rank = dist.get_rank()
    n = tokens if isinstance(tokens, int) else tokens[rank]
    config = layer_config(dispatcher, backend, ep, hidden, experts, topk, ffn, layers, recompute,
                          dtype)  # fmt: skip
    if recompute:
        assert config.recompute_granularity == "selective" and "moe" in config.recompute_modules
    route = Routing(routing_policy(routing or {"kind": "balanced"}), experts, topk, rank)
    counter = LiveBytes()
    counter.made_at = {} if sites else None
    ctx = RealRun(route, counter) if mode == "real" else ProductionShapeMode(route, counter)
    with ctx:
        stack = []
        for i in range(layers):
            layer = on_device(MoELayer(config, local_moe_submodules(experts)))
            layer.set_layer_number(i + 1)
            layer.train()
            stack.append(layer)
        route.attach([layer.router for layer in stack])
        # The previous layer's output: the data plus a parameter, so that the graph of the
        # layers' input ends at a parameter (AccumulateGrad keeps it, not an activation).
        previous = torch.zeros(hidden, dtype=config.params_dtype).requires_grad_()
        params = counter.live()
        counter.recording = True
        baseline = counter.live()
        before = {k: s.nbytes() for k, s in counter.keyed().items()}
        x = torch.randn(n, 1, hidden, dtype=config.params_dtype)
        if input_from == "leaf":
            x.requires_grad_()
        else:
            x = x + previous
        h = x
        for layer in stack:
            h, _ = layer(h)
        loss = (h.float() ** 2).sum()
        loss.backward()
        counter.recording = False
        del x, h, loss
        previous.grad = None
        for layer in stack:
            layer.zero_grad(set_to_none=True)
        gc.collect()
        live = counter.live()
        buffers = bytes_of(_comm_buffer_tensors())
        split = origins(counter, before, stack)
    return dict(
        rank=rank,
        tokens=n,
        params=params,
        retained=live - baseline,
        buffers=buffers,
        state=live - baseline - buffers,
        peak=max(counter.peak - baseline, 0),
        origins=split,
        seconds=time.monotonic() - start,
    )


def run_origins(tree: str, world_size: int, timeout: float = 600.0, **kwargs):
    """:func:`measure_origins` on ``world_size`` gloo ranks of ``tree`` (parent side), placement
    rules off; returns each rank's result."""
    from moe_release.runtime.ranks.launcher import run_distributed

    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        return run_distributed(f"{__name__}:measure_origins", world_size, tree, kwargs, timeout)
