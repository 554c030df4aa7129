# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Emulation of DeepEP's ``HybridEPBuffer`` (the ``hybridep`` flex backend).

``HybridEPBuffer.dispatch_with_permute`` / ``combine_with_unpermute``, over plain
``torch.distributed`` collectives (gloo works): tokens are gathered on the ranks that own their
experts, grouped by local expert (source rank, then token order, inside each expert), each
expert padded with zero rows to ``pad_multiple``; combine sums the rows of every copy of a token
without probability weighting and scatters probabilities back to ``[num_tokens, num_experts]``.
Reductions accumulate in float32 in a fixed order (local experts ascending, then ranks
ascending), so results are deterministic; any floating dtype is accepted, although the real
kernels move 16-bit payloads only.

**Outputs as the real kernels return them.** Every output has the real kernel's device, dtype and
shape in every mode megatron-core uses (the tables below). "device" is the device of the inputs (a
GPU on a GPU run; on a CPU rank under the placement rules of
:mod:`moe_release.runtime.cuda.placement`, a host tensor placed ``device``); "pinned" is page-locked
host memory (``pin_memory=True`` where CUDA or the placement rules are there, plain host memory
otherwise: pinning needs a driver). The contents of the handle fields that only the kernels read
(the maps and the chunk layout) are the emulation's own encoding of the same routing, in the real
fields' shapes and dtypes; what the emulation needs on the host (its collectives' split sizes) it
keeps as Python ints in the config object (item 9, an opaque pybind object in the real handle), so
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
passed), E = all experts. ``cdiv`` rounds up, ``ceil16(n)`` is ``16 * cdiv(n, 16)``.
Modes (``all``: every mode of that call megatron-core uses): ``blocking`` is
``num_permuted_tokens=None, non_blocking=False`` (megatron's dropless path); ``non-blocking`` a
``num_permuted_tokens`` budget with ``non_blocking=True`` (``moe_expert_rank_capacity_factor``,
and drop-and-pad with its capacity budget); each also with ``fuse_permute_dispatch=True`` (the
same preallocations, ``hybrid_ep.cu:312``); megatron's forward dispatch always passes probs
(``no probs``: the kernel called without). Combine: ``probs`` is the dispatch's backward,
``no probs`` the forward combine.
Sources are cited by file name: ``hybrid_ep.cu``, ``executor.cu`` and ``executor.cuh`` are
under ``csrc/hybrid_ep/`` (the last two in ``executor/``), ``hybrid_ep_buffer.py`` under
``deep_ep/``; ``h[i]`` is item ``i`` of the returned handle.

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

Host synchronizations the kernels make themselves, counted with
:func:`moe_release.runtime.cuda.placement.count_sync` under the placement rules (the host then waits
for the current stream); the emulation's own bookkeeping reads sizes from shapes and host metadata
and adds none:

| call | mode | syncs | kind | source @94a9f8f |
|---|---|---|---|---|
| hybridep dispatch | blocking | 1 | hybridep blocking dispatch | executor.cu:166-175 |
| hybridep dispatch | non-blocking | 0 | - | executor.cu:166 |
| hybridep replay | all | 0 | - | hybrid_ep_buffer.py:380-395 |
| hybridep combine | all | 0 | - | executor.cuh:93 |

Blocking dispatch: the kernel synchronizes its stream and the host sums the pinned counts into
P. In megatron-core's dropless path, ``tokens_per_expert.to(torch.int64)`` then returns
the same pinned tensor and ``.sum()`` a 0-dim host tensor, which reaches the replay as
``num_permuted_tokens`` (an int64 field in the real handle, taken through ``__index__``);
drop-and-pad discards the kernel's counts for its own host ``torch.full``.

**The buffer**, one rank's ``hybrid_ep_cpp.HybridEPBuffer`` (``hybrid_ep.cu:38-73``: the
allocator, the NVLink coordinator, the custom all-gather), read from the source at 94a9f8f by
this emulation itself, not taken from the memory planner, so that the report's planner rows
compare two readings. The real buffer lives outside PyTorch's allocator (``cudaMalloc``, or
cuMem with fabric handles, rounded to the granularity: not modelled); the emulation allocates
the sum of the terms below as one tensor (``memory``; ``terms`` lists them), so allocator
counts see it live and die with the buffer object. R is the NVLink domain
(``hybrid_ep_buffer.py:61-83``: ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN``, else the detected
ranks, here the emulated node's) and M = group size / R; several nodes add the RDMA rows of the
second table (see "Several nodes" below).
Rows per rank: the first call's tokens, at least 512, rounded up to the combine chunk
(``config.cuh:385-387``); a later call with more tokens rounds them to 16
(``hybrid_ep_buffer.py:142``), then to the combine chunk (``config.cuh:466-468``), and a larger
figure regrows the buffer (``config.cuh:557-559``, ``intranode.cu:136``), freeing the old one
first (``hybrid_ep.cu:123-131``). N = rows x R x M (``intranode.cu:127-129``), S = preprocessing
blocks (``num_sms_preprocessing_api``, else 108: ``config.cuh:365``), Cd / Cc = cdiv(rows,
dispatch / combine chunk) (``config.cuh:388-391``; chunks of
``NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API`` / ``_COMBINE_API``, 64 unless set, read with ``atoi``:
``config.cuh:197-200,383-384``). Files:
``intranode.cu`` and ``internode_doca.cu`` under ``csrc/hybrid_ep/buffer/``, ``allgather.cu``
under ``extension/``, ``allocator.cu`` under ``allocator/``, ``hybrid_ep_backend.cuh`` under
``backend/``, ``utils.cuh`` and ``config.cuh`` under ``csrc/hybrid_ep/``.

[hybridep buffer] ``HybridEPBuffer(...)`` and its regrowth

| term | ranks | bytes | source @94a9f8f |
|---|---|---|---|
| preprocessing scratch (ranks) | all | S x R x 8 | intranode.cu:180-181,185-187 |
| preprocessing scratch (local experts) | all | S x E_l x 8 | intranode.cu:182-183,188-190 |
| combine expert_input_token | all | N x H x 2 | intranode.cu:255,260 |
| combine expert_input_prob | all | N x E_l x R x 4 | intranode.cu:256-257,261 |
| combine write-completion flags | local rank 0 | 8 | intranode.cu:264-266 |
| combine expected flag value | all | 8 | intranode.cu:269 |
| combine flag parity | all | 4 | intranode.cu:271 |
| combine expected unpermute flag | all | 4 | intranode.cu:274 |
| combine chunk flags | all | Cc x R x M x 4 | intranode.cu:277-278 |
| dispatch expert_output_scaling_factor | all | N x floor(H/128) x 4 | intranode.cu:201,213 |
| dispatch write-completion flags | local rank 0 | 8 | intranode.cu:216-218 |
| dispatch expected flag value | all | 8 | intranode.cu:220 |
| dispatch flag parity | all | 4 | intranode.cu:222 |
| dispatch expected permute flag | all | 4 | intranode.cu:226 |
| dispatch chunk flags | all | Cd x R x M x 4 | intranode.cu:229-230 |
| all-gather routing map | all | E_l x R x M x rows x R x M | allgather.cu:144-147 |
| all-gather NVLink sync flag | local rank 0, M = 1 | 8 | allgather.cu:150-154 |
| all-gather SM sync flag | M = 1 | 8 | allgather.cu:157 |
| all-gather iteration id | M = 1 | 8 | allgather.cu:159 |
| all-gather peer pointers | M = 1 | R x 8 | allgather.cu:164 |
| allocator probe | all | 512 | allocator.cu:62 |

``hybrid_ep::tmp_state_t`` is ``{enum, int32}``, 8 bytes (``hybrid_ep_backend.cuh:79-87``).
Not terms: the dispatch token and probability buffers alias the combine ones (deep_ep's
default ``use_shared_buffer=True``, ``hybrid_ep_buffer.py:51``; ``intranode.cu:204-208``); the
packed memory handles are pageable host tensors (``intranode.cu:245,292``,
``allgather.cu:173``); the Python constructor's own ``ExtendedMemoryAllocator``
(``hybrid_ep_buffer.py:61``) and its 512-byte probe are dropped when the constructor returns.
The custom all-gather's NVLink state (its flags and peer pointers) exists on one node only
(``allgather.cu:149``, ``181-182``): on several nodes the routing map is gathered otherwise.

**Several nodes.** A group larger than its NVLink domain (M > 1) takes HybridEP's multi-node path
(``hybrid_ep.cu:62-70``; the real build needs ``HYBRID_EP_MULTINODE=1``, ``setup.py:47,100-101``,
else the constructor asserts; its default transport is DOCA GPUNetIO, ``internode.cuh:11-15``,
``setup.py:103-110``). The constructor first initializes the RDMA coordinator
(``internode_doca.cu:337-381``: opens its GPU's NIC, allocates a protection domain; local, no
collective). Every ``allocate_buffer`` (the constructor's and each regrowth's,
``hybrid_ep.cu:92-107``) then allocates the rows below with ``cudaMalloc``, registers 14 memory
regions (``ibv_reg_mr``), creates Qc + Qd queue pairs and connects them: the combine queue
pairs' addresses and keys, then the dispatch ones' (``internode_doca.cu:332-335``), are
all-gathered over the whole group (``exchange_remote_rdma_info``, ``torch.distributed.all_gather``
from C++, ``internode_doca.cu:503,649,789-812``: every rank of the group takes part, and each
reads the M - 1 ranks of its own local rank on the other nodes, ``:808``). The emulation runs
each of the two as a rendezvous of every rank of the group on the job's store
(:class:`moe_release.runtime.measure.faults.Fabric`, over the ranks the constructor exchanged
with), logged as ``hybridep rdma info exchange (combine)`` / ``(dispatch)`` and bounded by
``MOE_RELEASE_DEVICE_BARRIER_TIMEOUT``: a peer that never arrives makes it raise "a GPU would
trap", where the real all-gather waits for the process group's timeout. Teardown is local:
``release_buffer`` (the destructor, and each regrowth before it reallocates) runs
``RDMACoordinator::destroy`` (``hybrid_ep.cu:83-86``, ``internode_doca.cu:698-787``): a device
synchronize, ``ibv_dereg_mr``, ``cudaFree``, the queue pairs destroyed; no collective, no peer
waits (the protection domain and the device close with the coordinator,
``internode_doca.cu:814-832``). The emulation frees with the runtime and logs
``hybridep rdma release`` over the rank alone (``collective: false``, the buffer's ranks as
``peers``). A peer's RDMA write into a deregistered region then fails on that peer's queue pair:
not modelled. Dispatch and combine give the one-node results: the same all-to-alls over the
group, reduced in the same fixed order (the real combine reduces within the node, then across
nodes). The multi-node rows per rank must keep the dispatch queue pairs' send depth
3 x rows + 1 below 65536 (``config.cuh:18-47``, ``94-95``): a constructor past it raises
``RuntimeError`` (``config.cuh:393-398``), a larger call ``AssertionError``
(``hybrid_ep_buffer.py:156``).

M' = M - 1 (the remote nodes), Qd / Qc = M' x dispatch / combine blocks
(``num_sms_dispatch_api`` / ``_combine_api``, else 8 on several nodes and 24 on one:
``config.cuh:366-367``), one queue pair per block and remote node
(``internode_doca.cu:453,608``); 104 and 80 bytes are ``sizeof(dispatch_memory_region_info_t)``
and ``sizeof(combine_memory_region_info_t)`` (eight / six 4-byte keys, nine / seven 8-byte
addresses, ``utils.cuh:43-77``); ``doca.cu`` is ``internode_doca.cu``, ``_sf`` a
``_scaling_factor`` buffer.

[hybridep buffer, multi-node] the RDMA coordinator's, on every rank when M > 1

| multi-node term | ranks | bytes | source @94a9f8f |
|---|---|---|---|
| RDMA combine intra_node_red_token | all | rows x M' x H x 2 | doca.cu:559-560,573-574 |
| RDMA combine intra_node_red_prob | all | rows x M' x E_l x R x 4 | doca.cu:561-562,575-576 |
| RDMA combine inter_node_group_token | all | rows x M' x H x 2 | doca.cu:563-564,577-578 |
| RDMA combine inter_node_group_prob | all | rows x M' x E_l x R x 4 | doca.cu:565-566,579-580 |
| RDMA combine inter_node_group_flags | all | (Cc + 2) x M' x 8 | doca.cu:567-570,581-582 |
| RDMA combine attn_output_flags | all | (Cc + 2) x M' x 8 | doca.cu:567-570,585-586 |
| RDMA combine expected_rdma_flag_value | all | 8 | doca.cu:591 |
| RDMA combine queue-pair pointers | all | Qc x 8 | doca.cu:608,660 |
| RDMA combine memory-region info | all | Qc x 80 | doca.cu:608,664 |
| RDMA dispatch attn_input_token | all | rows x H x 2 | doca.cu:388,409-410 |
| RDMA dispatch attn_input_prob | all | rows x E_l x R x M x 4 | doca.cu:389-392,411-412 |
| RDMA dispatch attn_input_sf | all | rows x floor(H/128) x 4 | doca.cu:393-394,413-414 |
| RDMA dispatch inter_node_group_token | all | rows x M' x H x 2 | doca.cu:395-397,415-416 |
| RDMA dispatch inter_node_group_prob | all | rows x M' x E_l x R x 4 | doca.cu:398-401,417-418 |
| RDMA dispatch inter_node_group_sf | all | rows x M' x floor(H/128) x 4 | doca.cu:402-403,419-420 |
| RDMA dispatch inter_node_group_flags | all | (Cd + 2) x M' x 8 | doca.cu:404-407,421-422 |
| RDMA dispatch attn_input_flags | all | (Cd + 2) x M' x 8 | doca.cu:404-407,425-426 |
| RDMA dispatch expected_rdma_flag_value | all | 8 | doca.cu:431 |
| RDMA dispatch queue-pair pointers | all | Qd x 8 | doca.cu:453,514 |
| RDMA dispatch memory-region info | all | Qd x 104 | doca.cu:453,518 |

Not multi-node terms: the queue pairs' work and completion queues, which DOCA GPUNetIO places in
GPU memory (``internode_doca.cuh:51-52``; send depths 3 x rows + 1 and 2 x rows + 1,
``internode_doca.cu:457,612``), sized inside DOCA, not in deep_ep's source; the host-side
remote-info and memory-region arrays (``calloc``); the exchange's transient tensors (Q x 96
bytes of ``remote_info`` per rank and the gathered copies, through PyTorch's allocator, freed
when it returns, ``internode_doca.cu:793-811``).

