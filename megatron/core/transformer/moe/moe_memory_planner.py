# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""MoE memory planner: what the MoE token dispatchers will hold, predicted from the model and
parallel configuration before anything is allocated.

Planners (an admission check, a memory estimator) need two numbers that neither
``torch.cuda.memory_allocated`` nor a learned peak gives them in advance:

* **the communication buffers** of the flex dispatcher, allocated outside PyTorch's caching
  allocator by DeepEP's kernels: :func:`hybridep_buffer_terms` (HybridEP, intranode NVLink and
  multi-node RDMA) and :func:`deepep_buffer_terms` (DeepEP normal mode), term by term, each
  citing the line of deep_ep's source that allocates it;
* **the dispatcher state an unpatched megatron-core keeps alive between calls**, per MoE
  layer: :func:`retained_state_terms` (routing map, probabilities, the dispatch handle and the
  autograd graph the differentiable dispatched probabilities pin). megatron-core with this
  series releases it after combine and keeps nothing.

:func:`plan` puts the terms of a configuration together, base beside patched; :func:`main`
is the command (``python -m megatron.core.transformer.moe.moe_memory_planner``), taking
Megatron's own argument names or a Megatron-Bridge style YAML.

Sources. deep_ep is read at ``DEEP_EP_COMMIT``, the head of its ``hybrid-ep`` branch; the commit
megatron-core's CI pins (``de0dd11``) was not available to read, so where the two differ these
figures follow ``DEEP_EP_COMMIT``. Two terms depend on that: the unused all-gather buffer
(``enable_custom_allgather`` defaults to False at ``DEEP_EP_COMMIT``) and the rounding of rows
to the combine chunk (since deep_ep 4214430). megatron-core call sites are cited as in
megatron-core 0.19.2. Terms marked approximate (the DOCA queue pairs of multi-node HybridEP)
come from a stored NCCL version, not deep_ep's submodule pin. Not modelled: NVSHMEM's own
memory (DeepEP across more than 8 ranks), the cuMem fabric granularity, NCCL communicators,
DeepEP's low-latency mode, NCCL EP's leaked device communicator (one cuMem granule per
bootstrap), and (for the retained state) capacity-factor routing (drop-and-pad keeps other
shapes) and the DeepEP v2 and NCCL EP backends, whose buffers are priced
(:func:`deepep_v2_buffer_terms` at ``DEEP_EP_V2_COMMIT``, :func:`nccl_ep_terms` at
``NCCL_EP_COMMIT``) but whose retained state is not.

Imports only the standard library.
"""

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence

DEEP_EP_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# DeepEP v2 (ElasticBuffer, megatron dev's 'deepepv2'): the epv2-release branch.
DEEP_EP_V2_COMMIT = "018f21ea62c6c2888d9b46806aad6d90b399b23d"
# NCCL EP (TransformerEngine's NCCL EP API, the 'ncclep' backend): nccl-extensions, as pinned by
# TransformerEngine d0067d0 (3rdparty/nccl-extensions).
NCCL_EP_COMMIT = "9f47d6eb3b60962d8157a579b4caaaa4ae6b19f4"

# Where a term's bytes live.
OUTSIDE = "outside allocator"  # cudaMalloc, CUDA IPC, cuMem or NVSHMEM, by deep_ep
ALLOCATOR = "allocator"  # PyTorch's caching allocator
HOST = "pinned host"  # cudaMallocHost: host memory, not device

BF16 = 2
FP32 = 4
INT32 = 4
INT64 = 8

MIN_ROWS = 512  # csrc/hybrid_ep/config.cuh:386
DEFAULT_CHUNK = 64  # csrc/hybrid_ep/config.cuh:383-384
DEFAULT_BLOCKS_PREPROCESSING = 108  # megatron: moe_hybridep_num_sms_preprocessing
DEFAULT_MULTINODE_BLOCKS = 8  # csrc/hybrid_ep/config.cuh:366-367
TMP_STATE_BYTES = 8  # hybrid_ep::tmp_state_t {enum, int32}: backend/hybrid_ep_backend.cuh:79-87
ALLOCATOR_TEST_BYTES = 512  # ExtendedMemoryAllocator's probe: allocator/allocator.cu:62
DEEPEP_WORKSPACE = 32 * 1024 * 1024  # NUM_WORKSPACE_BYTES: csrc/kernels/configs.cuh:5
DEEPEP_NVL_META = 8 * 4 + 8 * 8 + 8 * 8  # barrier signals and pointers: csrc/deep_ep.cpp:171-184
NUM_MAX_NVL_PEERS = 8  # csrc/kernels/configs.cuh:3
SOURCE_META_BYTES = 8  # internode::get_source_meta_bytes: csrc/kernels/internode.cu:40-42
MAX_TOPK = 128  # kNumMaxTopK, kNumMaxScales: csrc/config.hpp:54-55
DEFAULT_DEEPEP_SMS = 20  # megatron: moe_flex_dispatcher_num_sms or 20 (token_dispatcher.py)

# Buffer.get_dispatch_config / get_combine_config: (nvl_send, nvl_recv, rdma_send, rdma_recv)
# per group size (deep_ep/buffer.py:240-251 and 268-279); any other size is refused there.
DEEPEP_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (8, 288, 32, 128), 32: (32, 288, 32, 128), 64: (20, 288, 28, 128),
    128: (20, 560, 32, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128),
}  # fmt: skip
DEEPEP_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 64: (1, 288, 20, 128),
    128: (1, 560, 12, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


@dataclass(frozen=True)
class Term:
    """One allocation: its name, bytes, where it lives and the source line that sizes it;
    ``released`` is False for what the kernel's destroy leaves allocated."""

    name: str
    nbytes: int
    where: str
    source: str
    note: str = ""
    released: bool = True


def total(terms: Sequence[Term], where: Optional[str] = None) -> int:
    """Bytes of ``terms`` (of those living ``where`` only, if given)."""
    return sum(t.nbytes for t in terms if where is None or t.where == where)


def released_bytes(terms: Sequence[Term]) -> int:
    """Bytes a release of these buffers gives back, device and pinned host: every term but
    those the kernel's destroy leaves allocated."""
    return sum(t.nbytes for t in terms if t.released)


def _up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _env_chunk(name: str) -> int:
    return int(os.environ.get(name, DEFAULT_CHUNK))


# --------------------------------------------------------------------------------------------
# HybridEP


def hybridep_rows(first_tokens: int, chunk_combine: Optional[int] = None) -> int:
    """Rows per rank HybridEP builds its buffer for: the first dispatch's token count, at
    least 512, rounded up to the combine chunk (``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``,
    default 64): ``csrc/hybrid_ep/config.cuh:384-387``. megatron-core builds the buffer at its
    first dispatch from that call's tokens (``fused_a2a.py`` ``init_hybrid_ep_buffer``)."""
    chunk = chunk_combine or _env_chunk("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API")
    return _up(max(first_tokens, MIN_ROWS), chunk)


def hybridep_rows_after(rows: int, tokens: int, chunk_combine: Optional[int] = None) -> int:
    """Rows after a dispatch of ``tokens`` against a buffer of ``rows``: the call rounds its
    tokens up to 16 (``deep_ep/hybrid_ep_buffer.py:142``), then to the combine chunk
    (``config.cuh:466-468``), and the buffer grows to that if larger (``config.cuh:557-559``;
    ``hybrid_ep.cu:109-133`` frees the old buffer, then allocates the new one). Rows never
    shrink."""
    chunk = chunk_combine or _env_chunk("NUM_OF_TOKENS_PER_CHUNK_COMBINE_API")
    return max(rows, _up(_up(tokens, 16), chunk))


