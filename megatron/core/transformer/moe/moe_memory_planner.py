# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""MoE memory planner: what the MoE token dispatchers of one rank will hold, priced from the
model and parallel configuration before anything is allocated.

Admission checks and memory estimators (ART's trainer, Megatron-Bridge's estimator) need two
numbers that neither ``torch.cuda.memory_allocated`` nor a learned peak gives them in advance:

* **the communication buffers** of the flex dispatcher, allocated outside PyTorch's caching
  allocator by the kernels: :func:`hybridep_buffer_terms` (HybridEP, intranode NVLink and
  multi-node RDMA), :func:`deepep_buffer_terms` (DeepEP normal mode),
  :func:`deepep_v2_buffer_terms` and :func:`nccl_ep_terms`, term by term, each citing the
  source line that allocates it;
* **the dispatcher state kept between calls**, per MoE layer: :func:`retained_state_terms`
  (routing map, probabilities, the dispatch handle and the autograd graph the differentiable
  dispatched probabilities pin), held by a megatron-core whose dispatchers do not release it
  after combine. megatron-core with moe-release's series releases it and keeps nothing.

:func:`estimate` is the entry point: a ``TransformerConfig`` (or a Mapping of its field names)
and the tokens per rank to a :class:`MoEMemoryEstimate`, every term with its bytes, where it
lives, the source line that sizes it and whether a release frees it. The dispatcher state is
that of the *installed* megatron-core: :func:`installed_tree_releases` reads from its code
whether its dispatchers release after combine. Invalid input or a configuration the kernels
refuse is a ValueError naming the field (and the refusing source line). The command that
prints a configuration's terms, unpatched megatron-core beside patched, from flags or a
Megatron-Bridge YAML, is moe-release's ``scripts/moe_memory_plan.py``; this module has none.

Sources. deep_ep is read at ``DEEP_EP_COMMIT``, the head of its ``hybrid-ep`` branch; the commit
megatron-core's CI pins (``de0dd11``) was not available to read, so where the two differ these
figures follow ``DEEP_EP_COMMIT``. Two terms depend on that: the unused all-gather buffer
(``enable_custom_allgather`` defaults to False at ``DEEP_EP_COMMIT``) and the rounding of rows
to the combine chunk (since deep_ep 4214430). DeepEP's normal mode is also priced at DeepEP
main (``DEEP_EP_MAIN_COMMIT``, 2.1.0: other dispatch/combine configs, EP 48 and 96) when
``deep_ep="main"`` is chosen; the estimate names the source it priced. Configurations the
kernels refuse (HybridEP's ``BufferConfig::is_valid``, DeepEP's group sizes and SM count) are
refused here with the line that refuses them, and HybridEP's chunk-size environment variables
are read as deep_ep reads them (``atoi``, default 64) for every term they size. megatron-core
call sites are cited as in megatron-core 0.19.2. Terms marked approximate (the DOCA queue pairs
of multi-node HybridEP) come from a stored NCCL version, not deep_ep's submodule pin.

Not modelled: NVSHMEM's own memory (DeepEP across more than 8 ranks), the cuMem fabric
granularity, NCCL communicators, DeepEP's low-latency mode, NCCL EP's leaked device
communicator (one cuMem granule per bootstrap), capacity-factor routing (drop-and-pad keeps
other shapes; the terms are dropless), the retained state of the DeepEP v2 and NCCL EP backends
(their buffers are priced, :func:`deepep_v2_buffer_terms` at ``DEEP_EP_V2_COMMIT``,
:func:`nccl_ep_terms` at ``NCCL_EP_COMMIT``), the MoE layers of MTP, the per-expert padding of
routed rows for FP8, the kernels' limits that depend on the device (its SM count, shared
memory), and everything outside the dispatchers (activations, weights, optimizer state).

