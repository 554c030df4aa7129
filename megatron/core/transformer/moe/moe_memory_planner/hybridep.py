# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""HybridEP's buffers (deep_ep's ``hybrid-ep`` branch at ``DEEP_EP_COMMIT``): the chunk-size
environment variables read as deep_ep reads them, the buffer layout, what the kernels refuse,
the intranode and RDMA buffers, and the dispatch handle."""

import os
from dataclasses import dataclass
from typing import List, Optional

from .terms import ALLOCATOR, BF16, FP32, HOST, INT32, INT64, INT_MAX, OUTSIDE, Term, _cdiv, _up

MIN_ROWS = 512  # csrc/hybrid_ep/config.cuh:386
DEFAULT_CHUNK = 64  # csrc/hybrid_ep/config.cuh:383-384
DEFAULT_BLOCKS_PREPROCESSING = 108  # megatron: moe_hybridep_num_sms_preprocessing
DEFAULT_MULTINODE_BLOCKS = 8  # csrc/hybrid_ep/config.cuh:366-367
TMP_STATE_BYTES = 8  # hybrid_ep::tmp_state_t {enum, int32}: backend/hybrid_ep_backend.cuh:79-87
ALLOCATOR_TEST_BYTES = 512  # ExtendedMemoryAllocator's probe: allocator/allocator.cu:62

CHUNK_ENV = {
    "dispatch": "NUM_OF_TOKENS_PER_CHUNK_DISPATCH_API",
    "combine": "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API",
    "preprocessing": "NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API",
}


def _atoi(text: str) -> int:
    """C's ``atoi``: leading whitespace, an optional sign, the digits that follow; 0 if none."""
    text = text.lstrip(" \t\n\v\f\r")
    sign, digits = 1, ""
    if text[:1] and text[0] in "+-":
        sign, text = (-1 if text[0] == "-" else 1), text[1:]
    for ch in text:
        if not "0" <= ch <= "9":
            break
        digits += ch
    return sign * int(digits) if digits else 0


def env_chunk(kind: str) -> int:
    """Tokens per HybridEP chunk of ``kind`` (dispatch, combine, preprocessing), read as deep_ep
    reads it: ``get_env_int`` is ``atoi`` of the variable, 64 if unset
    (``csrc/hybrid_ep/config.cuh:197-200``). A value the kernels cannot use (0 or less: the
    chunk counts divide by it, ``config.cuh:388-391``; beyond a C int) is a ValueError naming
    the variable."""
    name = CHUNK_ENV[kind]
    raw = os.environ.get(name)
    if raw is None:
        return DEFAULT_CHUNK
    value = _atoi(raw)
    if not 0 < value <= INT_MAX:
        raise ValueError(
            f"{name}={raw[:40]!r}: deep_ep reads it with atoi as {value}; the chunk counts divide "
            "by it (csrc/hybrid_ep/config.cuh:388-391), it must be a positive C int"
        )
    return value


def hybridep_rows(first_tokens: int, chunk_combine: Optional[int] = None) -> int:
    """Rows per rank HybridEP builds its buffer for: the first dispatch's token count, at
    least 512, rounded up to the combine chunk (``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``,
    default 64): ``csrc/hybrid_ep/config.cuh:384-387``. megatron-core builds the buffer at its
    first dispatch from that call's tokens (``fused_a2a.py`` ``init_hybrid_ep_buffer``)."""
    chunk = chunk_combine or env_chunk("combine")
    return _up(max(first_tokens, MIN_ROWS), chunk)


def hybridep_rows_after(rows: int, tokens: int, chunk_combine: Optional[int] = None) -> int:
    """Rows after a dispatch of ``tokens`` against a buffer of ``rows``: the call rounds its
    tokens up to 16 (``deep_ep/hybrid_ep_buffer.py:142``), then to the combine chunk
    (``config.cuh:466-468``), and the buffer grows to that if larger (``config.cuh:557-559``;
    ``hybrid_ep.cu:109-133`` frees the old buffer, then allocates the new one). Rows never
    shrink."""
    chunk = chunk_combine or env_chunk("combine")
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
        local_rank: the rank priced within its NVLink domain: local rank 0 also allocates the
            3 x 8 B of flags its peers map (None: a rank other than 0).
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
    local_rank: Optional[int] = None

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


HYBRIDEP_MAX_TX_DEPTH = 65536  # HYBRID_EP_IB_QP_MAX_TX_DEPTH: csrc/hybrid_ep/config.cuh:18
HYBRIDEP_MAX_MULTINODE_ROWS = (HYBRIDEP_MAX_TX_DEPTH - 1 - 1) // 3  # config.cuh:36-38: 21,844