@dataclass(frozen=True)
class HybridEPLayout:
    """What sizes HybridEP's buffers.

    Args:
        hidden: hidden size H.
        local_experts: experts per rank of the group (L).
        ranks_per_node: ranks of one NVLink domain (R).
        nodes: NVLink domains the group spans (n); the group is R x n ranks.
        rows: rows per rank (:func:`hybridep_rows`).
        shared_buffer: dispatch outputs alias the combine inputs (deep_ep's default,
            ``use_shared_buffer=True``; megatron-core does not pass it).
        fp8: FP8 tokens in the dispatch buffers (megatron-core 0.19 refuses FP8 dispatch).
        chunk_dispatch / chunk_combine: tokens per dispatch / combine chunk (env, default 64).
        blocks_preprocessing: preprocessing blocks (megatron-core passes
            ``moe_hybridep_num_sms_preprocessing``, default 108).
        blocks_dispatch / blocks_combine: SMs of the dispatch / combine kernels; multi-node
            queue pairs scale with them (None: deep_ep's multi-node default, 8).
    """

    hidden: int
    local_experts: int
    ranks_per_node: int
    nodes: int
    rows: int
    shared_buffer: bool = True
    fp8: bool = False
    chunk_dispatch: int = DEFAULT_CHUNK
    chunk_combine: int = DEFAULT_CHUNK
    blocks_preprocessing: int = DEFAULT_BLOCKS_PREPROCESSING
    blocks_dispatch: Optional[int] = None
    blocks_combine: Optional[int] = None

    @property
    def max_tokens(self) -> int:
        """N: rows x R x n, the tokens one rank may receive (``intranode.cu:127-129``)."""
        return self.rows * self.ranks_per_node * self.nodes

    @property
    def nvl_experts(self) -> int:
        """E_nvl: the experts of one NVLink domain, L x R."""
        return self.local_experts * self.ranks_per_node

    @property
    def experts(self) -> int:
        """E: the group's expert columns, L x R x n."""
        return self.nvl_experts * self.nodes


def hybridep_buffer_terms(layout: HybridEPLayout) -> List[Term]:
    """Every allocation of one rank's ``deep_ep.HybridEPBuffer``: the NVLink coordinator, the
    custom all-gather and (multi-node) the RDMA coordinator, all outside PyTorch's allocator.
    Sources: ``csrc/hybrid_ep/`` at ``DEEP_EP_COMMIT``."""
    lay = layout
    n, h, r, nodes = lay.max_tokens, lay.hidden, lay.ranks_per_node, lay.nodes
    e_nvl, e = lay.nvl_experts, lay.experts
    tok = 1 if lay.fp8 else BF16
    scales = h // 128  # integer division in C++: hidden_dim / 128
    dispatch_chunks = _cdiv(lay.rows, lay.chunk_dispatch)  # config.cuh:388-391
    combine_chunks = _cdiv(lay.rows, lay.chunk_combine)
    nvl = "buffer/intranode.cu"
    t = [
        Term("combine tokens (N x H, 16-bit)", n * h * BF16, OUTSIDE, f"{nvl}:255,260"),
        Term("combine probs (N x E_nvl, fp32)", n * e_nvl * FP32, OUTSIDE, f"{nvl}:256-257,261"),
    ]
    if lay.shared_buffer:
        t.append(Term("dispatch tokens and probs", 0, OUTSIDE, f"{nvl}:204-208",
                      "alias the combine buffers (use_shared_buffer)"))  # fmt: skip
    else:
        t += [
            Term("dispatch tokens (N x H)", n * h * tok, OUTSIDE, f"{nvl}:198,209-210"),
            Term("dispatch probs (N x E_nvl, fp32)", n * e_nvl * FP32, OUTSIDE, f"{nvl}:199,211"),
        ]
    t += [
        Term("dispatch scaling factors (N x floor(H/128), fp32)", n * scales * FP32, OUTSIDE,
             f"{nvl}:201,213", "allocated without FP8 too"),
        Term("dispatch chunk flags", dispatch_chunks * r * nodes * INT32, OUTSIDE,
             f"{nvl}:229-230"),
        Term("combine chunk flags", combine_chunks * r * nodes * INT32, OUTSIDE,
             f"{nvl}:277-278"),
        Term("preprocessing scratch", lay.blocks_preprocessing * (r + lay.local_experts)
             * TMP_STATE_BYTES, OUTSIDE, f"{nvl}:180-190"),
        # dispatch: expected flag 8 + parity 4 + permute flag 4; combine: the same.
        Term("flags", 2 * (8 + 4 + 4), OUTSIDE, f"{nvl}:220-226,269-274",
             "local rank 0 also holds 2 x 8 B of write-completion flags (:216-219,264-267)"),
        Term("all-gathered routing map (N x E, bool)", n * e, OUTSIDE,
             "extension/allgather.cu:144-147",
             "allocated always; read only with enable_custom_allgather (default False)"),
    ]  # fmt: skip
    if nodes == 1:
        t.append(Term("all-gather flags and peer pointers", 8 + 8 + r * 8, OUTSIDE,
                      "extension/allgather.cu:157-164"))  # fmt: skip
    t.append(Term("allocator probe", ALLOCATOR_TEST_BYTES, OUTSIDE, "allocator/allocator.cu:62"))
    if nodes > 1:
        t += _hybridep_rdma_terms(lay, tok, scales)
    return t


def _hybridep_rdma_terms(lay: HybridEPLayout, tok: int, scales: int) -> List[Term]:
    """The DOCA RDMA coordinator's buffers (``buffer/internode_doca.cu``), cudaMalloc'd and
    registered with the NIC; ``rows`` per rank, ``n - 1`` peer nodes."""
    rows, h, peers = lay.rows, lay.hidden, lay.nodes - 1
    e_nvl, e = lay.nvl_experts, lay.experts
    src = "buffer/internode_doca.cu"
    s_d = lay.blocks_dispatch or DEFAULT_MULTINODE_BLOCKS
    s_c = lay.blocks_combine or DEFAULT_MULTINODE_BLOCKS
    q_d, q_c = peers * s_d, peers * s_c
    d_flags = 2 * (_cdiv(rows, lay.chunk_dispatch) * peers + 2 * peers) * INT64
    c_flags = 2 * (_cdiv(rows, lay.chunk_combine) * peers + 2 * peers) * INT64

    def ring(depth: int) -> int:
        # One send queue of depth WQEs and a completion queue, 64 B each, page-aligned, and two
        # doorbell pages; doca_gpu_mem_alloc over-allocates by its 4 KiB alignment.
        wqes = 1 << (depth - 1).bit_length()
        return 2 * (wqes * 64 + 4096) + 2 * 8192

    return [
        Term("rdma dispatch input tokens", rows * h * tok, OUTSIDE, f"{src}:388,409-410"),
        Term("rdma dispatch input probs (E, fp32)", rows * e * FP32, OUTSIDE, f"{src}:389-392"),
        Term("rdma dispatch input scaling factors", rows * scales * FP32, OUTSIDE, f"{src}:393"),
        Term("rdma dispatch peer tokens", rows * peers * h * tok, OUTSIDE, f"{src}:395-397"),
        Term("rdma dispatch peer probs", rows * peers * e_nvl * FP32, OUTSIDE, f"{src}:398-401"),
        Term("rdma dispatch peer scaling factors", rows * peers * scales * FP32, OUTSIDE,
             f"{src}:402-403"),
        Term("rdma dispatch flags", d_flags + INT64, OUTSIDE, f"{src}:404-407,421-431"),
        Term("rdma combine reduction tokens", rows * peers * h * BF16, OUTSIDE, f"{src}:559-560"),
        Term("rdma combine reduction probs", rows * peers * e_nvl * FP32, OUTSIDE,
             f"{src}:561-562"),
        Term("rdma combine peer tokens", rows * peers * h * BF16, OUTSIDE, f"{src}:563-564"),
        Term("rdma combine peer probs", rows * peers * e_nvl * FP32, OUTSIDE, f"{src}:565-566"),
        Term("rdma combine flags", c_flags + INT64, OUTSIDE, f"{src}:567-570,581-591"),
        Term("queue-pair tables", q_d * (8 + 104) + q_c * (8 + 80), OUTSIDE,
             f"{src}:453,514,518,608,660,664"),
        Term("DOCA queue pairs (approximate)", q_d * ring(3 * rows + 1) + q_c * ring(2 * rows + 1),
             OUTSIDE, f"{src}:457,612",
             "ring sizes from NCCL's doca_gpunetio_high_level.cpp, not deep_ep's pin"),
    ]  # fmt: skip


