# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of the DeepEP / HybridEP kernels that megatron-core's flex dispatcher calls.

The emulation implements, over plain ``torch.distributed`` collectives (gloo works), the
documented semantics of the two ``deep_ep`` Python surfaces that
``megatron/core/transformer/moe/fused_a2a.py`` binds at import time:

* ``HybridEPBuffer.dispatch_with_permute`` / ``combine_with_unpermute`` (the ``hybridep`` flex
  backend): tokens are gathered on the ranks that own their experts, grouped by local expert
  (source rank, then token order, inside each expert), each expert padded with zero rows to
  ``pad_multiple``; combine sums the rows of every copy of a token without probability weighting
  and scatters probabilities back to ``[num_tokens, num_experts]``.
* ``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine`` (the ``deepep`` flex backend,
  intranode "normal" mode): a token is sent once to each rank owning one of its top-k experts;
  received top-k indices are made local (``-1`` and weight ``0`` for experts on other ranks);
  combine sums the copies of each token (and the top-k weights) on the source rank.

Only torch, the standard library and :mod:`cpu_runtime.placement` (torch only) are imported,
so the module can be registered as ``deep_ep`` before megatron-core is first imported. It never
activates by itself: call :func:`install` explicitly (tests, the memory report). Reductions
accumulate in float32 and run in a fixed order (local experts ascending, then ranks ascending),
so results are deterministic; tensors of any floating dtype are accepted, although the real
kernels move 16-bit (HybridEP) or bf16/fp8 (DeepEP) payloads only.

**Outputs as the real kernels return them.** Every output has the real kernel's device, dtype
and shape in every mode megatron-core uses (the table below). "device" is the device of the
inputs (a GPU on a GPU run; on a CPU rank under the placement rules of
:mod:`cpu_runtime.placement`, a host tensor placed ``device``); "pinned" is page-locked host
memory (``pin_memory=True`` where CUDA or the placement rules are there, plain host memory
otherwise: pinning needs a driver). Collectives over a gloo group stage device tensors through
host memory. The contents of the handle fields that only the kernels read (HybridEP's maps and
chunk layout, DeepEP's prefix matrices and ``send_head``) are the emulation's own encoding of the
same routing, in the real fields' shapes and dtypes; what the emulation needs on the host (its
collectives' split sizes) it keeps as Python ints in the HybridEP config object (item 9, an
opaque pybind object in the real handle) and on the DeepEP handle (a ``tuple`` subclass), so
handles hold no tensor bytes the real ones do not.

Source: DeepEP's ``hybrid-ep`` branch at **94a9f8f** (``94a9f8f6b146c07d97ec58f67cd6d303296d6098``,
2026-07-10), whose build provides both ``HybridEPBuffer`` and the normal-mode ``Buffer``.
megatron-core 0.19.2's CI pins DeepEP **de0dd11** (``de0dd1185142c727b9c118aeb4cc4702e34deeba``,
``docker/Dockerfile.ci.dev:85`` of ``core_r0.19.0``), which is newer than any commit in our
mirror of DeepEP and so could not be read; 94a9f8f is the newest ``hybrid-ep`` commit there, a
descendant of the previous dev pin 17cfb81 with no tensor allocation changed between the two,
and ``main`` (rewritten to DeepEP v2) has no ``HybridEPBuffer``. Where the LTS image's older pin
34152ae differs: its unfused handle is a 9-tuple, with ``row_id_map`` where 94a9f8f has items
5-7 (34152ae ``hybrid_ep_buffer.py:445-455``; the 11-tuple only on its fused path), the overflow
flag last as well. megatron-core (0.19.2 and the 0.18.2 backport base) indexes only
``handle[-1]``, the overflow flag; 0.17.1 and 0.16.1 index no handle item.