Imports only the standard library (:func:`installed_tree_releases` imports the installed
megatron-core when called).
"""

import ast
import math
import os
import re
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:  # only for the annotations: this module imports the standard library alone
    from megatron.core.transformer.transformer_config import TransformerConfig

DEEP_EP_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# DeepEP main (2.1.0): normal-mode DeepEP only (no HybridEP); its dispatch and combine configs
# differ from the hybrid-ep branch's (other RDMA chunk sizes, EP 48 and 96 accepted).
DEEP_EP_MAIN_COMMIT = "dd758caf451848bd150e1046af3d0a73e5fff38d"
DEEP_EP_SOURCES = {"hybrid-ep": DEEP_EP_COMMIT, "main": DEEP_EP_MAIN_COMMIT}
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
# per group size (deep_ep/buffer.py:240-251 and 268-279 at DEEP_EP_COMMIT); any other size is
# refused there.
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
# The same at DEEP_EP_MAIN_COMMIT (deep_ep/buffers/legacy.py:246-257 and 276-287).
DEEPEP_MAIN_DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
    24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
    96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}  # fmt: skip
DEEPEP_MAIN_COMBINE_CONFIGS = {
    2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
    24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
    96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128),
}  # fmt: skip


@dataclass(frozen=True)
class DeepEPSource:
    """Where one deep_ep source sizes and refuses DeepEP's normal-mode buffer: its configs
    and the lines that hold them, the SM-count check, the size hints, the buffer's
    allocations."""

    name: str
    commit: str
    dispatch: Dict[int, tuple]
    combine: Dict[int, tuple]
    configs_at: str  # get_dispatch_config's table and refusal
    even_sms_at: str  # Buffer.set_num_sms: assert new_num_sms % 2 == 0
    nvl_hint_at: str
    rdma_hint_at: str
    nvl_alloc_at: str
    workspace_at: str
    counters_at: str
    rdma_counter_at: str
    destroy_at: str
    rdma_alloc_at: str
    # (intranode, internode): the checks a dispatch or combine of megatron's makes
    local_experts_at: Tuple[str, str]  # local experts <= NUM_MAX_LOCAL_EXPERTS (1024)
    topk_at: Tuple[str, str]  # num_topk <= 32, a device assert in the dispatch kernel
    hidden_at: Tuple[str, str]  # hidden x element size a multiple of 16 (int4)


DEEPEP_SOURCE = {
    "hybrid-ep": DeepEPSource(
        "hybrid-ep", DEEP_EP_COMMIT, DEEPEP_DISPATCH_CONFIGS, DEEPEP_COMBINE_CONFIGS,
        "deep_ep/buffer.py:252", "deep_ep/buffer.py:160", "csrc/config.hpp:51-73",
        "csrc/config.hpp:75-103", "csrc/deep_ep.cpp:145-147,171-184", "csrc/deep_ep.cpp:186-188",
        "csrc/deep_ep.cpp:191-200", "csrc/deep_ep.cpp:202-206", "deep_ep.cpp:299-304",
        "csrc/deep_ep.cpp:341-356",
        ("csrc/deep_ep.cpp:474", "csrc/deep_ep.cpp:869"),
        ("csrc/kernels/intranode.cu:187", "csrc/kernels/internode.cu:408"),
        ("csrc/deep_ep.cpp:717", "csrc/deep_ep.cpp:1111"),
    ),
    "main": DeepEPSource(
        "main", DEEP_EP_MAIN_COMMIT, DEEPEP_MAIN_DISPATCH_CONFIGS, DEEPEP_MAIN_COMBINE_CONFIGS,
        "deep_ep/buffers/legacy.py:259", "deep_ep/buffers/legacy.py:162",
        "csrc/legacy/config.hpp:53-73", "csrc/legacy/config.hpp:75-99",
        "csrc/legacy/buffer.hpp:101-103,132-137", "csrc/legacy/buffer.hpp:149-150",
        "csrc/legacy/buffer.hpp:153-161", "csrc/legacy/buffer.hpp:164-168",
        "buffer.hpp:326-331", "csrc/legacy/buffer.hpp:268",
        ("csrc/legacy/buffer.hpp:469", "csrc/legacy/buffer.hpp:949"),
        ("csrc/kernels/legacy/intranode.cu:251", "csrc/kernels/legacy/internode.cu:519"),
        ("csrc/legacy/buffer.hpp:458", "csrc/legacy/buffer.hpp:930"),
    ),
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


INT_MAX = 2**31 - 1  # the kernels' configs are C ints
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


# --------------------------------------------------------------------------------------------
# HybridEP


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
    hidden_bytes: int,
    group_size: int,
    num_sms: int = DEFAULT_DEEPEP_SMS,
    source: str = "hybrid-ep",
) -> List[Term]:
    """One rank's ``deep_ep.Buffer`` as megatron-core's ``get_buffer`` builds it: the byte
    hints are the maximum over the dispatch and combine configs for the group
    (``fused_a2a.py`` ``get_buffer``), so the size does not depend on the token count.
    ``hidden_bytes`` is ``H x max(element size, 2)`` (``fused_a2a.py`` ``get_hidden_bytes``).
    ``source`` is the deep_ep read (:data:`DEEPEP_SOURCE`): ``hybrid-ep`` (``DEEP_EP_COMMIT``)
    or ``main`` (``DEEP_EP_MAIN_COMMIT``), whose configs differ. A group size the source has no
    config for is a ValueError citing the line that refuses it."""
    src = DEEPEP_SOURCE[source]
    if group_size not in src.dispatch:
        raise ValueError(
            f"DeepEP has no config for {group_size} ranks ({src.configs_at} accepts "
            f"{sorted(src.dispatch)})"
        )
    configs = (src.dispatch[group_size], src.combine[group_size])
    nvl = max(deepep_nvl_bytes(hidden_bytes, group_size, num_sms, c[1]) for c in configs)
    rdma = max(deepep_rdma_bytes(hidden_bytes, group_size, num_sms, c[2], c[3]) for c in configs)
    t = [
        Term("NVLink buffer (num_nvl_bytes)", nvl, OUTSIDE, src.nvl_hint_at,
             f"one cudaMalloc shared over CUDA IPC ({src.nvl_alloc_at})"),
        Term("NVLink barrier signals and pointers", DEEPEP_NVL_META, OUTSIDE, src.nvl_alloc_at),
        Term("workspace", DEEPEP_WORKSPACE, OUTSIDE, src.workspace_at),
        Term("receive counters (token, per local expert)", 8 + 4 * 1024, HOST,
             src.counters_at, f"freed by destroy() ({src.destroy_at})"),
        Term("RDMA receive counter", 4, HOST, src.rdma_counter_at,
             f"destroy() does not free it ({src.destroy_at})", released=False),
    ]  # fmt: skip
    if rdma:
        t.append(Term("RDMA buffer (num_rdma_bytes)", rdma, OUTSIDE, src.rdma_hint_at,
                      f"NVSHMEM symmetric heap ({src.rdma_alloc_at}); NVSHMEM's own "
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
        e, lx, k = self.experts, self.local_experts, self.topk
        if k <= 64:
            miss = math.comb(e - lx, k) / math.comb(e, k)
        elif e - lx < k:
            miss = 0.0
        else:  # the same ratio through lgamma: comb of a large top-k would take too long
            lg = math.lgamma
            miss = math.exp(lg(e - lx + 1) - lg(e - lx - k + 1) - lg(e + 1) + lg(e - k + 1))
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
            Term(
                "tokens_per_expert [L] int64",
                lx * INT64,
                HOST,
                f"{where}.dispatch",
                "deep_ep's padded_tokens_per_expert, pinned when blocking "
                "(executor/executor.cu:155-158)",
            ),
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
    an MoE layer's dispatcher receives per call with sequence parallelism (``/ CP`` without it:
    ``sequence_parallel=False``). ``ranks_per_node`` is
    the NVLink domain HybridEP detects (8 on an HGX node); the group spans
    ``ceil(ETP x EP / ranks_per_node)`` of them. ``routed_rows_factor`` scales the rows a rank's
    experts receive against balanced routing (T x top-k), at most EP (every routed pair of the
    group on one rank). ``moe_layer_freq`` is Megatron's: N (layer i is MoE when i % N == 0), a
    0/1 list of ``num_layers`` entries, or a pattern string such as ``"([0]*3+[1]*58)"``
    (stored as the tuple). ``deep_ep`` names the deep_ep source priced (:data:`DEEP_EP_SOURCES`).
    ``local_rank``: the rank priced within its NVLink domain; HybridEP's local rank 0 holds 24 B
    of flags more than its peers (None: a rank other than 0).
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
    virtual_pipeline_model_parallel_size: Optional[int] = None
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Union[None, str, Tuple[Tuple[str, ...], ...]] = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1
    moe_token_dispatcher_type: str = "allgather"
    moe_flex_dispatcher_backend: str = "deepep"
    moe_flex_dispatcher_num_sms: Optional[int] = None
    moe_hybridep_num_sms_preprocessing: int = DEFAULT_BLOCKS_PREPROCESSING
    moe_permute_fusion_into_hybridep: bool = False
    moe_router_dtype: Optional[str] = None
    moe_expert_rank_capacity_factor: Optional[float] = None
    moe_ncclep_zero_copy: bool = False
    recompute_granularity: Optional[str] = None
    recompute_modules: Sequence[str] = ("core_attn",)
    bf16: bool = True
    sequence_parallel: bool = True
    tokens_per_rank: Optional[int] = None
    ranks_per_node: int = 8
    routed_rows_factor: float = 1.0
    deep_ep: str = "hybrid-ep"
    local_rank: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(
            self, "moe_layer_freq", parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        )
        if self.pipeline_model_parallel_layout is not None:
            layout = parse_pipeline_layout(self.pipeline_model_parallel_layout)
            object.__setattr__(self, "pipeline_model_parallel_layout", layout)
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
            "moe_hybridep_num_sms_preprocessing",
            "ranks_per_node",
        ):
            _positive(name, getattr(self, name))
        for name in (
            "seq_length",
            "virtual_pipeline_model_parallel_size",
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "expert_tensor_parallel_size",
            "tokens_per_rank",
            "moe_flex_dispatcher_num_sms",
        ):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.tokens_per_rank is None and self.seq_length is None:
            raise ValueError("seq_length: needed (or tokens_per_rank)")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(
                f"sequence_parallel: must be true or false, got {self.sequence_parallel!r}"
            )
        if self.tokens_per_rank is None and (self.seq_length * self.micro_batch_size) % (
            self._token_split
        ):
            raise ValueError(
                "seq_length: seq_length x micro_batch_size must divide by "
                + ("TP x CP" if self.sequence_parallel else "CP")
            )
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
        if factor is not None and not (_real(factor) and factor > 0):
            raise ValueError(f"moe_expert_rank_capacity_factor: must be positive, got {factor!r}")
        for name in (
            "bf16",
            "moe_ncclep_zero_copy",
            "moe_permute_fusion_into_hybridep",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        modules = self.recompute_modules
        if not isinstance(modules, (list, tuple)) or not all(isinstance(m, str) for m in modules):
            raise ValueError(f"recompute_modules: must be a list of module names, got {modules!r}")
        if self.deep_ep not in DEEP_EP_SOURCES:
            raise ValueError(
                f"deep_ep: {self.deep_ep!r} is not one of {', '.join(DEEP_EP_SOURCES)}"
            )
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
        self._check_pipeline()
        if self.group_size > self.ranks_per_node and self.group_size % self.ranks_per_node:
            raise ValueError(
                f"ranks_per_node: {self.ranks_per_node} does not divide the dispatcher group "
                f"of {self.group_size} ranks (ETP x EP)"
            )
        rf = self.routed_rows_factor
        if not (_real(rf) and 0 < rf <= self.expert_model_parallel_size):
            raise ValueError(
                f"routed_rows_factor: must be a number above 0 and at most EP "
                f"({self.expert_model_parallel_size}: every routed pair of the group on one rank), "
                f"got {rf!r}"
            )
        if factor is not None and factor * self.tokens * self.moe_router_topk >= 2**63:
            raise ValueError(
                f"moe_expert_rank_capacity_factor: {factor!r} x {self.tokens} tokens x top-"
                f"{self.moe_router_topk} overflows NCCL EP's 64-bit receive capacity"
            )

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
        return self.seq_length * self.micro_batch_size // self._token_split

    @property
    def _token_split(self) -> int:
        """The ranks a micro-batch's tokens are split over before the MoE layer: CP, and TP with
        sequence parallelism (without it each TP rank holds the whole sequence)."""
        tp = self.tensor_model_parallel_size if self.sequence_parallel else 1
        return tp * self.context_parallel_size

    def _check_pipeline(self) -> None:
        """Megatron's checks of the pipeline split (transformer_config.py, layout module)."""
        pp, vpp, layout = (
            self.pipeline_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            self.pipeline_model_parallel_layout,
        )
        first, last = (
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
        )
        if pp * (vpp or 1) > MAX_PATTERN_LAYERS:
            raise ValueError(
                f"pipeline_model_parallel_size: {pp * (vpp or 1):,} pipeline stages (PP x VPP) "
                "are more than any model has layers"
            )
        emb, loss = (
            self.account_for_embedding_in_pipeline_split,
            self.account_for_loss_in_pipeline_split,
        )
        if (emb or loss) and (first is not None or last is not None):
            raise ValueError(
                "account_for_embedding_in_pipeline_split: not with num_layers_in_first/last_"
                f"pipeline_stage ({TRANSFORMER_CONFIG}:1923-1932)"
            )
        if layout is not None:
            if first is not None or last is not None or emb or loss:
                raise ValueError(
                    "pipeline_model_parallel_layout: cannot be set with num_layers_in_first/last_"
                    f"pipeline_stage or account_for_* ({TRANSFORMER_CONFIG}:1939-1953)"
                )
            where = "megatron/core/transformer/pipeline_parallel_layer_layout.py"
            if len(layout) % pp:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {len(layout)} stages do not divide over "
                    f"PP {pp} ({where}:40-44)"
                )
            if vpp is not None and vpp != len(layout) // pp:
                raise ValueError(
                    f"virtual_pipeline_model_parallel_size: {vpp}, but the layout has "
                    f"{len(layout) // pp} stages per pipeline rank ({TRANSFORMER_CONFIG}:1973-1979)"
                )
            decoders = sum(stage.count("decoder") for stage in layout)
            if decoders != self.num_layers:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {decoders} decoder layers for num_layers "
                    f"{self.num_layers} ({where}:106-109)"
                )
            return
        if first is None and last is None:
            stages = pp * (vpp or 1)
            total = self.num_layers + emb + loss  # the embedding and loss as layers
            if total % stages:
                raise ValueError(
                    "pipeline_model_parallel_size: must divide num_layers"
                    + (" + the embedding/loss layers" if emb or loss else "")
                    + (f" (x {vpp} virtual stages)" if vpp else "")
                )
            if total // stages == 0 and emb + loss > 0:
                raise ValueError(
                    "account_for_embedding_in_pipeline_split: a stage would hold fewer than 0 "
                    "layers (megatron/core/transformer/transformer_block.py:185-196)"
                )
            return
        middle, middle_stages = self.num_layers, pp
        for name, n, lines in (("first", first, ":2000-2011"), ("last", last, ":2019-2030")):
            if n is None:
                continue
            if vpp and n % vpp:
                raise ValueError(
                    f"num_layers_in_{name}_pipeline_stage: {n} does not divide into {vpp} virtual "
                    f"stages ({TRANSFORMER_CONFIG}{lines})"
                )
            middle, middle_stages = middle - n, middle_stages - 1
        if bool(middle) != bool(middle_stages) or middle < 0:
            raise ValueError(
                f"num_layers_in_first_pipeline_stage: {middle} middle layers for {middle_stages} "
                f"middle stages ({TRANSFORMER_CONFIG}:2035-2039)"
            )
        if middle_stages > 0 and (middle % middle_stages or (middle // middle_stages) % (vpp or 1)):
            raise ValueError(
                f"num_layers_in_first_pipeline_stage: {middle} middle layers do not divide over "
                f"{middle_stages} middle stages"
                + (f" x {vpp} virtual" if vpp else "")
                + f" ({TRANSFORMER_CONFIG}:2043-2062)"
            )

    def _stage_decoders(self) -> List[int]:
        """Decoder layers of each pipeline stage in layer order: stage v x PP + r is virtual
        stage v of rank r (megatron's get_transformer_layer_offset / the layout's flatten)."""
        pp, vpp = self.pipeline_model_parallel_size, self.virtual_pipeline_model_parallel_size or 1
        if self.pipeline_model_parallel_layout is not None:
            return [stage.count("decoder") for stage in self.pipeline_model_parallel_layout]
        first, last = (
            self.num_layers_in_first_pipeline_stage,
            self.num_layers_in_last_pipeline_stage,
        )
        if first is None and last is None:
            emb = self.account_for_embedding_in_pipeline_split
            loss = self.account_for_loss_in_pipeline_split
            counts = [(self.num_layers + emb + loss) // (pp * vpp)] * (pp * vpp)
            counts[0] -= emb  # the first stage's first layer is the embedding
            counts[-1] -= loss  # the last stage's last, the loss
            return counts
        middle_stages = pp - (first is not None) - (last is not None)
        middle = self.num_layers - (first or 0) - (last or 0)
        per_rank = [middle // middle_stages if middle_stages > 0 else 0] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]

    def rank_moe_layers(self) -> List[int]:
        """MoE layers each pipeline rank builds (all its virtual stages): the decoder layers of
        each stage in order (:meth:`_stage_decoders`: even, uneven first/last stages, or
        ``pipeline_model_parallel_layout``), layer i MoE when ``moe_layer_freq`` says so
        (``i % N == 0``, or the pattern's entry, as ``gpt_layer_specs.py`` reads it)."""
        pp, freq = self.pipeline_model_parallel_size, self.moe_layer_freq
        counts = [0] * pp
        first = 0
        for s, n in enumerate(self._stage_decoders()):
            end = first + n
            if isinstance(freq, int):
                counts[s % pp] += _cdiv(end, freq) - _cdiv(first, freq)
            else:
                counts[s % pp] += sum(freq[first:end])
            first = end
        return counts

    @property
    def moe_layers_per_rank(self) -> int:
        """MoE layers of the pipeline rank that builds the most (:meth:`rank_moe_layers`)."""
        return max(self.rank_moe_layers())

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
    if value > INT_MAX:
        raise ValueError(f"{name}: must be at most {INT_MAX:,} (a C int), got {value:,}")


def _real(value) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_PATTERN_LAYERS = 1 << 20  # a moe_layer_freq pattern longer than this is no model's
GPT_LAYER_SPECS = "megatron/core/models/gpt/gpt_layer_specs.py"
TRANSFORMER_CONFIG = "megatron/core/transformer/transformer_config.py"


def _eval_pattern(text: str) -> list:
    """A Megatron pattern string (``"([0]*3+[1]*58)"``, ``"[1,0]*4"``) read without ``eval``: only
    lists of integers, ``+``, ``*`` by an integer and parentheses (what arguments.py's
    ``moe_freq_type`` accepts in practice)."""

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add) and type(a) is type(b):
                return a + b
            if isinstance(node.op, ast.Mult):
                n, seq = (a, b) if isinstance(a, int) else (b, a)
                if isinstance(n, int) and isinstance(seq, list):
                    if len(seq) * max(n, 0) > MAX_PATTERN_LAYERS:
                        raise ValueError("longer than any model")
                    return seq * n
                if isinstance(a, int) and isinstance(b, int) and abs(a * b) <= MAX_PATTERN_LAYERS:
                    return a * b
        raise ValueError("only lists of 0/1, + and * by an integer are read")

    if len(text) > 65536:
        raise ValueError("longer than any model")
    try:
        value = ev(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(type(exc).__name__) from None
    if not isinstance(value, list):
        raise ValueError("not a list")
    return value


LAYER_CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}
LAYER_TYPES = ("embedding", "loss", "encoder", "decoder", "mtp")  # megatron's LayerType


def _unroll(match) -> str:
    body, times = match.group(1), int(match.group(2))
    if len(body) * times > MAX_PATTERN_LAYERS:
        raise ValueError("longer than any model")
    return body * times


def parse_pipeline_layout(value) -> Tuple[Tuple[str, ...], ...]:
    """Megatron's ``pipeline_model_parallel_layout``: a list of stages, each a list of layer
    types (``embedding``, ``decoder``, ``mtp``, ``loss``), or the string form (``"Et|(tt|)*29,
    m|L"``: E, t, m, L; ``|`` between stages, ``(...)*n`` and ``x*n`` repeat, commas cosmetic),
    unrolled as ``pipeline_parallel_layer_layout.py`` ``parse_str_to_list`` does, bounded. The
    stages as tuples of type names; ValueError names the field."""
    name = "pipeline_model_parallel_layout"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, str):
        text = value.replace(",", "")
        if len(text) > 65536:
            raise ValueError(f"{name}: longer than any model")
        try:
            for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
                text = re.sub(pattern, _unroll, text)
                if len(text) > MAX_PATTERN_LAYERS:
                    raise ValueError("longer than any model")
        except ValueError as exc:
            raise ValueError(f"{name}: cannot read {shown}: {exc}") from None
        bad = next((ch for ch in text if ch not in LAYER_CHARS and ch != "|"), None)
        if bad is not None:
            raise ValueError(
                f"{name}: {bad!r} is no layer (E, t, m, L; '|' between stages) in {shown}"
            )
        return tuple(tuple(LAYER_CHARS[ch] for ch in stage) for stage in text.split("|"))
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in value):
        raise ValueError(f"{name}: must be a list of stages (lists of layer types) or a string")
    stages = []
    for row in value:
        kinds = [v.strip().lower() if isinstance(v, str) else v for v in row]
        bad = next((k for k in kinds if k not in LAYER_TYPES), None)
        if bad is not None or any(not isinstance(k, str) for k in kinds):
            raise ValueError(f"{name}: {bad!r} is not one of {', '.join(LAYER_TYPES)}")
        stages.append(tuple(kinds))
    if sum(len(s) for s in stages) > MAX_PATTERN_LAYERS:
        raise ValueError(f"{name}: longer than any model")
    return tuple(stages)


def parse_moe_layer_freq(value, num_layers) -> Union[int, Tuple[int, ...]]:
    """Megatron's ``moe_layer_freq`` as an int N or a tuple of 0/1 per layer: an int, a list, a
    string of an int, or a pattern string (arguments.py ``moe_freq_type``). ValueError names
    the field and never echoes a whole list."""
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    if isinstance(value, str):
        text = value.strip()
        if "[" in text:
            try:
                value = _eval_pattern(text)
            except ValueError as exc:
                raise ValueError(f"moe_layer_freq: cannot read {shown}: {exc}") from None
        else:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"moe_layer_freq: {shown} is neither an integer nor a pattern such as "
                    "'([0]*3+[1]*58)'"
                ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        _positive("moe_layer_freq", value)
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f"moe_layer_freq: must be an integer, a 0/1 list or a pattern string, got {shown}"
        )
    if any(type(v) is not int or v not in (0, 1) for v in value):
        bad = next(v for v in value if type(v) is not int or v not in (0, 1))
        raise ValueError(f"moe_layer_freq: entries are 0 (dense) or 1 (MoE), got {bad!r}")
    if isinstance(num_layers, int) and len(value) != num_layers:
        raise ValueError(
            f"moe_layer_freq: the pattern has {len(value)} entries for {num_layers} layers; "
            f"megatron needs one per layer ({GPT_LAYER_SPECS}:653)"
        )
    return tuple(value)


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
        chunk_dispatch=env_chunk("dispatch"),
        chunk_combine=env_chunk("combine"),
        blocks_preprocessing=cfg.moe_hybridep_num_sms_preprocessing,
        blocks_dispatch=cfg.moe_flex_dispatcher_num_sms,
        blocks_combine=cfg.moe_flex_dispatcher_num_sms,
        local_rank=None if cfg.local_rank is None else cfg.local_rank % r,
    )


