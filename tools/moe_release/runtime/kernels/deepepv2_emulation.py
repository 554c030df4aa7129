# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of DeepEP v2's ``ElasticBuffer`` (the ``deepepv2`` flex backend of Megatron-LM dev).

``ElasticBuffer.dispatch`` / ``combine`` in the intranode direct mode (every rank of the group in
one NVLink domain, no expand layout: what megatron dev's ``_DeepepV2Manager`` uses), over plain
``torch.distributed`` collectives (gloo works): a token is sent once to each rank owning one of
its top-k experts; the received rows come in blocks by source rank (ascending), tokens ascending
inside a block (the real kernel's slot order inside a block is an atomic counter's; ascending is
one legal order, the one ``deterministic=True`` gives); received top-k indices are made local
(``-1`` for experts on other ranks) while the top-k weights are copied unmasked; combine sends
every received row back and sums, in float32 with one rounding, the copies of each token over
its distinct destination ranks (unweighted); combined top-k weights take column ``k`` from the
rank owning expert ``k``.

**Outputs as the real kernels return them** (the tables below), "device" and "pinned" as in
:mod:`moe_release.runtime.kernels.hybridep_emulation`. The handle is DeepEP's ``EPHandle`` with its
real fields; the collectives' split sizes ride on it as Python ints (``send_counts``,
``recv_counts``, ``send_token_ids`` is not kept: it is read back from ``dst_buffer_slot_idx``), so
it holds no tensor bytes the real one does not. Columns ``2..K+1`` of ``recv_src_metadata`` are left
uninitialized, as the real kernel leaves them outside the expand layout.

Source: DeepEP's ``epv2-release`` branch at **018f21e**
(``018f21ea62c6c2888d9b46806aad6d90b399b23d``, 2026-04-28, the branch DeepEP v2 is released
from; megatron dev d48bd6b pins no DeepEP v2 commit).
Files are cited by name: ``elastic.py`` is ``deep_ep/buffers/elastic.py``, ``buffer.hpp``
``csrc/elastic/buffer.hpp``, ``layout.cuh`` ``deep_ep/include/deep_ep/common/layout.cuh``,
``combine.cuh`` ``deep_ep/include/deep_ep/impls/combine.cuh``, ``envs.py``
``deep_ep/utils/envs.py``; ``h.<field>`` is a field of the returned ``EPHandle``.

Sizes: T = ``x.shape[0]`` (tokens on this rank), N = ``num_max_tokens_per_rank``, H = hidden,
K = top-k, E = all experts, E_l = ``E / R`` local experts, R = ranks, Nr = tokens this rank
receives (a token counts once per destination rank). Modes: ``async`` is megatron's
``async_with_compute_stream=True, allocate_on_comm_stream=True`` with ``previous_event =
buffer.capture()`` (what ``MoEFlexTokenDispatcher.token_dispatch``/``token_combine`` always
pass), ``sync`` leaves them off; combine ``weights`` is ``DeepepV2Dispatch.backward``, ``no
weights`` the forward combine; the cached dispatch is ``DeepepV2Combine.backward``.

Kernel outputs, by call (the tests parse these tables, one test per row and mode):

[deepepv2 dispatch] ``ElasticBuffer.dispatch`` without a handle

| output | mode | device | dtype | shape | source @018f21e |
|---|---|---|---|---|---|
| recv_x | all | device | x.dtype | [Nr, H] | buffer.hpp:1012-1013 |
| recv_topk_idx | all | device | int64 | [Nr, K] | buffer.hpp:1038-1041 |
| recv_topk_weights | all | device | float32 | [Nr, K] | buffer.hpp:1042-1047 |
| handle | all | - | object | - | elastic.py:792-804 |
| h.topk_idx | all | device | int64 | [T, K] | buffer.hpp:891-896 |
| h.psum_num_recv_tokens_per_scaleup_rank | all | device | int32 | [R] | buffer.hpp:755-756 |
| h.psum_num_recv_tokens_per_expert | all | device | int32 | [E_l] | buffer.hpp:1054-1056 |
| h.recv_src_metadata | all | device | int32 | [Nr, K + 2] | buffer.hpp:1017-1019 |
| h.dst_buffer_slot_idx | all | device | int32 | [T, K] | buffer.hpp:813-814 |
| h.token_metadata_at_forward | all | - | None | - | buffer.hpp:819-888 |
| h.channel_linked_list | all | - | None | - | buffer.hpp:819-888 |
| h.num_recv_tokens_per_expert_list | all | - | list[int] | [E_l] | buffer.hpp:971-979 |
| h.num_sms | all | - | int | - | elastic.py:732 |
| event | async | - | EventOverlap(EventHandle) | - | elastic.py:810 |
| event | sync | - | EventOverlap(None) | - | elastic.py:810 |

[deepepv2 cached dispatch] ``ElasticBuffer.dispatch(handle=...)``

| output | mode | device | dtype | shape | source @018f21e |
|---|---|---|---|---|---|
| recv_x | all | device | x.dtype | [Nr, H] | buffer.hpp:1012-1013 |
| recv_topk_idx | all | device | int64 | [Nr, K] | buffer.hpp:1038-1041 |
| recv_topk_weights | all | - | None | - | buffer.hpp:1042 |
| handle | all | - | object | - | elastic.py:792 |
| event | async | - | EventOverlap(EventHandle) | - | elastic.py:810 |
| event | sync | - | EventOverlap(None) | - | elastic.py:810 |