Sizes: N = ``hidden.shape[0]`` (tokens per rank), H = hidden size, E_l = local experts, R = ranks
(per NVLink domain), M = nodes (1: the emulation is intranode), P = permuted rows (blocking: the
sum of ``tokens_per_expert``; non-blocking, drop-and-pad and replay: the ``num_permuted_tokens``
passed), T = tokens per rank and K = top-k (DeepEP), Nr = received tokens, C = channels
(``num_sms // 2``), E = all experts. ``cdiv`` rounds up, ``ceil16(n)`` is ``16 * cdiv(n, 16)``.
Modes (``all``: every mode of that call megatron-core uses): HybridEP ``blocking`` is
``num_permuted_tokens=None, non_blocking=False`` (megatron's dropless path); ``non-blocking`` a
``num_permuted_tokens`` budget with ``non_blocking=True`` (``moe_expert_rank_capacity_factor``,
and drop-and-pad with its capacity budget); each also with ``fuse_permute_dispatch=True`` (the
same preallocations, ``hybrid_ep.cu:312``); megatron's forward dispatch always passes probs
(``no probs``: the kernel called without). Combine: ``probs`` is the dispatch's backward,
``no probs`` the forward combine. DeepEP ``async`` is megatron's ``async_finish=True,
allocate_on_comm_stream=True`` with a ``previous_event``, ``sync`` leaves them off (device,
dtype and shape are the same in both); combine ``weights`` is ``FusedDispatch.backward``,
``no weights`` the forward combine.
Sources are cited by file name: ``hybrid_ep.cu``, ``executor.cu`` and ``executor.cuh`` are
under ``csrc/hybrid_ep/`` (the last two in ``executor/``), ``deep_ep.cpp`` under ``csrc/``,
``hybrid_ep_buffer.py``, ``buffer.py`` and ``utils.py`` under ``deep_ep/``; ``h[i]`` is item
``i`` of the returned handle.

Kernel outputs, by call (the tests parse these tables, one test per row and mode):

[hybridep dispatch] ``HybridEPBuffer.dispatch_with_permute`` without a handle

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| dispatched_token | all | device | x.dtype | [P, H] | hybrid_ep.cu:313-314 |
| dispatched_probs | all | device | float32 | [P] | hybrid_ep.cu:315-316 |
| dispatched_probs | no probs | - | None | - | hybrid_ep.cu:315 |
| dispatched_scaling_factor | all | - | None | - | hybrid_ep.cu:318-320 |
| tokens_per_expert | blocking | pinned | int64 | [E_l] | executor.cu:155-158 |
| tokens_per_expert | non-blocking | device | int64 | [E_l] | executor.cu:151-154 |
| handle | all | - | tuple | [11] | hybrid_ep_buffer.py:419-431 |
| h[0] sparse_to_dense_map | all | device | int32 | [N*M, R] | executor.cu:93-96 |
| h[1] rdma_to_attn_map | all | device | bool | [ceil16(N), M] | executor.cu:85-99 |
| h[2] attn_to_rdma_map | all | device | bool | [N, M-1] | executor.cu:100-102 |
| h[3] num_dispatched_tokens_tensor | blocking | pinned | int32 | [1] | executor.cu:106-108 |
| h[3] num_dispatched_tokens_tensor | non-blocking | device | int32 | [1] | executor.cu:103-105 |
| h[4] local_expert_routing_map | all | device | bool | [N*R*M, E_l] | executor.cu:110-112 |
| h[5] dense_chunk_layout | all | device | int32 | [cdiv(N, 64)*R*M] | executor.cu:119-123 |
| h[6] dense_to_expert_map | all | device | int32 | [N*R*M, E_l] | executor.cu:124-126 |
| h[7] tokens_per_expert | all | device | int32 | [E_l] | executor.cu:127-129 |
| h[8] num_of_tokens_per_rank | all | - | int | - | executor.cuh:26 |
| h[9] config | all | - | object | - | executor.cu:90 |
| h[10] overflow_flag | all | device | int32 | [1] | executor.cu:117-118 |

[hybridep replay] ``dispatch_with_permute(handle=...)``, megatron's ``HybridEPCombine.backward``

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| dispatched_token | all | device | x.dtype | [P, H] | hybrid_ep.cu:313-314 |
| dispatched_probs | all | - | None | - | hybrid_ep.cu:315 |
| dispatched_scaling_factor | all | - | None | - | hybrid_ep.cu:318 |
| tokens_per_expert | all | - | None | - | hybrid_ep_buffer.py:381-395 |
| handle | all | - | tuple | [11] | hybrid_ep_buffer.py:419-431 |

[hybridep combine] ``HybridEPBuffer.combine_with_unpermute``

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| combined_token | all | device | x.dtype | [N, H] | hybrid_ep.cu:361-362 |
| combined_probs | probs | device | float32 | [N, E_l*R*M] | hybrid_ep.cu:363-366 |
| combined_probs | no probs | - | None | - | hybrid_ep.cu:360 |

[deepep layout] ``Buffer.get_dispatch_layout``

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| num_tokens_per_rank | all | device | int32 | [R] | deep_ep.cpp:391 |
| num_tokens_per_rdma_rank | all | - | None | - | deep_ep.cpp:392-396 |
| num_tokens_per_expert | all | device | int32 | [E] | deep_ep.cpp:393 |
| is_token_in_rank | all | device | bool | [T, R] | deep_ep.cpp:394 |
| event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:407-409 |
| event | sync | - | EventOverlap(None) | - | buffer.py:310 |

[deepep dispatch] ``Buffer.dispatch`` without a handle

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| recv_x | all | device | x.dtype | [Nr, H] | deep_ep.cpp:620 |
| recv_topk_idx | all | device | int64 | [Nr, K] | deep_ep.cpp:632 |
| recv_topk_weights | all | device | float32 | [Nr, K] | deep_ep.cpp:633 |
| num_recv_tokens_per_expert_list | all | - | list[int] | [E_l] | deep_ep.cpp:554-615 |
| handle | all | - | tuple | [6] | buffer.py:411 |
| h[0] rank_prefix_matrix | all | device | int32 | [R, R] | deep_ep.cpp:569 |
| h[1] channel_prefix_matrix | all | device | int32 | [R, C] | deep_ep.cpp:570 |
| h[2] recv_channel_prefix_matrix | all | device | int32 | [R, C] | deep_ep.cpp:623 |
| h[3] recv_src_idx | all | device | int32 | [Nr] | deep_ep.cpp:621 |
| h[4] is_token_in_rank | all | device | bool | [T, R] | buffer.py:411 |
| h[5] send_head | all | device | int32 | [T, R] | deep_ep.cpp:624 |
| event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:671-673 |
| event | sync | - | EventOverlap(None) | - | buffer.py:414 |

[deepep cached dispatch] ``Buffer.dispatch(handle=...)``, megatron's ``FusedCombine.backward``

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| recv_x | all | device | x.dtype | [Nr, H] | buffer.py:394-395 |
| recv_topk_idx | all | - | None | - | buffer.py:403 |
| recv_topk_weights | all | - | None | - | buffer.py:403 |
| num_recv_tokens_per_expert_list | all | - | None | - | buffer.py:403 |
| handle | all | - | None | - | buffer.py:403 |
| event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:671-673 |
| event | sync | - | EventOverlap(None) | - | buffer.py:403 |

[deepep combine] ``Buffer.combine``

| output | mode | device | dtype | shape | source @94a9f8f |
|---|---|---|---|---|---|
| combined_x | all | device | x.dtype | [T, H] | deep_ep.cpp:712-767 |
| combined_topk_weights | weights | device | float32 | [T, K] | deep_ep.cpp:741-744 |
| combined_topk_weights | no weights | - | None | - | deep_ep.cpp:735 |
| event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:783-785 |
| event | sync | - | EventOverlap(None) | - | buffer.py:466 |

``EventOverlap.current_stream_wait()`` asserts that it holds an event (``deep_ep/utils.py:40``),
so it may only follow an ``async`` call, as in megatron-core. The emulated kernels finish before
they return, so the events are stand-ins with nothing to wait for.

Host synchronizations the kernels make themselves, counted with
:func:`cpu_runtime.placement.count_sync` under the placement rules (the host then waits for the
current stream); the emulation's own bookkeeping reads sizes from shapes and host metadata and
adds none:

| call | mode | syncs | kind | source @94a9f8f |
|---|---|---|---|---|
| hybridep dispatch | blocking | 1 | hybridep blocking dispatch | executor.cu:166-175 |
| hybridep dispatch | non-blocking | 0 | - | executor.cu:166 |
| hybridep replay | all | 0 | - | hybrid_ep_buffer.py:380-395 |
| hybridep combine | all | 0 | - | executor.cuh:93 |
| deepep layout | all | 0 | - | deep_ep.cpp:406-422 |
| deepep dispatch | all | 1 | deepep dispatch | deep_ep.cpp:597-615 |
| deepep cached dispatch | all | 0 | - | deep_ep.cpp:559-567 |
| deepep combine | all | 0 | - | deep_ep.cpp:782-798 |

Blocking HybridEP: the kernel synchronizes its stream and the host sums the pinned counts into
P. DeepEP's fresh dispatch: the CPU busy-waits for the received counts in mapped host memory.
In megatron-core's dropless HybridEP path, ``tokens_per_expert.to(torch.int64)`` then returns
the same pinned tensor and ``.sum()`` a 0-dim host tensor, which reaches the replay as
``num_permuted_tokens`` (an int64 field in the real handle, taken through ``__index__``);
drop-and-pad discards the kernel's counts for its own host ``torch.full``.
"""

import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from cpu_runtime import placement

__all__ = ["Buffer", "EventHandle", "EventOverlap", "HybridEPBuffer", "install", "uninstall"]

# Marker so callers (and tests) can tell the emulation from a real deep_ep.
IS_CPU_EMULATION = True

# The DeepEP commit the output table above was read from.
DEEP_EP_SOURCE_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"


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


def _event(async_finish: bool) -> EventOverlap:
    """What a kernel returns: an event recorded on its stream when ``async_finish``."""
    return EventOverlap(EventHandle() if async_finish else None)


def _buffer_device() -> torch.device:
    """Where a communication buffer lives: the current GPU, else the host."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pinned(values: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor, as the kernels allocate with ``pinned_memory(true)``; plain
    host memory where neither CUDA nor the placement rules are there (pinning needs a driver)."""
    pin = torch.cuda.is_available() or placement.active()
    return torch.tensor(list(values), dtype=dtype, device="cpu", pin_memory=pin)


def _kernel_host_sync(kind: str) -> None:
    """A synchronization the real kernel makes (``cudaStreamSynchronize``, a CPU wait for the
    GPU): counted under the placement rules, and the host is then ordered after the current
    stream."""
    if placement.active():
        placement.count_sync(kind)
        placement.HOST_STREAMS.host_waits_for(placement.HOST_STREAMS.current)


def _rows(mask: torch.Tensor) -> int:
    """How many entries of a bool tensor are set, read from a shape (the emulation's own
    bookkeeping; the real kernels keep these counts on the device)."""
    return int(torch.nonzero(mask).shape[0])


def _cdiv(a: int, b: int) -> int:
    """``(a - 1) / b + 1`` as the kernels compute it (1 for ``a == 0``)."""
    return (max(a, 1) - 1) // b + 1


def _planner() -> types.ModuleType:
    """The overlay's ``moe_memory_planner`` (standard library only), by file path: the buffer
    terms the emulation allocates are the planner's, read from deep_ep's source."""
    global _PLANNER
    if _PLANNER is None:
        spec = importlib.util.spec_from_file_location("_moe_release_memory_planner", PLANNER)
        _PLANNER = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_PLANNER)
    return _PLANNER


PLANNER = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    + "/megatron/core/transformer/moe/moe_memory_planner.py"
)
_PLANNER: Optional[types.ModuleType] = None


def hybrid_ep_buffer_bytes(
    rows: int,
    hidden_dim: int,
    num_local_experts: int,
    num_of_ranks: int,
    ranks_per_node: Optional[int] = None,
    blocks_preprocessing: Optional[int] = None,
) -> int:
    """Device bytes of one rank's HybridEP buffer for ``rows`` rows per rank, every term the
    planner reads from deep_ep's source (``moe_memory_planner.hybridep_buffer_terms``: the
    16-bit combine tokens, FP32 probabilities of the NVLink domain's experts, FP32 scaling
    factors ``floor(H/128)`` per token, the all-gathered routing map, chunk flags and scratch).
    (1024 rows, 2 ranks, H=2048, 128 local experts: 11,254,272 bytes.)"""
    planner = _planner()
    r = ranks_per_node or num_of_ranks
    layout = planner.HybridEPLayout(
        hidden=hidden_dim,
        local_experts=num_local_experts,
        ranks_per_node=r,
        nodes=num_of_ranks // r,
        rows=rows,
        blocks_preprocessing=blocks_preprocessing or planner.DEFAULT_BLOCKS_PREPROCESSING,
    )
    return planner.total(planner.hybridep_buffer_terms(layout), planner.OUTSIDE)


def _group_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def _group_rank(group) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def _staged_through_host(t: torch.Tensor, group) -> bool:
    """Whether a collective on ``t`` must go through host memory: gloo on a non-CPU tensor.

    The emulation runs on CUDA tensors too (the memory report on a GPU, several ranks sharing
    one device, where NCCL refuses a duplicate GPU). Staging explicitly keeps the result
    independent of which collectives a torch build's gloo implements for CUDA.
    """
    # The storage's device is where the memory really is (the CPU runtime's placement rules
    # report a host tensor that stands in for a device one as ``cuda:0``).
    return t.untyped_storage().device.type != "cpu" and dist.get_backend(group) == "gloo"


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy (``.cpu()`` keeps a dense tensor's strides, e.g. a transpose's)."""
    return t.to("cpu", memory_format=torch.contiguous_format)


def _collective(t: torch.Tensor, out_rows: int, group, op) -> torch.Tensor:
    """``op(out, src)`` into a new ``[out_rows, *t.shape[1:]]`` tensor on ``t``'s device,
    staged through host memory where :func:`_staged_through_host` says so."""
    staged = _staged_through_host(t, group)
    src = _host_copy(t) if staged else t.contiguous()
    out = src.new_empty((out_rows,) + tuple(t.shape[1:]))
    op(out, src)
    return out.to(t.device) if staged else out


def _all_to_all(rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], group):
    """Uneven all-to-all of the leading dimension; a local copy on a group of one."""
    if len(send_counts) == 1:
        return rows.clone()
    return _collective(
        rows,
        sum(recv_counts),
        group,
        lambda out, src: dist.all_to_all_single(
            out, src, list(recv_counts), list(send_counts), group=group
        ),
    )