def buffer_terms(cfg: MoEMemoryConfig) -> List[Term]:
    """The communication buffers ``cfg``'s dispatcher allocates (flex only)."""
    if cfg.moe_token_dispatcher_type != "flex":
        return []
    backend = cfg.moe_flex_dispatcher_backend
    if cfg.deep_ep != "hybrid-ep" and backend != "deepep":
        where = {"hybridep": "HybridEP is on deep_ep's hybrid-ep branch only",
                 "deepepv2": f"DeepEP v2 is priced at epv2-release {DEEP_EP_V2_COMMIT[:7]} only",
                 "ncclep": "NCCL EP does not use deep_ep"}[backend]  # fmt: skip
        raise ValueError(f"deep_ep: {cfg.deep_ep!r} applies to the deepep backend; {where}")
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
            return deepep_buffer_terms(hidden_bytes, cfg.group_size, sms, cfg.deep_ep)
        except ValueError as exc:
            raise ValueError(
                f"expert_model_parallel_size: ETP x EP = {cfg.group_size}: {exc}"
            ) from None
    return hybridep_buffer_terms(hybridep_layout(cfg))


def kernel_refusal(cfg: MoEMemoryConfig) -> Optional[str]:
    """Why the kernels of ``cfg``'s flex backend refuse it, as ``field: reason (source line)``;
    None if they accept it. DeepEP: an odd SM count (megatron passes it to
    ``Buffer.set_num_sms``, token_dispatcher.py:1279), more than 1024 local experts, top-k over
    32, hidden bytes not a multiple of 16 (the intranode or internode check, by group size);
    HybridEP: :func:`hybridep_refusal`. (The sizing functions do not refuse: the CPU emulation
    runs shapes the kernels would not.)"""
    if cfg.moe_token_dispatcher_type != "flex":
        return None
    if cfg.moe_flex_dispatcher_backend == "deepep":
        src = DEEPEP_SOURCE[cfg.deep_ep]
        sms = cfg.moe_flex_dispatcher_num_sms or DEFAULT_DEEPEP_SMS
        if sms % 2:
            return (
                f"moe_flex_dispatcher_num_sms: DeepEP refuses an odd SM count, got {sms} "
                f"({src.even_sms_at})"
            )
        inter = int(cfg.group_size > NUM_MAX_NVL_PEERS)  # internode kernels past 8 ranks
        local = cfg.num_moe_experts // cfg.expert_model_parallel_size
        if local > 1024:
            return (
                f"num_moe_experts: DeepEP refuses {local} local experts per rank, more than "
                f"NUM_MAX_LOCAL_EXPERTS 1024 ({src.local_experts_at[inter]})"
            )
        if cfg.moe_router_topk > 32:
            return (
                f"moe_router_topk: DeepEP's dispatch kernel asserts top-k <= 32, got "
                f"{cfg.moe_router_topk} ({src.topk_at[inter]})"
            )
        elem = BF16 if cfg.bf16 else FP32
        if cfg.hidden_size * elem % 16:
            return (
                f"hidden_size: DeepEP refuses {cfg.hidden_size} x {elem}-byte elements, not a "
                f"multiple of 16 bytes ({src.hidden_at[inter]})"
            )
    if cfg.moe_flex_dispatcher_backend == "hybridep":
        chunks = {kind: env_chunk(kind) for kind in CHUNK_ENV}
        if cfg.moe_permute_fusion_into_hybridep and len(set(chunks.values())) > 1:
            sizes = ", ".join(f"{CHUNK_ENV[k]}={v}" for k, v in chunks.items())
            return (
                f"moe_permute_fusion_into_hybridep: HybridEP's fused permute needs one chunk "
                f"size for dispatch, combine and preprocessing, got {sizes} (deep_ep "
                "csrc/hybrid_ep/config.cuh:174-183)"
            )
        return hybridep_refusal(hybridep_layout(cfg))
    return None


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
    refusal = hybridep_refusal(hybridep_layout(cfg, needed))
    if refusal:
        raise ValueError(refusal)
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