def hybridep_handle_terms(
    tokens: int, local_experts: int, ranks_per_node: int, nodes: int, blocking: bool = True
) -> List[Term]:
    """The dispatch handle one HybridEP call allocates in PyTorch's allocator, which the
    dispatch's autograd context keeps until backward (``fused_a2a.py`` ``HybridEPDispatch``):
    ``csrc/hybrid_ep/executor/executor.cu`` at ``DEEP_EP_COMMIT``. ``blocking`` (no
    ``num_permuted_tokens``): the counts are pinned host tensors."""
    g = ranks_per_node * nodes
    src = "executor/executor.cu"
    counts = HOST if blocking else ALLOCATOR
    return [
        Term("sparse_to_dense_map", tokens * g * INT32, ALLOCATOR, f"{src}:93-96"),
        Term("rdma_to_attn_map", _up(tokens, 16) * nodes, ALLOCATOR, f"{src}:85,97-99"),
        Term("attn_to_rdma_map", tokens * (nodes - 1), ALLOCATOR, f"{src}:100-102"),
        Term("num_dispatched_tokens", INT32, counts, f"{src}:103-109"),
        Term("local_expert_routing_map", tokens * g * local_experts, ALLOCATOR, f"{src}:110-112"),
        Term("overflow_flag", INT32, ALLOCATOR, f"{src}:117-118"),
        Term("dense_chunk_layout", _cdiv(tokens, 64) * g * INT32, ALLOCATOR, f"{src}:120-123"),
        Term("dense_to_expert_map", tokens * g * local_experts * INT32, ALLOCATOR,
             f"{src}:124-126"),
        Term("tokens_per_expert", local_experts * INT32, counts, f"{src}:128-129"),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# DeepEP (normal mode)


def deepep_nvl_bytes(hidden_bytes: int, group_size: int, num_sms: int, recv: int) -> int:
    """``Config::get_nvl_buffer_size_hint`` (``csrc/config.hpp:51-73``), with NVSHMEM."""
    rdma_ranks = max(group_size // NUM_MAX_NVL_PEERS, 1)
    nvl_ranks = min(group_size, NUM_MAX_NVL_PEERS)
    c = num_sms // 2
    b = c * nvl_ranks * (2 * rdma_ranks + 3) * INT32
    b += c * nvl_ranks * recv * (hidden_bytes + SOURCE_META_BYTES)
    b += c * nvl_ranks * recv * MAX_TOPK * (INT64 + FP32 + FP32)
    return _up(b, 128)


def deepep_rdma_bytes(hidden_bytes: int, group_size: int, num_sms: int, send: int, recv: int):
    """``Config::get_rdma_buffer_size_hint`` (``csrc/config.hpp:75-103``): 0 up to 8 ranks;
    ``recv`` is first rounded up to a multiple of ``send`` (``config.hpp:45``)."""
    if group_size <= NUM_MAX_NVL_PEERS:
        return 0
    recv = _up(recv, send)
    c, rr = num_sms // 2, group_size // NUM_MAX_NVL_PEERS
    b = c * rr * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * INT32
    b += c * rr * recv * (hidden_bytes + SOURCE_META_BYTES) * 2
    b += c * rr * recv * MAX_TOPK * (INT64 + FP32 + FP32) * 2
    b += c * rr * recv * 16 * 2  # sizeof(int4)
    return _up(b, 128)


def deepep_buffer_terms(
    hidden_bytes: int, group_size: int, num_sms: int = DEFAULT_DEEPEP_SMS
) -> List[Term]:
    """One rank's ``deep_ep.Buffer`` as megatron-core's ``get_buffer`` builds it: the byte
    hints are the maximum over the dispatch and combine configs for the group
    (``fused_a2a.py`` ``get_buffer``), so the size does not depend on the token count.
    ``hidden_bytes`` is ``H x max(element size, 2)`` (``fused_a2a.py`` ``get_hidden_bytes``)."""
    if group_size not in DEEPEP_DISPATCH_CONFIGS:
        raise ValueError(
            f"DeepEP has no config for {group_size} ranks (deep_ep/buffer.py:252 accepts "
            f"{sorted(DEEPEP_DISPATCH_CONFIGS)})"
        )
    configs = (DEEPEP_DISPATCH_CONFIGS[group_size], DEEPEP_COMBINE_CONFIGS[group_size])
    nvl = max(deepep_nvl_bytes(hidden_bytes, group_size, num_sms, c[1]) for c in configs)
    rdma = max(deepep_rdma_bytes(hidden_bytes, group_size, num_sms, c[2], c[3]) for c in configs)
    t = [
        Term("NVLink buffer (num_nvl_bytes)", nvl, OUTSIDE, "csrc/config.hpp:51-73",
             "one cudaMalloc shared over CUDA IPC (csrc/deep_ep.cpp:145-147,171-184)"),
        Term("NVLink barrier signals and pointers", DEEPEP_NVL_META, OUTSIDE,
             "csrc/deep_ep.cpp:171-184"),
        Term("workspace", DEEPEP_WORKSPACE, OUTSIDE, "csrc/deep_ep.cpp:186-188"),
        Term("receive counters (token, per local expert)", 8 + 4 * 1024, HOST,
             "csrc/deep_ep.cpp:191-200", "freed by destroy() (deep_ep.cpp:299-304)"),
        Term("RDMA receive counter", 4, HOST, "csrc/deep_ep.cpp:202-206",
             "destroy() does not free it (deep_ep.cpp:299-304)", released=False),
    ]  # fmt: skip
    if rdma:
        t.append(Term("RDMA buffer (num_rdma_bytes)", rdma, OUTSIDE, "csrc/config.hpp:75-103",
                      "NVSHMEM symmetric heap (csrc/deep_ep.cpp:341-356); NVSHMEM's own "
                      "memory is not modelled"))  # fmt: skip
    return t


def deepep_emulated_bytes(hidden_bytes: int, group_size: int, num_sms: int) -> int:
    """Device bytes of :func:`deepep_buffer_terms` (what the CPU emulation allocates)."""
    return total(deepep_buffer_terms(hidden_bytes, group_size, num_sms), OUTSIDE)


# DeepEP v2: layout::WorkspaceLayout::get_num_bytes() (deep_ep/include/deep_ep/common/
# layout.cuh:43-81): barrier signals, notify reduction, scale-up/out rank and expert counters
# for 1024 ranks and 2048 experts, 1024 x 1024 channel metadata and tails, PP and AGRS signals.
DEEPEP_V2_WORKSPACE = 12_820_544


def _a32(n: int) -> int:
    return _up(n, 32)


def _a256(n: int) -> int:
    return _up(n, 256)


def deepep_v2_buffer_terms(
    group_size: int, tokens_per_rank: int, hidden: int, topk: int, fp8: bool = False
) -> List[Term]:
    """One rank's DeepEP v2 ``ElasticBuffer`` as megatron dev's ``get_elastic_buffer`` builds it
    (``num_max_tokens_per_rank`` = the call's tokens; one NVLink domain): the NCCL symmetric
    window of the workspace and the data buffer ``get_buffer_size_hint`` sizes
    (``max(R x N x Bd, min(R, K) x N x Bc)``, ``Bd = a32(H x elem) + a32(4 x sf) +
    a32(12 K + 4)``, ``Bc = a32(2 H) + a32(8 K)``), and the mapped pinned host workspace.
    Sources at ``DEEP_EP_V2_COMMIT``, under ``csrc/elastic/`` and ``deep_ep/include/``."""
    if tokens_per_rank <= 0 or hidden <= 0:
        raise ValueError("DeepEP v2 needs tokens and a hidden size (buffer.hpp:600)")
    if _cdiv(hidden, 32) * 4 > hidden:
        raise ValueError(f"hidden_size: {hidden} is too small for DeepEP v2 (buffer.hpp:603)")
    k = topk or 32
    elem = 1 if fp8 else 2
    if hidden * elem % 32:
        raise ValueError(
            f"hidden_size: DeepEP v2 needs hidden x {elem} bytes to be a multiple of 32, got "
            f"{hidden} (layout.cuh:199)"
        )
    sf = _cdiv(hidden, 32) if fp8 else 0
    dispatch = (
        group_size * tokens_per_rank * (_a32(hidden * elem) + _a32(4 * sf) + _a32(12 * k + 4))
    )
    combine = min(group_size, k) * tokens_per_rank * (_a32(2 * hidden) + _a32(8 * k))
    data = max(dispatch, combine)
    return [
        Term("symmetric window: data buffer", data, OUTSIDE, "buffer.hpp:595-629",
             "get_buffer_size_hint; dispatch and combine tokens (layout.cuh:180-209)"),
        Term("symmetric window: workspace", DEEPEP_V2_WORKSPACE, OUTSIDE, "layout.cuh:43-81",
             "ncclMemAlloc of workspace + data (buffer.hpp:100-114)"),
        Term("host workspace (mapped)", DEEPEP_V2_WORKSPACE, HOST, "buffer.hpp:118-120"),
    ]  # fmt: skip


def nccl_ep_capacity(tokens_per_rank: int, topk: int, capacity_factor: float, alignment: int = 0):
    """``(M, MR)``: the tokens per rank NCCL EP is bootstrapped for (rounded up to 64) and the
    receive capacity (``M x top-k x capacity factor``, rounded up to the alignment), as
    megatron's ``_NCCLEPManager._ensure_bootstrap`` sizes them."""
    m = _up(tokens_per_rank, 64)
    mr = int(m * topk * capacity_factor)
    return m, (_up(mr, alignment) if alignment else mr)


def nccl_ep_terms(
    group_size: int,
    num_experts: int,
    max_tokens: int,
    recv_capacity: int,
    hidden: int,
    zero_copy: bool = False,
) -> List[Term]:
    """One rank's NCCL EP context (``ncclEpCreateGroup`` for TransformerEngine's configuration:
    high throughput, one NVLink domain, expert-major) and, with zero-copy, megatron's two
    persistent symmetric buffers; ``max_tokens`` (M) and ``recv_capacity`` (MR) as
    :func:`nccl_ep_capacity` gives them, bf16 payloads (B = 2 x hidden). Sources at
    ``NCCL_EP_COMMIT``, ``nccl_ep/nccl_ep.cc``."""
    r, m, mr, e, b = group_size, max_tokens, recv_capacity, num_experts, 2 * hidden
    terms = [
        Term("workspace", 32 * 1024 * 1024, OUTSIDE, "nccl_ep.cc:1910-1911",
             "NUM_WORKSPACE_BYTES, include/common.hpp:19"),
        Term("counter block", 32, OUTSIDE, "nccl_ep.cc:1102-1128"),
        Term("all-gathered routing map", r * m * _cdiv(e, 8), OUTSIDE, "nccl_ep.cc:1953-1963"),
    ]  # fmt: skip
    if not zero_copy:
        terms.append(Term("dispatch and combine token staging", 2 * _a256(m * r * b), OUTSIDE,
                          "nccl_ep.cc:1013-1045", "symmetric window"))  # fmt: skip
    terms += [
        Term("dispatch and combine probabilities", 2 * _a256(mr * e * 4), OUTSIDE,
             "nccl_ep.cc:1013-1045", "symmetric window"),
        Term("scale region", _a256(mr * b), OUTSIDE, "nccl_ep.cc:1032-1038",
             "allocated for bf16 too"),
        Term("completion flags", 8, OUTSIDE, "nccl_ep.cc:1089-1091"),
        Term("host pointer block (mapped)", 40 * r, HOST, "nccl_ep.cc:1072-1075"),
    ]  # fmt: skip
    if zero_copy:
        terms.append(Term("zero-copy buffers (fc2 output, fc1 dgrad) [MR, H] bf16 x 2",
                          2 * mr * b, OUTSIDE, f"{SRC} _NCCLEPManager._ensure_bootstrap",
                          "torch symmetric memory on the EP group"))  # fmt: skip
    return terms


# --------------------------------------------------------------------------------------------
# Dispatcher state an unpatched megatron-core keeps between calls


RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class LayerShape:
    """One MoE layer's call, as its dispatcher sees it.

    Args:
        tokens: tokens the layer's dispatcher receives per call on this rank (T).
        hidden: hidden size H.
        experts: routing-map columns (megatron passes ETP x num_moe_experts to the flex
            dispatcher; the number of experts otherwise).
        topk: experts per token.
        group: ranks of the dispatcher's group (ETP x EP).
        local_experts: experts per rank (L).
        routed_rows: token-expert rows the local experts receive (P; balanced routing:
            T x top-k).
        received_tokens: tokens this rank receives, each once however many of its experts
            are local (DeepEP; None: the expectation under uniform routing).
        dtype_bytes: bytes per activation element (2: BF16).
        probs_bytes: bytes per router probability (``moe_router_dtype``; 4: fp32).
        recompute: ``none``; ``selective`` (``moe`` among the recompute modules) or ``full``:
            the layer's forward is recomputed in backward from a leaf of its input.
        channels: DeepEP's channels (``num_sms / 2``).
    """

    tokens: int
    hidden: int
    experts: int
    topk: int
    group: int
    local_experts: int
    routed_rows: int
    received_tokens: Optional[int] = None
    dtype_bytes: int = BF16
    probs_bytes: int = FP32
    recompute: str = "selective"
    channels: int = DEFAULT_DEEPEP_SMS // 2

    @property
    def expected_received_tokens(self) -> int:
        """Tokens a rank receives: as given, or T x group x P(a token picks at least one of
        this rank's experts) under uniform top-k routing."""
        if self.received_tokens is not None:
            return self.received_tokens
        miss = math.comb(self.experts - self.local_experts, self.topk) / math.comb(
            self.experts, self.topk
        )
        return math.ceil(self.tokens * self.group * (1 - miss))


DISPATCHERS = ("allgather", "alltoall", "flex")
BACKENDS = ("deepep", "hybridep")  # the retained state is modelled for these
FLEX_BACKENDS = ("deepep", "hybridep", "deepepv2", "ncclep")
SRC = "megatron/core/transformer/moe/token_dispatcher.py"


def retained_state_terms(
    shape: LayerShape, dispatcher: str, backend: Optional[str] = None, nodes: int = 1
) -> List[Term]:
    """What one MoE layer of an unpatched megatron-core still references after its backward,
    until the layer's next forward replaces it: the dispatcher's (and comm manager's) fields,
    what the autograd graph behind its differentiable fields keeps (a custom Function's
    ``ctx`` attributes outlive backward; built-in nodes' saved tensors do not) and, when the
    layer is recomputed, the recompute's input leaf and its ``.grad``. All of it is in
    PyTorch's allocator. megatron-core with this series keeps none of it: its dispatchers
    release their state after combine. Dropless routing (no capacity factor) is modelled."""
    s = shape
    t, e, k, g, lx, p = s.tokens, s.experts, s.topk, s.group, s.local_experts, s.routed_rows
    pb = s.probs_bytes
    if dispatcher == "flex" and backend == "hybridep":
        where = f"{SRC} _HybridEPManager"
        terms = [
            Term("routing_map [T, E] bool", t * e, ALLOCATOR, f"{where}.setup_metadata"),
            Term("token_probs [T, E] fp32", t * e * FP32, ALLOCATOR, f"{where}.dispatch"),
            Term("dispatched_probs [P] fp32", p * FP32, ALLOCATOR, f"{where}.dispatch"),
            Term("tokens_per_expert [L] int64", lx * INT64, ALLOCATOR, f"{where}.dispatch"),
        ]
        ranks_per_node = g // nodes
        for term in hybridep_handle_terms(t, lx, ranks_per_node, nodes):
            terms.append(Term(f"handle: {term.name}", term.nbytes, term.where, term.source,
                              "HybridEPDispatch's ctx, through dispatched_probs"))  # fmt: skip
    elif dispatcher == "flex" and backend == "deepep":
        where = f"{SRC} _DeepepManager"
        r = s.expected_received_tokens
        terms = [
            Term("token_indices [T, k] int64", t * k * INT64, ALLOCATOR, f"{where}.setup_metadata"),
            Term("token_probs [T, k] fp32", t * k * FP32, ALLOCATOR, f"{where}.setup_metadata"),
            Term("tokens_per_expert [L] int64", lx * INT64, ALLOCATOR, f"{where}.dispatch"),
            Term("dispatched_routing_map [R, L] bool", r * lx, ALLOCATOR,
                 f"{where}._indices_to_multihot", "R: tokens received"),
            Term("reversed_mapping_for_combine [P] int64", p * INT64, ALLOCATOR,
                 f"{where}.get_permuted_hidden_states_by_experts"),
        ]  # fmt: skip
    elif dispatcher == "alltoall":
        where = f"{SRC} MoEAlltoAllTokenDispatcher"
        terms = [
            Term("probs [T, E]", t * e * pb, ALLOCATOR, f"{where}.dispatch_preprocess"),
            Term("routing_map [T, E] bool", t * e, ALLOCATOR, f"{where}.dispatch_preprocess"),
            Term("num_global_tokens_per_local_expert [G, L] int64", g * lx * INT64, ALLOCATOR,
                 f"{where}.preprocess"),
            Term("reversed_local_input_permutation_mapping [T x k] int64", t * k * INT64,
                 ALLOCATOR, f"{where}.dispatch_preprocess"),
        ]  # fmt: skip
    elif dispatcher == "allgather":
        where = f"{SRC} MoEAllGatherTokenDispatcher"
        terms = [
            Term("local_map [T x G, L] bool", t * g * lx, ALLOCATOR, f"{where}.token_dispatch"),
            Term("local_probs [P]", p * pb, ALLOCATOR, f"{where}.token_dispatch"),
            Term("reversed_local_input_permutation_mapping [P] int64", p * INT64, ALLOCATOR,
                 f"{where}.dispatch_postprocess"),
        ]  # fmt: skip
    else:
        raise ValueError(f"no retained-state model for dispatcher {dispatcher!r} {backend!r}")
    if s.recompute != "none":
        leaf = t * s.hidden * s.dtype_bytes
        terms += [
            Term("recompute input leaf [T, H]", leaf, ALLOCATOR,
                 "megatron/core/tensor_parallel/random.py CheckpointFunction.backward"),
            Term("its .grad [T, H]", leaf, ALLOCATOR, "autograd: the leaf's accumulated grad"),
        ]  # fmt: skip
    return terms


def retained_chain_terms(shape: LayerShape, dispatcher: str, backend: Optional[str] = None):
    """Without recompute, a later layer's retained graph reaches back through this layer's
    combine: what that combine's ``ctx`` adds to the layer's own terms (held for every MoE
    layer of a rank but the last). With recompute every layer's graph ends at its own leaf."""
    s = shape
    if s.recompute != "none" or dispatcher != "flex":
        return []
    if backend == "hybridep":
        return [Term("combine ctx: num_permuted_tokens (0-d int64)", INT64, ALLOCATOR,
                     "megatron/core/transformer/moe/fused_a2a.py HybridEPCombine")]  # fmt: skip
    g, c, t, r = s.group, s.channels, s.tokens, s.expected_received_tokens
    src = "deep_ep/buffer.py Buffer.dispatch (the handle FusedCombine's ctx keeps)"
    return [
        Term("handle: rank_prefix_matrix [G, G] int32", g * g * INT32, ALLOCATOR, src),
        Term("handle: channel_prefix_matrix [G, C] int32", g * c * INT32, ALLOCATOR, src),
        Term("handle: recv_channel_prefix_matrix [G, C] int32", g * c * INT32, ALLOCATOR, src),
        Term("handle: recv_src_idx [R] int32", r * INT32, ALLOCATOR, src),
        Term("handle: is_token_in_rank [T, G] bool", t * g, ALLOCATOR, src),
        Term("handle: send_head [T, G] int32", t * g * INT32, ALLOCATOR, src),
    ]


# --------------------------------------------------------------------------------------------
# A configuration's plan


@dataclass(frozen=True)
class MoEMemoryConfig:
    """A model and parallel configuration, in TransformerConfig's field names.

    ``tokens_per_rank`` (T) defaults to ``seq_length x micro_batch_size / (TP x CP)``: the tokens
    an MoE layer's dispatcher receives per call with sequence parallelism. ``ranks_per_node`` is
    the NVLink domain HybridEP detects (8 on an HGX node); the group spans
    ``ceil(ETP x EP / ranks_per_node)`` of them. ``routed_rows_factor`` scales the rows a rank's
    experts receive against balanced routing (T x top-k).
    """

    hidden_size: int
    num_moe_experts: int
    moe_router_topk: int
    num_layers: int
    seq_length: Optional[int] = None
    micro_batch_size: int = 1
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_layer_freq: int = 1
    moe_token_dispatcher_type: str = "allgather"
    moe_flex_dispatcher_backend: str = "deepep"
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = DEFAULT_BLOCKS_PREPROCESSING
    moe_router_dtype: Optional[str] = None
    moe_expert_rank_capacity_factor: Optional[float] = None
    moe_ncclep_zero_copy: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: Sequence[str] = ("core_attn",)
    bf16: bool = True
    tokens_per_rank: Optional[int] = None
    ranks_per_node: int = 8
    routed_rows_factor: float = 1.0

    def __post_init__(self):
        for name in (
            "hidden_size",
            "num_moe_experts",
            "moe_router_topk",
            "num_layers",
            "micro_batch_size",
            "tensor_model_parallel_size",
            "context_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
            "moe_layer_freq",
            "moe_hybridep_num_sms_preprocessing",
            "ranks_per_node",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "seq_length",
            "expert_tensor_parallel_size",
            "tokens_per_rank",
            "moe_flex_dispatcher_num_sms",
        ):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.tokens_per_rank is None and self.seq_length is None:
            raise ValueError("seq_length: needed (or tokens_per_rank)")
        if self.tokens_per_rank is None and (self.seq_length * self.micro_batch_size) % (
            self.tensor_model_parallel_size * self.context_parallel_size
        ):
            raise ValueError("seq_length: seq_length x micro_batch_size must divide by TP x CP")
        if self.moe_token_dispatcher_type not in ("allgather", "alltoall", "flex"):
            raise ValueError(
                f"moe_token_dispatcher_type: {self.moe_token_dispatcher_type!r} is not one of "
                "allgather, alltoall, flex"
            )
        if self.moe_flex_dispatcher_backend not in FLEX_BACKENDS:
            raise ValueError(
                f"moe_flex_dispatcher_backend: {self.moe_flex_dispatcher_backend!r} is not one "
                f"of {', '.join(FLEX_BACKENDS)}"
            )
        factor = self.moe_expert_rank_capacity_factor
        if factor is not None and not (isinstance(factor, (int, float)) and factor > 0):
            raise ValueError(f"moe_expert_rank_capacity_factor: must be positive, got {factor}")
        if self.moe_router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(
                f"moe_router_dtype: {self.moe_router_dtype!r} is not one of fp32, fp64"
            )
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(
                f"recompute_granularity: {self.recompute_granularity!r} is not one of "
                "selective, full"
            )
        if self.num_moe_experts % self.expert_model_parallel_size:
            raise ValueError(
                f"expert_model_parallel_size: {self.expert_model_parallel_size} does not divide "
                f"the {self.num_moe_experts} experts"
            )
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk: {self.moe_router_topk} exceeds the {self.num_moe_experts} "
                "experts"
            )
        if self.num_layers % self.pipeline_model_parallel_size:
            raise ValueError("pipeline_model_parallel_size: must divide num_layers")
        if self.group_size > self.ranks_per_node and self.group_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} does not divide the dispatcher group "
                f"of {self.group_size} ranks (ETP x EP)"
            )
        if not self.routed_rows_factor > 0:
            raise ValueError(f"routed_rows_factor: must be positive, got {self.routed_rows_factor}")

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size (TransformerConfig defaults it to TP)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def group_size(self) -> int:
        """The flex dispatcher's group: ETP x EP ranks (``tp_ep_group``)."""
        return self.etp * self.expert_model_parallel_size

    @property
    def tokens(self) -> int:
        """T: tokens per MoE layer call on this rank."""
        if self.tokens_per_rank is not None:
            return self.tokens_per_rank
        return (
            self.seq_length
            * self.micro_batch_size
            // (self.tensor_model_parallel_size * self.context_parallel_size)
        )

    @property
    def moe_layers_per_rank(self) -> int:
        """MoE layers of this rank's pipeline stage (every ``moe_layer_freq``-th layer)."""
        layers = self.num_layers // self.pipeline_model_parallel_size
        return _cdiv(layers, self.moe_layer_freq)

    @property
    def recompute(self) -> str:
        """``selective`` when the MoE layer is recomputed, ``full``, or ``none``."""
        if self.recompute_granularity == "full":
            return "full"
        if self.recompute_granularity == "selective" and "moe" in self.recompute_modules:
            return "selective"
        return "none"


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