def _all_gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """Gather equally sized per-rank tensors along dim 0 (rank order)."""
    size = _group_size(group)
    if size == 1:
        return t.clone()
    return _collective(
        t,
        t.shape[0] * size,
        group,
        lambda out, src: dist.all_gather_into_tensor(out, src, group=group),
    )


def _sum_rows(rows: torch.Tensor, index: torch.Tensor, num_out: int, out_dtype) -> torch.Tensor:
    """out[index[i]] += rows[i] in row order, accumulated in float32."""
    acc = torch.zeros((num_out,) + tuple(rows.shape[1:]), dtype=torch.float32, device=rows.device)
    if rows.shape[0] > 0:
        acc.index_add_(0, index, rows.float())
    return acc.to(out_dtype)


def _host_all_gather_ints(values: List[int], group) -> List[List[int]]:
    """Every rank's ``values`` (rank order), exchanged as host metadata: in host memory over
    gloo, so reading them is no device sync (on another backend: on the device)."""
    size = _group_size(group)
    if size == 1:
        return [list(values)]
    gloo = dist.get_backend(group) == "gloo"
    dev = torch.device("cpu") if gloo else _buffer_device()
    mine = torch.tensor([list(values)], dtype=torch.long, device=dev)
    out = torch.empty((size, len(values)), dtype=torch.long, device=dev)
    dist.all_gather_into_tensor(out, mine, group=group)
    return out.tolist()