# --------------------------------------------------------------------------------------------
# The installed tree, and the public estimate


# The dispatcher classes of megatron/core/transformer/moe/token_dispatcher.py, by
# moe_token_dispatcher_type.
DISPATCHER_CLASSES = {
    "allgather": "MoEAllGatherTokenDispatcher",
    "alltoall": "MoEAlltoAllTokenDispatcher",
    "flex": "MoEFlexTokenDispatcher",
}
# The hook a releasing tree's dispatchers call at the end of combine_postprocess (megatron-core
# with moe-release's series; upstream's dev branch has reset_transient_forward_state() but does
# not call it after combine).
RELEASE_HOOK = "_maybe_reset_transient_forward_state"


def installed_tree_releases(dispatcher_type: str) -> bool:
    """Whether the installed megatron-core's dispatcher of ``dispatcher_type`` (allgather,
    alltoall, flex) releases its per-forward state once combine is done: its
    ``combine_postprocess`` calls ``_maybe_reset_transient_forward_state``. Read from the
    installed code (imports ``megatron.core.transformer.moe.token_dispatcher``, and so torch);
    nothing is built or run."""
    import inspect

    from megatron.core.transformer.moe import token_dispatcher

    if dispatcher_type not in DISPATCHER_CLASSES:
        raise ValueError(
            f"moe_token_dispatcher_type: {dispatcher_type!r} is not one of "
            f"{', '.join(DISPATCHER_CLASSES)}"
        )
    cls = getattr(token_dispatcher, DISPATCHER_CLASSES[dispatcher_type])
    code = getattr(inspect.unwrap(cls.combine_postprocess), "__code__", None)
    return code is not None and RELEASE_HOOK in code.co_names