def layer_shape(cfg: MoEMemoryConfig) -> LayerShape:
    """The per-call shape of one MoE layer of ``cfg``."""
    flex = cfg.moe_token_dispatcher_type == "flex"
    group = cfg.group_size if flex else cfg.expert_model_parallel_size
    return LayerShape(
        tokens=cfg.tokens,
        hidden=cfg.hidden_size,
        experts=cfg.num_moe_experts * (cfg.etp if flex else 1),
        topk=cfg.moe_router_topk,
        group=group,
        local_experts=cfg.num_moe_experts // cfg.expert_model_parallel_size,
        routed_rows=math.ceil(cfg.tokens * cfg.moe_router_topk * cfg.routed_rows_factor),
        dtype_bytes=BF16 if cfg.bf16 else FP32,
        probs_bytes={"fp32": FP32, "fp64": 8}.get(cfg.moe_router_dtype, BF16 if cfg.bf16 else FP32),
        recompute=cfg.recompute,
        channels=(cfg.moe_flex_dispatcher_num_sms or DEFAULT_DEEPEP_SMS) // 2,
    )


def hybridep_layout(cfg: MoEMemoryConfig, rows: Optional[int] = None) -> HybridEPLayout:
    """The HybridEP buffer ``cfg`` builds (``rows`` per rank: from its token count if None)."""
    g = cfg.group_size
    r = min(g, cfg.ranks_per_node)
    return HybridEPLayout(
        hidden=cfg.hidden_size,
        local_experts=cfg.num_moe_experts // cfg.expert_model_parallel_size,
        ranks_per_node=r,
        nodes=g // r,
        rows=hybridep_rows(cfg.tokens) if rows is None else rows,
        blocks_preprocessing=cfg.moe_hybridep_num_sms_preprocessing,
        blocks_dispatch=cfg.moe_flex_dispatcher_num_sms,
        blocks_combine=cfg.moe_flex_dispatcher_num_sms,
    )