def _dense_rows(to_rank: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``int32 [N, R]``: the row token ``n`` takes in rank ``d``'s receive buffer (sources
    ascending, then token order: ``offsets[d]`` rows come from lower ranks), -1 if not sent."""
    rows = torch.cumsum(to_rank.to(torch.int32), 0) - 1 + offsets
    return torch.where(to_rank, rows, torch.full_like(rows, -1)).to(torch.int32)


def _sent_token_ids(dense_rows: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """The tokens sent to each rank (token order, ranks ascending) and how many go to each,
    read from a ``[N, R]`` map of receive-buffer rows (-1: not sent)."""
    ids = [torch.nonzero(dense_rows[:, d] >= 0).flatten() for d in range(dense_rows.shape[1])]
    return torch.cat(ids), [int(i.shape[0]) for i in ids]


@dataclass
class HybridEPConfig:
    """Stands in for the handle's ``HybridEpConfigInstance`` (item 9, an opaque pybind object):
    the per-call configuration, and the host-side routing sizes the emulation's collectives
    need (the real kernels keep them on the device)."""

    hidden_dim: int
    num_of_experts_per_rank: int
    num_of_ranks_per_node: int
    num_of_nodes: int
    rank: int
    pad_multiple: Optional[int]
    num_of_tokens_per_chunk_preprocessing_api: int
    fuse_permute_dispatch: bool
    # Emulation only: tokens this rank sends to / receives from each rank, received tokens,
    # and the permuted rows the routing fills (the rest of P is padding after the budget).
    send_counts: List[int] = field(default_factory=list)
    recv_counts: List[int] = field(default_factory=list)
    num_dispatched: int = 0
    rows_used: int = 0


class HybridEPBuffer:
    """Emulation of ``deep_ep.HybridEPBuffer`` (permute + all-to-all + permute).

    :meth:`dispatch_with_permute` returns the 11-item handle of DeepEP 94a9f8f (module
    docstring), last the overflow flag (an int32 tensor, non-zero when ``num_permuted_tokens``
    was too small and rows were dropped). The emulation encodes the routing in the real fields:
    ``sparse_to_dense_map[n, d]`` is token ``n``'s row in rank ``d``'s receive buffer (-1: not
    sent); ``local_expert_routing_map`` / ``dense_to_expert_map`` rows are received tokens
    (source rank, then token order; rows past the received ones unused) and
    ``dense_to_expert_map[r, e]`` is the permuted output row of received token ``r`` for local
    expert ``e`` (-1: none, or dropped past the budget); ``dense_chunk_layout`` counts, per
    source rank and 64-token chunk (``NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API``), the tokens
    received; ``handle[7]`` holds the unpadded counts before any budget drop.

    The real buffer is allocated outside PyTorch's allocator; the emulation allocates the same
    number of bytes (:func:`hybrid_ep_buffer_bytes`) as one tensor (``memory``), so allocator
    counts see it live and die with the buffer object.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        hidden_dim: int,
        max_num_of_tokens_per_rank: int,
        num_local_experts: int,
        use_fp8: bool = False,
        num_sms_dispatch_api: Optional[int] = None,
        num_sms_combine_api: Optional[int] = None,
        num_sms_preprocessing_api: Optional[int] = None,
        num_sms_permute_api: Optional[int] = None,
        num_blocks_permute: Optional[int] = None,
        num_blocks_unpermute: Optional[int] = None,
        num_of_ranks_per_nvlink_domain: Optional[int] = None,
        use_mnnvl: Optional[bool] = None,
    ) -> None:
        if use_fp8:
            raise NotImplementedError("The HybridEP emulation does not implement FP8 dispatch.")
        self.group = group
        self.rank = _group_rank(group)
        self.group_size = _group_size(group)
        self.hidden_dim = hidden_dim
        self.max_num_of_tokens_per_rank = max_num_of_tokens_per_rank
        self.num_local_experts = num_local_experts
        self.use_fp8 = use_fp8
        # SM/block counts only tune the CUDA kernels; kept for introspection.
        self.num_sms_dispatch_api = num_sms_dispatch_api
        self.num_sms_combine_api = num_sms_combine_api
        self.num_sms_preprocessing_api = num_sms_preprocessing_api
        self.num_blocks_permute = num_blocks_permute
        self.num_blocks_unpermute = num_blocks_unpermute
        self.num_of_ranks_per_nvlink_domain = num_of_ranks_per_nvlink_domain
        # Rows per rank: the first call's tokens, at least 512, rounded to the combine chunk
        # (config.cuh:384-387); later calls grow them (_grow).
        self.rows = _planner().hybridep_rows(max_num_of_tokens_per_rank)
        self._allocate()

    def _allocate(self) -> None:
        self.nbytes = hybrid_ep_buffer_bytes(
            self.rows,
            self.hidden_dim,
            self.num_local_experts,
            self.group_size,
            self.num_of_ranks_per_nvlink_domain,
            self.num_sms_preprocessing_api,
        )
        self.memory = torch.empty(self.nbytes, dtype=torch.uint8, device=_buffer_device())

    def _grow(self, num_tokens: int) -> None:
        """``update_buffer`` (``hybrid_ep_buffer.py:140-165``, ``hybrid_ep.cu:109-133``): a call
        with more tokens than the rows grows them (tokens rounded to 16, then to the combine
        chunk); the old buffer is freed before the new one is allocated."""
        rows = _planner().hybridep_rows_after(self.rows, num_tokens)
        if rows > self.rows:
            self.rows = rows
            self.memory = None
            self._allocate()

    def _preprocess(
        self,
        routing_map: torch.Tensor,
        num_of_experts_per_rank: int,
        pad_multiple: Optional[int],
        num_permuted_tokens: Optional[int],
        non_blocking: bool,
        fuse_permute_dispatch: bool,
    ) -> Tuple[tuple, torch.Tensor, int]:
        """Metadata preprocessing: every rank learns the whole routing map (one all-gather).

        Returns the handle, the padded ``tokens_per_expert`` and P."""
        num_tokens, num_experts = routing_map.shape
        dev = routing_map.device
        size, rank, local = self.group_size, self.rank, num_of_experts_per_rank
        if num_experts != size * local:
            raise ValueError(
                f"routing_map has {num_experts} experts, expected group size {size} x "
                f"{local} experts per rank"
            )
        global_map = _all_gather_rows(routing_map.bool(), self.group)
        per_rank = global_map.view(size, num_tokens, size, local)
        to_rank_all = per_rank.any(-1)  # [source, token, destination]
        to_rank = to_rank_all[rank]
        # Rows of each destination's receive buffer that lower ranks fill.
        offsets = to_rank_all[:rank].sum(dim=(0, 1)).to(torch.int32)
        sparse_to_dense = _dense_rows(to_rank, offsets)
        _, send_counts = _sent_token_ids(sparse_to_dense)
        # What it receives: tokens of every source rank routed to its experts, source-major.
        from_src = per_rank[:, :, rank, :]
        recv_mask = from_src.any(-1)  # [source, token]
        recv_counts = [_rows(recv_mask[s]) for s in range(size)]
        local_map = from_src[recv_mask]  # [received, local]: source rank, then token order
        received = local_map.shape[0]
        # Permute: output rows grouped by local expert, each group padded to pad_multiple.
        dense_to_expert = torch.full((num_tokens * size, local), -1, dtype=torch.int32, device=dev)
        raw, padded, start = [], [], 0
        for e in range(local):
            ids = torch.nonzero(local_map[:, e]).flatten()
            n = int(ids.shape[0])
            dense_to_expert[ids, e] = torch.arange(start, start + n, dtype=torch.int32, device=dev)
            count = n + (-n % pad_multiple if pad_multiple else 0)
            raw.append(n)
            padded.append(count)
            start += count
        needed = start
        overflow = torch.zeros(1, dtype=torch.int32, device=dev)
        if num_permuted_tokens is None:
            rows = needed  # the host sums the padded counts (blocking mode)
        else:
            rows = int(num_permuted_tokens)
        if needed > rows:
            # Rows past the static budget are dropped (their tokens get no contribution from
            # that expert); the flag tells the caller.
            overflow.fill_(1)
            dense_to_expert.masked_fill_(dense_to_expert >= rows, -1)
            starts = [sum(padded[:e]) for e in range(local)]
            padded = [min(c, max(rows - s, 0)) for c, s in zip(padded, starts)]
        if non_blocking:
            tokens_per_expert = torch.tensor(padded, dtype=torch.int64, device=dev)
            num_dispatched = torch.tensor([received], dtype=torch.int32, device=dev)
        else:
            # The kernel writes the counts into pinned memory, synchronizes the stream and
            # (without num_permuted_tokens) sums them on the host.
            tokens_per_expert = _pinned(padded, torch.int64)
            num_dispatched = _pinned([received], torch.int32)
            _kernel_host_sync("hybridep blocking dispatch")
        rdma_to_attn = torch.zeros((_cdiv(num_tokens, 16) * 16, 1), dtype=torch.bool, device=dev)
        rdma_to_attn[:num_tokens, 0] = to_rank.any(-1)
        attn_to_rdma = torch.zeros((num_tokens, 0), dtype=torch.bool, device=dev)
        local_expert_routing_map = torch.zeros(
            (num_tokens * size, local), dtype=torch.bool, device=dev
        )
        local_expert_routing_map[:received] = local_map
        chunk = int(os.environ.get("NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API", "64"))
        chunks = _cdiv(num_tokens, chunk)
        by_chunk = torch.zeros((size, chunks * chunk), dtype=torch.int32, device=dev)
        by_chunk[:, :num_tokens] = recv_mask.to(torch.int32)
        dense_chunk_layout = by_chunk.view(size, chunks, chunk).sum(-1).to(torch.int32).flatten()
        config = HybridEPConfig(
            hidden_dim=self.hidden_dim,
            num_of_experts_per_rank=local,
            num_of_ranks_per_node=size,
            num_of_nodes=1,
            rank=rank,
            pad_multiple=pad_multiple,
            num_of_tokens_per_chunk_preprocessing_api=chunk,
            fuse_permute_dispatch=fuse_permute_dispatch,
            send_counts=send_counts,
            recv_counts=recv_counts,
            num_dispatched=received,
            rows_used=min(needed, rows),
        )
        handle = (
            sparse_to_dense,
            rdma_to_attn,
            attn_to_rdma,
            num_dispatched,
            local_expert_routing_map,
            dense_chunk_layout,
            dense_to_expert,
            torch.tensor(raw, dtype=torch.int32, device=dev),
            num_tokens,
            config,
            overflow,
        )
        return handle, tokens_per_expert, rows

    @staticmethod
    def _unpack(handle: tuple):
        """``(sparse_to_dense_map, dense_to_expert_map, num_of_tokens_per_rank, config)`` of
        an 11-item handle."""
        if not isinstance(handle, tuple) or len(handle) != 11:
            raise ValueError(
                "expected the 11-item HybridEP handle of dispatch_with_permute, got "
                f"{type(handle).__name__} of {len(handle) if isinstance(handle, tuple) else '?'}"
            )
        config = handle[9]
        if not isinstance(config, HybridEPConfig):
            raise TypeError("handle[9] is not the config this emulation's dispatch returned")
        return handle[0], handle[6], handle[8], config

    @staticmethod
    def _row_id_map(dense_to_expert: torch.Tensor, rows: int) -> torch.Tensor:
        """``[rows, 2]``: for every permuted row its received-token index and local expert, or
        ``-1`` for padding (from ``dense_to_expert_map``)."""
        received, local = torch.nonzero(dense_to_expert >= 0).unbind(1)
        row_id_map = torch.full((rows, 2), -1, dtype=torch.long, device=dense_to_expert.device)
        row = dense_to_expert[received, local].long()
        row_id_map[row] = torch.stack([received, local], dim=1)
        return row_id_map

    def dispatch_with_permute(
        self,
        *,
        hidden: torch.Tensor,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        num_of_experts_per_rank: Optional[int] = None,
        num_of_experts: Optional[int] = None,
        use_fp8: Optional[bool] = None,
        routing_map: Optional[torch.Tensor] = None,
        probs: Optional[torch.Tensor] = None,
        scaling_factor: Optional[torch.Tensor] = None,
        num_permuted_tokens: Optional[int] = None,
        pad_multiple: Optional[int] = None,
        handle: Optional[tuple] = None,
        non_blocking: bool = False,
        fuse_permute_dispatch: bool = False,
    ):
        """Dispatch ``hidden[N, H]`` to the expert ranks and permute it by local expert.

        Returns ``(tokens[P, H], probs[P] fp32 | None, None, tokens_per_expert[E_l] int64,
        handle)``; ``tokens_per_expert`` is pinned host memory unless ``non_blocking``. With
        ``handle`` given (the backward of combine) the routing is replayed: no routing map is
        needed, P is ``num_permuted_tokens`` (required, as the real handle's int64 field) and
        ``tokens_per_expert`` is ``None``.
        """
        if use_fp8:
            raise NotImplementedError("The HybridEP emulation does not implement FP8 dispatch.")
        if non_blocking and (num_permuted_tokens is None or num_permuted_tokens < 0):
            raise ValueError("num_permuted_tokens is required for non-blocking mode.")
        num_tokens, _ = hidden.shape
        if handle is None:
            self._grow(num_tokens)
            if routing_map is None:
                if topk_idx is None or num_of_experts is None:
                    raise ValueError("dispatch_with_permute needs a routing map or a handle.")
                routing_map = torch.zeros(
                    num_tokens, num_of_experts, dtype=torch.bool, device=hidden.device
                )
                routing_map.scatter_(1, topk_idx.long(), True)
                if topk_weights is not None:
                    probs = torch.zeros(
                        num_tokens, num_of_experts, dtype=torch.float32, device=hidden.device
                    )
                    probs = probs.scatter(1, topk_idx.long(), topk_weights.float())
            if routing_map.dtype != torch.bool or routing_map.shape[0] != num_tokens:
                raise ValueError("routing_map must be bool with one row per token of hidden.")
            local = num_of_experts_per_rank or self.num_local_experts
            handle, tokens_per_expert, rows = self._preprocess(
                routing_map, local, pad_multiple, num_permuted_tokens, non_blocking,
                fuse_permute_dispatch,
            )  # fmt: skip
        else:
            if num_permuted_tokens is None:
                # The replay sets the handle's int64 num_permuted_tokens from the argument
                # (hybrid_ep_buffer.py:395); pybind refuses None.
                raise TypeError(
                    "dispatch_with_permute with a handle needs num_permuted_tokens (the replay "
                    "sets HandleImpl.num_permuted_tokens, an int64, from it)."
                )
            handle = tuple(handle)
            tokens_per_expert = None  # a fresh HandleImpl never sets padded_tokens_per_expert
            rows = int(num_permuted_tokens)
        sparse_to_dense, dense_to_expert, n, config = self._unpack(handle)
        if num_tokens != n:
            raise ValueError(f"hidden has {num_tokens} rows but the handle was built for {n}.")
        if rows < config.rows_used:
            raise ValueError(
                f"num_permuted_tokens={rows} is below the {config.rows_used} rows the routing fills"
            )
        size, local = config.num_of_ranks_per_node, config.num_of_experts_per_rank
        send_token_ids, sends = _sent_token_ids(sparse_to_dense)
        recvs = config.recv_counts
        row_id_map = self._row_id_map(dense_to_expert, rows)

        recv_hidden = _all_to_all(hidden[send_token_ids], sends, recvs, self.group)
        valid = row_id_map[:, 0] >= 0
        out = hidden.new_zeros((rows, hidden.shape[1]))
        out[valid] = recv_hidden[row_id_map[valid, 0]]

        out_probs = None
        if probs is not None:
            # Each destination only needs the probability columns of its own experts.
            per_dest = probs.float().reshape(num_tokens, size, local)
            dest_of_row = torch.repeat_interleave(
                torch.arange(size, device=hidden.device),
                torch.tensor(sends, dtype=torch.long, device=hidden.device),
            )
            send_probs = per_dest[send_token_ids, dest_of_row]
            recv_probs = _all_to_all(send_probs, sends, recvs, self.group)
            out_probs = torch.zeros(rows, dtype=torch.float32, device=hidden.device)
            out_probs[valid] = recv_probs[row_id_map[valid, 0], row_id_map[valid, 1]]
        return out, out_probs, None, tokens_per_expert, handle

    def combine_with_unpermute(
        self,
        *,
        hidden: torch.Tensor,
        probs: Optional[torch.Tensor] = None,
        handle: Optional[tuple] = None,
        pad_multiple: Optional[int] = None,
        fuse_unpermute_combine: bool = False,
    ):
        """Inverse of :meth:`dispatch_with_permute`: ``hidden[P, H]`` -> ``tokens[N, H]``.

        Rows of one token are summed (local experts first, then ranks, in ascending order)
        without probability weighting; padding rows are ignored. ``probs[P]`` are scattered back
        to ``[N, num_experts]`` float32 (``None`` without probs).
        """
        if handle is None:
            raise ValueError("The handle is necessary for combine.")
        sparse_to_dense, dense_to_expert, n, config = self._unpack(tuple(handle))
        if hidden.shape[0] < config.rows_used:
            raise ValueError(
                f"hidden has {hidden.shape[0]} rows but dispatch filled {config.rows_used}."
            )
        size, local = config.num_of_ranks_per_node, config.num_of_experts_per_rank
        send_token_ids, sends = _sent_token_ids(sparse_to_dense)
        recvs = config.recv_counts
        m = config.num_dispatched
        row_id_map = self._row_id_map(dense_to_expert, hidden.shape[0])
        valid = row_id_map[:, 0] >= 0
        # Unpermute on the expert rank, then send one partial sum per token copy back.
        partial = _sum_rows(hidden[valid], row_id_map[valid, 0], m, hidden.dtype)
        back = _all_to_all(partial, recvs, sends, self.group)
        out = _sum_rows(back, send_token_ids, n, hidden.dtype)

        out_probs = None
        if probs is not None:
            recv_probs = torch.zeros(m, local, dtype=torch.float32, device=hidden.device)
            recv_probs[row_id_map[valid, 0], row_id_map[valid, 1]] = probs.float()[valid]
            back_probs = _all_to_all(recv_probs, recvs, sends, self.group)
            dest_of_row = torch.repeat_interleave(
                torch.arange(size, device=hidden.device),
                torch.tensor(sends, dtype=torch.long, device=hidden.device),
            )
            out_probs = torch.zeros(n, size, local, dtype=torch.float32, device=hidden.device)
            out_probs[send_token_ids, dest_of_row] = back_probs
            out_probs = out_probs.view(n, size * local)
        return out, out_probs


