# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What the CPU emulations of the expert-parallel communication kernels share.

The kernel families megatron-core's flex dispatcher calls are emulated one module each
(:mod:`moe_release.runtime.kernels.hybridep_emulation`,
:mod:`moe_release.runtime.kernels.deepep_emulation`,
:mod:`moe_release.runtime.kernels.deepepv2_emulation`,
:mod:`moe_release.runtime.kernels.ncclep_emulation`); this module holds what they have in common:
DeepEP's event objects, where buffers and pinned outputs live, the host synchronizations a kernel
makes (counted under the placement rules), and the collectives over ``torch.distributed`` (gloo
works) that stand in for NVLink/RDMA transfers, staged through host memory where gloo cannot take a
device tensor. Only torch, the standard library and :mod:`moe_release.runtime.cuda.placement` are
imported, so the emulations can be registered before megatron-core is first imported.
"""

import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_release import settings
from moe_release.runtime.cuda import placement


class EventHandle:
    """Stand-in for ``deep_ep_cpp.EventHandle`` (a CUDA event recorded on the current stream):
    the emulated kernels finish before they return, so there is nothing to wait for."""

    def current_stream_wait(self) -> None:
        """Nothing to wait for: the emulated kernels finish before they return."""


class EventOverlap:
    """``deep_ep.utils.EventOverlap``: holds the kernel's event when the call was
    ``async_finish`` (else ``None``); :meth:`current_stream_wait` requires one, as the real
    one asserts (``deep_ep/utils.py:40``)."""

    def __init__(self, event: Optional[EventHandle] = None, extra_tensors=None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (there must be one)."""
        if self.event is None:
            raise AssertionError(
                "EventOverlap.current_stream_wait() without an event: the call was not "
                "async_finish (deep_ep/utils.py:40 asserts `self.event is not None`)."
            )
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


def event(async_finish: bool) -> EventOverlap:
    """What a kernel returns: an event recorded on its stream when ``async_finish``."""
    return EventOverlap(EventHandle() if async_finish else None)


def buffer_device() -> torch.device:
    """Where a communication buffer lives: the current GPU, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pinned(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor, as the kernels allocate with ``pinned_memory(true)``; plain
    host memory where neither CUDA nor the placement rules are there (pinning needs a driver)."""
    pin = torch.cuda.is_available() or placement.active()
    return torch.tensor(list(values), dtype=dtype, device="cpu", pin_memory=pin)


def kernel_host_sync(kind: str) -> None:
    """A synchronization the real kernel makes (``cudaStreamSynchronize``, a CPU wait for the
    GPU): counted under the placement rules, and the host is then ordered after the current
    stream."""
    if placement.active():
        placement.count_sync(kind)
        placement.HOST_STREAMS.host_waits_for(placement.HOST_STREAMS.current)


def count_set(mask: torch.Tensor) -> int:
    """How many entries of a bool tensor are set, read from a shape (the emulation's own
    bookkeeping; the real kernels keep these counts on the device)."""
    return int(torch.nonzero(mask).shape[0])


def cdiv(a: int, b: int) -> int:
    """``(a - 1) / b + 1`` as the kernels compute it (1 for ``a == 0``)."""
    return (max(a, 1) - 1) // b + 1


class BufferTerm(NamedTuple):
    """One allocation of an emulated kernel's buffer, as the emulation reads it from the kernel's
    source: what it is, its bytes, the source lines that size it (``file:lines``, several
    separated by ``, ``), and whether the kernel's ``destroy()`` frees it."""

    name: str
    nbytes: int
    source: str
    released: bool = True


def env_int(name: str, default: int) -> int:
    """An integer environment setting as C's ``atoi`` reads it (leading blanks, a sign, the
    digits that follow; 0 if none), ``default`` when unset: how deep_ep reads its tuning
    variables (``get_env_int``, ``csrc/hybrid_ep/config.cuh:197-200``)."""
    raw = settings.deep_ep_variable(name)
    if raw is None:
        return default
    match = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", raw)
    return int(match.group(1)) if match else 0


class NodeLayout(NamedTuple):
    """Where a group's ranks sit on the emulated nodes (``settings.ranks_per_node``): the
    kernels' own rule for what is "a node" (DeepEP's ``NUM_MAX_NVL_PEERS``, HybridEP's NVLink
    domain, NCCL EP's LSA team) reads this instead of the GPUs of a real node."""

    ranks_per_node: int  # ranks of the group on one node (the NVLink peers)
    nodes: int  # nodes the group spans
    node: int  # this rank's node, in the group's order
    local_rank: int  # this rank's place on its node


