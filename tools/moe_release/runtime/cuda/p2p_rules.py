# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL's point-to-point matching rule for megatron's pipeline p2p, checked on gloo ranks.

NCCL matches the sends and receives between two ranks of one communicator in the order they are
posted ("point-to-point calls within a group targeting the *same* peer ... are executed in
order", NCCL user guide, Point-to-point communication); gloo does the same per (group, peer,
tag). Neither looks at what a message is. With two pipeline stages and virtual stages, the
previous and the next stage are the same rank, so a batch that sends an activation forward
(``send_next``) and a gradient backward (``send_prev``) to that rank is matched by posting
order alone: megatron's ``_batched_p2p_ops`` posts ``send_prev`` first and the peer's
``recv_prev`` (an activation) first, so activation and gradient are swapped, silently on a GPU
(they have one shape). Megatron-LM's training arguments refuse that configuration for this
reason ("pipeline-model-parallel size should be greater than 2 to avoid having multiple p2p
sends and recvs between same 2 ranks per communication batch"); megatron-core does not.

:func:`install` makes a rank refuse it instead of computing with swapped tensors: around
megatron-core's ``_batched_p2p_ops`` and ``_p2p_ops``, every send also posts a small header
(what the tensor is, its size) on a gloo tag of its own, in the same order on the same group,
so the i-th header between two ranks describes the i-th tensor; a receive checks, when it is
waited on, that it got what it posted for (``recv_prev``: the previous stage's ``send_next``;
``recv_next``: the next stage's ``send_prev``) and raises :class:`P2PMatchError` otherwise.
Megatron's code is not changed; the tensors it sends and receives are the same.
"""

import threading
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

# What each receive must be matched with.
EXPECTED_SENDER = {"recv_prev": "send_next", "recv_next": "send_prev"}
ROLE_CODES = {"send_next": 1, "send_prev": 2}
ROLES = {code: role for role, code in ROLE_CODES.items()}
WHAT = {"send_next": "an activation", "send_prev": "a gradient"}
# The headers' own gloo tag: a channel per (group, peer) beside megatron's tag 0.
HEADER_TAG = 0x6D72

P2P_FUNCTIONS = ("_batched_p2p_ops", "_p2p_ops")
MODULE = "megatron.core.pipeline_parallel.p2p_communication"


class P2PMatchError(RuntimeError):
    """A pipeline receive was matched with a send of another kind (what NCCL would deliver)."""


class _Checked:
    """A p2p request whose ``wait`` also waits for its header and checks it."""

    def __init__(self, work, header_work, header, check: Optional[Callable[[], None]]):
        self._work = work
        self._header = header  # alive until the header's send or receive is waited on
        self._header_work = header_work
        self._check = check

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        self._header_work.wait()
        self._header = None
        if self._check is not None:
            check, self._check = self._check, None
            check()
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed() and self._header_work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_ACTIVE = threading.local()
_REAL: Dict[str, Callable] = {}


def _peer(kwargs: Dict[str, Any], key: str, group) -> int:
    if kwargs.get(key) is not None:
        return kwargs[key]
    return dist.get_global_rank(group, kwargs[f"group_{key}"])


def _isend(tensor: torch.Tensor, dst: Optional[int] = None, group=None, tag: int = 0, **kw):
    work = _REAL["isend"](tensor, dst, group, tag, **kw)
    role = _ACTIVE.roles.get(id(tensor))
    if role not in ROLE_CODES:
        return work
    header = torch.tensor([ROLE_CODES[role], tensor.numel(), dist.get_rank()], dtype=torch.int64)
    peer = _peer(dict(kw, dst=dst), "dst", group)
    header_work = _REAL["isend"](header.cpu(), peer, group, HEADER_TAG)
    return _Checked(work, header_work, header, None)


def _irecv(tensor: torch.Tensor, src: Optional[int] = None, group=None, tag: int = 0, **kw):
    work = _REAL["irecv"](tensor, src, group, tag, **kw)
    role = _ACTIVE.roles.get(id(tensor))
    if role not in EXPECTED_SENDER:
        return work
    header = torch.zeros(3, dtype=torch.int64).cpu()
    peer = _peer(dict(kw, src=src), "src", group)
    header_work = _REAL["irecv"](header, peer, group, HEADER_TAG)
    me, numel = dist.get_rank(), tensor.numel()

    def check() -> None:
        code, sent_numel, sender = (int(v) for v in header.tolist())
        sent = ROLES.get(code, f"role code {code}")
        expected = EXPECTED_SENDER[role]
        if sent != expected or sent_numel != numel:
            raise P2PMatchError(
                f"pipeline p2p: rank {me}'s {role} (waiting for {WHAT[expected]}, the "
                f"{expected} of rank {peer}, {numel} elements) was matched with rank {sender}'s "
                f"{sent} ({WHAT.get(sent, 'unknown')}, {sent_numel} elements). Sends and "
                "receives between two ranks of one group are matched in posting order, on "
                "NCCL as on gloo, so a GPU would compute with the wrong tensor here. With "
                "pipeline-model-parallel size 2 and virtual stages, use overlap_p2p_comm=True "
                "and batch_p2p_comm=False (Megatron-LM's training arguments require it)."
            )

    return _Checked(work, header_work, header, check)


def _batch_isend_irecv(ops: List[dist.P2POp]) -> List[Any]:
    """gloo's batch_isend_irecv (no coalescing: each op posted in turn), through the checked
    isend/irecv (a P2POp holds torch's own isend or irecv: it refuses any other)."""
    works = []
    for op in ops:
        if op.op is _REAL["isend"]:
            works.append(_isend(op.tensor, op.peer, op.group, op.tag))
        else:
            works.append(_irecv(op.tensor, op.peer, op.group, op.tag))
    return works


def _checked(original: Callable) -> Callable:
    # The batched path builds P2POps, which accept only torch's isend/irecv: it gets the
    # checked batch_isend_irecv; the unbatched path calls isend/irecv itself.
    batched = original.__name__ == "_batched_p2p_ops"
    names = ("batch_isend_irecv",) if batched else ("isend", "irecv")
    checked = {"batch_isend_irecv": _batch_isend_irecv, "isend": _isend, "irecv": _irecv}

    def p2p_ops(**kwargs):
        roles = {
            id(kwargs[f"tensor_{role}"]): role
            for role in ("send_prev", "recv_prev", "send_next", "recv_next")
            if kwargs.get(f"tensor_{role}") is not None
        }
        saved = {name: getattr(dist, name) for name in names}
        _ACTIVE.roles = roles
        for name in names:
            setattr(dist, name, checked[name])
        try:
            return original(**kwargs)
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            _ACTIVE.roles = {}

    p2p_ops._moe_release_p2p_rules = original
    return p2p_ops


def install() -> List[str]:
    """Check every pipeline p2p of megatron-core's ``p2p_communication`` (idempotent).

    Only for gloo: the header channel is a gloo tag. Returns the functions wrapped."""
    import importlib

    module = importlib.import_module(MODULE)
    _REAL.setdefault("isend", dist.isend)
    _REAL.setdefault("irecv", dist.irecv)
    changed = []
    for name in P2P_FUNCTIONS:
        original = getattr(module, name)
        if not hasattr(original, "_moe_release_p2p_rules"):
            setattr(module, name, _checked(original))
            changed.append(name)
    return changed


def uninstall() -> None:
    """Put megatron-core's p2p functions back."""
    import sys

    module = sys.modules.get(MODULE)
    for name in P2P_FUNCTIONS if module is not None else ():
        original = getattr(getattr(module, name), "_moe_release_p2p_rules", None)
        if original is not None:
            setattr(module, name, original)