class Config:
    """DeepEP's tuning ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``: its
    buffer size hints are the real ones (``csrc/config.hpp:51-103``, from the planner), the
    RDMA receive chunk rounded up to a multiple of the send chunk (``config.hpp:45``)."""

    def __init__(self, num_sms: int = 20, *chunk_sizes: int) -> None:
        self.num_sms = num_sms
        self.chunk_sizes = chunk_sizes

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes for ``num_ranks`` ranks (``config.hpp:51-73``)."""
        return _planner().deepep_nvl_bytes(
            hidden_bytes, num_ranks, self.num_sms, self.chunk_sizes[1]
        )

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes (``config.hpp:75-103``): 0 up to 8 ranks."""
        _, _, send, recv = self.chunk_sizes
        return _planner().deepep_rdma_bytes(hidden_bytes, num_ranks, self.num_sms, send, recv)


# Buffers built with explicitly_destroy that were never destroyed: deep_ep leaks them, so their
# bytes stay allocated here too.
LEAKED_BUFFERS: List[torch.Tensor] = []


class _EmulatedRuntime:
    """Stand-in for ``deep_ep_cpp.Buffer``: its ``destroy()`` is collective over the group."""

    def destroy(self, group: Optional[dist.ProcessGroup]) -> None:
        if group is not None and dist.is_initialized():
            dist.barrier(group=group)