def node_layout(group, real_ranks_per_node: int) -> NodeLayout:
    """The group's layout: every rank on one node, capped at ``real_ranks_per_node`` (the
    kernel's own constant, e.g. 8), unless ``MOE_RELEASE_RANKS_PER_NODE`` names a node size;
    ranks fill nodes in the group's order, as a launcher fills real nodes. A group whose size
    is not a multiple of the node size is refused, as the kernels refuse it."""
    size, rank = group_size(group), group_rank(group)
    per_node = settings.ranks_per_node() or real_ranks_per_node
    per_node = min(per_node, size)
    if size % per_node:
        raise ValueError(f"{size} ranks do not fill nodes of {per_node} "
                         f"({settings.RANKS_PER_NODE})")  # fmt: skip
    return NodeLayout(per_node, size // per_node, rank // per_node, rank % per_node)


def group_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def staged_through_host(t: torch.Tensor, group) -> bool:
    """Whether a collective on ``t`` must go through host memory: gloo on a non-CPU tensor.

    The emulation runs on CUDA tensors too (the memory report on a GPU, several ranks sharing
    one device, where NCCL refuses a duplicate GPU). Staging explicitly keeps the result
    independent of which collectives a torch build's gloo implements for CUDA.
    """
    # The storage's device is where the memory really is (the CPU runtime's placement rules
    # report a host tensor that stands in for a device one as ``cuda:0``).
    return t.untyped_storage().device.type != "cpu" and dist.get_backend(group) == "gloo"


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (``.cpu()`` keeps a dense tensor's strides, e.g. a transpose's)."""
    return t.to("cpu", memory_format=torch.contiguous_format)


def collective(t: torch.Tensor, out_rows: int, group, op) -> torch.Tensor:
    """``op(out, src)`` into a new ``[out_rows, *t.shape[1:]]`` tensor on ``t``'s device,
    staged through host memory where :func:`_staged_through_host` says so."""
    staged = staged_through_host(t, group)
    src = host_copy(t) if staged else t.contiguous()
    out = src.new_empty((out_rows,) + tuple(t.shape[1:]))
    op(out, src)
    return out.to(t.device) if staged else out


def all_to_all(rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], group):
    """Uneven all-to-all of the leading dimension; a local copy on a group of one."""
    if len(send_counts) == 1:
        return rows.clone()
    return collective(
        rows,
        sum(recv_counts),
        group,
        lambda out, src: dist.all_to_all_single(
            out, src, list(recv_counts), list(send_counts), group=group
        ),
    )


def all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Gather equally sized per-rank tensors along dim 0 (rank order)."""
    size = group_size(group)
    if size == 1:
        return t.clone()
    return collective(
        t,
        t.shape[0] * size,
        group,
        lambda out, src: dist.all_gather_into_tensor(out, src, group=group),
    )


# Calls so far per (the default store, the group's ranks): a world re-formed (a replaced peer's
# fresh process joining the survivors) has a new store, so its ranks count from the same start.
_SAME_COUNT_CALLS: Dict[Tuple[object, Tuple[int, ...]], int] = {}


def same_count_on_every_rank(n: int, group, what: str) -> None:
    """Raise ``ValueError`` naming every rank's count unless all ranks of ``group`` pass the
    same ``n`` (``what`` says which call needs it and why). Exchanged through the default
    process group's store (host TCP, no tensor), so no allocator count or dispatch mode sees
    it; every rank of the group must call it the same number of times, as they do a
    collective."""
    if group_size(group) == 1:
        return
    ranks = (
        tuple(dist.get_process_group_ranks(group))
        if group is not None
        else tuple(range(dist.get_world_size()))
    )
    store = dist.distributed_c10d._get_default_store()
    seq = _SAME_COUNT_CALLS.get((store, ranks), 0)
    _SAME_COUNT_CALLS[store, ranks] = seq + 1
    prefix = f"moe_release/same_count/{'-'.join(map(str, ranks))}"
    me = dist.get_rank()
    store.set(f"{prefix}/{seq}/{me}", str(n))
    counts = [int(store.get(f"{prefix}/{seq}/{r}")) for r in ranks]
    if seq >= 2:  # every rank has read it: each set its key of seq - 1 after reading seq - 2
        store.delete_key(f"{prefix}/{seq - 2}/{me}")
    if len(set(counts)) > 1:
        raise ValueError(
            f"{what}: the ranks of the group pass different counts: "
            + ", ".join(f"rank {r}: {c}" for r, c in zip(ranks, counts))
        )


def sum_rows(rows: torch.Tensor, index: torch.Tensor, num_out: int, out_dtype) -> torch.Tensor:
    """out[index[i]] += rows[i] in row order, accumulated in float32."""
    acc = torch.zeros((num_out,) + tuple(rows.shape[1:]), dtype=torch.float32, device=rows.device)
    if rows.shape[0] > 0:
        acc.index_add_(0, index, rows.float())
    return acc.to(out_dtype)


def host_all_gather_ints(values: List[int], group) -> List[List[int]]:
    """Every rank's ``values`` (rank order), exchanged as host metadata: in host memory over
    gloo, so reading them is no device sync (on another backend: on the device)."""
    size = group_size(group)
    if size == 1:
        return [list(values)]
    gloo = dist.get_backend(group) == "gloo"
    dev = torch.device("cpu") if gloo else buffer_device()
    mine = torch.tensor([list(values)], dtype=torch.long, device=dev)
    out = torch.empty((size, len(values)), dtype=torch.long, device=dev)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


def dense_rows(to_rank: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``int32 [N, R]``: the row token ``n`` takes in rank ``d``'s receive buffer (sources
    ascending, then token order: ``offsets[d]`` rows come from lower ranks), -1 if not sent."""
    rows = torch.cumsum(to_rank.to(torch.int32), 0) - 1 + offsets
    return torch.where(to_rank, rows, torch.full_like(rows, -1)).to(torch.int32)


def sent_token_ids(rows_map: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """The tokens sent to each rank (token order, ranks ascending) and how many go to each,
    read from a ``[N, R]`` map of receive-buffer rows (-1: not sent)."""
    ids = [torch.nonzero(rows_map[:, d] >= 0).flatten() for d in range(rows_map.shape[1])]
    return torch.cat(ids), [int(i.shape[0]) for i in ids]