def buffer_terms(cfg: MoEMemoryConfig) -> List[Term]:
    """The communication buffers ``cfg``'s dispatcher allocates (flex only)."""
    if cfg.moe_token_dispatcher_type != "flex":
        return []
    if cfg.moe_flex_dispatcher_backend == "deepepv2":
        return deepep_v2_buffer_terms(cfg.group_size, cfg.tokens, cfg.hidden_size,
                                      cfg.moe_router_topk)  # fmt: skip
    if cfg.moe_flex_dispatcher_backend == "ncclep":
        m, mr = nccl_ep_capacity(
            cfg.tokens, cfg.moe_router_topk, cfg.moe_expert_rank_capacity_factor or 1.0
        )
        if cfg.moe_expert_rank_capacity_factor is None:  # eager (main): MR = R x M x top-k
            mr = cfg.group_size * m * cfg.moe_router_topk
        return nccl_ep_terms(cfg.group_size, cfg.num_moe_experts, m, mr, cfg.hidden_size,
                             cfg.moe_ncclep_zero_copy)  # fmt: skip
    if cfg.moe_flex_dispatcher_backend == "deepep":
        sms = cfg.moe_flex_dispatcher_num_sms or DEFAULT_DEEPEP_SMS
        # fused_a2a.get_hidden_bytes: H x max(element size, 2).
        hidden_bytes = cfg.hidden_size * max(BF16 if cfg.bf16 else FP32, 2)
        try:
            return deepep_buffer_terms(hidden_bytes, cfg.group_size, sms)
        except ValueError as exc:
            raise ValueError(
                f"expert_model_parallel_size: ETP x EP = {cfg.group_size}: {exc}"
            ) from None
    return hybridep_buffer_terms(hybridep_layout(cfg))