def hybridep_refusal(layout: HybridEPLayout) -> Optional[str]:
    """Why deep_ep's ``BufferConfig::is_valid`` (``csrc/hybrid_ep/config.cuh:84-101`` at
    ``DEEP_EP_COMMIT``; the Configurer throws at ``:393-398``) refuses ``layout``, as
    ``field: reason (source line)``; None if it accepts it."""
    lay, src = layout, "deep_ep csrc/hybrid_ep/config.cuh"
    r, lx = lay.ranks_per_node, lay.local_experts
    if lay.fp8 and lay.hidden % 512:
        return (
            f"hidden_size: HybridEP refuses {lay.hidden} with FP8, not a multiple of 512 ({src}:87)"
        )
    if not lay.fp8 and lay.hidden % 16:
        return f"hidden_size: HybridEP refuses {lay.hidden}, not a multiple of 16 (TMA; {src}:89)"
    if lx * r % 4:
        return (
            f"num_moe_experts: HybridEP refuses {lx} local experts x {r} ranks per NVLink domain "
            f"= {lx * r}, not a multiple of 4 ({src}:91)"
        )
    if lay.chunk_dispatch * r % 4:
        return (
            f"{CHUNK_ENV['dispatch']}: HybridEP refuses {lay.chunk_dispatch} tokens per chunk x "
            f"{r} ranks per NVLink domain, not a multiple of 4 ({src}:93)"
        )
    if lay.nodes > 1 and 3 * lay.rows + 1 >= HYBRIDEP_MAX_TX_DEPTH:
        return (
            f"tokens_per_rank: HybridEP refuses {lay.rows:,} rows per rank across {lay.nodes} "
            f"nodes: the IB queue depth 3 x rows + 1 must stay below {HYBRIDEP_MAX_TX_DEPTH}, at "
            f"most {HYBRIDEP_MAX_MULTINODE_ROWS:,} rows ({src}:28-33)"
        )
    return None


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
        Term("flags", 2 * (8 + 4 + 4), OUTSIDE, f"{nvl}:220-226,269-274"),
        Term("all-gathered routing map (N x E, bool)", n * e, OUTSIDE,
             "extension/allgather.cu:144-147",
             "allocated always; read only with enable_custom_allgather (default False)"),
    ]  # fmt: skip
    if lay.local_rank == 0:  # allocated by local rank 0, mapped by its peers
        t += [
            Term("dispatch write-completion flags (local rank 0)", INT64, OUTSIDE,
                 f"{nvl}:216-218"),
            Term("combine write-completion flags (local rank 0)", INT64, OUTSIDE,
                 f"{nvl}:264-266"),
        ]  # fmt: skip
    if nodes == 1:
        t.append(Term("all-gather flags and peer pointers", 8 + 8 + r * 8, OUTSIDE,
                      "extension/allgather.cu:157-164"))  # fmt: skip
        if lay.local_rank == 0:
            t.append(Term("all-gather NVLink sync flag (local rank 0)", INT64, OUTSIDE,
                          "extension/allgather.cu:150-154"))  # fmt: skip
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
    tokens: int,
    local_experts: int,
    ranks_per_node: int,
    nodes: int,
    blocking: bool = True,
    chunk_preprocessing: Optional[int] = None,
) -> List[Term]:
    """The dispatch handle one HybridEP call allocates in PyTorch's allocator, which the
    dispatch's autograd context keeps until backward (``fused_a2a.py`` ``HybridEPDispatch``):
    ``csrc/hybrid_ep/executor/executor.cu`` at ``DEEP_EP_COMMIT``. ``blocking`` (no
    ``num_permuted_tokens``): the dispatched-token count is a pinned host tensor; the raw
    ``tokens_per_expert`` is on the device either way. ``chunk_preprocessing``: tokens per
    preprocessing chunk (``NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API``, default 64)."""
    g = ranks_per_node * nodes
    src = "executor/executor.cu"
    counts = HOST if blocking else ALLOCATOR
    chunk = chunk_preprocessing or env_chunk("preprocessing")
    return [
        Term("sparse_to_dense_map", tokens * g * INT32, ALLOCATOR, f"{src}:93-96"),
        Term("rdma_to_attn_map", _up(tokens, 16) * nodes, ALLOCATOR, f"{src}:85,97-99"),
        Term("attn_to_rdma_map", tokens * (nodes - 1), ALLOCATOR, f"{src}:100-102"),
        Term("num_dispatched_tokens", INT32, counts, f"{src}:103-109"),
        Term("local_expert_routing_map", tokens * g * local_experts, ALLOCATOR, f"{src}:110-112"),
        Term("overflow_flag", INT32, ALLOCATOR, f"{src}:117-118"),
        Term("dense_chunk_layout", _cdiv(tokens, chunk) * g * INT32, ALLOCATOR,
             f"{src}:120-123", "chunks of NUM_OF_TOKENS_PER_CHUNK_PREPROCESSING_API"),
        Term("dense_to_expert_map", tokens * g * local_experts * INT32, ALLOCATOR,
             f"{src}:124-126"),
        Term("tokens_per_expert", local_experts * INT32, ALLOCATOR, f"{src}:128-129",
             "raw int32 counts on the device"),
    ]  # fmt: skip
