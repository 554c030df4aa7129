# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of DeepEP's normal-mode ``Buffer`` (the ``deepep`` flex backend).

``Buffer.get_dispatch_layout`` / ``dispatch`` / ``combine`` in "normal" mode, intranode and,
when the group spans several emulated nodes, internode (its multi-node path: "Across nodes"
below), over plain ``torch.distributed`` collectives (gloo works): a token is sent once to each
rank owning
one of its top-k experts; received top-k indices are made local (``-1`` and weight ``0`` for
experts on other ranks); combine sums the copies of each token (and the top-k weights) on the
source rank, in float32, ranks ascending. Any floating dtype is accepted, although the real
kernels move bf16/fp8 payloads only.

**Outputs as the real kernels return them** (the tables below), "device" and "pinned" as in
:mod:`moe_release.runtime.kernels.hybridep_emulation`. The contents of the handle fields that only
the kernels read (the prefix matrices and ``send_head``) are the emulation's own encoding of the
same routing, in the real fields' shapes and dtypes; the collectives' split sizes ride on the handle
(a ``tuple`` subclass) as Python ints, so handles hold no tensor bytes the real ones do not.

Source: DeepEP's ``hybrid-ep`` branch at **94a9f8f** (``94a9f8f6b146c07d97ec58f67cd6d303296d6098``),
whose build provides the normal-mode ``Buffer`` beside ``HybridEPBuffer`` (megatron-core 0.19.2's
CI pin de0dd11 is not in our mirror; see :mod:`moe_release.runtime.kernels.hybridep_emulation`).

Sizes: T = tokens per rank, K = top-k, H = hidden size, E_l = local experts, E = all experts,
R = ranks, Nr = received tokens, C = channels (``num_sms // 2``). Modes: ``async`` is megatron's
``async_finish=True, allocate_on_comm_stream=True`` with a ``previous_event``, ``sync`` leaves
them off (device, dtype and shape are the same in both); combine ``weights`` is
``FusedDispatch.backward``, ``no weights`` the forward combine. Sources are cited by file name:
``deep_ep.cpp`` under ``csrc/``, ``buffer.py`` and ``utils.py`` under ``deep_ep/``; ``h[i]`` is
item ``i`` of the returned handle.

Kernel outputs, by call (the tests parse these tables, one test per row and mode):

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
:func:`moe_release.runtime.cuda.placement.count_sync` under the placement rules (the host then waits
for the current stream); the emulation's own bookkeeping reads sizes from shapes and host metadata
and adds none:

| call | mode | syncs | kind | source @94a9f8f |
|---|---|---|---|---|
| deepep layout | all | 0 | - | deep_ep.cpp:406-422 |
| deepep dispatch | all | 1 | deepep dispatch | deep_ep.cpp:597-615 |
| deepep cached dispatch | all | 0 | - | deep_ep.cpp:559-567 |
| deepep combine | all | 0 | - | deep_ep.cpp:782-798 |

The fresh dispatch: the CPU busy-waits for the received counts in mapped host memory.

**The buffer**, read from the source at 94a9f8f by this emulation itself, not taken from the
memory planner, so that the report's planner rows compare two readings. The real NVLink/RDMA
buffers live outside PyTorch's allocator; the emulation allocates what the constructor
(``deep_ep.cpp:127-207``) and ``sync`` (``deep_ep.cpp:341-356``) do for the ``num_nvl_bytes`` and
``num_rdma_bytes`` megatron-core's ``get_buffer`` asks (the maximum of the :class:`Config`
hints of the dispatch and combine configs, ``buffer.py:240-281``), the device terms as one
counted tensor (``memory``), the mapped pinned counters apart (``terms`` lists them all).
Sizes: C = channels (``num_sms / 2``), Rn = NVLink ranks ``min(R, P)``, Rr = RDMA ranks (nodes)
``max(R / P, 1)``, P = a node's ranks (8 on a real node; "Across nodes"), Bh = hidden bytes,
r_nvl / r_rdma = the config's NVLink / RDMA receive chunk (the RDMA one rounded up to a multiple
of its send chunk, ``config.hpp:45``), ``a128`` rounds up to 128; Bt = Bh + 8 + 128 x (8 + 4 +
4), a token's hidden bytes, source metadata (``sizeof(SourceMeta)``,
``csrc/kernels/internode.cu:17-18``: NVSHMEM compiled in), top-k indices and weights and
scales. The barrier block only with an NVLink buffer (``deep_ep.cpp:171``); the RDMA buffer is
0 on one node. ``configs.cuh`` is
``csrc/kernels/configs.cuh``, ``config.hpp`` ``csrc/config.hpp``.

[deepep buffer] ``Buffer(group, num_nvl_bytes, num_rdma_bytes)`` and the hints sizing them

| term | where | bytes | source @94a9f8f |
|---|---|---|---|
| NVLink buffer (num_nvl_bytes) | device | a128(C Rn ((2 Rr + 3) 4 + r_nvl Bt)) | config.hpp:51-73 |
| NVLink barrier signals and pointers | device | 8 x (4 + 8 + 8) | deep_ep.cpp:145-147 |
| workspace | device | 32 MiB | configs.cuh:5, deep_ep.cpp:187 |
| receive token counter | pinned | 8 | deep_ep.cpp:191 |
| receive expert counters | pinned | 4 x 1024 | deep_ep.cpp:196 |
| RDMA receive counter | pinned, never freed | 4 | deep_ep.cpp:203 |
| RDMA buffer (num_rdma_bytes) | device | a128(C Rr (144 + 2 r_rdma (Bt+16))) | config.hpp:75-103 |