[deepepv2 combine] ``ElasticBuffer.combine``

| output | mode | device | dtype | shape | source @018f21e |
|---|---|---|---|---|---|
| combined_x | all | device | x.dtype | [T, H] | buffer.hpp:1235 |
| combined_topk_weights | weights | device | float32 | [T, K] | buffer.hpp:1236-1241 |
| combined_topk_weights | no weights | - | None | - | buffer.hpp:1236 |
| event | async | - | EventOverlap(EventHandle) | - | elastic.py:883 |
| event | sync | - | EventOverlap(None) | - | elastic.py:883 |

[deepepv2 capture] ``ElasticBuffer.capture``

| output | mode | device | dtype | shape | source @018f21e |
|---|---|---|---|---|---|
| event | all | - | EventHandle | - | elastic.py:348-356 |

Host synchronizations the kernels make themselves, counted with
:func:`moe_release.runtime.cuda.placement.count_sync` under the placement rules:

| call | mode | syncs | kind | source @018f21e |
|---|---|---|---|---|
| deepepv2 dispatch | all | 1 | deepepv2 dispatch | buffer.hpp:954-1001 |
| deepepv2 cached dispatch | all | 0 | - | buffer.hpp:952-953 |
| deepepv2 combine | all | 0 | - | buffer.hpp:1110-1272 |
| deepepv2 capture | all | 0 | - | elastic.py:348-356 |

The fresh dispatch: the host busy-waits on mapped host memory for the received counts (Nr and
the per-expert list), which size its outputs; the cached one reuses the handle's.

**Memory.** The buffer is one NCCL symmetric window per rank, outside PyTorch's allocator, of
``12,820,544 + num_bytes`` bytes (the fixed workspace of ``layout.cuh:43-81``, then the data
buffer, ``buffer.hpp:100-114``), and ``12,820,544`` bytes of mapped pinned host memory
(``buffer.hpp:118-120``); the emulation allocates both through the counted allocator, owned by
the emulated C++ runtime. ``get_buffer_size_hint`` is ``buffer.hpp:595-629`` for one NVLink
domain: ``max(R * N * Bd, L * N * Bc)`` with ``Bd = a32(H * elem) + a32(4 * sf) + a32(12K + 4)``,
``Bc = a32(2H) + a32(8K)``, ``L = min(R, K)`` (``K`` without multiple reduction), ``a32`` rounding
up to 32, ``elem`` 2 (1 with FP8), ``sf = ceil(H / 32)`` with FP8 else 0, ``K = 32`` when 0
(``layout.cuh:180-209``, ``buffer.hpp:529-593``).

**What the real one refuses, refused here**: an unknown constructor argument; combine of a
non-bf16 ``x`` (``buffer.hpp:1134``) or with ``H % 256 != 0`` (the JIT kernel's static assert,
``combine.cuh:109``); dispatch of more than N tokens (``buffer.hpp:684``), of ``x`` whose
``H * element_size`` is no multiple of 16 (``buffer.hpp:683``), of ``x`` needing more buffer than
the buffer has (an fp32 ``x`` in a bf16-sized buffer, ``buffer.hpp:899-902``), non-int64 top-k
indices (``buffer.hpp:704-706``), non-float32 top-k weights (``buffer.hpp:714``), experts not
splitting over the ranks (``buffer.hpp:733``); a ``previous_event`` without
``allocate_on_comm_stream`` (``buffer.hpp:482-483``); a cached dispatch with top-k inputs or a
CPU sync (``elastic.py:742-743``); ``destroy()`` without ``explicitly_destroy``
(``elastic.py:233``); any use after ``destroy()`` (``runtime`` is None: ``AttributeError``).
And one thing the real one does not check but its layout assumes (``elastic.py:34``:
"all the ranks must hold the same value"; ``src_token_global_idx = rank * N + idx``,
``dispatch.cuh:326``): a dispatch whose N differs across the group's ranks raises here, where
the real kernels would mis-address each other's slots.

**Lifetime** (``buffer.hpp:127-151``, ``elastic.py:229-238``): the constructor is collective (a
barrier on the group). ``destroy()`` (only with ``explicitly_destroy``; a second call does nothing)
runs the C++ ``destroy()``: a GPU barrier across the group's ranks with device synchronizations
(``barrier(true, true)``, ``buffer.hpp:141``), then frees the window and the host workspace. That
barrier runs on the device over the NCCL window, not over the process group: the emulation
rendezvouses the peers on the job's store (:class:`moe_release.runtime.measure.faults.Fabric`),
logged as a device-side collective with the context it ran from, and bounded (a peer that never
arrives makes it raise "a GPU would trap"; from the destructor that is printed to stderr and the
bytes are kept). The C++ destructor, when the last reference to the runtime goes: without
``explicitly_destroy`` it runs that collective ``destroy()`` there; with it and no ``destroy()``, it
prints DeepEP's warning to stdout and frees nothing (the emulation keeps the bytes allocated in
:data:`LEAKED_BUFFERS`). A job's teardown
(:func:`moe_release.runtime.cuda.compat.teardown_megatron_state`) calls :func:`release_for_exit`: a
process exit frees device memory without a collective.