def hybridep_growth(cfg: MoEMemoryConfig, held_rows: Optional[int]) -> Dict[str, object]:
    """What a call of ``cfg``'s tokens allocates against a HybridEP buffer of ``held_rows`` per
    rank (None: none held, the buffer is built at this call). Rows only grow; deep_ep frees
    the old buffer before allocating the new one (``hybrid_ep.cu:109-133``), so inside deep_ep
    the peak is the new size. ``transient_peak_holding_old`` is old + new, where the caller
    still references the old buffer while the new one is built (megatron-core's DeepEP
    ``get_buffer`` before this series)."""
    if held_rows is None:
        needed = hybridep_rows(cfg.tokens)
    else:
        needed = hybridep_rows_after(held_rows, cfg.tokens)
    grows = held_rows is None or needed > held_rows
    new = total(hybridep_buffer_terms(hybridep_layout(cfg, needed)), OUTSIDE) if grows else 0
    old = total(hybridep_buffer_terms(hybridep_layout(cfg, held_rows)), OUTSIDE) if held_rows else 0
    return {
        "needed_rows": needed,
        "held_rows": held_rows,
        "grows": grows,
        "growth_bytes": new,
        "transient_peak_holding_old": old + new if grows else old,
        "transient_peak_dropping_old": new if grows else old,
    }