class _DeepEPHandle(tuple):
    """DeepEP's intranode dispatch handle, the real 6-tuple ``(rank_prefix_matrix,
    channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank,
    send_head)``, carrying the host-side split sizes of the emulation's collectives."""

    send_counts: List[int]
    recv_counts: List[int]

    def __new__(cls, items, send_counts: List[int], recv_counts: List[int]):
        self = super().__new__(cls, items)
        self.send_counts = list(send_counts)
        self.recv_counts = list(recv_counts)
        return self

    def __getnewargs__(self):
        return (tuple(self), self.send_counts, self.recv_counts)


class Buffer:
    """Emulation of ``deep_ep.Buffer`` in intranode normal (non-low-latency) mode.

    The dispatch handle is the real 6-tuple (module docstring). The emulation encodes the
    routing in it: ``rank_prefix_matrix[s, d]`` counts the tokens ranks ``0..s`` send to rank
    ``d``; ``channel_prefix_matrix[d, c]`` the tokens this rank sends to ``d`` from its channels
    ``0..c`` (channel ``c`` takes tokens ``c*cdiv(T, C)`` on) and
    ``recv_channel_prefix_matrix[s, c]`` the same for what source ``s`` sends here;
    ``recv_src_idx`` the source-rank token index of every received row (source rank, then token
    order); ``send_head[t, d]`` token ``t``'s row in rank ``d``'s ``recv_x`` (-1: not sent).

    The real NVLink/RDMA buffers live outside PyTorch's allocator; the emulation allocates
    what the real one does for the ``num_nvl_bytes`` and ``num_rdma_bytes`` megatron-core's
    ``get_buffer`` asks (sized by the :class:`Config` hints): the NVLink buffer with its
    barrier signals and pointers, the 32 MiB workspace and the RDMA buffer (the memory
    planner's DeepEP terms), as one tensor (``memory``), so allocator counts see them.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_normal_mode: bool = True,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        comm=None,
    ) -> None:
        # The real signature at 94a9f8f (deep_ep/buffer.py:33-41): an unknown keyword raises.
        if low_latency_mode:
            raise NotImplementedError("The DeepEP emulation implements normal mode only.")
        self.group = group
        self.rank = _group_rank(group)
        self.group_size = _group_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        # The C++ runtime; destroy() sets it to None, as the real one does (buffer.py:143).
        self.runtime = _EmulatedRuntime()
        # One allocation for the NVLink buffer with its barrier signals and pointers, the 32 MiB
        # workspace, and the RDMA buffer (deep_ep.cpp:145-188, 341-356; the planner's terms).
        planner = _planner()
        device_bytes = num_nvl_bytes + planner.DEEPEP_NVL_META + planner.DEEPEP_WORKSPACE
        self.memory = torch.empty(
            device_bytes + num_rdma_bytes, dtype=torch.uint8, device=_buffer_device()
        )

    def destroy(self) -> None:
        """``Buffer.destroy()`` (94a9f8f ``deep_ep/buffer.py:135-144``, C++ ``Buffer::destroy``
        ``csrc/deep_ep.cpp:269-309``): only with ``explicitly_destroy``; synchronizes the device
        and the buffer's peers (an intranode barrier: collective over the group, emulated by a
        barrier on it), frees the buffer, and leaves ``runtime`` None, so any later use fails."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self.runtime.destroy(self.group)
        self.runtime = None
        self.memory = None

    def _check_runtime(self) -> None:
        # The real methods call self.runtime.<kernel>(...), which fails once destroy() has run.
        if self.runtime is None:
            raise AttributeError("'NoneType' object has no attribute 'get_local_device_id'")

    def __del__(self) -> None:
        # C++ ~Buffer (csrc/deep_ep.cpp:209-216): with explicitly_destroy and no destroy(), the
        # resources are not released (it warns); the emulation keeps the bytes allocated.
        if getattr(self, "explicitly_destroy", False) and getattr(self, "runtime", None):
            print(
                "WARNING: destroy() was not called before DeepEP buffer destruction, which can "
                "leak resources.",
                file=sys.stderr,
            )
            LEAKED_BUFFERS.append(self.memory)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record the SM budget (tuning only)."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The recommended dispatch config (``buffer.py:240-253``): refuses a group size it
        has none for, as the real one asserts."""
        configs = _planner().DEEPEP_DISPATCH_CONFIGS
        assert num_ranks in configs, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *configs[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The recommended combine config (``buffer.py:268-281``)."""
        configs = _planner().DEEPEP_COMBINE_CONFIGS
        assert num_ranks in configs, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *configs[num_ranks])

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns ``(num_tokens_per_rank[R] int32, None, num_tokens_per_expert[E] int32,
        is_token_in_rank[T, R] bool, event)``; ``-1`` entries of ``topk_idx`` are ignored."""
        self._check_runtime()
        size = self.group_size
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not split over {size} ranks.")
        local = num_experts // size
        idx = topk_idx.long()
        valid = idx >= 0
        num_tokens_per_expert = torch.bincount(idx[valid], minlength=num_experts).to(torch.int32)
        dest = torch.where(valid, idx // local, torch.full_like(idx, size))
        is_token_in_rank = torch.zeros(idx.shape[0], size + 1, dtype=torch.bool, device=idx.device)
        is_token_in_rank.scatter_(1, dest, True)
        is_token_in_rank = is_token_in_rank[:, :size].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        return (
            num_tokens_per_rank,
            None,
            num_tokens_per_expert,
            is_token_in_rank,
            _event(async_finish),
        )

    def _routing(self, handle: tuple) -> Tuple[torch.Tensor, List[int], List[int]]:
        """``(send_token_ids, send_counts, recv_counts)`` of a dispatch handle."""
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise ValueError("expected the 6-item DeepEP handle of Buffer.dispatch")
        send_token_ids, sends = _sent_token_ids(handle[5])
        recvs = getattr(handle, "recv_counts", None)
        if recvs is None:
            # A handle re-packed into a plain tuple: read the counts from rank_prefix_matrix.
            column = handle[0][:, self.rank].long()
            recvs = torch.diff(column, prepend=column.new_zeros(1)).tolist()
        return send_token_ids, sends, list(recvs)

    def dispatch(
        self,
        x: torch.Tensor,
        handle: Optional[tuple] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each token once to every rank owning one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``; received rows are in source rank, then token order. With a cached
        ``handle`` only ``x`` is sent and the other four are ``None``, as in DeepEP.
        """
        self._check_runtime()
        size, rank = self.group_size, self.rank
        if handle is not None:
            send_token_ids, sends, recvs = self._routing(handle)
            recv_x = _all_to_all(x[send_token_ids], sends, recvs, self.group)
            return recv_x, None, None, None, None, _event(async_finish)
        if is_token_in_rank is None or topk_idx is None:
            raise ValueError("dispatch needs the layout and top-k indices, or a handle.")
        num_experts = int(num_tokens_per_expert.numel()) if num_tokens_per_expert is not None else 0
        if not num_experts:
            raise ValueError("dispatch needs num_tokens_per_expert from get_dispatch_layout.")
        config = config or self.get_dispatch_config(size)
        channels = max(config.num_sms // 2, 1)
        num_tokens = x.shape[0]
        dev = x.device
        in_rank = is_token_in_rank.bool()
        sends = [_rows(in_rank[:, d]) for d in range(size)]
        # The counts every rank sends to every other (notify_dispatch), which the host reads
        # once they arrive: the kernel's one CPU wait.
        counts_all = _host_all_gather_ints(sends, self.group)  # [source][destination]
        _kernel_host_sync("deepep dispatch")
        recvs = [counts_all[s][rank] for s in range(size)]
        below = [sum(counts_all[s][d] for s in range(rank)) for d in range(size)]
        send_head = _dense_rows(in_rank, torch.tensor(below, dtype=torch.int32, device=dev))
        send_token_ids, _ = _sent_token_ids(send_head)
        recv_x = _all_to_all(x[send_token_ids], sends, recvs, self.group)
        recv_src_idx = _all_to_all(send_token_ids.to(torch.int32), sends, recvs, self.group)
        recv_idx = _all_to_all(topk_idx.long()[send_token_ids], sends, recvs, self.group)
        local = num_experts // size
        begin = rank * local
        mine = (recv_idx >= begin) & (recv_idx < begin + local)
        recv_topk_idx = torch.where(mine, recv_idx - begin, torch.full_like(recv_idx, -1))
        recv_topk_weights = None
        if topk_weights is not None:
            w = _all_to_all(topk_weights.float()[send_token_ids], sends, recvs, self.group)
            recv_topk_weights = torch.where(mine, w, torch.zeros_like(w))
        per_expert = [_rows(recv_topk_idx == e) for e in range(local)]
        if expert_alignment > 1:
            per_expert = [c + (-c % expert_alignment) for c in per_expert]
        prefix, running = [], [0] * size
        for s in range(size):
            running = [a + b for a, b in zip(running, counts_all[s])]
            prefix.append(list(running))
        rank_prefix_matrix = torch.tensor(prefix, dtype=torch.int32, device=dev)
        # Channel c sends tokens [c * per, (c + 1) * per) (DeepEP's channel task range).
        per = _cdiv(num_tokens, channels)
        ends = [min((c + 1) * per, num_tokens) for c in range(channels)]
        cumulative = torch.cat(
            [
                torch.zeros((1, size), dtype=torch.int32, device=dev),
                torch.cumsum(in_rank.to(torch.int32), 0).to(torch.int32),
            ]
        )
        channel_prefix_matrix = (
            cumulative[torch.tensor(ends, dtype=torch.long, device=dev)].t().contiguous()
        )
        recv_channel_prefix_matrix = _all_to_all(
            channel_prefix_matrix, [1] * size, [1] * size, self.group
        )
        new_handle = _DeepEPHandle(
            (
                rank_prefix_matrix,
                channel_prefix_matrix,
                recv_channel_prefix_matrix,
                recv_src_idx,
                is_token_in_rank,
                send_head,
            ),
            send_counts=sends,
            recv_counts=recvs,
        )
        return (
            recv_x,
            recv_topk_idx,
            recv_topk_weights,
            per_expert,
            new_handle,
            _event(async_finish),
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: Optional[torch.Tensor] = None,
        bias=None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send every received row back and sum the copies of each token (ranks ascending).

        Returns ``(combined_x[T, H], combined_topk_weights[T, K] float32 | None, event)``.
        """
        self._check_runtime()
        if bias is not None:
            raise NotImplementedError("The DeepEP emulation does not implement combine bias.")
        send_token_ids, sends, recvs = self._routing(handle)
        recv_src_idx, send_head = handle[3], handle[5]
        if x.shape[0] != recv_src_idx.shape[0]:
            raise ValueError(
                f"x has {x.shape[0]} rows but the dispatch received {recv_src_idx.shape[0]}."
            )
        num_tokens = send_head.shape[0]
        back = _all_to_all(x, recvs, sends, self.group)
        out = _sum_rows(back, send_token_ids, num_tokens, x.dtype)
        out_weights = None
        if topk_weights is not None:
            back_w = _all_to_all(topk_weights.float(), recvs, sends, self.group)
            out_weights = _sum_rows(back_w, send_token_ids, num_tokens, torch.float32)
        return out, out_weights, _event(async_finish)


def _real_deep_ep_importable() -> bool:
    current = sys.modules.get("deep_ep")
    if current is not None:
        return not getattr(current, "IS_CPU_EMULATION", False)
    try:
        return importlib.util.find_spec("deep_ep") is not None
    except (ImportError, ValueError):
        return False


def install(force: bool = False) -> types.ModuleType:
    """Register this module as ``deep_ep`` (and ``deep_ep.utils``) in ``sys.modules``.

    Must run before megatron-core's ``fused_a2a`` is imported, which binds the kernels at import
    time. Refuses to shadow an importable real ``deep_ep`` unless ``force``.
    """
    if "megatron.core.transformer.moe.fused_a2a" in sys.modules and not _is_installed():
        raise RuntimeError(
            "megatron.core.transformer.moe.fused_a2a is already imported; install the deep_ep "
            "emulation before the first `import megatron.core`."
        )
    if _real_deep_ep_importable() and not force:
        raise RuntimeError(
            "A real deep_ep is importable; refusing to shadow it with the emulation "
            "(pass force=True to override)."
        )
    module = sys.modules[__name__]
    utils = types.ModuleType("deep_ep.utils")
    utils.EventHandle = EventHandle
    utils.EventOverlap = EventOverlap
    utils.IS_CPU_EMULATION = True
    module.utils = utils
    sys.modules["deep_ep"] = module
    sys.modules["deep_ep.utils"] = utils
    return module


def _is_installed() -> bool:
    return getattr(sys.modules.get("deep_ep"), "IS_CPU_EMULATION", False)


def uninstall() -> None:
    """Remove the emulation from ``sys.modules`` (megatron modules keep what they bound)."""
    if _is_installed():
        sys.modules.pop("deep_ep", None)
        sys.modules.pop("deep_ep.utils", None)