``destroy()`` frees all but the RDMA receive counter (``deep_ep.cpp:269-309``); the 144 of the
RDMA buffer's formula is its per-channel counters, ``(2 x 8 + 2) x 2`` ints whatever P (8:
``NUM_MAX_NVL_PEERS`` slots), as the barrier block's 8.
``explicitly_destroy`` is honoured as deep_ep does: ``destroy()`` needs it, is collective, and
leaves the buffer unusable; a flagged buffer dropped without it stays allocated (deep_ep leaks
it) and the destructor's warning is printed. A buffer built without the flag is destroyed by its
destructor (``~Buffer``, ``deep_ep.cpp:209-211``), collective too. The collective is
``intranode::barrier`` across the NVLink peers (``deep_ep.cpp:276-277``, only with an NVLink
buffer), which runs over IPC-mapped signals and not over the process group: the emulation
rendezvouses the peers on the job's store (:class:`moe_release.runtime.measure.faults.Fabric`),
logged as a device-side collective with the context it ran from, and bounded: a peer that never
arrives makes it raise "a GPU would trap" (the kernel's timeout), in the destructor printed to
stderr with the bytes kept. With an RDMA buffer (across nodes) ``destroy()`` then runs
``internode::barrier()``, ``free`` and ``finalize()`` (``deep_ep.cpp:291-297``):
``nvshmem_barrier_all``, ``nvshmem_free`` and ``nvshmem_finalize`` (``runtime.cu:75-89``), each
a collective over every PE of the rank's NVSHMEM job, emulated the same way over exactly those
ranks ("deepep nvshmem barrier", "deepep nvshmem free", "deepep nvshmem finalize"). A rendezvous
that times out frees nothing: the trapped kernel leaves the context unusable.

**Across nodes.** DeepEP's node is ``NUM_MAX_NVL_PEERS`` (8) consecutive ranks of the group
(``rdma_rank = rank / 8``, ``nvl_rank = rank % 8``, ``deep_ep.cpp:159-160``). The emulation
reads the node from :func:`moe_release.runtime.kernels.emulation_common.node_layout`
(``MOE_RELEASE_RANKS_PER_NODE``, at most 8: a larger NVLink domain is cut into nodes of 8, as
``rank / 8`` cuts it; unset, every rank of a group of up to 8 on one node), so 4 CPU ranks can
be 2 nodes of 2 (P = 2). Then, as deep_ep does past one node:

* the :class:`Config` hints count the node's ranks (Rn = P, Rr = R / P), so
  ``get_rdma_buffer_size_hint`` is > 0 and megatron-core's ``get_buffer`` asks an RDMA buffer;
* the constructor all-gathers the IPC handles over the group, but the intranode barrier
  (``destroy()``'s) rendezvouses the node's ranks only (``sync`` maps those, ``:316-331``);
  the NVSHMEM unique ids are all-gathered over the group (``buffer.py:102-129``: each rank of
  node 0 makes one), and in normal mode each rank joins the NVSHMEM job of its local rank: the
  ranks ``local + n x P`` of every node n, one PE each (``nvshmem_rank = rdma_rank``,
  ``deep_ep.cpp:347-349``), whose init (bootstrap, ``nvshmem_barrier_all``, ``nvshmem_align``)
  is one more rendezvous, "deepep nvshmem init", and whose barrier, free and finalize
  ``destroy()`` runs;
* ``get_dispatch_layout`` returns ``num_tokens_per_rdma_rank`` and ``dispatch`` / ``combine``
  take the internode path (``buffer.py:376-380, 453-455``): :meth:`Buffer.internode_dispatch`,
  whose docstring holds the tables of its outputs (``[deepep internode dispatch]`` and the rest),
  with the same rows, in the same order, and so the same numerics, as one node.

What differs from a real 8-GPU node: real DeepEP runs internode only from 16 ranks (and refuses
``num_rdma_bytes`` on one node, ``deep_ep.cpp:154-155``, which the emulation accepts); the
configs are those of the group's size (4 ranks: the 4-rank config's RDMA chunks, which a real
4-rank job never uses); what the kernels size by ``NUM_MAX_NVL_PEERS`` at compile time stays 8
(the barrier block, the RDMA counters above, ``SourceMeta``'s 8 bits, ``send_nvl_head``'s 8
columns, past P holding -1); the RDMA buffer is counted at ``num_rdma_bytes``, not at the
symmetric heap NVSHMEM reserves (``NVSHMEM_CUMEM_GRANULARITY`` = 512 MiB steps,
``buffer.py:119``), and NVSHMEM is not process-wide here (megatron-core's patched ``get_buffer``
refuses a second internode buffer itself); the tokens move in one collective per tensor, not
over RDMA to the rank of the same local rank on each node and on over NVLink; and, as on one
node, the emulation does not check that the hints fit the buffer (``internode.cu:338-339``).
"""

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_release import settings
from moe_release.runtime.cuda import placement
from moe_release.runtime.kernels.emulation_common import (
    BufferTerm,
    EventOverlap,
    NodeLayout,
    all_to_all,
    buffer_device,
    cdiv,
    count_set,
    dense_rows,
    event,
    group_rank,
    group_size,
    host_all_gather_ints,
    kernel_host_sync,
    node_layout,
    sent_token_ids,
    sum_rows,
)
from moe_release.runtime.measure import faults

# The DeepEP commit the tables above were read from.
DEEP_EP_SOURCE_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# csrc/kernels/configs.cuh:3-6 at that commit.
NUM_MAX_NVL_PEERS = 8
NUM_MAX_RDMA_PEERS = 20
NUM_WORKSPACE_BYTES = 32 * 1024 * 1024
NUM_MAX_LOCAL_EXPERTS = 1024


# sizeof(internode::SourceMeta), two ints (csrc/kernels/internode.cu:17-18,40-42).
SOURCE_META_BYTES = 8
# kNumMaxTopK and kNumMaxScales of the size hints (csrc/config.hpp:54-55, 83-84).
NUM_MAX_TOPK = 128
NUM_MAX_SCALES = 128
# Buffer.get_dispatch_config / get_combine_config: (nvl_send, nvl_recv, rdma_send, rdma_recv)
# chunk tokens per group size (deep_ep/buffer.py:240-251 and 268-279); any other is refused.
DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128),
    128: (20, 560, 32, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128),
    128: (1, 560, 12, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


def _align_up(value: int, multiple: int) -> int:
    """``align_up`` (``csrc/config.hpp:14-17``)."""
    return (value + multiple - 1) // multiple * multiple


def _ranks_per_node() -> int:
    """The ranks of one emulated node as DeepEP sees it: ``MOE_RELEASE_RANKS_PER_NODE``, at most
    ``NUM_MAX_NVL_PEERS`` (``rdma_rank = rank / NUM_MAX_NVL_PEERS`` splits a larger NVLink
    domain into nodes of 8, ``deep_ep.cpp:159``); unset: 8."""
    return min(settings.ranks_per_node() or NUM_MAX_NVL_PEERS, NUM_MAX_NVL_PEERS)


def node_ranks(num_ranks: int) -> Tuple[int, int]:
    """``(num_nvl_ranks, num_rdma_ranks)`` of a group of ``num_ranks``
    (``deep_ep.cpp:159-160``, ``config.hpp:56-59``) on the emulated nodes (the module
    docstring's "Across nodes"): ``min(R, P)`` NVLink peers and ``max(R / P, 1)`` RDMA ranks, P
    the node's ranks. A group beyond one node that does not fill whole nodes is refused, as
    ``config.hpp:56`` asserts."""
    per = _ranks_per_node()
    nvl = min(num_ranks, per)
    if num_ranks > per and num_ranks % per:
        raise ValueError(
            f"{num_ranks} ranks do not fill nodes of {per} (csrc/config.hpp:56 asserts "
            f"num_ranks % NUM_MAX_NVL_PEERS == 0; {settings.RANKS_PER_NODE})"
        )
    return nvl, max(num_ranks // per, 1)


def deep_ep_layout(group) -> NodeLayout:
    """Where this rank sits on the emulated nodes, as DeepEP places it (``rdma_rank``,
    ``nvl_rank``, ``deep_ep.cpp:159-160``): :func:`emulation_common.node_layout` with DeepEP's
    ``NUM_MAX_NVL_PEERS``, a node of more than 8 split into nodes of 8 as DeepEP splits it, and
    at most ``NUM_MAX_RDMA_PEERS`` nodes (``deep_ep.cpp:152``)."""
    layout = node_layout(group, NUM_MAX_NVL_PEERS)
    if layout.ranks_per_node > NUM_MAX_NVL_PEERS:
        size = layout.ranks_per_node * layout.nodes
        rank = layout.node * layout.ranks_per_node + layout.local_rank
        if size % NUM_MAX_NVL_PEERS:
            raise ValueError(
                f"{size} ranks: deep_ep needs num_ranks % NUM_MAX_NVL_PEERS == 0 beyond "
                f"{NUM_MAX_NVL_PEERS} (csrc/deep_ep.cpp:153)"
            )
        per = NUM_MAX_NVL_PEERS
        layout = NodeLayout(per, size // per, rank // per, rank % per)
    if layout.nodes > NUM_MAX_RDMA_PEERS:
        raise ValueError(
            f"{layout.nodes} nodes: deep_ep's normal mode spans at most NUM_MAX_RDMA_PEERS = "
            f"{NUM_MAX_RDMA_PEERS} (csrc/deep_ep.cpp:152)"
        )
    return layout


class Config:
    """DeepEP's tuning ``Config(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv)``
    (``csrc/config.hpp:24-49``): the RDMA receive chunk is rounded up to a multiple of the send
    chunk (``config.hpp:45``); the buffer size hints are the module docstring's
    ``[deepep buffer]`` formulas, with NVSHMEM compiled in."""

    def __init__(self, num_sms: int = 20, *chunk_sizes: int) -> None:
        self.num_sms = num_sms
        if len(chunk_sizes) == 4:
            send, recv = chunk_sizes[2], chunk_sizes[3]
            chunk_sizes = (*chunk_sizes[:3], _align_up(recv, send))
        self.chunk_sizes = chunk_sizes

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """NVLink buffer bytes for ``num_ranks`` ranks (``config.hpp:51-73``): per channel
        (``num_sms / 2``) and NVLink rank, ``2 x RDMA ranks + 3`` int counters, then per
        received-chunk token the hidden bytes, the source metadata, top-k indices (int64) and
        weights (fp32) and the scales (fp32); rounded up to 128 bytes. The NVLink and RDMA
        ranks are the emulated node's (:func:`node_ranks`; the real one divides by
        ``NUM_MAX_NVL_PEERS``)."""
        nvl_ranks, rdma_ranks = node_ranks(num_ranks)
        slots = self.num_sms // 2 * nvl_ranks
        recv = self.chunk_sizes[1]
        per_token = hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4
        return _align_up(slots * (2 * rdma_ranks + 3) * 4 + slots * recv * per_token, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """RDMA buffer bytes (``config.hpp:75-103``): 0 on one node (the real one: up to
        ``NUM_MAX_NVL_PEERS`` ranks); else per channel and RDMA rank (node, :func:`node_ranks`)
        ``(2 x 8 + 2) x 2`` int counters (8: the kernels' ``NUM_MAX_NVL_PEERS`` slots, whatever
        the node's size) and, doubled (send and receive), per received-chunk token what the
        NVLink hint holds plus an ``int4``."""
        _, rdma_ranks = node_ranks(num_ranks)
        if rdma_ranks == 1:
            return 0
        slots = self.num_sms // 2 * rdma_ranks
        recv = self.chunk_sizes[3]
        per_token = hidden_bytes + SOURCE_META_BYTES + NUM_MAX_TOPK * (8 + 4) + NUM_MAX_SCALES * 4
        counters = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        return _align_up(counters + slots * recv * (per_token + 16) * 2, 128)


# The pinned host terms of buffer_terms (cudaMallocHost), the rest is device memory.
_PINNED = ("receive token counter", "receive expert counters", "RDMA receive counter")


def buffer_terms(num_nvl_bytes: int, num_rdma_bytes: int) -> List[BufferTerm]:
    """Every allocation of one rank's normal-mode ``Buffer`` built with these byte counts
    (megatron-core's ``get_buffer`` asks the :class:`Config` hints): the module docstring's
    ``[deepep buffer]`` table, row for row."""
    nvl = num_nvl_bytes > 0  # deep_ep.cpp:171
    table = [
        ("NVLink buffer (num_nvl_bytes)", num_nvl_bytes, "config.hpp:51-73", True),
        ("NVLink barrier signals and pointers", NUM_MAX_NVL_PEERS * (4 + 8 + 8) if nvl else 0,
         "deep_ep.cpp:145-147", True),
        ("workspace", NUM_WORKSPACE_BYTES, "configs.cuh:5, deep_ep.cpp:187", True),
        ("receive token counter", 8, "deep_ep.cpp:191", True),
        ("receive expert counters", 4 * NUM_MAX_LOCAL_EXPERTS, "deep_ep.cpp:196", True),
        ("RDMA receive counter", 4, "deep_ep.cpp:203", False),
        ("RDMA buffer (num_rdma_bytes)", num_rdma_bytes, "config.hpp:75-103", True),
    ]  # fmt: skip
    return [BufferTerm(n, b, src, released) for n, b, src, released in table if b]


# Buffers built with explicitly_destroy that were never destroyed, and the RDMA receive counter
# of every destroyed one: deep_ep leaks them, so their bytes stay allocated here too.
LEAKED_BUFFERS: List[torch.Tensor] = []


class _EmulatedRuntime:
    """Stand-in for ``deep_ep_cpp.Buffer``: its ``destroy()`` (``csrc/deep_ep.cpp:269-309``)
    synchronizes the device and, with an NVLink buffer, runs ``intranode::barrier`` across the
    node's NVLink peers (``deep_ep.cpp:276-277``): a device-side collective over the IPC-mapped
    barrier signals, not over the process group, so it rendezvouses (and hangs) whatever became
    of the group. With an RDMA buffer (across nodes) it then runs ``internode::barrier()``,
    ``internode::free`` and ``internode::finalize()`` (``deep_ep.cpp:291-297``:
    ``nvshmem_barrier_all``, ``nvshmem_free``, ``nvshmem_finalize``, ``runtime.cu:75-89``),
    collectives over every PE of the rank's NVSHMEM job: in normal mode the ranks with its local
    rank on every node (``deep_ep.cpp:347-349``). Each is emulated by
    :class:`moe_release.runtime.measure.faults.Fabric` over exactly those ranks (a bounded
    barrier on the job's store; past its bound it raises, as the kernel traps)."""

    def __init__(
        self,
        group: Optional[dist.ProcessGroup],
        num_nvl_bytes: int,
        num_rdma_bytes: int,
        layout: NodeLayout,
    ) -> None:
        self.layout = layout
        per, node, local = layout.ranks_per_node, layout.node, layout.local_rank
        ranks = faults.group_ranks(group) or (0,)
        # The constructor all-gathers the device ids and IPC handles over the whole group
        # (deep_ep/buffer.py:94-100); sync() maps those of its node's NVLink peers only
        # (deep_ep.cpp:316-331): the barrier signals destroy() uses are theirs.
        tokens = faults.exchange(group)
        peers = slice(node * per, node * per + per)
        self.fabric = None
        if num_nvl_bytes > 0:
            self.fabric = faults.Fabric(group, "deepep", tokens[peers], ranks=ranks[peers])
        self.nvshmem = None
        if layout.nodes > 1:
            # NVSHMEM's unique ids (buffer.py:102-129): the ranks of RDMA rank 0 make one each,
            # all-gathered over the group; a rank takes its local rank's (get_root_rdma_rank(
            # true) = nvl_rank, deep_ep.cpp:234-236): one NVSHMEM job per local rank.
            ids: List[Optional[str]] = [None] * len(ranks)
            mine = os.urandom(6).hex() if node == 0 else None
            dist.all_gather_object(ids, mine, group=group)
            if num_rdma_bytes > 0:
                # sync(): internode::init with nvshmem_rank = rdma_rank over num_rdma_ranks PEs
                # (deep_ep.cpp:347-349, runtime.cu:50-69: its bootstrap and barrier_all), the
                # barrier, nvshmem_align (collective) and the barrier again (:350-360).
                team = ranks[local::per]
                self.nvshmem = faults.Fabric(group, "deepep-nvshmem", [str(ids[local])], team)
                self.nvshmem.barrier("deepep nvshmem init")

    def get_num_rdma_ranks(self) -> int:
        return self.layout.nodes

    def get_rdma_rank(self) -> int:
        return self.layout.node

    def get_root_rdma_rank(self, global_: bool) -> int:
        return self.layout.local_rank if global_ else 0

    def is_internode_available(self) -> bool:
        return self.layout.nodes > 1

    def destroy(self) -> None:
        if self.fabric is not None:
            self.fabric.barrier("deepep destroy barrier")
        if self.nvshmem is not None:
            for op in ("deepep nvshmem barrier", "deepep nvshmem free", "deepep nvshmem finalize"):
                self.nvshmem.barrier(op)


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


class _DeepEPInternodeHandle(_DeepEPHandle):
    """DeepEP's internode dispatch handle, the real 10-tuple ``(is_token_in_rank,
    rdma_channel_prefix_matrix, gbl_channel_prefix_matrix, recv_rdma_channel_prefix_matrix,
    recv_rdma_rank_prefix_sum, recv_gbl_channel_prefix_matrix, recv_gbl_rank_prefix_sum,
    recv_src_meta, send_rdma_head, send_nvl_head)`` (``deep_ep/buffer.py:589-592``), carrying
    the host-side split sizes of the emulation's collectives."""


class Buffer:
    """Emulation of ``deep_ep.Buffer`` in normal (non-low-latency) mode, intranode and, when the
    group spans several emulated nodes, internode (:meth:`internode_dispatch`).

    The intranode dispatch handle is the real 6-tuple (module docstring). The emulation encodes the
    routing in it: ``rank_prefix_matrix[s, d]`` counts the tokens ranks ``0..s`` send to rank
    ``d``; ``channel_prefix_matrix[d, c]`` the tokens this rank sends to ``d`` from its channels
    ``0..c`` (channel ``c`` takes tokens ``c*cdiv(T, C)`` on) and
    ``recv_channel_prefix_matrix[s, c]`` the same for what source ``s`` sends here;
    ``recv_src_idx`` the source-rank token index of every received row (source rank, then token
    order); ``send_head[t, d]`` token ``t``'s row in rank ``d``'s ``recv_x`` (-1: not sent).

    The real NVLink/RDMA buffers live outside PyTorch's allocator; the emulation allocates
    what the real one does for the ``num_nvl_bytes`` and ``num_rdma_bytes`` megatron-core's
    ``get_buffer`` asks (sized by the :class:`Config` hints): the NVLink buffer with its
    barrier signals and pointers, the 32 MiB workspace and the RDMA buffer as one tensor
    (``memory``), and the pinned receive counters, so allocator counts see them; sized from
    deep_ep's constructor (``csrc/deep_ep.cpp:145-206``), the hints from :class:`Config`.
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
        self.rank = group_rank(group)
        self.group_size = group_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        # Where this rank sits on the emulated nodes (rdma_rank, nvl_rank: deep_ep.cpp:159-160).
        self.layout = deep_ep_layout(group)
        # The C++ runtime; destroy() sets it to None, as the real one does (buffer.py:143).
        self.runtime = _EmulatedRuntime(group, num_nvl_bytes, num_rdma_bytes, self.layout)
        self.terms = buffer_terms(num_nvl_bytes, num_rdma_bytes)
        # One device allocation for the NVLink buffer with its barrier signals and pointers,
        # the workspace and the RDMA buffer; the mapped pinned receive counters apart, the RDMA
        # one alone: destroy() frees the others only (deep_ep.cpp:299-305). Page-locked where
        # CUDA or the placement rules are there (pinning needs a driver).
        device = sum(t.nbytes for t in self.terms if t.name not in _PINNED)
        self.memory = torch.empty(device, dtype=torch.uint8, device=buffer_device())
        pin = torch.cuda.is_available() or placement.active()
        counters = sum(t.nbytes for t in self.terms if t.name in _PINNED and t.released)
        self.host_counters = torch.empty(counters, dtype=torch.uint8, device="cpu", pin_memory=pin)
        self.rdma_counter = torch.empty(4, dtype=torch.uint8, device="cpu", pin_memory=pin)
        faults.register_buffer(self)

    @property
    def nbytes(self) -> int:
        """The bytes ``destroy()`` frees: device memory and the freed pinned counters."""
        if self.memory is None:
            return 0
        return self.memory.nbytes + self.host_counters.nbytes

    def destroy(self) -> None:
        """``Buffer.destroy()`` (94a9f8f ``deep_ep/buffer.py:135-144``, C++ ``Buffer::destroy``
        ``csrc/deep_ep.cpp:269-309``): only with ``explicitly_destroy``; synchronizes the device
        and the buffer's peers (an intranode barrier: collective over the group, emulated by a
        barrier on it), frees the buffer, and leaves ``runtime`` None, so any later use fails."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        self._destroy()

    def _destroy(self, _leaked=LEAKED_BUFFERS) -> None:
        """C++ ``Buffer::destroy()``: the peers' barrier, then the frees (a barrier that timed
        out raises first and frees nothing, as the trapped kernel leaves the context)."""
        self.runtime.destroy()
        self.runtime = None
        self.memory = self.host_counters = None
        _leaked.append(self.rdma_counter)  # never freed (deep_ep.cpp:299-304)

    def _check_runtime(self) -> None:
        # The real methods call self.runtime.<kernel>(...), which fails once destroy() has run.
        if self.runtime is None:
            raise AttributeError("'NoneType' object has no attribute 'get_local_device_id'")

    def __del__(self, _write=os.write, _faults=faults, _leaked=LEAKED_BUFFERS) -> None:
        # C++ ~Buffer (csrc/deep_ep.cpp:209-216): with explicitly_destroy and no destroy(), the
        # resources are not released (it warns); the emulation keeps the bytes allocated.
        # Without explicitly_destroy it calls destroy(): the peers' barrier, from wherever the
        # last reference went (a finalizer, a garbage collection, the interpreter's exit: the
        # module globals it needs are bound here, as finalization may clear them first).
        if getattr(self, "explicitly_destroy", False) and getattr(self, "runtime", None):
            _faults.printf(  # printf to stdout, then fflush(stdout), as deep_ep.cpp:213-214
                "WARNING: destroy() was not called before DeepEP buffer destruction, which can "
                "leak resources."
            )
            _leaked.extend((self.memory, self.host_counters, self.rdma_counter))
        elif getattr(self, "runtime", None) is not None:  # ~Buffer calls destroy()
            try:
                self._destroy()
            except _faults.DeviceBarrierTimeout as exc:
                _write(2, f"{exc}\n".encode())
                _leaked.extend((self.memory, self.host_counters, self.rdma_counter))

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Record the SM budget (tuning only)."""
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The recommended dispatch config (``buffer.py:240-253``): refuses a group size it
        has none for, as the real one asserts."""
        configs = DISPATCH_CONFIGS
        assert num_ranks in configs, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *configs[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """The recommended combine config (``buffer.py:268-281``)."""
        configs = COMBINE_CONFIGS
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
        """Returns ``(num_tokens_per_rank[R] int32, num_tokens_per_rdma_rank,
        num_tokens_per_expert[E] int32, is_token_in_rank[T, R] bool, event)``; ``-1`` entries of
        ``topk_idx`` are ignored.
        ``num_tokens_per_rdma_rank`` is None on one node, else ``[Rr]`` int32: the tokens sent
        to each node, once however many of its ranks take them (``deep_ep.cpp:395-396``)."""
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
        num_tokens_per_rdma_rank = None
        if self.layout.nodes > 1:
            per_node = is_token_in_rank.view(idx.shape[0], self.layout.nodes, -1).any(-1)
            num_tokens_per_rdma_rank = per_node.sum(0).to(torch.int32)
        return (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            num_tokens_per_expert,
            is_token_in_rank,
            event(async_finish),
        )

    def _routing(self, handle: tuple) -> Tuple[torch.Tensor, List[int], List[int]]:
        """``(send_token_ids, send_counts, recv_counts)`` of a dispatch handle."""
        if not isinstance(handle, tuple) or len(handle) != 6:
            raise ValueError("expected the 6-item DeepEP handle of Buffer.dispatch")
        send_token_ids, sends = sent_token_ids(handle[5])
        recvs = getattr(handle, "recv_counts", None)
        if recvs is None:
            # A handle re-packed into a plain tuple: read the counts from rank_prefix_matrix.
            column = handle[0][:, self.rank].long()
            recvs = torch.diff(column, prepend=column.new_zeros(1)).tolist()
        return send_token_ids, sends, list(recvs)

    def _recv_topk(
        self, topk_idx, topk_weights, send_token_ids, sends, recvs, num_experts, alignment
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], List[int]]:
        """The received rows' top-k indices made local (``-1`` for other ranks' experts), their
        weights (``0`` there) and the tokens per local expert (rounded up to ``alignment``),
        as both dispatches return them."""
        recv_idx = all_to_all(topk_idx.long()[send_token_ids], sends, recvs, self.group)
        local = num_experts // self.group_size
        begin = self.rank * local
        mine = (recv_idx >= begin) & (recv_idx < begin + local)
        recv_topk_idx = torch.where(mine, recv_idx - begin, torch.full_like(recv_idx, -1))
        recv_topk_weights = None
        if topk_weights is not None:
            w = all_to_all(topk_weights.float()[send_token_ids], sends, recvs, self.group)
            recv_topk_weights = torch.where(mine, w, torch.zeros_like(w))
        per_expert = [count_set(recv_topk_idx == e) for e in range(local)]
        if alignment > 1:
            per_expert = [c + (-c % alignment) for c in per_expert]
        return recv_topk_idx, recv_topk_weights, per_expert

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
        ``handle`` only ``x`` is sent and the other four are ``None``, as in DeepEP. Across
        nodes it is :meth:`internode_dispatch` (``buffer.py:376-380``).
        """
        self._check_runtime()
        size, rank = self.group_size, self.rank
        if self.layout.nodes > 1:
            assert num_worst_tokens == 0, (
                "Internode dispatch does not support `num_worst_tokens > 0`"
            )
            return self.internode_dispatch(
                x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                config or self.get_dispatch_config(size), previous_event, async_finish,
                allocate_on_comm_stream,
            )  # fmt: skip
        if handle is not None:
            send_token_ids, sends, recvs = self._routing(handle)
            recv_x = all_to_all(x[send_token_ids], sends, recvs, self.group)
            return recv_x, None, None, None, None, event(async_finish)
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
        sends = [count_set(in_rank[:, d]) for d in range(size)]
        # The counts every rank sends to every other (notify_dispatch), which the host reads
        # once they arrive: the kernel's one CPU wait.
        counts_all = host_all_gather_ints(sends, self.group)  # [source][destination]
        kernel_host_sync("deepep dispatch")
        recvs = [counts_all[s][rank] for s in range(size)]
        below = [sum(counts_all[s][d] for s in range(rank)) for d in range(size)]
        send_head = dense_rows(in_rank, torch.tensor(below, dtype=torch.int32, device=dev))
        send_token_ids, _ = sent_token_ids(send_head)
        recv_x = all_to_all(x[send_token_ids], sends, recvs, self.group)
        recv_src_idx = all_to_all(send_token_ids.to(torch.int32), sends, recvs, self.group)
        recv_topk_idx, recv_topk_weights, per_expert = self._recv_topk(
            topk_idx, topk_weights, send_token_ids, sends, recvs, num_experts, expert_alignment
        )
        prefix, running = [], [0] * size
        for s in range(size):
            running = [a + b for a, b in zip(running, counts_all[s])]
            prefix.append(list(running))
        rank_prefix_matrix = torch.tensor(prefix, dtype=torch.int32, device=dev)
        # Channel c sends tokens [c * per, (c + 1) * per) (DeepEP's channel task range).
        per = cdiv(num_tokens, channels)
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
        recv_channel_prefix_matrix = all_to_all(
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
            event(async_finish),
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

        Returns ``(combined_x[T, H], combined_topk_weights[T, K] float32 | None, event)``. Across
        nodes it is :meth:`internode_combine` (``buffer.py:453-455``).
        """
        self._check_runtime()
        if self.layout.nodes > 1:
            return self.internode_combine(
                x, handle, topk_weights, bias, config or self.get_combine_config(self.group_size),
                previous_event, async_finish, allocate_on_comm_stream,
            )  # fmt: skip
        if bias is not None:
            raise NotImplementedError("The DeepEP emulation does not implement combine bias.")
        send_token_ids, sends, recvs = self._routing(handle)
        recv_src_idx, send_head = handle[3], handle[5]
        if x.shape[0] != recv_src_idx.shape[0]:
            raise ValueError(
                f"x has {x.shape[0]} rows but the dispatch received {recv_src_idx.shape[0]}."
            )
        num_tokens = send_head.shape[0]
        back = all_to_all(x, recvs, sends, self.group)
        out = sum_rows(back, send_token_ids, num_tokens, x.dtype)
        out_weights = None
        if topk_weights is not None:
            back_w = all_to_all(topk_weights.float(), recvs, sends, self.group)
            out_weights = sum_rows(back_w, send_token_ids, num_tokens, torch.float32)
        return out, out_weights, event(async_finish)

    # -- across nodes ---------------------------------------------------------------------------

    def _internode_routing(self, handle: tuple) -> Tuple[torch.Tensor, List[int], List[int]]:
        """``(send_token_ids, send_counts, recv_counts)`` of an internode handle: the tokens
        ``is_token_in_rank`` (``h[0]``) sends to each rank (ranks ascending, token order) and
        what each source sends here (``h[6]``, the received rows' prefix sum over sources)."""
        if not isinstance(handle, tuple) or len(handle) != 10:
            raise ValueError(
                "expected the 10-item internode DeepEP handle of Buffer.internode_dispatch "
                f"(the group spans {self.layout.nodes} nodes)"
            )
        in_rank = handle[0].bool()
        ids = [torch.nonzero(in_rank[:, d]).flatten() for d in range(in_rank.shape[1])]
        sends = getattr(handle, "send_counts", None) or [int(i.shape[0]) for i in ids]
        recvs = getattr(handle, "recv_counts", None)
        if recvs is None:
            # A handle re-packed into a plain tuple: read the counts from recv_gbl_rank_prefix_sum.
            prefix = handle[6].long()
            recvs = torch.diff(prefix, prepend=prefix.new_zeros(1)).tolist()
        return torch.cat(ids), list(sends), list(recvs)

    def internode_dispatch(
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
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """``Buffer.internode_dispatch`` (``buffer.py:545-593``, ``deep_ep.cpp:807-1086``):
        what :meth:`dispatch` runs when the group spans several emulated nodes. The same rows
        as the intranode dispatch, in the same order (source rank, then token order: the
        real kernel writes each source rank's rows at its ``recv_gbl_rank_prefix_sum`` offset,
        ``internode.cu:880-905``), so the same numerics; the handle is the real internode
        10-tuple, and the emulation moves each tensor in one collective where the kernels go
        over RDMA to the rank of the same local rank on each node and on over NVLink.

        The handle's fields, as the emulation fills them: ``is_token_in_rank`` the layout's;
        ``rdma_channel_prefix_matrix[n, c]`` the tokens this rank's channels ``0..c`` (channel
        ``c`` takes tokens ``c*cdiv(T, C)`` on) send to node ``n``, once per node, and
        ``gbl_channel_prefix_matrix[d, c]`` those to rank ``d`` (``internode.cu:252-301``);
        ``recv_rdma_channel_prefix_matrix[n, c]`` what the rank of this local rank on node ``n``
        sends this node (``internode.cu:715``), ``recv_rdma_rank_prefix_sum`` its prefix sum
        over nodes (``:201-211``); ``recv_gbl_channel_prefix_matrix[s, c]`` the first
        ``recv_x`` row of source ``s``'s channel ``c`` (``:905``), ``recv_gbl_rank_prefix_sum``
        the received rows' prefix sum over sources (``:227-234``); ``recv_src_meta`` per row a
        ``SourceMeta`` (int32 source node, int32 bits of the destination node's ranks taking
        the token, ``internode.cu:17-36``) as its 8 bytes; ``send_rdma_head[t, n]`` token
        ``t``'s index among its channel's tokens to node ``n`` (-1: none, ``:494-526``);
        ``send_nvl_head[i, p]``, for the RDMA-received tokens (source nodes ascending, token
        order), the token's index among those this rank forwards to its node's rank ``p`` (-1:
        not forwarded, and in the columns past the node's ranks).

        Sizes as in the module docstring, and Rr = nodes (RDMA ranks), Nrr = the tokens this
        rank receives over RDMA (the other nodes' and its own node's, each once,
        ``moe_recv_rdma_counter``, ``deep_ep.cpp:975``); ``8`` is ``NUM_MAX_NVL_PEERS``, the
        kernels' compile-time width. The tests run these on 4 ranks as 2 nodes of 2.

        [deepep internode layout] ``Buffer.get_dispatch_layout`` across nodes

        | output | mode | device | dtype | shape | source @94a9f8f |
        |---|---|---|---|---|---|
        | num_tokens_per_rank | all | device | int32 | [R] | deep_ep.cpp:391 |
        | num_tokens_per_rdma_rank | all | device | int32 | [Rr] | deep_ep.cpp:395-396 |
        | num_tokens_per_expert | all | device | int32 | [E] | deep_ep.cpp:393 |
        | is_token_in_rank | all | device | bool | [T, R] | deep_ep.cpp:394 |
        | event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:407-409 |
        | event | sync | - | EventOverlap(None) | - | buffer.py:310 |

        [deepep internode dispatch] ``Buffer.dispatch`` without a handle, across nodes

        | output | mode | device | dtype | shape | source @94a9f8f |
        |---|---|---|---|---|---|
        | recv_x | all | device | x.dtype | [Nr, H] | deep_ep.cpp:997 |
        | recv_topk_idx | all | device | int64 | [Nr, K] | deep_ep.cpp:1017 |
        | recv_topk_weights | all | device | float32 | [Nr, K] | deep_ep.cpp:1018 |
        | num_recv_tokens_per_expert_list | all | - | list[int] | [E_l] | deep_ep.cpp:970-993 |
        | handle | all | - | tuple | [10] | buffer.py:589-592 |
        | h[0] is_token_in_rank | all | device | bool | [T, R] | buffer.py:589 |
        | h[1] rdma_channel_prefix_matrix | all | device | int32 | [Rr, C] | deep_ep.cpp:948 |
        | h[2] gbl_channel_prefix_matrix | all | device | int32 | [R, C] | deep_ep.cpp:950 |
        | h[3] recv_rdma_channel_prefix_matrix | all | device | int32 | [Rr, C] | deep_ep.cpp:1006 |
        | h[4] recv_rdma_rank_prefix_sum | all | device | int32 | [Rr] | deep_ep.cpp:949 |
        | h[5] recv_gbl_channel_prefix_matrix | all | device | int32 | [R, C] | deep_ep.cpp:1007 |
        | h[6] recv_gbl_rank_prefix_sum | all | device | int32 | [R] | deep_ep.cpp:951 |
        | h[7] recv_src_meta | all | device | uint8 | [Nr, 8] | deep_ep.cpp:1005 |
        | h[8] send_rdma_head | all | device | int32 | [T, Rr] | deep_ep.cpp:1008 |
        | h[9] send_nvl_head | all | device | int32 | [Nrr, 8] | deep_ep.cpp:1009 |
        | event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:1049-1050 |
        | event | sync | - | EventOverlap(None) | - | buffer.py:593 |

        [deepep internode cached dispatch] ``Buffer.dispatch(handle=...)`` across nodes

        | output | mode | device | dtype | shape | source @94a9f8f |
        |---|---|---|---|---|---|
        | recv_x | all | device | x.dtype | [Nr, H] | deep_ep.cpp:997 |
        | recv_topk_idx | all | - | None | - | buffer.py:577 |
        | recv_topk_weights | all | - | None | - | buffer.py:577 |
        | num_recv_tokens_per_expert_list | all | - | None | - | buffer.py:577 |
        | handle | all | - | None | - | buffer.py:577 |
        | event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:1049-1050 |
        | event | sync | - | EventOverlap(None) | - | buffer.py:577 |

        [deepep internode combine] ``Buffer.combine`` across nodes

        | output | mode | device | dtype | shape | source @94a9f8f |
        |---|---|---|---|---|---|
        | combined_x | all | device | x.dtype | [T, H] | deep_ep.cpp:1177 |
        | combined_topk_weights | weights | device | float32 | [T, K] | deep_ep.cpp:1146 |
        | combined_topk_weights | no weights | - | None | - | deep_ep.cpp:1137 |
        | event | async | - | EventOverlap(EventHandle) | - | deep_ep.cpp:1190-1192 |
        | event | sync | - | EventOverlap(None) | - | buffer.py:623 |

        Host synchronizations, as the module docstring's (the fresh dispatch: the CPU
        busy-waits for the received counts, the RDMA one included):

        | call | mode | syncs | kind | source @94a9f8f |
        |---|---|---|---|---|
        | deepep internode layout | all | 0 | - | deep_ep.cpp:406-422 |
        | deepep internode dispatch | all | 1 | deepep internode dispatch | deep_ep.cpp:970-993 |
        | deepep internode cached dispatch | all | 0 | - | deep_ep.cpp:930-946 |
        | deepep internode combine | all | 0 | - | deep_ep.cpp:1189-1211 |
        """
        assert config is not None
        self._check_runtime()
        group, size, rank = self.group, self.group_size, self.rank
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            send_token_ids, sends, recvs = self._internode_routing(handle)
            recv_x = all_to_all(x[send_token_ids], sends, recvs, group)
            return recv_x, None, None, None, None, event(async_finish)
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch needs the layout (buffer.py:579), or a handle.")
        if num_tokens_per_rdma_rank is None:
            # EP_HOST_ASSERT(num_tokens_per_rdma_rank.has_value()) (deep_ep.cpp:834).
            raise ValueError(
                "internode dispatch needs get_dispatch_layout's num_tokens_per_rdma_rank"
            )
        if topk_idx is None:
            raise ValueError("dispatch needs the top-k indices, or a handle.")
        per, nodes, node, local = self.layout
        num_experts = int(num_tokens_per_expert.numel())
        channels = max(config.num_sms // 2, 1)
        num_tokens = x.shape[0]
        dev = x.device
        in_rank = is_token_in_rank.bool()
        in_node = in_rank.view(num_tokens, nodes, per).any(-1)  # [T, Rr]
        sends = [count_set(in_rank[:, d]) for d in range(size)]
        node_sends = [count_set(in_node[:, n]) for n in range(nodes)]
        # notify_dispatch: every rank's counts per rank and per node, which the host reads once
        # they arrive (the kernel's one CPU wait, for moe_recv_counter and moe_recv_rdma_counter).
        counts_all = host_all_gather_ints(sends + node_sends, group)  # [source][R + Rr]
        kernel_host_sync("deepep internode dispatch")
        recvs = [counts_all[s][rank] for s in range(size)]
        column = [n * per + local for n in range(nodes)]  # this rank's RDMA peers, by node
        rdma_recvs = [counts_all[s][size + node] for s in column]
        ids = [torch.nonzero(in_rank[:, d]).flatten() for d in range(size)]
        send_token_ids = torch.cat(ids)
        recv_x = all_to_all(x[send_token_ids], sends, recvs, group)
        recv_topk_idx, recv_topk_weights, per_expert = self._recv_topk(
            topk_idx, topk_weights, send_token_ids, sends, recvs, num_experts, expert_alignment
        )
        # SourceMeta of every sent row: this rank's node, and which ranks of the destination's
        # node take the token (one bit each).
        place = torch.pow(2, torch.arange(per, dtype=torch.int32, device=dev)).to(torch.int32)
        bits = (in_rank.view(num_tokens, nodes, per).to(torch.int32) * place).sum(-1)  # [T, Rr]
        dest = torch.arange(size, dtype=torch.long, device=dev)
        dest = torch.repeat_interleave(dest, torch.tensor(sends, dtype=torch.long, device=dev))
        row_bits = bits[send_token_ids, dest // per].to(torch.int32)
        meta = torch.stack([torch.full_like(row_bits, node), row_bits], 1)
        recv_src_meta = all_to_all(meta, sends, recvs, group).view(torch.uint8)  # [Nr, 8]
        # Channel c sends tokens [c * each, (c + 1) * each) (get_channel_task_range).
        each = cdiv(num_tokens, channels)
        ends = [min((c + 1) * each, num_tokens) for c in range(channels)]
        ends = torch.tensor(ends, dtype=torch.long, device=dev)

        def prefix(mask: torch.Tensor) -> torch.Tensor:  # [T + 1, n]: tokens before each
            zero = torch.zeros((1, mask.shape[1]), dtype=torch.int32, device=dev)
            return torch.cat([zero, torch.cumsum(mask.to(torch.int32), 0).to(torch.int32)])

        by_rank, by_node = prefix(in_rank), prefix(in_node)
        gbl_channel_prefix_matrix = by_rank[ends].t().contiguous()  # [R, C]
        rdma_channel_prefix_matrix = by_node[ends].t().contiguous()  # [Rr, C]
        # What every destination learns of this rank's channels: its own row, and its node's.
        told = torch.cat(
            [gbl_channel_prefix_matrix, rdma_channel_prefix_matrix.repeat_interleave(per, 0)], 1
        )
        heard = all_to_all(told, [1] * size, [1] * size, group)  # [R, 2C], row s: source s's
        peers = torch.tensor(column, dtype=torch.long, device=dev)
        recv_rdma_channel_prefix_matrix = heard[peers, channels:].contiguous()
        running = 0
        gbl_sums, starts = [], []
        for count in recvs:
            starts.append(running)
            running += count
            gbl_sums.append(running)
        recv_gbl_rank_prefix_sum = torch.tensor(gbl_sums, dtype=torch.int32, device=dev)
        first = torch.cat(
            [torch.zeros((size, 1), dtype=torch.int32, device=dev), heard[:, : channels - 1]], 1
        )
        starts = torch.tensor(starts, dtype=torch.int32, device=dev).unsqueeze(1)
        recv_gbl_channel_prefix_matrix = (first + starts).to(torch.int32).contiguous()
        rdma_sums = [sum(rdma_recvs[: n + 1]) for n in range(nodes)]
        recv_rdma_rank_prefix_sum = torch.tensor(rdma_sums, dtype=torch.int32, device=dev)
        # send_rdma_head: each token's index among its channel's tokens to each node.
        token = torch.arange(num_tokens, dtype=torch.long, device=dev)
        rdma_head = by_node[1:] - by_node[token // each * each] - 1
        send_rdma_head = torch.where(in_node, rdma_head, torch.full_like(rdma_head, -1))
        # The RDMA leg: each node's tokens go to the rank of this local rank there, with the
        # bits of the ranks they are forwarded to; send_nvl_head numbers them per rank.
        leg_sends, leg_recvs = [0] * size, [0] * size
        for n, s in enumerate(column):
            leg_sends[s], leg_recvs[s] = node_sends[n], rdma_recvs[n]
        node_ids = [torch.nonzero(in_node[:, n]).flatten() for n in range(nodes)]
        to_node = torch.arange(nodes, dtype=torch.long, device=dev)
        to_node = torch.repeat_interleave(to_node, torch.tensor(node_sends, device=dev))
        leg_bits = bits[torch.cat(node_ids), to_node].to(torch.int32)
        rdma_bits = all_to_all(leg_bits, leg_sends, leg_recvs, group)  # [Nrr]
        lane = torch.arange(NUM_MAX_NVL_PEERS, dtype=torch.int32, device=dev)
        forwarded = ((rdma_bits.unsqueeze(1) >> lane) & 1).bool()  # [Nrr, 8]
        nvl_head = torch.cumsum(forwarded.to(torch.int32), 0) - 1
        send_nvl_head = torch.where(forwarded, nvl_head, torch.full_like(nvl_head, -1))
        new_handle = _DeepEPInternodeHandle(
            (
                is_token_in_rank,
                rdma_channel_prefix_matrix,
                gbl_channel_prefix_matrix,
                recv_rdma_channel_prefix_matrix,
                recv_rdma_rank_prefix_sum,
                recv_gbl_channel_prefix_matrix,
                recv_gbl_rank_prefix_sum,
                recv_src_meta,
                send_rdma_head.to(torch.int32).contiguous(),
                send_nvl_head.to(torch.int32).contiguous(),
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
            event(async_finish),
        )

    def internode_combine(
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
        """``Buffer.internode_combine`` (``buffer.py:596-623``, ``deep_ep.cpp:1088-1219``):
        every received row back to its source, the copies of each token summed in float32,
        ranks ascending, as the intranode combine. Returns ``(combined_x[T, H],
        combined_topk_weights[T, K] float32 | None, event)``, T the rows of the handle's
        ``is_token_in_rank`` (``deep_ep.cpp:1110``)."""
        assert config is not None
        self._check_runtime()
        if bias is not None:
            raise NotImplementedError("The DeepEP emulation does not implement combine bias.")
        send_token_ids, sends, recvs = self._internode_routing(handle)
        src_meta = handle[7]
        if x.shape[0] != src_meta.shape[0]:
            raise ValueError(
                f"x has {x.shape[0]} rows but the dispatch received {src_meta.shape[0]}."
            )
        num_tokens = handle[0].shape[0]
        back = all_to_all(x, recvs, sends, self.group)
        out = sum_rows(back, send_token_ids, num_tokens, x.dtype)
        out_weights = None
        if topk_weights is not None:
            back_w = all_to_all(topk_weights.float(), recvs, sends, self.group)
            out_weights = sum_rows(back_w, send_token_ids, num_tokens, torch.float32)
        return out, out_weights, event(async_finish)