**Across nodes** (``nccl.cu:51-152``, ``buffer.hpp:529-629``). The NVLink domain is NCCL's LSA
team (``dev_comm.lsaSize``); here it is the emulated node of
:func:`moe_release.runtime.kernels.emulation_common.node_layout` (``MOE_RELEASE_RANKS_PER_NODE``;
unset, one node capped at :data:`NVL_RANKS_PER_NODE` = 8, an H100 node). A group spanning ``So``
nodes of ``Su`` ranks has ``num_rdma_ranks = So``, ``num_nvlink_ranks = Su``; with
``allow_hybrid_mode`` (DeepEP's default, and megatron dev's: ``get_elastic_buffer`` passes no
``allow_hybrid_mode``, fused_a2a.py:90-117 at d48bd6b) the logical domains are ``So`` scale-out x
``Su`` scale-up ranks (``scaleout_rank_idx = rank // Su``), without it one scale-out rank of
``R`` scale-up ranks over RDMA (``is_scaleup_nvlink`` false). The window is then sized by the
hybrid layout (``get_buffer_size_hint``, ``buffer.hpp:529-593``; ``C = kNumMaxChannels = 8 x
160``): dispatch ``Su·So·N·Bd + N·Bd + So·(N + C)·Bd``, combine ``Lu·So·N·Bc + Lo·N·Bc +
So·(N + C)·Bc`` with ``Lu = min(Su, K)``, ``Lo = min(So, K)`` (``K`` each without multiple
reduction, and the scale-out send ``K·So·(N + C)·Bc``); without hybrid mode across nodes the
direct layout adds its send buffers, ``N·Bd`` and ``R·N·Bc`` (``K·R·N·Bc`` without multiple
reduction). The window is registered with ``ncclCommWindowRegister`` on the communicator (every
rank of the group: NCCL's bootstrap barrier, ``nccl.cu:122-125``) and deregistered by
``destroy()``'s ``nccl_context->finalize()`` after its GPU barrier (``nccl.cu:145-152``); across
nodes the emulation rendezvouses both over the group's ranks (``deepepv2 window register`` /
``deepepv2 window deregister``, bounded like the destroy barrier: a peer that never arrives
raises "a GPU would trap" where the real bootstrap barrier would hang). The hybrid combine
reduces each token's copies per node on that node's forwarder into bf16 (the scale-out send
buffer), then the nodes' partials in float32 with one rounding (``hybrid_combine.cuh``): the
emulation rounds the same way, so a token whose copies sit on two ranks of one node and on
another node can differ from the one-node sum (with top-k <= 2 it cannot). ``deterministic`` is
refused in the hybrid layout (``buffer.hpp:822``).

Scale-down, and what is not emulated across nodes: a real node has 8 GPUs (or 72 in an NVL72
domain) and the scale-out hop runs over NCCL GIN (RDMA, one QP set per rail); here a node is
``MOE_RELEASE_RANKS_PER_NODE`` CPU ranks and every hop is a gloo collective. The hybrid handle's
channel metadata (``dst_buffer_slot_idx [C_h, So, ceil(N / C_h), K]``,
``token_metadata_at_forward``, ``channel_linked_list``, ``buffer.hpp:819-888``) is sized by the
channel count the device's shared memory and SM count give (``buffer.hpp:760-780``), which the
emulation does not model: the handle keeps the direct layout's fields and shapes, and
``psum_num_recv_tokens_per_scaleup_rank`` keeps ``[R]`` (the real one has ``[Su]``). The
received rows keep the direct layout's order (sources ascending), one the hybrid kernels' channel
order need not give. ``ncclDevCommCreate``/``ncclDevCommDestroy`` and the one-node window's
registration (folded into the constructor's barrier, as before) are not logged.

**The communicator** (``deep_ep/utils/comm.py:10-71``): the buffer is built on the NCCL
communicator ``get_nccl_comm_handle(group)`` gives, which is one DeepEP creates for the group
(``managed``, destroyed with its last handle) unless ``EP_REUSE_NCCL_COMM=1`` and the group's
backend exposes ``_comm_ptr``, when it is the process group's own (not managed). The emulation
takes ``EP_REUSE_NCCL_COMM=1`` as the reuse (gloo has no ``_comm_ptr``; a real job runs NCCL) and
refuses ``destroy()`` of a buffer on a reused communicator once its process group is destroyed:
the real barrier and ``nccl_context->finalize()`` (``buffer.hpp:141-148``) would run on a
communicator freed with its group.
"""

import os
import weakref
from typing import List, NamedTuple, Optional

import torch
import torch.distributed as dist

from moe_release import settings
from moe_release.runtime.kernels.emulation_common import (
    EventHandle,
    EventOverlap,
    all_to_all,
    buffer_device,
    count_set,
    group_rank,
    group_size,
    host_all_gather_ints,
    kernel_host_sync,
    node_layout,
)
from moe_release.runtime.measure import faults

# The DeepEP commit the tables above were read from.
DEEP_EP_V2_SOURCE_COMMIT = "018f21ea62c6c2888d9b46806aad6d90b399b23d"

# ``layout::WorkspaceLayout::get_num_bytes()`` (layout.cuh:43-81): barrier signals 16, notify
# reduction (1024 + 2048) x 8, scale-up rank/expert send-recv 1024 x 8 x 2 + 2048 x 8 x 2, atomic
# sender count 1024 x 4, scale-out rank/expert send-recv 1024 x 4 x 2 + 2048 x 4 x 2, channel
# metadata 1024 x 1024 x 8, channel tail 1024 x 1024 x 4, PP counters 32, AGRS signals
# 33 x 1024 x 4; 12,820,528 rounded up to 32.
WORKSPACE_BYTES = 12_820_544

# SMs of the device the placement rules describe (an H100), for ``get_theoretical_num_sms``.
DEVICE_SMS = 132

# GPUs of one NVLink domain (NCCL's LSA team) on the node the placement rules describe: an
# 8-GPU H100 node. ``emulation_common.node_layout`` caps the emulated node at it.
NVL_RANKS_PER_NODE = 8

# ``ElasticBuffer::kNumMaxChannels`` (buffer.hpp:56-58): 8 channels per SM x 160 SMs, the slack
# of the hybrid layout's scale-out buffers (buffer.hpp:552, 588).
MAX_CHANNELS = 8 * 160

# ElasticBuffers built with explicitly_destroy and dropped without destroy(): DeepEP leaks
# them, so their bytes stay allocated here too.
LEAKED_BUFFERS: List[torch.Tensor] = []

# Every live emulated runtime, for release_for_exit().
_RUNTIMES: "weakref.WeakSet[_ElasticRuntime]" = weakref.WeakSet()


def _a32(n: int) -> int:
    return (n + 31) // 32 * 32


def _refuse(condition: bool, where: str, what: str) -> None:
    """An ``EP_HOST_ASSERT``: pybind turns DeepEP's exception into a RuntimeError."""
    if not condition:
        raise RuntimeError(f"Assertion exception ({where}): {what}")


def dispatch_token_bytes(hidden: int, num_topk: int, elem: int = 2, fp8: bool = False) -> int:
    """Bytes of one token in the dispatch buffer, ``TokenLayout(H * elem, sf * 4, K, true)``
    (``dispatch.hpp:209-212``, ``layout.cuh:195-209``): hidden bytes, scaling factors, top-k
    indices and weights (8 per k) and the metadata ``(1 + K) * 4``, each rounded up to 32."""
    sf_packs = -(-hidden // 32) if fp8 else 0
    return _a32(hidden * elem) + _a32(4 * sf_packs) + _a32(num_topk * 8 + (1 + num_topk) * 4)


def combine_token_bytes(hidden: int, num_topk: int) -> int:
    """Bytes of one token in the combine buffer, ``TokenLayout(H * 2, 0, K, false)``
    (``combine.hpp:109-112``): bf16 hidden and the top-k weights and slots (8 per k)."""
    return _a32(hidden * 2) + _a32(num_topk * 8)


def buffer_size_hint(
    num_ranks: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int = 0,
    use_fp8_dispatch: bool = False,
    allow_multiple_reduction: bool = True,
    elem: Optional[int] = None,
    num_scaleout_ranks: int = 1,
    is_scaleup_nvlink: bool = True,
) -> int:
    """``ElasticBuffer::calculate_buffer_size`` (``buffer.hpp:595-629``): the larger of the
    dispatch (``buffer.hpp:529-556``) and combine (``buffer.hpp:558-593``) layouts for
    ``num_scaleout_ranks`` scale-out ranks of ``num_ranks / num_scaleout_ranks`` scale-up ranks
    each (1: the direct layout; ``is_scaleup_nvlink`` False: a scale-up domain wider than the
    NVLink domain, ``allow_hybrid_mode=False`` across nodes, which adds send buffers). ``elem``
    overrides the token element size (a dispatch checks the buffer with ``x.element_size()``,
    ``buffer.hpp:898-902``)."""
    _refuse(num_max_tokens_per_rank > 0 and hidden > 0, "buffer.hpp:600", "N > 0 and H > 0")
    _refuse(-(-hidden // 32) * 4 <= hidden, "buffer.hpp:603", "ceil_div(H, 32) * 4 <= H")
    k = 32 if num_topk == 0 else num_topk
    elem = elem or (1 if use_fp8_dispatch else 2)
    _refuse(hidden * elem % 32 == 0, "layout.cuh:199", "num_hidden_bytes % 32 == 0")
    n, so = num_max_tokens_per_rank, num_scaleout_ranks
    su = num_ranks // so
    bd = dispatch_token_bytes(hidden, k, elem, use_fp8_dispatch)
    bc = combine_token_bytes(hidden, k)
    amr = allow_multiple_reduction
    if so == 1:
        dispatch = (0 if is_scaleup_nvlink else 1) * n * bd + num_ranks * n * bd
        reductions = min(num_ranks, k) if amr else k
        send = (0 if is_scaleup_nvlink else num_ranks) * n * (1 if amr else k) * bc
        combine = send + reductions * n * bc
    else:
        # Scale-up receive (Su x So*N), scale-out send (1 x N), scale-out receive (So x (N +
        # kNumMaxChannels)); combine: scale-up receive, scale-out receive, scale-out send.
        dispatch = su * so * n * bd + n * bd + so * (n + MAX_CHANNELS) * bd
        up = min(su, k) if amr else k
        out = min(so, k) if amr else k
        combine = up * so * n * bc + out * n * bc + (1 if amr else k) * so * (n + MAX_CHANNELS) * bc
    return max(dispatch, combine)


class DomainLayout(NamedTuple):
    """``NCCLSymmetricMemoryContext``'s domains (``nccl.cu:51-62, 105-119``): the physical
    (RDMA x NVLink ranks, the NVLink domain being NCCL's LSA team) and the logical (scale-out x
    scale-up ranks) sizes, this rank's indices, and whether scale-up is NVLink."""

    num_rdma_ranks: int
    num_nvl_ranks: int
    num_scaleout_ranks: int
    num_scaleup_ranks: int
    scaleout_rank_idx: int
    scaleup_rank_idx: int
    is_scaleup_nvlink: bool


def domain_layout(group, allow_hybrid_mode: bool) -> DomainLayout:
    """The group's domains, its NVLink domain (LSA team) the emulated node
    (:func:`moe_release.runtime.kernels.emulation_common.node_layout`)."""
    nodes = node_layout(group, NVL_RANKS_PER_NODE)
    size, rank = group_size(group), group_rank(group)
    if allow_hybrid_mode:
        so, su = nodes.nodes, nodes.ranks_per_node
    else:
        so, su = 1, size
    return DomainLayout(
        nodes.nodes, nodes.ranks_per_node, so, su, rank // su, rank % su,
        su == nodes.ranks_per_node,
    )  # fmt: skip


class EPHandle:
    """DeepEP's ``EPHandle`` (``elastic.py:24-87``): the dispatch's layout, reused by the
    cached dispatch and consumed by combine. ``send_counts``/``recv_counts`` are the
    emulation's host-side split sizes (the real kernels keep them on the device)."""

    def __init__(
        self,
        do_expand: bool,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens_per_expert_list: list,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
        dst_buffer_slot_idx: torch.Tensor,
        token_metadata_at_forward: Optional[torch.Tensor],
        channel_linked_list: Optional[torch.Tensor],
    ) -> None:
        assert topk_idx is not None
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = token_metadata_at_forward
        self.channel_linked_list = channel_linked_list
        self.num_recv_tokens = recv_src_metadata.shape[0]
        self.send_counts: List[int] = []
        self.recv_counts: List[int] = []


class NCCLCommHandle:
    """``deep_ep.utils.comm.NCCLCommHandle``: a communicator and whether DeepEP made it
    (``managed``) or took the process group's (``EP_REUSE_NCCL_COMM=1``)."""

    def __init__(self, group, managed: bool) -> None:
        self.group = group
        self.managed = managed

    def usable(self) -> bool:
        """A managed communicator lives as long as its handle; a reused one dies with its group."""
        if self.managed or self.group is None:
            return True
        try:
            dist.get_process_group_ranks(self.group)
        except (KeyError, RuntimeError, ValueError):
            return False
        return True


def get_nccl_comm_handle(group) -> NCCLCommHandle:
    """``comm.py:41-71``, without the cache: reuse the group's communicator only when asked."""
    reuse = settings.deep_ep_variable("EP_REUSE_NCCL_COMM") or "0"
    return NCCLCommHandle(group, managed=reuse != "1")


class _ElasticRuntime:
    """Stand-in for ``deep_ep._C.ElasticBuffer``: owns the window and the host workspace."""

    def __init__(
        self,
        group,
        num_bytes: int,
        explicitly_destroy: bool,
        comm: NCCLCommHandle,
        multi_node: bool = False,
    ) -> None:
        _refuse(num_bytes % 16 == 0, "nccl.cu:135-137", "window size % 16 == 0")
        # Across NVLink domains the window's registration and deregistration are rendezvous of
        # every rank of the communicator (the group's): see the module docstring.
        self.multi_node = multi_node
        self.group = group
        self.comm = comm
        # The peers destroy()'s GPU barrier waits for (buffer.hpp:141, barrier(true, true)): over
        # the NCCL window, not over the process group (moe_release.runtime.measure.faults.Fabric).
        self.fabric = faults.Fabric(group, "deepepv2")
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.exiting = False
        self.window = torch.empty(
            WORKSPACE_BYTES + num_bytes, dtype=torch.uint8, device=buffer_device()
        )
        pin = torch.cuda.is_available() or _placement_active()
        self.host_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, pin_memory=pin)
        if multi_node:
            # ncclCommWindowRegister (nccl.cu:122-125): collective over the communicator's ranks
            # (NCCL's bootstrap barrier); a peer that never registers holds the others there.
            try:
                self.fabric.barrier("deepepv2 window register")
            except faults.DeviceBarrierTimeout:
                self.window = self.host_workspace = None
                self.destroyed = True
                raise
        _RUNTIMES.add(self)

    def destroy(self) -> None:
        """``ElasticBuffer::destroy()`` (``buffer.hpp:137-151``): a barrier across the group
        (collective), then the host workspace and the window are freed."""
        _refuse(not self.destroyed, "buffer.hpp:138", "not destroyed")
        _refuse(
            self.exiting or self.comm.usable(),
            "buffer.hpp:141-148",
            "the communicator destroy() runs on is alive (EP_REUSE_NCCL_COMM=1: the process "
            "group's, destroyed with it)",
        )
        if not self.exiting:
            self.fabric.barrier("deepepv2 destroy barrier")
            if self.multi_node:
                # nccl_context->finalize() (buffer.hpp:147, nccl.cu:145-152): the window's
                # ncclCommWindowDeregister, over the communicator's ranks as its registration.
                self.fabric.barrier("deepepv2 window deregister")
        self.window = None
        self.host_workspace = None
        self.destroyed = True

    def __del__(self, _write=os.write, _faults=faults, _leaked=LEAKED_BUFFERS) -> None:
        # ~ElasticBuffer (buffer.hpp:127-135): without explicitly_destroy, destroy() and its GPU
        # barrier run from wherever the last reference went (a finalizer, a garbage
        # collection, the interpreter's exit).
        if getattr(self, "destroyed", True):
            return
        if self.exiting:
            return
        if not self.explicitly_destroy:
            try:
                self.destroy()
            except _faults.DeviceBarrierTimeout as exc:
                _write(2, f"{exc}\n".encode())
                _leaked.extend((self.window, self.host_workspace))
            return
        _faults.printf(  # printf to stdout, then fflush(stdout), as buffer.hpp:132-133
            "`destroy()` is not called before DeepEP elastic buffer destruction, which can leak "
            "resources."
        )
        _leaked.extend((self.window, self.host_workspace))


def _placement_active() -> bool:
    from moe_release.runtime.cuda import placement

    return placement.active()


def release_for_exit() -> None:
    """A process exit: every live emulated buffer frees its memory without a collective and
    without DeepEP's leak warning (the CPU runtime's job teardown, not a DeepEP call)."""
    for runtime in list(_RUNTIMES):
        runtime.exiting = True


class ElasticBuffer:
    """Emulation of ``deep_ep.ElasticBuffer`` at 018f21e (module docstring): the constructor's
    real signature (an unknown keyword raises), ``get_buffer_size_hint``, ``dispatch``,
    ``combine``, ``capture``, ``destroy``; every tuning argument is accepted and ignored."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: Optional[int] = None,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        self.group = group
        self.rank_idx = group_rank(group)
        self.num_ranks = group_size(group)
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.domains = domain_layout(group, allow_hybrid_mode)
        if num_bytes is None:
            num_bytes = buffer_size_hint(
                self.num_ranks,
                num_max_tokens_per_rank,
                hidden,
                num_topk,
                use_fp8_dispatch,
                allow_multiple_reduction,
                num_scaleout_ranks=self.domains.num_scaleout_ranks,
                is_scaleup_nvlink=self.domains.is_scaleup_nvlink,
            )
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        if num_allocated_qps == 0:
            num_allocated_qps = 129 if allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self.explicitly_destroy = explicitly_destroy
        self.nccl_comm_handle = get_nccl_comm_handle(group)
        d = self.domains
        self.runtime = _ElasticRuntime(
            group, num_bytes, explicitly_destroy, self.nccl_comm_handle, d.num_rdma_ranks > 1
        )
        faults.register_buffer(self)
        # The domains (nccl.cu:51-62, 105-119; elastic.py:207-213).
        self.num_scaleout_ranks, self.num_scaleup_ranks = d.num_scaleout_ranks, d.num_scaleup_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = d.scaleout_rank_idx, d.scaleup_rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = d.num_rdma_ranks, d.num_nvl_ranks
        # The constructor ends with a barrier on the group (elastic.py:225-227).
        if group is not None and dist.is_initialized():
            dist.barrier(group=group)

    def destroy(self) -> None:
        """``elastic.py:229-238``: needs ``explicitly_destroy``; a second call does nothing."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            self.runtime.destroy()
            self.runtime = None
            self.nccl_comm_handle = None

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
    ) -> int:
        """The recommended buffer size in bytes (``elastic.py:240-264``)."""
        d = domain_layout(group, allow_hybrid_mode)
        return buffer_size_hint(
            group_size(group),
            num_max_tokens_per_rank,
            hidden,
            num_topk,
            use_fp8_dispatch,
            allow_multiple_reduction,
            num_scaleout_ranks=d.num_scaleout_ranks,
            is_scaleup_nvlink=d.is_scaleup_nvlink,
        )

    @staticmethod
    def capture() -> EventHandle:
        """An event recorded on the current stream (``elastic.py:348-356``)."""
        return EventHandle()

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int) -> int:
        """``elastic.py:536-642`` on this host: without ``nvidia-smi`` the NVLink bandwidth
        reads 0 GB/s (``envs.py:192-219``), so 4 SMs with traffic, all of them (an H100's 132)
        on one rank."""
        assert num_experts % self.num_ranks == 0
        return DEVICE_SMS if self.num_ranks == 1 else 4

    def _live(self, name: str):
        if self.runtime is None:
            raise AttributeError(f"'NoneType' object has no attribute '{name}'")
        return self.runtime

    @staticmethod
    def _stream_prologue(previous_event, allocate_on_comm_stream: bool) -> None:
        _refuse(
            previous_event is None or allocate_on_comm_stream,
            "buffer.hpp:482-483",
            "previous_event requires allocate_on_comm_stream",
        )

    def dispatch(
        self,
        x,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        num_experts: Optional[int] = None,
        num_max_tokens_per_rank: Optional[int] = None,
        expert_alignment: Optional[int] = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        previous_event_before_epilogue: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: Optional[EPHandle] = None,
        do_handle_copy: bool = True,
        do_cpu_sync: Optional[bool] = None,
        do_expand: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        """Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``; with a
        cached ``handle`` the routing is the handle's, no top-k weights come back and the
        handle returned is the one passed."""
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        if isinstance(x, tuple):
            raise NotImplementedError("The DeepEP v2 emulation does not implement FP8 dispatch.")
        if do_expand or cumulative_local_expert_recv_stats is not None:
            raise NotImplementedError("The DeepEP v2 emulation implements the direct layout only.")
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            num_max_tokens_per_rank = num_max_tokens_per_rank or handle.num_max_tokens_per_rank
            num_experts = num_experts or handle.num_experts
            expert_alignment = expert_alignment or handle.expert_alignment
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == (
                handle.num_experts,
                handle.expert_alignment,
                handle.num_max_tokens_per_rank,
            )
        num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        expert_alignment = expert_alignment or 1
        self._live("dispatch")
        self._stream_prologue(previous_event, allocate_on_comm_stream)
        tokens, hidden = x.shape
        n, size, rank = num_max_tokens_per_rank, self.num_ranks, self.rank_idx
        _refuse(x.is_contiguous(), "buffer.hpp:682", "x.is_contiguous()")
        _refuse(hidden * x.element_size() % 16 == 0, "buffer.hpp:683", "hidden bytes % 16 == 0")
        _refuse(
            tokens <= n, "buffer.hpp:684", f"num_tokens {tokens} <= num_max_tokens_per_rank {n}"
        )
        _refuse(num_experts % size == 0, "buffer.hpp:733", "num_experts % num_ranks == 0")
        d = self.domains
        need = buffer_size_hint(
            size, n, hidden, num_topk, elem=x.element_size(),
            num_scaleout_ranks=d.num_scaleout_ranks, is_scaleup_nvlink=d.is_scaleup_nvlink,
        )  # fmt: skip
        _refuse(need <= self.num_bytes, "buffer.hpp:899-902", f"buffer {self.num_bytes} >= {need}")
        _refuse(
            d.num_scaleout_ranks == 1 or not self.deterministic,
            "buffer.hpp:822",
            "not deterministic (the hybrid layout has no deterministic mode)",
        )
        if handle is not None:
            recv_x, recv_idx = self._send(
                x, handle.topk_idx, None, handle.dst_buffer_slot_idx, handle.send_counts,
                handle.recv_counts, num_experts, n,
            )[:2]  # fmt: skip
            return recv_x, recv_idx, None, handle, self._event(async_with_compute_stream)
        _refuse(
            topk_idx.dtype == torch.int64 and tuple(topk_idx.shape) == (tokens, num_topk),
            "buffer.hpp:704-706",
            "topk_idx is [num_tokens, num_topk] int64",
        )
        if topk_weights is not None:
            _refuse(topk_weights.shape[0] == tokens, "buffer.hpp:712", "topk_weights rows")
            _refuse(topk_weights.dtype == torch.float32, "buffer.hpp:714", "topk_weights float")
        local = num_experts // size
        idx = topk_idx.long()
        dest = torch.where(idx >= 0, idx // local, torch.full_like(idx, -1))
        to_rank = torch.stack([(dest == d).any(1) for d in range(size)], dim=1)  # [T, R]
        sends = [count_set(to_rank[:, d]) for d in range(size)]
        # The notify phase: every rank's counts (and N, which the layout assumes equal).
        table = host_all_gather_ints([n] + sends, self.group)
        kernel_host_sync("deepepv2 dispatch")
        if any(row[0] != n for row in table):
            raise RuntimeError(
                "DeepEP v2 assumes the same num_max_tokens_per_rank on every rank (elastic.py:34; "
                f"dispatch.cuh:326 addresses slots by rank * N): got {[row[0] for row in table]}"
            )
        recvs = [row[1 + rank] for row in table]
        # dst_buffer_slot_idx: at the highest k on each destination, rank * N + slot there.
        dst_slot = torch.full((tokens, num_topk), -1, dtype=torch.int32, device=x.device)
        for d in range(size):
            ids = torch.nonzero(to_rank[:, d]).flatten()
            on_d = dest[ids] == d
            last_k = num_topk - 1 - torch.argmax(on_d.flip(1).int(), dim=1)
            dst_slot[ids, last_k] = (rank * n + torch.arange(len(ids), device=x.device)).int()
        recv_x, recv_idx, recv_weights, recv_src = self._send(
            x, topk_idx, topk_weights, dst_slot, sends, recvs, num_experts, n
        )
        counts = [count_set((recv_idx == e).any(1)) for e in range(local)]
        counts = [c + (-c % expert_alignment) for c in counts]
        psum_expert = torch.zeros(local + 1, dtype=torch.int32, device=x.device)
        psum_expert[1:] = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0)
        psum_rank = torch.tensor(recvs, dtype=torch.int32, device=x.device).cumsum(0).int()
        handle = EPHandle(
            False, num_experts, expert_alignment, n, num_sms,
            topk_idx.clone() if do_handle_copy else topk_idx, counts, psum_rank,
            psum_expert[1:], recv_src, dst_slot, None, None,
        )  # fmt: skip
        handle.send_counts, handle.recv_counts = sends, recvs
        return recv_x, recv_idx, recv_weights, handle, self._event(async_with_compute_stream)

    def _routing(self, topk_idx: torch.Tensor, slots: torch.Tensor, num_experts: int):
        """``(token_ids, ks, dest)``: the tokens this rank sends, destination by destination
        (ascending), in token order inside each, with the k holding each token's slot on that
        destination (``dst_buffer_slot_idx``) and the destination of each."""
        local = num_experts // self.num_ranks
        idx = topk_idx.long()
        dest = torch.where(idx >= 0, idx // local, torch.full_like(idx, -1))
        pairs = [torch.nonzero((slots >= 0) & (dest == d)) for d in range(self.num_ranks)]
        token_ids = torch.cat([p[:, 0] for p in pairs])
        ks = torch.cat([p[:, 1] for p in pairs])
        return token_ids, ks, dest[token_ids, ks]

    def _send(self, x, topk_idx, topk_weights, slots, sends, recvs, num_experts: int, n: int):
        """The rows of ``x`` (and of the top-k inputs) to every rank owning one of their
        experts: ``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_metadata)``."""
        k, local = topk_idx.shape[1], num_experts // self.num_ranks
        token_ids, _, _ = self._routing(topk_idx, slots, num_experts)
        recv_x = all_to_all(x[token_ids], sends, recvs, self.group)
        recv_idx = all_to_all(topk_idx.long()[token_ids], sends, recvs, self.group)
        begin = self.rank_idx * local
        mine = (recv_idx >= begin) & (recv_idx < begin + local)
        recv_topk_idx = torch.where(mine, recv_idx - begin, torch.full_like(recv_idx, -1))
        recv_weights = None
        if topk_weights is not None:
            recv_weights = all_to_all(topk_weights[token_ids], sends, recvs, self.group)
        # recv_src_metadata: column 0 src_rank * N + token, column 1 src_rank * K + the highest
        # local k; the other columns are left uninitialized outside the expand layout.
        src = all_to_all((token_ids + self.rank_idx * n).to(torch.int32), sends, recvs, self.group)
        highest = k - 1 - torch.argmax(mine.flip(1).int(), dim=1)
        recv_src = torch.empty((recv_x.shape[0], k + 2), dtype=torch.int32, device=x.device)
        recv_src[:, 0] = src
        recv_src[:, 1] = ((src // n) * k + highest).to(torch.int32)
        return recv_x, recv_topk_idx, recv_weights, recv_src

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: Optional[torch.Tensor] = None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: Optional[EventHandle] = None,
        previous_event_before_epilogue: Optional[EventHandle] = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Returns ``(combined_x[T, H], combined_topk_weights[T, K] float32 | None, event)``."""
        self._live("combine")
        self._stream_prologue(previous_event, allocate_on_comm_stream)
        if bias is not None:
            raise NotImplementedError("The DeepEP v2 emulation does not implement combine bias.")
        hidden = x.shape[1]
        _refuse(x.dtype == torch.bfloat16, "buffer.hpp:1134", "x.scalar_type() == kBFloat16")
        _refuse(x.is_contiguous(), "buffer.hpp:1133", "x.is_contiguous()")
        _refuse(
            x.shape[0] == handle.recv_src_metadata.shape[0],
            "buffer.hpp:1150",
            f"x has {x.shape[0]} rows, the dispatch received {handle.recv_src_metadata.shape[0]}",
        )
        if hidden % 256:
            raise RuntimeError(
                f"NVCC compilation failed: combine_impl needs hidden % 256 == 0, got {hidden} "
                "(combine.cuh:109 static assert)"
            )
        k = handle.topk_idx.shape[1]
        if topk_weights is not None:
            _refuse(
                tuple(topk_weights.shape) == (x.shape[0], k)
                and topk_weights.dtype == torch.float32,
                "buffer.hpp:1160-1163",
                "topk_weights is [num_recv_tokens, num_topk] float32",
            )
        sends, recvs = handle.send_counts, handle.recv_counts
        token_ids, _, dest = self._routing(
            handle.topk_idx, handle.dst_buffer_slot_idx, handle.num_experts
        )
        tokens = handle.topk_idx.shape[0]
        back = all_to_all(x, recvs, sends, self.group)
        combined = self._reduce(back, token_ids, dest, tokens, hidden, x.dtype)
        combined_weights = None
        if topk_weights is not None:
            # Column k of a token comes from the rank owning its expert k (0 for -1 slots).
            back_w = all_to_all(topk_weights, recvs, sends, self.group)
            local = handle.num_experts // self.num_ranks
            idx = handle.topk_idx.long()
            owner = torch.where(idx >= 0, idx // local, torch.full_like(idx, -1))
            take = owner[token_ids] == dest.unsqueeze(1)
            rows, cols = torch.nonzero(take).unbind(1)
            combined_weights = torch.zeros((tokens, k), dtype=torch.float32, device=x.device)
            combined_weights[token_ids[rows], cols] = back_w[rows, cols]
        return combined, combined_weights, self._event(async_with_compute_stream)

    def _reduce(self, back, token_ids, dest, tokens: int, hidden: int, dtype) -> torch.Tensor:
        """Each token's copies summed: in float32 with one rounding in the direct layout; in
        the hybrid one, first over the ranks of each scale-out rank (node) on that node's
        forwarder, rounded to bf16 into the scale-out send buffer (``hybrid_combine.cuh:
        66-74, 491-519``), then the nodes' partials in float32 with one more rounding."""
        su = self.num_scaleup_ranks
        acc = torch.zeros((tokens, hidden), dtype=torch.float32, device=back.device)
        if self.num_scaleout_ranks == 1:
            if back.shape[0]:
                acc.index_add_(0, token_ids, back.float())
            return acc.to(dtype)
        for node in range(self.num_scaleout_ranks):
            mine = torch.nonzero(dest // su == node).flatten()
            part = torch.zeros((tokens, hidden), dtype=torch.float32, device=back.device)
            if mine.shape[0]:
                part.index_add_(0, token_ids[mine], back[mine].float())
            acc += part.to(torch.bfloat16).float()
        return acc.to(dtype)

    @staticmethod
    def _event(async_with_compute_stream: bool) -> EventOverlap:
        return EventOverlap(EventHandle() if async_with_compute_stream else None)