def per_call_bytes(cfg: MoEMemoryConfig, token_bytes: Optional[int] = None) -> Dict[str, int]:
    """Allocator bytes of one HybridEP dispatch and combine: the permuted tokens and FP32 probs
    the dispatch returns (one prob per routed row), its int64 tokens-per-expert, and the
    combine output ``[T, H]``; tokens of ``token_bytes`` each (the model's dtype if None)."""
    shape = layer_shape(cfg)
    tb = token_bytes or shape.dtype_bytes
    return {
        "dispatch_tokens": shape.routed_rows * cfg.hidden_size * tb,
        "dispatch_probs": shape.routed_rows * FP32,
        "tokens_per_expert": shape.local_experts * INT64,
        "combine_output": cfg.tokens * cfg.hidden_size * tb,
    }


def expert_working_set(cfg: MoEMemoryConfig) -> Dict[str, int]:
    """Routed rows reaching the local experts and their input bytes: balanced, with
    ``routed_rows_factor``, and in the worst case (all the group's routed pairs on one rank:
    EP x balanced)."""
    shape = layer_shape(cfg)
    balanced = cfg.tokens * cfg.moe_router_topk
    worst = balanced * cfg.expert_model_parallel_size
    h = cfg.hidden_size * shape.dtype_bytes
    return {
        "balanced_rows": balanced,
        "rows": shape.routed_rows,
        "worst_rows": worst,
        "balanced_bytes": balanced * h,
        "bytes": shape.routed_rows * h,
        "worst_bytes": worst * h,
    }


def recompute_combine_floor(extent_rows: int, hidden: int) -> int:
    """Bytes of the fresh BF16 ``[P, H]`` output combine allocates at the restored
    communication extent ``P`` (before cropping) when a checkpoint recompute runs while an
    earlier, larger graph is live."""
    if extent_rows < 0 or hidden <= 0:
        raise ValueError("extent_rows must be >= 0 and hidden positive")
    return extent_rows * hidden * BF16


def measured_retained_bytes(dispatcher) -> int:
    """Bytes a live dispatcher really holds between calls (the retained-state probe's
    attribution: its references and the graph they pin), to compare with the prediction."""
    from megatron.core.transformer.moe import moe_memory_probe as probe

    return probe.attribute_layer("layer", dispatcher).pinned_bytes