**The emulated node, scaled down.** R is ``node_layout(group, group size)``'s ranks per node
(:func:`moe_release.runtime.kernels.emulation_common.node_layout`): ``MOE_RELEASE_RANKS_PER_NODE``
ranks, else the whole group, where the real detection counts the ranks of the host or NVLink
fabric (up to 72, ``config.cuh:16``): the tests' 2 x 2 layout has 2 ranks per "node" where a
real node has 4 or 8 GPUs (72 on an NVL72 rack), and every rank is a process of one host over
gloo. ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` overrides the domain as in the real one (a
warning if it differs). There is no NIC (the real coordinator opens one per GPU,
``internode_doca.cu:349-365``), no registration (pinning, keys), no queue pair, and nothing
crosses an RDMA link: the bytes are allocated, the connection's collectives are met, the data
moves over gloo as on one node. The NIXL build (``USE_NIXL``: a ``torch.distributed.barrier``
over the group once the buffers are registered, ``internode_nixl.cu:243-244``, and its own
buffers) is not emulated.
"""

import socket
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_release import settings
from moe_release.runtime.kernels.emulation_common import (
    BufferTerm,
    all_gather_rows,
    all_to_all,
    buffer_device,
    cdiv,
    count_set,
    dense_rows,
    env_int,
    group_rank,
    group_size,
    kernel_host_sync,
    node_layout,
    pinned,
    same_count_on_every_rank,
    sent_token_ids,
    sum_rows,
)
from moe_release.runtime.measure import faults

# The DeepEP commit the tables above were read from.
DEEP_EP_SOURCE_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"


# hybrid_ep::tmp_state_t {scan_state, int32_t}: backend/hybrid_ep_backend.cuh:79-87.
TMP_STATE_BYTES = 8
# Blocks of the preprocessing kernel when the caller passes none: config.cuh:365.
DEFAULT_BLOCKS_PREPROCESSING = 108
# The chunk sizes deep_ep reads from the environment (config.cuh:383-384) and the preprocessing
# chunk (executor.cu:119-123), 64 tokens unless set.
CHUNK_DISPATCH_ENV = "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API"
CHUNK_COMBINE_ENV = "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API"
CHUNK_PREPROCESSING_ENV = "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API"
RANKS_PER_DOMAIN_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"
# Dispatch / combine blocks (one RDMA queue pair each per remote node) when the caller passes
# none: 24 on one node, 8 on several (config.cuh:366-367).
SINGLE_NODE_BLOCKS = 24
MULTI_NODE_BLOCKS = 8
# sizeof(dispatch_memory_region_info_t) / sizeof(combine_memory_region_info_t): eight / six
# __be32 keys, nine / seven uint64_t, aligned to 8 (utils.cuh:43-77).
DISPATCH_MR_INFO_BYTES = 8 * 4 + 9 * 8
COMBINE_MR_INFO_BYTES = 6 * 4 + 7 * 8
# The multi-node token limit: the dispatch queue pairs' send depth 3 x rows + 1 must stay below
# the IB limit 65536 (config.cuh:18-47, checked by BufferConfig::is_valid, config.cuh:94-95).
IB_QP_MAX_TX_DEPTH = 65536


def _round_up(value: int, multiple: int) -> int:
    """``hybrid_ep_pad_num_of_tokens_per_rank`` (``config.cuh:52-62``): up to a multiple of the
    chunk, unchanged for a chunk of 0 or less."""
    return value if multiple <= 0 else (value + multiple - 1) // multiple * multiple


def buffer_rows(first_tokens: int) -> int:
    """Rows per rank the constructor sizes the buffer for (``config.cuh:385-387``)."""
    return _round_up(max(first_tokens, 512), env_int(CHUNK_COMBINE_ENV, 64))


def rows_after(rows: int, num_tokens: int) -> int:
    """Rows after a dispatch of ``num_tokens`` against a buffer of ``rows``: the tokens rounded
    to 16 (``hybrid_ep_buffer.py:141-147``), then to the combine chunk (``config.cuh:466-468``);
    the buffer only grows (``grow_to``, ``intranode.cu:136``; ``config.cuh:557-559``)."""
    return max(rows, _round_up((num_tokens + 15) // 16 * 16, env_int(CHUNK_COMBINE_ENV, 64)))


def hybrid_ep_buffer_terms(
    rows: int,
    hidden_dim: int,
    num_local_experts: int,
    num_of_ranks: int,
    local_rank: int,
    blocks_preprocessing: Optional[int] = None,
    *,
    num_of_nodes: int = 1,
    blocks_dispatch: Optional[int] = None,
    blocks_combine: Optional[int] = None,
) -> List[BufferTerm]:
    """Every allocation of one rank's HybridEP buffer for ``rows`` rows per rank, NVLink domains
    of ``num_of_ranks`` ranks on ``num_of_nodes`` nodes: the module docstring's ``[hybridep
    buffer]`` table, row for row, then (several nodes) its ``[hybridep buffer, multi-node]``
    table. ``local_rank`` 0 also holds the flags its peers map. ``blocks_dispatch`` /
    ``blocks_combine`` are the dispatch / combine blocks, one queue pair per block and remote
    node (default: 24 on one node, 8 on several, ``config.cuh:366-367``)."""
    r, m, e_l, h = num_of_ranks, num_of_nodes, num_local_experts, hidden_dim
    n = rows * r * m
    blocks = blocks_preprocessing or DEFAULT_BLOCKS_PREPROCESSING
    combine_chunks = cdiv(rows, env_int(CHUNK_COMBINE_ENV, 64))
    dispatch_chunks = cdiv(rows, env_int(CHUNK_DISPATCH_ENV, 64))
    nvl, ag = "intranode.cu", "allgather.cu"
    rank0 = local_rank == 0
    one_node = m == 1  # the custom all-gather's NVLink state: one node only (allgather.cu:149)
    rows_of_table = [
        ("preprocessing scratch (ranks)", blocks * r * TMP_STATE_BYTES, f"{nvl}:180-181,185-187"),
        ("preprocessing scratch (local experts)", blocks * e_l * TMP_STATE_BYTES,
         f"{nvl}:182-183,188-190"),
        ("combine expert_input_token", n * h * 2, f"{nvl}:255,260"),
        ("combine expert_input_prob", n * e_l * r * 4, f"{nvl}:256-257,261"),
        ("combine write-completion flags", 8 if rank0 else 0, f"{nvl}:264-266"),
        ("combine expected flag value", 8, f"{nvl}:269"),
        ("combine flag parity", 4, f"{nvl}:271"),
        ("combine expected unpermute flag", 4, f"{nvl}:274"),
        ("combine chunk flags", combine_chunks * r * m * 4, f"{nvl}:277-278"),
        ("dispatch expert_output_scaling_factor", n * (h // 128) * 4, f"{nvl}:201,213"),
        ("dispatch write-completion flags", 8 if rank0 else 0, f"{nvl}:216-218"),
        ("dispatch expected flag value", 8, f"{nvl}:220"),
        ("dispatch flag parity", 4, f"{nvl}:222"),
        ("dispatch expected permute flag", 4, f"{nvl}:226"),
        ("dispatch chunk flags", dispatch_chunks * r * m * 4, f"{nvl}:229-230"),
        ("all-gather routing map", e_l * r * m * rows * r * m, f"{ag}:144-147"),
        ("all-gather NVLink sync flag", 8 if rank0 and one_node else 0, f"{ag}:150-154"),
        ("all-gather SM sync flag", 8 if one_node else 0, f"{ag}:157"),
        ("all-gather iteration id", 8 if one_node else 0, f"{ag}:159"),
        ("all-gather peer pointers", r * 8 if one_node else 0, f"{ag}:164"),
        ("allocator probe", 128 * 4, "allocator.cu:62"),
    ]  # fmt: skip
    if m > 1:
        rows_of_table += _rdma_rows(
            rows, h, e_l, r, m, dispatch_chunks, combine_chunks,
            blocks_dispatch or MULTI_NODE_BLOCKS, blocks_combine or MULTI_NODE_BLOCKS,
        )  # fmt: skip
    return [BufferTerm(name, nbytes, src) for name, nbytes, src in rows_of_table if nbytes]


def _rdma_rows(rows, h, e_l, r, m, dispatch_chunks, combine_chunks, blocks_d, blocks_c):
    """The multi-node rows (``RDMACoordinator``, ``internode_doca.cu``): its
    ``allocate_buffers`` allocates the combine buffers, then the dispatch ones (``:332-335``)."""
    rdma, remote = "doca.cu", m - 1  # internode_doca.cu
    combine_flags = (combine_chunks * remote + 2 * remote) * 8
    dispatch_flags = (dispatch_chunks * remote + 2 * remote) * 8
    qps_c, qps_d = remote * blocks_c, remote * blocks_d
    return [
        ("RDMA combine intra_node_red_token", rows * remote * h * 2,
         f"{rdma}:559-560,573-574"),
        ("RDMA combine intra_node_red_prob", rows * remote * e_l * r * 4,
         f"{rdma}:561-562,575-576"),
        ("RDMA combine inter_node_group_token", rows * remote * h * 2,
         f"{rdma}:563-564,577-578"),
        ("RDMA combine inter_node_group_prob", rows * remote * e_l * r * 4,
         f"{rdma}:565-566,579-580"),
        ("RDMA combine inter_node_group_flags", combine_flags, f"{rdma}:567-570,581-582"),
        ("RDMA combine attn_output_flags", combine_flags, f"{rdma}:567-570,585-586"),
        ("RDMA combine expected_rdma_flag_value", 8, f"{rdma}:591"),
        ("RDMA combine queue-pair pointers", qps_c * 8, f"{rdma}:608,660"),
        ("RDMA combine memory-region info", qps_c * COMBINE_MR_INFO_BYTES, f"{rdma}:608,664"),
        ("RDMA dispatch attn_input_token", rows * h * 2, f"{rdma}:388,409-410"),
        ("RDMA dispatch attn_input_prob", rows * e_l * r * m * 4, f"{rdma}:389-392,411-412"),
        ("RDMA dispatch attn_input_sf", rows * (h // 128) * 4,
         f"{rdma}:393-394,413-414"),
        ("RDMA dispatch inter_node_group_token", rows * remote * h * 2,
         f"{rdma}:395-397,415-416"),
        ("RDMA dispatch inter_node_group_prob", rows * remote * e_l * r * 4,
         f"{rdma}:398-401,417-418"),
        ("RDMA dispatch inter_node_group_sf", rows * remote * (h // 128) * 4,
         f"{rdma}:402-403,419-420"),
        ("RDMA dispatch inter_node_group_flags", dispatch_flags, f"{rdma}:404-407,421-422"),
        ("RDMA dispatch attn_input_flags", dispatch_flags, f"{rdma}:404-407,425-426"),
        ("RDMA dispatch expected_rdma_flag_value", 8, f"{rdma}:431"),
        ("RDMA dispatch queue-pair pointers", qps_d * 8, f"{rdma}:453,514"),
        ("RDMA dispatch memory-region info", qps_d * DISPATCH_MR_INFO_BYTES, f"{rdma}:453,518"),
    ]  # fmt: skip


def hybrid_ep_buffer_bytes(
    rows: int,
    hidden_dim: int,
    num_local_experts: int,
    num_of_ranks: int,
    local_rank: int,
    blocks_preprocessing: Optional[int] = None,
    **multi_node,
) -> int:
    """Device bytes of one rank's HybridEP buffer (:func:`hybrid_ep_buffer_terms`, whose
    keywords ``multi_node`` takes). (1024 rows, 2 ranks, H=2048, 128 local experts: 11,254,272
    bytes on local rank 1, 24 more on 0.)"""
    terms = hybrid_ep_buffer_terms(
        rows, hidden_dim, num_local_experts, num_of_ranks, local_rank, blocks_preprocessing,
        **multi_node,
    )  # fmt: skip
    return sum(t.nbytes for t in terms)


def _node_major(rows_map: torch.Tensor, nodes: int) -> torch.Tensor:
    """``[N, R x M]`` (token ``n``'s row in each rank's receive buffer, ranks in group order) as
    the real ``sparse_to_dense_map``'s ``[N x M, R]``: row ``m x N + n`` holds token ``n``'s rows
    on the ``R`` ranks of node ``m``."""
    n, size = rows_map.shape
    return rows_map.view(n, nodes, size // nodes).transpose(0, 1).reshape(nodes * n, -1)


def _rank_major(rows_map: torch.Tensor, nodes: int) -> torch.Tensor:
    """The inverse of :func:`_node_major`."""
    n, per_node = rows_map.shape[0] // nodes, rows_map.shape[1]
    return rows_map.view(nodes, n, per_node).transpose(0, 1).reshape(n, nodes * per_node)


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


@dataclass(frozen=True)
class _BufferConfig:
    """The field of ``hybrid_ep_cpp.BufferConfig`` (``config.cuh:67``) megatron's callers read."""

    max_num_of_tokens_per_rank: int


# The bytes of a host name deep_ep compares (``MemHandle::src_hostname``, allocator.cuh).
HOSTNAME_BYTES = 256


class ExtendedMemoryAllocator:
    """``hybrid_ep_cpp.ExtendedMemoryAllocator`` (``csrc/hybrid_ep/allocator/allocator.cu`` at
    94a9f8f) as Python code calls it: megatron-core's HybridEP InfiniBand guardrail (main
    2026-05, #4719, removed by #4846) sizes the NVLink domain with
    ``detect_accessible_ranks(group)`` before a buffer exists. The real one all-gathers each
    rank's test memory handle over the group (a collective: every rank must call it,
    ``allocator.cu:178-211``) and counts the ranks whose handle it can open (fabric) or that
    come from its own host (``is_accessible``, ``allocator.cu:162-176``), itself included. The
    emulation all-gathers the host names on the buffer device and counts the ranks of its own
    host that sit on its emulated node
    (:func:`moe_release.runtime.kernels.emulation_common.node_layout`, every rank of the group
    unless ``MOE_RELEASE_RANKS_PER_NODE`` names a node size)."""

    def detect_accessible_ranks(self, process_group) -> int:
        """The ranks of ``process_group`` in this rank's NVLink domain (collective)."""
        name = socket.gethostname().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
        mine = torch.tensor(list(name), dtype=torch.uint8, device=buffer_device()).view(1, -1)
        rows = all_gather_rows(mine, process_group).cpu()
        me = group_rank(process_group)
        layout = node_layout(process_group, group_size(process_group))
        per_node = layout.ranks_per_node
        return sum(
            1
            for i in range(rows.shape[0])
            if i // per_node == layout.node and (i == me or torch.equal(rows[i], mine[0].cpu()))
        )


class _HybridEPRuntime:
    """Stand-in for ``hybrid_ep_cpp.HybridEPBuffer``, whose destructor (``hybrid_ep.cu:75-90``,
    ``release_buffer``) synchronizes the device and frees the buffers the peers map (closing
    their IPC handles): no peer waits in it, but a peer's kernel still reading or writing this
    rank's memory then faults. Its destruction is logged as ``hybridep release_buffer`` with its
    context (:func:`moe_release.runtime.measure.faults.note`), so that where the memory goes is
    seen. It owns the emulated memory (``memory``), which goes with it: dropping the Python
    buffer's ``runtime`` frees it while the Python object lives on, as the real one.

    On several nodes it also holds the RDMA coordinator's state (``hybrid_ep.cu:62-64``): the
    queue pairs every ``allocate_buffer`` connects through two all-gathers of their addresses
    over the whole group (``internode_doca.cu:503,649,789-812``), emulated as rendezvous of
    ``fabric`` (:class:`moe_release.runtime.measure.faults.Fabric`, bounded), and that
    ``release_buffer`` deregisters and frees locally (``internode_doca.cu:698-787``: no peer
    waits), logged as ``hybridep rdma release`` over this rank alone."""

    def __init__(self, group: Optional[dist.ProcessGroup], num_of_nodes: int = 1) -> None:
        self.ranks = faults.group_ranks(group)
        self.memory: Optional[torch.Tensor] = None
        self.num_of_nodes = num_of_nodes
        # The queue pairs' peers are the constructor's (the exchange below): a fabric per
        # construction, whatever becomes of the group (faults.Fabric).
        self.fabric = faults.Fabric(group, "hybridep-rdma") if num_of_nodes > 1 else None
        self.me = dist.get_rank() if dist.is_initialized() else 0

    def connect_rdma(self) -> None:
        """``RDMACoordinator::allocate_buffers`` (``internode_doca.cu:332-335``): the combine
        queue pairs' addresses, then the dispatch ones', all-gathered over the group."""
        if self.fabric is not None:
            self.fabric.barrier("hybridep rdma info exchange (combine)")
            self.fabric.barrier("hybridep rdma info exchange (dispatch)")

    def release_rdma(self) -> None:
        """``RDMACoordinator::destroy`` (``internode_doca.cu:698-787``): a device synchronize,
        ``ibv_dereg_mr``, ``cudaFree`` and the queue pairs destroyed, all on this rank."""
        if self.fabric is not None:
            faults.note(
                "hybridep rdma release", (self.me,), peers=list(self.ranks or ()), collective=False
            )

    def __del__(self, _faults=faults) -> None:
        try:
            _faults.note("hybridep release_buffer", self.ranks)
            self.release_rdma()
        except Exception:  # noqa: BLE001 - the interpreter's finalization may have cleared it
            pass


class HybridEPBuffer:
    """Emulation of ``deep_ep.HybridEPBuffer`` (permute + all-to-all + permute).

    :meth:`dispatch_with_permute` returns the 11-item handle of DeepEP 94a9f8f (module
    docstring), last the overflow flag (an int32 tensor, non-zero when ``num_permuted_tokens``
    was too small and rows were dropped). The emulation encodes the routing in the real fields:
    ``sparse_to_dense_map[m * N + n, r]`` is token ``n``'s row in the receive buffer of local
    rank ``r`` of node ``m`` (-1: not sent; on one node, ``[n, d]`` for rank ``d``);
    ``rdma_to_attn_map[n, m]`` whether token ``n`` goes to node ``m``, ``attn_to_rdma_map`` the
    same for the other nodes (own node skipped); ``local_expert_routing_map`` /
    ``dense_to_expert_map`` rows are received tokens (source rank, then token order; rows past
    the received ones unused) and
    ``dense_to_expert_map[r, e]`` is the permuted output row of received token ``r`` for local
    expert ``e`` (-1: none, or dropped past the budget); ``dense_chunk_layout`` counts, per
    source rank and 64-token chunk (``NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API``), the tokens
    received; ``handle[7]`` holds the unpadded counts before any budget drop.

    The real buffer is allocated outside PyTorch's allocator; the emulation allocates the sum
    of its terms (``terms``, :func:`hybrid_ep_buffer_terms`) as one tensor (``memory``), so
    allocator counts see it live and die with the buffer object.
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
        self.rank = group_rank(group)
        self.group_size = group_size(group)
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
        # Deprecated and ignored by deep_ep (hybrid_ep_buffer.py:53-55); kept for introspection.
        self.num_of_ranks_per_nvlink_domain = num_of_ranks_per_nvlink_domain
        # The NVLink domain (hybrid_ep_buffer.py:61-83): the environment's size (a warning if
        # it differs from the detected one), else the ranks detected accessible, here the
        # emulated node's (node_layout); the group must fill whole domains.
        detected = node_layout(group, self.group_size).ranks_per_node
        env = settings.deep_ep_variable(RANKS_PER_DOMAIN_ENV)
        domain = int(env) if env is not None else detected
        if domain != detected:
            warnings.warn(
                f"[Warning] {RANKS_PER_DOMAIN_ENV}={domain} differs from detected value "
                f"{detected}. Using environment variable.",
                stacklevel=2,
            )
        if domain < 1 or self.group_size % domain:
            raise AssertionError(
                f"The number of ranks {self.group_size} should be divisible by the number of "
                f"ranks per node {domain} at rank={self.rank}."
            )
        self.num_of_ranks_per_node = self.num_of_hybrid_ep_ranks_per_nvlink_domain = domain
        self.local_rank = self.rank % domain
        self.node_rank = self.rank // domain
        self.num_of_nodes = self.group_size // domain
        # Dispatch / combine blocks: one RDMA queue pair each per remote node (config.cuh:366-367).
        default_blocks = SINGLE_NODE_BLOCKS if self.num_of_nodes == 1 else MULTI_NODE_BLOCKS
        self.num_of_blocks_dispatch_api = num_sms_dispatch_api or default_blocks
        self.num_of_blocks_combine_api = num_sms_combine_api or default_blocks
        # Rows per rank: the first call's tokens, at least 512, rounded to the combine chunk
        # (config.cuh:385-387); later calls grow them (_grow).
        self.rows = buffer_rows(max_num_of_tokens_per_rank)
        self._check_capacity(self.rows, RuntimeError, "The buffer config is not valid.")
        # The C++ buffer (hybrid_ep_buffer.py:101-111): code outside reads ``runtime``, and its
        # destructor is where the memory goes (_HybridEPRuntime).
        self.runtime = _HybridEPRuntime(self.group, self.num_of_nodes)
        self._allocate()
        faults.register_buffer(self)

    def _check_capacity(self, rows: int, error, message: str) -> None:
        """Several nodes: the dispatch queue pairs' send depth ``3 x rows + 1`` must stay below
        65536 (``config.cuh:18-47``; the constructor throws, ``config.cuh:393-398``, a larger
        call fails ``update_template_config``'s assertion, ``hybrid_ep_buffer.py:156``)."""
        if self.num_of_nodes > 1 and 3 * rows + 1 >= IB_QP_MAX_TX_DEPTH:
            raise error(
                f"{message} max_num_of_tokens_per_rank={rows} exceeds the supported maximum "
                f"number of {(IB_QP_MAX_TX_DEPTH - 2) // 3} tokens in multi-node mode."
            )

    @property
    def memory(self) -> Optional[torch.Tensor]:
        """The emulated buffer memory, which the C++ runtime owns (None once it is dropped)."""
        return None if self.runtime is None else self.runtime.memory

    @memory.setter
    def memory(self, value: Optional[torch.Tensor]) -> None:
        self.runtime.memory = value

    def _live_runtime(self, name: str) -> None:
        """The real methods call ``self.runtime.<name>``: with the runtime dropped, that raises."""
        if self.runtime is None:
            raise AttributeError(f"'NoneType' object has no attribute '{name}'")

    @property
    def configurer(self) -> SimpleNamespace:
        """The buffer's ``Configurer`` as Python code reads it (``hybrid_ep_buffer.py:85-99``):
        only ``buffer_config.max_num_of_tokens_per_rank``, the rows per rank the buffer holds
        (the constructor's tokens, at least 512, rounded, ``config.cuh:385-387``; grown by
        ``update_template_config``, ``hybrid_ep_buffer.py:141-147``). Assigning the field raises:
        the emulation does not model it, and megatron-core never assigns it."""
        return SimpleNamespace(buffer_config=_BufferConfig(max_num_of_tokens_per_rank=self.rows))

    def _allocate(self) -> None:
        """``allocate_buffer`` (``hybrid_ep.cu:92-107``): the NVLink buffers, the RDMA ones on
        several nodes, the all-gather's; one counted tensor of the terms' sum."""
        self.terms = hybrid_ep_buffer_terms(
            self.rows,
            self.hidden_dim,
            self.num_local_experts,
            self.num_of_ranks_per_node,
            self.local_rank,
            self.num_sms_preprocessing_api,
            num_of_nodes=self.num_of_nodes,
            blocks_dispatch=self.num_of_blocks_dispatch_api,
            blocks_combine=self.num_of_blocks_combine_api,
        )
        self.nbytes = sum(t.nbytes for t in self.terms)
        self.memory = torch.empty(self.nbytes, dtype=torch.uint8, device=buffer_device())
        # allocate_buffers() ends with exchange_remote_nvl_info(): torch.distributed.all_gather of
        # the IPC handles over the group, from C++ (intranode.cu:171-177, 300-322), at the
        # constructor and at every regrowth (hybrid_ep.cu:109-133). Logged, not run: the
        # emulation maps nothing. The destructor (hybrid_ep.cu:75-90) is local: a device
        # synchronize and local frees, no peer barrier.
        faults.note("hybridep handle exchange", faults.group_ranks(self.group))
        # Several nodes: the RDMA queue pairs connect (hybrid_ep.cu:94-97).
        self.runtime.connect_rdma()

    def _grow(self, num_tokens: int) -> None:
        """``update_buffer`` (``hybrid_ep_buffer.py:141-165``, ``hybrid_ep.cu:109-133``): a call
        with more tokens than the rows grows them (:func:`rows_after`); the old buffer is freed
        (``release_buffer``, the RDMA state locally) before the new one is allocated."""
        rows = rows_after(self.rows, num_tokens)
        if rows > self.rows:
            self._check_capacity(rows, AssertionError, "The config is not valid.")
            self.rows = rows
            self.memory = None
            self.runtime.release_rdma()
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
        global_map = all_gather_rows(routing_map.bool(), self.group)
        per_rank = global_map.view(size, num_tokens, size, local)
        to_rank_all = per_rank.any(-1)  # [source, token, destination]
        to_rank = to_rank_all[rank]
        # Rows of each destination's receive buffer that lower ranks fill.
        offsets = to_rank_all[:rank].sum(dim=(0, 1)).to(torch.int32)
        sparse_to_dense = dense_rows(to_rank, offsets)
        _, send_counts = sent_token_ids(sparse_to_dense)
        # What it receives: tokens of every source rank routed to its experts, source-major.
        from_src = per_rank[:, :, rank, :]
        recv_mask = from_src.any(-1)  # [source, token]
        recv_counts = [count_set(recv_mask[s]) for s in range(size)]
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
            tokens_per_expert = pinned(padded, torch.int64)
            num_dispatched = pinned([received], torch.int32)
            kernel_host_sync("hybridep blocking dispatch")
        # Per node: whether each token goes to any rank of node m (rdma_to_attn_map, [.., M]),
        # and to any rank of each other node, own node skipped (attn_to_rdma_map, [N, M-1]).
        nodes, per_node = self.num_of_nodes, self.num_of_ranks_per_node
        to_node = to_rank.view(num_tokens, nodes, per_node).any(-1)
        rdma_to_attn = torch.zeros((cdiv(num_tokens, 16) * 16, nodes), dtype=torch.bool, device=dev)
        rdma_to_attn[:num_tokens] = to_node
        others = [m for m in range(nodes) if m != self.node_rank]
        attn_to_rdma = to_node[:, others].contiguous()
        local_expert_routing_map = torch.zeros(
            (num_tokens * size, local), dtype=torch.bool, device=dev
        )
        local_expert_routing_map[:received] = local_map
        chunk = env_int(CHUNK_PREPROCESSING_ENV, 64)
        chunks = cdiv(num_tokens, chunk)
        by_chunk = torch.zeros((size, chunks * chunk), dtype=torch.int32, device=dev)
        by_chunk[:, :num_tokens] = recv_mask.to(torch.int32)
        dense_chunk_layout = by_chunk.view(size, chunks, chunk).sum(-1).to(torch.int32).flatten()
        config = HybridEPConfig(
            hidden_dim=self.hidden_dim,
            num_of_experts_per_rank=local,
            num_of_ranks_per_node=per_node,
            num_of_nodes=nodes,
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
            _node_major(sparse_to_dense, nodes),
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
        return _rank_major(handle[0], config.num_of_nodes), handle[6], handle[8], config

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
        self._live_runtime("dispatch_with_permute")
        if use_fp8:
            raise NotImplementedError("The HybridEP emulation does not implement FP8 dispatch.")
        if non_blocking and (num_permuted_tokens is None or num_permuted_tokens < 0):
            raise ValueError("num_permuted_tokens is required for non-blocking mode.")
        num_tokens, _ = hidden.shape
        if handle is None:
            same_count_on_every_rank(
                num_tokens,
                self.group,
                "HybridEP dispatch needs the same number of tokens on every rank: the kernel "
                "all-gathers each rank's routing map as [N x ranks, E] with its own N (deep_ep "
                "94a9f8f csrc/hybrid_ep/executor/executor.cu:33-51)",
            )
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
        size = config.num_of_ranks_per_node * config.num_of_nodes
        local = config.num_of_experts_per_rank
        send_token_ids, sends = sent_token_ids(sparse_to_dense)
        recvs = config.recv_counts
        row_id_map = self._row_id_map(dense_to_expert, rows)

        recv_hidden = all_to_all(hidden[send_token_ids], sends, recvs, self.group)
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
            recv_probs = all_to_all(send_probs, sends, recvs, self.group)
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
        self._live_runtime("combine_with_unpermute")
        if handle is None:
            raise ValueError("The handle is necessary for combine.")
        sparse_to_dense, dense_to_expert, n, config = self._unpack(tuple(handle))
        if hidden.shape[0] < config.rows_used:
            raise ValueError(
                f"hidden has {hidden.shape[0]} rows but dispatch filled {config.rows_used}."
            )
        size = config.num_of_ranks_per_node * config.num_of_nodes
        local = config.num_of_experts_per_rank
        send_token_ids, sends = sent_token_ids(sparse_to_dense)
        recvs = config.recv_counts
        m = config.num_dispatched
        row_id_map = self._row_id_map(dense_to_expert, hidden.shape[0])
        valid = row_id_map[:, 0] >= 0
        # Unpermute on the expert rank, then send one partial sum per token copy back.
        partial = sum_rows(hidden[valid], row_id_map[valid, 0], m, hidden.dtype)
        back = all_to_all(partial, recvs, sends, self.group)
        out = sum_rows(back, send_token_ids, n, hidden.dtype)

        out_probs = None
        if probs is not None:
            recv_probs = torch.zeros(m, local, dtype=torch.float32, device=hidden.device)
            recv_probs[row_id_map[valid, 0], row_id_map[valid, 1]] = probs.float()[valid]
            back_probs = all_to_all(recv_probs, recvs, sends, self.group)
            dest_of_row = torch.repeat_interleave(
                torch.arange(size, device=hidden.device),
                torch.tensor(sends, dtype=torch.long, device=hidden.device),
            )
            out_probs = torch.zeros(n, size, local, dtype=torch.float32, device=hidden.device)
            out_probs[send_token_ids, dest_of_row] = back_probs
            out_probs = out_probs.view(n, size * local)
        return out, out_probs