@dataclass(frozen=True)
class MoEMemoryEstimate:
    """What the MoE layers of one rank hold, term by term (:func:`estimate`).

    Attributes:
        config: the configuration priced (TransformerConfig's field names).
        buffers: the flex dispatcher's communication buffers, one :class:`Term` each (bytes,
            where they live: ``OUTSIDE`` PyTorch's allocator or ``HOST`` pinned memory, the
            source line that sizes them, whether a release of the buffers frees them); empty
            for the all-gather and all-to-all dispatchers. Allocated at the first dispatch, held
            until released; one set per rank, whatever the number of layers.
        buffer_source: the source and commit the buffer terms were read from.
        releases: whether the tree priced releases its dispatchers' per-forward state after
            combine (megatron-core with moe-release's series) or keeps it between calls.
        dispatcher_state: what one MoE layer's dispatcher keeps between calls, in PyTorch's
            allocator (or pinned host memory): empty where the tree releases it; None where it
            is not modelled (the DeepEP v2 and NCCL EP backends).
        dispatcher_state_chain: without recompute, what a later layer's retained graph adds
            through each earlier layer's combine (every MoE layer but the last).
        moe_layers: MoE layers of the pipeline rank that builds the most.
    """

    config: MoEMemoryConfig
    buffers: Tuple[Term, ...]
    buffer_source: str
    releases: bool
    dispatcher_state: Optional[Tuple[Term, ...]]
    dispatcher_state_chain: Tuple[Term, ...]
    moe_layers: int

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the communication buffers, outside PyTorch's allocator."""
        return total(self.buffers, OUTSIDE)

    @property
    def buffer_pinned_host_bytes(self) -> int:
        """Pinned host bytes of the communication buffers."""
        return total(self.buffers, HOST)

    @property
    def buffer_released_bytes(self) -> int:
        """Bytes (device and pinned host) a release of the buffers gives back."""
        return released_bytes(self.buffers)

    @property
    def dispatcher_state_bytes_per_layer(self) -> Optional[int]:
        """Bytes one MoE layer's dispatcher keeps between calls (None: not modelled)."""
        return None if self.dispatcher_state is None else total(self.dispatcher_state)

    @property
    def dispatcher_state_bytes(self) -> Optional[int]:
        """Bytes every MoE layer of the rank keeps between calls (None: not modelled)."""
        per_layer = self.dispatcher_state_bytes_per_layer
        if per_layer is None:
            return None
        chain = total(self.dispatcher_state_chain) * max(self.moe_layers - 1, 0)
        return per_layer * self.moe_layers + chain