def plan(cfg: MoEMemoryConfig, held_rows: Optional[int] = None) -> Dict[str, object]:
    """Every MoE memory term of ``cfg`` on one rank, base (unpatched megatron-core) beside
    patched (this series), as one JSON-able dict; for HybridEP also what a call grows against
    a buffer of ``held_rows`` per rank already held."""
    shape = layer_shape(cfg)
    flex = cfg.moe_token_dispatcher_type == "flex"
    backend = cfg.moe_flex_dispatcher_backend if flex else None
    buffers = buffer_terms(cfg)
    group = cfg.group_size if flex else cfg.expert_model_parallel_size
    nodes = max(group // cfg.ranks_per_node, 1)
    modelled = backend in (None,) + BACKENDS
    if modelled:
        retained = retained_state_terms(shape, cfg.moe_token_dispatcher_type, backend, nodes)
        chain = retained_chain_terms(shape, cfg.moe_token_dispatcher_type, backend)
    else:  # DeepEP v2 and NCCL EP: the buffers are priced, the retained state is not modelled
        retained, chain = [], []
    layers = cfg.moe_layers_per_rank
    per_layer = total(retained) if modelled else None
    out = {
        "config": dict(asdict(cfg), recompute_modules=list(cfg.recompute_modules)),
        "derived": {
            "tokens_per_rank": cfg.tokens,
            "dispatcher_group": group,
            "local_experts": shape.local_experts,
            "expert_columns": shape.experts,
            "routed_rows": shape.routed_rows,
            "moe_layers_per_rank": layers,
            "recompute": shape.recompute,
            "deep_ep_commit": DEEP_EP_COMMIT,
            "deep_ep_v2_commit": DEEP_EP_V2_COMMIT,
            "nccl_ep_commit": NCCL_EP_COMMIT,
        },
        "buffers": [asdict(t) for t in buffers],
        "retained_per_layer": [asdict(t) for t in retained],
        "retained_per_layer_but_the_last": [asdict(t) for t in chain],
        "totals": {
            "buffers_outside_allocator": total(buffers, OUTSIDE),
            "buffers_pinned_host": total(buffers, HOST),
            "buffers_released": released_bytes(buffers),
            "retained_per_layer_base": per_layer,
            "retained_per_layer_patched": 0 if modelled else None,
            "retained_between_calls_base": (
                per_layer * layers + total(chain) * (layers - 1) if modelled else None
            ),
            "retained_between_calls_patched": 0 if modelled else None,
        },
    }
    if flex and backend == "hybridep":
        out["derived"]["hybridep_rows"] = hybridep_rows(cfg.tokens)
        out["per_call"] = per_call_bytes(cfg)
        out["growth"] = hybridep_growth(cfg, held_rows)
    out["expert_working_set"] = expert_working_set(cfg)
    return out


# --------------------------------------------------------------------------------------------
# The command

# Command-line flag (Megatron's argument names) -> MoEMemoryConfig field.
FLAGS = {
    "--hidden-size": "hidden_size",
    "--num-experts": "num_moe_experts",
    "--moe-router-topk": "moe_router_topk",
    "--num-layers": "num_layers",
    "--seq-length": "seq_length",
    "--micro-batch-size": "micro_batch_size",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--context-parallel-size": "context_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--expert-tensor-parallel-size": "expert_tensor_parallel_size",
    "--moe-layer-freq": "moe_layer_freq",
    "--moe-token-dispatcher-type": "moe_token_dispatcher_type",
    "--moe-flex-dispatcher-backend": "moe_flex_dispatcher_backend",
    "--moe-flex-dispatcher-num-sms": "moe_flex_dispatcher_num_sms",
    "--moe-hybridep-num-sms-preprocessing": "moe_hybridep_num_sms_preprocessing",
    "--moe-router-dtype": "moe_router_dtype",
    "--moe-expert-rank-capacity-factor": "moe_expert_rank_capacity_factor",
    "--recompute-granularity": "recompute_granularity",
    "--recompute-modules": "recompute_modules",
    "--tokens-per-rank": "tokens_per_rank",
    "--ranks-per-node": "ranks_per_node",
    "--routed-rows-factor": "routed_rows_factor",
}
FIELD_FLAGS = {field_name: flag for flag, field_name in FLAGS.items()}
INT_FIELDS = {
    "hidden_size", "num_moe_experts", "moe_router_topk", "num_layers", "seq_length",
    "micro_batch_size", "tensor_model_parallel_size", "context_parallel_size",
    "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_layer_freq", "moe_flex_dispatcher_num_sms", "moe_hybridep_num_sms_preprocessing",
    "tokens_per_rank", "ranks_per_node",
}  # fmt: skip
# Megatron-Bridge's YAML names these two differently from TransformerConfig.
YAML_ALIASES = {"num_experts": "num_moe_experts"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"moe_memory_planner: {message}", file=sys.stderr)
    return 2


def read_config_file(path: str) -> Dict[str, object]:
    """The known fields of a Megatron-Bridge style YAML (``model:`` and ``train:`` sections, or
    top-level keys, in TransformerConfig's names); other keys are not the planner's."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file: reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config-file: {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config-file: {path}: not a mapping")
    known = {f for f in MoEMemoryConfig.__dataclass_fields__}
    values: Dict[str, object] = {}
    for section in (data, data.get("train") or {}, data.get("model") or {}):
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            key = YAML_ALIASES.get(key, key)
            if key in known and not isinstance(value, dict):
                values[key] = value
    if "params_dtype" in (data.get("model") or {}):
        values.setdefault("bf16", "bfloat16" in str(data["model"]["params_dtype"]))
    return values


def config_from_args(argv: Optional[Sequence[str]] = None) -> tuple:
    """(MoEMemoryConfig, --json, --held-rows) from the command line; ValueError names the bad
    argument."""
    p = _Parser(
        prog="moe_memory_planner",
        description="MoE memory terms (communication buffers, dispatcher state held between "
        "calls), base vs patched, before anything is allocated.",
    )
    p.add_argument("--config-file", help="a Megatron-Bridge style YAML (flags override it)")
    for flag, name in FLAGS.items():
        if name == "recompute_modules":
            p.add_argument(flag, nargs="*", dest=name, default=None)
        else:
            floats = ("routed_rows_factor", "moe_expert_rank_capacity_factor")
            kind = int if name in INT_FIELDS else float if name in floats else str
            p.add_argument(flag, dest=name, type=kind, default=None)
    p.add_argument("--bf16", action="store_true", default=None)
    p.add_argument("--fp16", action="store_true", default=None)
    p.add_argument("--moe-ncclep-zero-copy", dest="moe_ncclep_zero_copy", action="store_true",
                   default=None)  # fmt: skip
    p.add_argument("--held-rows", type=int, help="rows per rank of a HybridEP buffer held now")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.held_rows is not None and args.held_rows <= 0:
        raise ValueError(f"--held-rows: must be a positive integer, got {args.held_rows}")
    values = read_config_file(args.config_file) if args.config_file else {}
    values.update({n: getattr(args, n) for n in FLAGS.values() if getattr(args, n) is not None})
    if args.moe_ncclep_zero_copy:
        values["moe_ncclep_zero_copy"] = True
    if args.bf16 or args.fp16:
        values["bf16"] = True
    elif args.config_file is None or "bf16" not in values:
        values["bf16"] = bool(values.get("fp16", False) or values.get("bf16", False))
    values.pop("fp16", None)
    for name in ("hidden_size", "num_moe_experts", "moe_router_topk", "num_layers"):
        if name not in values:
            raise ValueError(f"{FIELD_FLAGS[name]}: required")
    if "recompute_modules" in values:
        values["recompute_modules"] = tuple(values["recompute_modules"])
    for name, value in values.items():
        if name in INT_FIELDS and value is not None and not isinstance(value, int):
            raise ValueError(f"{FIELD_FLAGS.get(name, name)}: must be an integer, got {value!r}")
    try:
        cfg = MoEMemoryConfig(**values)
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(": ")
        raise ValueError(f"{FIELD_FLAGS.get(field_name, field_name)}: {rest}") from None
    return cfg, args.json, args.held_rows


def format_plan(result: Dict[str, object]) -> str:
    """The plan as a table: every term, its bytes, where it lives, its source."""
    d, tot = result["derived"], result["totals"]
    c = result["config"]
    head = (
        f"MoE memory plan: {c['moe_token_dispatcher_type']}"
        + (
            f"/{c['moe_flex_dispatcher_backend']}"
            if c["moe_token_dispatcher_type"] == "flex"
            else ""
        )
        + f", H={c['hidden_size']}, {c['num_moe_experts']} experts top-{c['moe_router_topk']},"
        f" group {d['dispatcher_group']}, T={d['tokens_per_rank']:,} tokens/rank,"
        f" {d['moe_layers_per_rank']} MoE layers/rank, recompute {d['recompute']}"
    )
    lines = [head, f"{'term':52}{'bytes':>16}  {'where':18} source"]

    def rows(terms):
        for t in terms:
            lines.append(f"  {t['name'][:50]:50}{t['nbytes']:>16,}  {t['where']:18} {t['source']}")

    if result["buffers"]:
        backend = result["config"]["moe_flex_dispatcher_backend"]
        source = {
            "deepepv2": f"DeepEP epv2-release {d['deep_ep_v2_commit'][:7]}",
            "ncclep": f"NCCL EP, nccl-extensions {d['nccl_ep_commit'][:7]}",
        }.get(backend, f"deep_ep {d['deep_ep_commit'][:7]}")
        lines.append(f"communication buffers ({source}), base = patched:")
        rows(result["buffers"])
    if "growth" in result:
        g = result["growth"]
        held = "none" if g["held_rows"] is None else f"{g['held_rows']:,} rows"
        lines.append(f"HybridEP buffer growth against the held buffer ({held}):")
        lines.append(f"  {'rows per rank needed':50}{g['needed_rows']:>16,}")
        lines.append(f"  {'allocated (outside the allocator)':50}{g['growth_bytes']:>16,}")
    if "per_call" in result:
        lines.append("one HybridEP call's outputs (allocator):")
        lines += [f"  {k:50}{v:>16,}" for k, v in result["per_call"].items()]

    def num(value) -> str:
        return f"{value:>16,}" if value is not None else f"{'not modelled':>16}"

    if tot["retained_per_layer_base"] is None:
        lines.append("dispatcher state kept between calls: not modelled for this backend")
    else:
        lines.append("dispatcher state kept per MoE layer between calls, base (patched: 0):")
    rows(result["retained_per_layer"])
    if result["retained_per_layer_but_the_last"]:
        lines.append("  and, reached from the next layer's graph (every MoE layer but the last):")
        rows(result["retained_per_layer_but_the_last"])
    lines += [
        f"{'':52}{'base':>16}{'patched':>16}",
        f"{'buffers outside the allocator':52}{tot['buffers_outside_allocator']:>16,}"
        f"{tot['buffers_outside_allocator']:>16,}",
        f"{'retained per MoE layer (allocator)':52}{num(tot['retained_per_layer_base'])}"
        f"{num(tot['retained_per_layer_patched'])}",
        f"{'retained between calls, all MoE layers':52}"
        f"{num(tot['retained_between_calls_base'])}{num(tot['retained_between_calls_patched'])}",
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The planner command: the table, or ``--json``; exit 2 on bad input (one line)."""
    try:
        cfg, as_json, held_rows = config_from_args(argv)
        result = plan(cfg, held_rows)
    except ValueError as exc:
        field_name, sep, rest = str(exc).partition(": ")
        return _fail(
            f"{FIELD_FLAGS[field_name]}: {rest}" if field_name in FIELD_FLAGS else str(exc)
        )
    except SystemExit as exc:
        return int(exc.code or 0)
    print(json.dumps(result, indent=1) if as_json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
