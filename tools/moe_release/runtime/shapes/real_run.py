# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The real twin of the production-shape mode: the same counting on real tensors, to compare
the two traces at a size both can run."""

import contextlib
import functools
from typing import Any, Dict, Iterator, List

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as _no_dispatch_modes
from torch.utils._pytree import tree_map

from moe_release.runtime.shapes.live_bytes import LiveBytes, _tensors
from moe_release.runtime.shapes.routing import Routing

# ---------------------------------------------------------------------------------------------
# The real twin


class _CountingMode(TorchDispatchMode):
    """A dispatch mode that counts live bytes with ``counter`` and, while entered, holds the
    context managers :meth:`_contexts` gives (the counter's resize watch; a subclass adds)."""

    def __init__(self, routing: Routing, counter: LiveBytes) -> None:
        super().__init__()
        self.routing = routing
        self.counter = counter
        self._stack = contextlib.ExitStack()

    def _contexts(self) -> List[Any]:
        return [self.counter.watching_resizes(), _object_collectives_unseen()]

    def __enter__(self):
        self._stack.__enter__()
        for context in self._contexts():
            self._stack.enter_context(context)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.__exit__(*exc)


# torch.distributed's collectives of picklable objects: host data (a buffer's handles, a token)
# pickled into byte tensors, which neither run counts and a fake tensor cannot hold.
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list")  # fmt: skip


@contextlib.contextmanager
def _object_collectives_unseen() -> Iterator[None]:
    """While entered, the object collectives run with no dispatch mode (both runs alike)."""
    modules = (dist, dist.distributed_c10d)
    originals = {(m, n): getattr(m, n) for m in modules for n in OBJECT_COLLECTIVES}

    def unseen(original):
        @functools.wraps(original)
        def call(*args, **kwargs):
            with _no_dispatch_modes():
                return original(*args, **kwargs)

        return call

    for (module, name), original in originals.items():
        setattr(module, name, unseen(original))
    try:
        yield
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


class RealRun(_CountingMode):
    """Real tensors with the policy's routing and the same counter: the reference run. With
    ``record`` and no policy, the router's own top-k runs and its indices are recorded by
    (rank, layer) (:class:`RecordedRouting`)."""

    def __init__(self, routing: Routing, counter: LiveBytes, record: bool = False) -> None:
        super().__init__(routing, counter)
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.routing.applies(func, args, kwargs):
            if self.record:
                out = func(*args, **kwargs)
                key = (self.routing.rank, self.routing.layer)
                self.routing.recorded.setdefault(key, out[1].detach().clone())
            else:
                idx = self.routing.indices(args[0].shape[0])
                out = (args[0].gather(1, idx), idx)
        elif func.namespace == "c10d" and func._schema.name.split("::")[-1] in _C10D:
            out = _on_copies(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self.counter.note(func, args, kwargs, out)
        return out


def _on_copies(func, args, kwargs):
    """A collective of the real run on copies of its tensors, waited for, the results copied
    back: gloo's threads drop their references to a collective's tensors some time after it
    completes, which would move when a storage dies from one run to the next."""
    out_at, in_at = _C10D[func._schema.name.split("::")[-1]]
    copies: Dict[int, torch.Tensor] = {}

    def copy(a):
        if isinstance(a, torch.Tensor):
            copies[id(a)] = c = a.clone()
            return c
        return a

    result = func(*tree_map(copy, args), **tree_map(copy, kwargs))
    work = result if len(func._schema.returns) == 1 else result[1]
    torch._C._distributed_c10d.Work.unbox(work).wait()
    for t in _tensors(args[out_at]):
        t.copy_(copies[id(t)])
    done = _completed_work()
    return done if len(func._schema.returns) == 1 else (args[out_at], done)


# Collectives (c10d ops, as the process group dispatches them): the real twin runs them; the
# production-shape mode (``_c10d``) runs them on values or completes them without data.
# op: (index of the output argument, index of the input argument; None: in place)
_C10D = {
    "_allgather_base_": (0, 1),
    "allgather_": (0, 1),
    "allgather_into_tensor_coalesced_": (0, 1),
    "alltoall_base_": (0, 1),
    "alltoall_": (0, 1),
    "reduce_scatter_": (0, 1),
    "_reduce_scatter_base_": (0, 1),
    "reduce_scatter_tensor_coalesced_": (0, 1),
    "allreduce_": (0, None),
    "broadcast_": (0, None),
}


def _completed_work():
    future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()