def buffer_source(cfg: MoEMemoryConfig) -> str:
    """The source and commit ``cfg``'s buffer terms are read from ("" without buffers)."""
    if cfg.moe_token_dispatcher_type != "flex":
        return ""
    backend = cfg.moe_flex_dispatcher_backend
    if backend == "deepepv2":
        return f"DeepEP epv2-release {DEEP_EP_V2_COMMIT}"
    if backend == "ncclep":
        return f"NCCL EP nccl-extensions {NCCL_EP_COMMIT}"
    return f"deep_ep {cfg.deep_ep} {DEEP_EP_SOURCES[cfg.deep_ep]}"


def estimate_config(cfg: MoEMemoryConfig, releases: Optional[bool] = None) -> MoEMemoryEstimate:
    """:func:`estimate` of a :class:`MoEMemoryConfig`. ``releases`` None: read from the
    installed megatron-core (:func:`installed_tree_releases`)."""
    refusal = kernel_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    dispatcher = cfg.moe_token_dispatcher_type
    if releases is None:
        releases = installed_tree_releases(dispatcher)
    flex = dispatcher == "flex"
    backend = cfg.moe_flex_dispatcher_backend if flex else None
    state: Optional[Tuple[Term, ...]] = None
    chain: Tuple[Term, ...] = ()
    if backend in (None,) + BACKENDS:
        state = ()
        if not releases:
            shape = layer_shape(cfg)
            group = cfg.group_size if flex else cfg.expert_model_parallel_size
            nodes = max(group // cfg.ranks_per_node, 1)
            state = tuple(retained_state_terms(shape, dispatcher, backend, nodes))
            chain = tuple(retained_chain_terms(shape, dispatcher, backend))
    return MoEMemoryEstimate(
        config=cfg,
        buffers=tuple(buffer_terms(cfg)),
        buffer_source=buffer_source(cfg),
        releases=releases,
        dispatcher_state=state,
        dispatcher_state_chain=chain,
        moe_layers=cfg.moe_layers_per_rank,
    )


# TransformerConfig fields the estimate reads; any other field of the config is not read.
CONFIG_FIELDS = tuple(
    f.name
    for f in fields(MoEMemoryConfig)
    if f.name not in ("tokens_per_rank", "seq_length", "micro_batch_size", "ranks_per_node",
                      "routed_rows_factor", "deep_ep", "bf16", "local_rank")
)  # fmt: skip


# What the caller's config is: a megatron-core TransformerConfig or a Mapping of its fields.
ConfigLike = Union["TransformerConfig", Mapping[str, Any]]
# Fields the estimate cannot do without (a TransformerConfig of a dense model has no experts).
NEEDED_FIELDS = ("hidden_size", "num_moe_experts", "moe_router_topk", "num_layers")


def _field(config: ConfigLike, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def config_from(
    config: ConfigLike,
    tokens_per_rank: int,
    ranks_per_node: int = 8,
    routed_rows_factor: float = 1.0,
    deep_ep: str = "hybrid-ep",
    local_rank: Optional[int] = None,
) -> MoEMemoryConfig:
    """The :class:`MoEMemoryConfig` of a megatron-core ``TransformerConfig`` (its fields read
    with getattr) or a Mapping of the same field names; a field it lacks or holds None takes
    TransformerConfig's default. ``bf16`` or ``fp16`` set: 16-bit activations. A
    ``PipelineParallelLayerLayout`` is read from what it was built from. ValueError names the
    field."""
    missing = [name for name in NEEDED_FIELDS if _field(config, name) is None]
    if missing:
        raise ValueError(f"{missing[0]}: needed, got None or nothing (an MoE model's field)")
    values: Dict[str, Any] = {}
    for name in CONFIG_FIELDS:
        value = _field(config, name)
        if value is None:
            continue
        if name == "pipeline_model_parallel_layout" and hasattr(value, "input_data"):
            value = value.input_data  # megatron's PipelineParallelLayerLayout
        if name == "pipeline_model_parallel_layout" and isinstance(value, (list, tuple)):
            value = [[getattr(t, "name", t) for t in stage] for stage in value]  # LayerType
        if name in ("recompute_modules", "moe_layer_freq") and isinstance(value, list):
            value = tuple(value)
        values[name] = value
    values["bf16"] = bool(_field(config, "bf16") or _field(config, "fp16"))
    return MoEMemoryConfig(
        **values,
        tokens_per_rank=tokens_per_rank,
        ranks_per_node=ranks_per_node,
        routed_rows_factor=routed_rows_factor,
        deep_ep=deep_ep,
        local_rank=local_rank,
    )


def estimate(
    config: ConfigLike,
    tokens_per_rank: int,
    *,
    ranks_per_node: int = 8,
    routed_rows_factor: float = 1.0,
    deep_ep: str = "hybrid-ep",
    releases: Optional[bool] = None,
    local_rank: Optional[int] = None,
) -> MoEMemoryEstimate:
    """The MoE memory one rank of ``config`` holds, before anything is allocated: the flex
    dispatcher's communication buffers and the dispatcher state the tree keeps between calls.

    Args:
        config: a megatron-core ``TransformerConfig``, or a Mapping of its field names
            (``hidden_size``, ``num_moe_experts``, ``moe_router_topk`` and ``num_layers`` are
            needed; the parallel sizes, pipeline split, ``moe_layer_freq``, dispatcher and
            backend, recompute, ``bf16``/``fp16`` are read where given).
        tokens_per_rank: tokens one MoE layer's dispatcher receives per call on this rank
            (``seq_length x micro_batch_size / (TP x CP)`` with sequence parallelism).
        ranks_per_node: ranks of one NVLink domain (8 on an HGX node, 72 on GB200 NVL72).
        routed_rows_factor: rows this rank's experts receive, as a multiple of balanced
            routing (``tokens_per_rank x top-k``); at most EP.
        deep_ep: the deep_ep source DeepEP's normal mode is priced at: ``hybrid-ep``
            (``DEEP_EP_COMMIT``) or ``main`` (``DEEP_EP_MAIN_COMMIT``).
        releases: whether the tree releases its dispatchers' state after combine; None reads
            it from the installed megatron-core (:func:`installed_tree_releases`).
        local_rank: the rank priced (its rank within the NVLink domain counts): HybridEP's
            local rank 0 allocates 3 x 8 B of flags its peers map; None prices a peer.

    Returns:
        A :class:`MoEMemoryEstimate`: every term with its bytes, where it lives and the source
        line that sizes it (HybridEP's and DeepEP's buffers from deep_ep at ``DEEP_EP_COMMIT``
        or ``DEEP_EP_MAIN_COMMIT``, DeepEP v2's at ``DEEP_EP_V2_COMMIT``, NCCL EP's at
        ``NCCL_EP_COMMIT``; its ``buffer_source`` names the one used).

    Raises:
        ValueError: a field missing or out of range, or a configuration the kernels refuse,
            named with the line that refuses it.
        ImportError: ``releases`` None where megatron-core (and torch) cannot be imported.

    Not modelled: NVSHMEM's own memory, NCCL communicators, the cuMem fabric granularity,
    DeepEP's low-latency mode, capacity-factor routing (the estimate is dropless), the MoE
    layers of MTP, per-expert padding of routed rows for FP8, the device-dependent limits of
    the kernels (SM count, shared memory), activations, weights and optimizer state, and the
    dispatcher state of the DeepEP v2 and NCCL EP backends (``dispatcher_state`` is None).
    HybridEP's chunk sizes are read from the environment, as deep_ep reads them.
    """
    cfg = config_from(
        config, tokens_per_rank, ranks_per_node, routed_rows_factor, deep_ep, local_rank
    )
    return estimate_config(cfg, releases)


if __name__ == "__main__":
    sys.exit(
        "moe_memory_planner: a library, not a command: call estimate(config, tokens_per_rank); "
        "the base-versus-patched table is moe-release's scripts/moe_memory_plan.py"
    )
