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
Megatron's own argument names or a Megatron-Bridge style YAML. Its input is strict: a key or
flag within typo distance of a known one, a value of the wrong kind, or a configuration the
kernels or megatron refuse is one line naming it (and the refusing source line), exit status 2;
deprecated fields megatron still accepts are read, with a note.

Sources. deep_ep is read at ``DEEP_EP_COMMIT``, the head of its ``hybrid-ep`` branch; the commit
megatron-core's CI pins (``de0dd11``) was not available to read, so where the two differ these
figures follow ``DEEP_EP_COMMIT``. Two terms depend on that: the unused all-gather buffer
(``enable_custom_allgather`` defaults to False at ``DEEP_EP_COMMIT``) and the rounding of rows
to the combine chunk (since deep_ep 4214430). DeepEP's normal mode is also priced at DeepEP
main (``DEEP_EP_MAIN_COMMIT``, 2.1.0: other dispatch/combine configs, EP 48 and 96) when
``deep_ep="main"`` is chosen; the plan names the source it priced. Configurations the kernels
refuse (HybridEP's ``BufferConfig::is_valid``, DeepEP's group sizes and SM count) are refused
here with the line that refuses them, and HybridEP's chunk-size environment variables are read
as deep_ep reads them (``atoi``, default 64) for every term they size. megatron-core call sites
are cited as in megatron-core 0.19.2. Terms marked approximate (the DOCA queue pairs of
multi-node HybridEP) come from a stored NCCL version, not deep_ep's submodule pin. Not modelled:
NVSHMEM's own memory (DeepEP across more than 8 ranks), the cuMem fabric granularity, NCCL
communicators, DeepEP's low-latency mode, NCCL EP's leaked device communicator (one cuMem granule
per bootstrap), and (for the retained state) capacity-factor routing (drop-and-pad keeps other
shapes) and the DeepEP v2 and NCCL EP backends, whose buffers are priced
(:func:`deepep_v2_buffer_terms` at ``DEEP_EP_V2_COMMIT``, :func:`nccl_ep_terms` at
``NCCL_EP_COMMIT``) but whose retained state is not. Nor are the MoE layers of MTP, the
per-expert padding of routed rows for FP8, or the kernels' limits that depend on the device
(its SM count, shared memory); the command notes such fields when they are set.

Imports only the standard library.
"""

import argparse
import ast
import difflib
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

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


def plan(cfg: MoEMemoryConfig, held_rows: Optional[int] = None) -> Dict[str, object]:
    """Every MoE memory term of ``cfg`` on one rank, base (unpatched megatron-core) beside
    patched (this series), as one JSON-able dict; for HybridEP also what a call grows against
    a buffer of ``held_rows`` per rank already held. A configuration the kernels refuse is a
    ValueError citing the line that refuses it (:func:`kernel_refusal`)."""
    refusal = kernel_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
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
            "moe_layers_per_pipeline_rank": cfg.rank_moe_layers(),
            "recompute": shape.recompute,
            "deep_ep_source": cfg.deep_ep,
            "deep_ep_commit": DEEP_EP_SOURCES[cfg.deep_ep],
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
                per_layer * layers + total(chain) * max(layers - 1, 0) if modelled else None
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


@dataclass(frozen=True)
class Arg:
    """One command-line argument: its flag (Megatron's name where Megatron has one) and help."""

    flag: str
    help: str
    metavar: str = "INT"


# MoEMemoryConfig field -> its argument; the help says what it is, its default and its unit.
ARGS = {
    "hidden_size": Arg("--hidden-size", "hidden size H, elements per token"),
    "num_moe_experts": Arg("--num-experts", "routed experts of an MoE layer"),
    "moe_router_topk": Arg("--moe-router-topk", "experts each token is routed to"),
    "num_layers": Arg("--num-layers", "transformer layers of the model, all pipeline stages"),
    "seq_length": Arg(
        "--seq-length", "tokens per sequence (no default: needed unless --tokens-per-rank)"
    ),
    "micro_batch_size": Arg("--micro-batch-size", "sequences per micro-batch (default 1)"),
    "tensor_model_parallel_size": Arg("--tensor-model-parallel-size", "TP, ranks (default 1)"),
    "context_parallel_size": Arg("--context-parallel-size", "CP, ranks (default 1)"),
    "pipeline_model_parallel_size": Arg(
        "--pipeline-model-parallel-size",
        "PP, ranks (default 1); without a layout, PP x VPP must divide --num-layers",
    ),
    "virtual_pipeline_model_parallel_size": Arg(
        "--num-virtual-stages-per-pipeline-rank",
        "VPP, virtual stages per pipeline rank (default: none; with a layout, from it)",
    ),
    "num_layers_in_first_pipeline_stage": Arg(
        "--decoder-first-pipeline-num-layers",
        "layers of the first pipeline stage (default: an even split)",
    ),
    "num_layers_in_last_pipeline_stage": Arg(
        "--decoder-last-pipeline-num-layers",
        "layers of the last pipeline stage (default: an even split)",
    ),
    "pipeline_model_parallel_layout": Arg(
        "--pipeline-model-parallel-layout",
        "megatron's layout string, e.g. 'Et*4|(tttt|)*14,tmL' (E embedding, t decoder, m MTP, "
        "L loss; '|' between stages; default: layers split evenly over PP x VPP)",
        "LAYOUT",
    ),
    "expert_model_parallel_size": Arg("--expert-model-parallel-size", "EP, ranks (default 1)"),
    "expert_tensor_parallel_size": Arg(
        "--expert-tensor-parallel-size", "ETP, ranks (default: TP); the flex group is ETP x EP"
    ),
    "moe_layer_freq": Arg(
        "--moe-layer-freq",
        "which layers are MoE: N (every Nth layer from layer 0), or a pattern of one 0/1 per "
        "layer such as '([0]*3+[1]*58)' (default 1: every layer)",
        "N|PATTERN",
    ),
    "moe_token_dispatcher_type": Arg(
        "--moe-token-dispatcher-type", "allgather, alltoall or flex (default allgather)", "TYPE"
    ),
    "moe_flex_dispatcher_backend": Arg(
        "--moe-flex-dispatcher-backend",
        "flex backend: deepep, hybridep, deepepv2 or ncclep (default deepep)",
        "BACKEND",
    ),
    "moe_flex_dispatcher_num_sms": Arg(
        "--moe-flex-dispatcher-num-sms",
        "SMs of the flex kernels (default: DeepEP 20, even; HybridEP 8 per direction across "
        "nodes, where its queue pairs scale with it)",
    ),
    "moe_hybridep_num_sms_preprocessing": Arg(
        "--moe-hybridep-num-sms-preprocessing", "HybridEP preprocessing blocks (default 108)"
    ),
    "moe_router_dtype": Arg(
        "--moe-router-dtype", "router probabilities: fp32 or fp64 (default: the model's)", "DTYPE"
    ),
    "moe_expert_rank_capacity_factor": Arg(
        "--moe-expert-rank-capacity-factor",
        "NCCL EP receive capacity, a multiple of tokens x top-k (default: none, eager sizing)",
        "FACTOR",
    ),
    "recompute_granularity": Arg(
        "--recompute-granularity", "selective or full (default: no recompute)", "GRANULARITY"
    ),
    "recompute_modules": Arg(
        "--recompute-modules",
        "modules selective recompute reruns; 'moe' reruns the MoE layer (default core_attn)",
        "MODULE",
    ),
    "tokens_per_rank": Arg(
        "--tokens-per-rank",
        "T, tokens an MoE layer's dispatcher gets per call on a rank "
        "(default: seq x micro-batch / (TP x CP), sequence parallel)",
    ),
    "ranks_per_node": Arg(
        "--ranks-per-node",
        "ranks of one NVLink domain (default 8: an HGX node; GB200: 72; HybridEP: "
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN when set)",
    ),
    "routed_rows_factor": Arg(
        "--routed-rows-factor",
        "rows a rank's experts receive, as a multiple of balanced routing T x top-k "
        "(default 1.0; above 0, at most EP)",
        "FACTOR",
    ),
    "deep_ep": Arg(
        "--deep-ep",
        f"deep_ep source priced: hybrid-ep (branch head {DEEP_EP_COMMIT[:7]}: HybridEP and "
        f"DeepEP; default) or main (DeepEP 2.1.0, {DEEP_EP_MAIN_COMMIT[:7]}: DeepEP only, its "
        "own configs, EP 48 and 96 too)",
        "SOURCE",
    ),
}
REQUIRED = ("hidden_size", "num_moe_experts", "moe_router_topk", "num_layers")
# Command-line flag (Megatron's argument names) -> MoEMemoryConfig field.
FLAGS = {arg.flag: name for name, arg in ARGS.items()}
FIELD_FLAGS = {field_name: flag for flag, field_name in FLAGS.items()}
# The flags build_parser adds beside ARGS, named as megatron names them.
FIELD_FLAGS.update({name: "--" + name.replace("_", "-") for name in (
    "num_layers_per_virtual_pipeline_stage", "sequence_parallel", "moe_ncclep_zero_copy",
    "moe_permute_fusion_into_hybridep", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)})  # fmt: skip
INT_FIELDS = {
    "hidden_size", "num_moe_experts", "moe_router_topk", "num_layers", "seq_length",
    "micro_batch_size", "tensor_model_parallel_size", "context_parallel_size",
    "pipeline_model_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
    "moe_flex_dispatcher_num_sms", "moe_hybridep_num_sms_preprocessing",
    "tokens_per_rank", "ranks_per_node", "virtual_pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
}  # fmt: skip
FLOAT_FIELDS = ("routed_rows_factor", "moe_expert_rank_capacity_factor")
BOOL_KEYS = (
    "bf16", "fp16", "moe_ncclep_zero_copy", "moe_enable_deepep", "moe_layer_recompute",
    "moe_permute_fusion_into_hybridep",
    "sequence_parallel", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)  # fmt: skip
# Megatron's argument names for TransformerConfig fields (arguments.py).
YAML_ALIASES = {
    "num_experts": "num_moe_experts",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
}
TRANSFORMER_CONFIG = "megatron/core/transformer/transformer_config.py"
# Deprecated TransformerConfig fields megatron-core 0.19 still accepts and routes to
# moe_flex_dispatcher_num_sms unless that is set (transformer_config.py:1616-1635).
DEPRECATED_SMS = ("moe_deepep_num_sms", "moe_hybridep_num_sms")
# Megatron's own names (TransformerConfig, ModelParallelConfig, megatron/training/config and
# arguments.py in megatron-core 0.19.2) that are not the planner's but lie within the typo
# distance of one of its names: never taken for a typo. A test re-derives it from the tree.
MEGATRON_NEIGHBOURS = frozenset({
    "eval_micro_batch_size", "ffn_hidden_size", "inference_moe_token_dispatcher_type",
    "main_params_dtype", "model_parallel_size", "moe_expert_capacity_factor",
    "moe_router_group_topk", "mtp_num_layers", "rl_inference_expert_model_parallel_size",
    "rl_inference_pipeline_model_parallel_size", "rl_inference_tensor_model_parallel_size",
})  # fmt: skip
# Megatron fields the terms depend on that the planner does not model: set, they are noted.
NOT_MODELLED = {
    "moe_expert_capacity_factor": "capacity-factor routing (the plan is dropless)",
    "moe_pad_expert_input_to_capacity": "capacity-factor routing (the plan is dropless)",
    "mtp_num_layers": "multi-token-prediction layers (their MoE layers are not counted)",
    "moe_router_padding_for_fp8": "rows padded per expert for FP8 (routed rows are unpadded)",
    "moe_router_padding_for_quantization": "rows padded per expert (routed rows are unpadded)",
}
TYPO_CUTOFF = 0.8  # difflib ratio: expert_model_paralel_size is 0.98 from its field


def _known_keys() -> List[str]:
    return sorted(set(ARGS) | set(YAML_ALIASES) | set(BOOL_KEYS) | set(DEPRECATED_SMS)
                  | {"params_dtype", "num_layers_per_virtual_pipeline_stage"})  # fmt: skip


def closest(name: str, known: Sequence[str]) -> Optional[str]:
    """The known name ``name`` is most likely a typo of (difflib), or None."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=TYPO_CUTOFF)
    return match[0] if match else None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit status 2
        raise SystemExit(_fail(message))


def _fail(message: str) -> int:
    print(f"moe_memory_planner: {message}", file=sys.stderr)
    return 2


def _note(message: str) -> None:
    print(f"moe_memory_planner: note: {message}", file=sys.stderr)


def read_config_file(path: str, notes: Optional[List[str]] = None) -> Dict[str, object]:
    """The planner's fields of a Megatron-Bridge style YAML (``model:`` and ``train:`` sections,
    or top-level keys, in TransformerConfig's names). A key that is no name the planner or
    Megatron knows but lies within typo distance of one of the planner's is a ValueError naming
    the closest; other keys are not the planner's. The deprecated SM-count fields and
    ``moe_enable_deepep`` are kept under their names (:func:`apply_deprecated` routes them);
    fields the planner does not model are appended to ``notes``."""
    try:
        import yaml
    except ImportError:
        raise ValueError("--config-file: reading YAML needs PyYAML (pip install pyyaml)") from None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        raise ValueError(f"--config-file: {path}: {lines[0]}") from None
    except RecursionError:
        raise ValueError(f"--config-file: {path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config-file: {path}: not a mapping")
    known = _known_keys()
    values: Dict[str, object] = {}
    for where, section in (("top level", data), ("train:", data.get("train")),
                           ("model:", data.get("model"))):  # fmt: skip
        if not isinstance(section, dict):
            continue
        for key, value in section.items():
            if key == "params_dtype" and isinstance(value, dict):  # Bridge: {_target_: torch.x}
                value = str(value.get("_target_"))
            if not isinstance(key, str) or isinstance(value, dict):
                if section is data and isinstance(key, str) and key not in ("model", "train"):
                    near = closest(key, ["model", "train"])
                    if near:
                        raise ValueError(
                            f"--config-file: {path}: unknown section {key!r}; the closest known "
                            f"is {near!r}"
                        )
                continue
            if key in NOT_MODELLED and value not in (None, False, 0) and notes is not None:
                notes.append(f"{key} is set; not modelled: {NOT_MODELLED[key]}")
            if key in known:
                values[YAML_ALIASES.get(key, key)] = value
            elif key not in MEGATRON_NEIGHBOURS and closest(key, known):
                raise ValueError(
                    f"--config-file: {path}: unknown key {key!r} ({where}); the closest known "
                    f"name is {closest(key, known)!r}"
                )
    if "params_dtype" in values:  # torch.bfloat16 or torch.float16: 16-bit activations
        dtype = str(values.pop("params_dtype"))
        if "bf16" not in values and "fp16" not in values:
            values["bf16"] = "float16" in dtype
    return values


def apply_deprecated(values: Dict[str, object], notes: List[str]) -> None:
    """Megatron's handling of the deprecated fields it still accepts, in place: the SM-count
    knobs route to ``moe_flex_dispatcher_num_sms`` unless it is set (``transformer_config.py``
    1616-1635; two that differ are an error), ``moe_layer_recompute`` is selective recompute
    of ``moe`` (1835-1846), ``moe_enable_deepep`` selects the deepep backend of the flex
    dispatcher (1589-1598)."""
    sms = {}
    for name in DEPRECATED_SMS:
        value = values.pop(name, None)
        if value is not None:
            _positive(name, value)
            sms[name] = value
    if sms:
        notes.append(f"{', '.join(sms)} is deprecated; megatron routes it to "
                     f"moe_flex_dispatcher_num_sms ({TRANSFORMER_CONFIG}:1616-1635)")  # fmt: skip
        if values.get("moe_flex_dispatcher_num_sms") is None:
            if len(set(sms.values())) > 1:
                raise ValueError(
                    f"{'/'.join(sms)}: conflicting deprecated SM counts "
                    f"{', '.join(f'{k}={v}' for k, v in sms.items())}; megatron refuses them "
                    f"({TRANSFORMER_CONFIG}:1630-1634)"
                )
            values["moe_flex_dispatcher_num_sms"] = next(iter(sms.values()))
    if values.pop("moe_layer_recompute", False) is True:
        if values.get("recompute_granularity") == "full":
            raise ValueError(
                "moe_layer_recompute: conflicts with recompute_granularity full; megatron "
                f"refuses it ({TRANSFORMER_CONFIG}:1840-1843)"
            )
        values["recompute_granularity"] = "selective"
        modules = values.get("recompute_modules") or ["core_attn"]
        if isinstance(modules, (list, tuple)) and "moe" not in modules:
            values["recompute_modules"] = list(modules) + ["moe"]
        notes.append(
            "moe_layer_recompute is deprecated; megatron reads it as recompute_granularity "
            f"selective with moe among recompute_modules ({TRANSFORMER_CONFIG}:1835-1846)"
        )
    enable = values.pop("moe_enable_deepep", False)
    if not isinstance(enable, bool):
        raise ValueError(f"moe_enable_deepep: must be true or false, got {enable!r}")
    if enable:
        if values.get("moe_token_dispatcher_type") != "flex":
            raise ValueError(
                "moe_enable_deepep: needs moe_token_dispatcher_type flex; megatron refuses it "
                f"({TRANSFORMER_CONFIG}:1590-1591)"
            )
        if values.get("moe_flex_dispatcher_backend") == "hybridep":
            raise ValueError(
                "moe_enable_deepep: conflicts with moe_flex_dispatcher_backend hybridep; megatron "
                f"refuses it ({TRANSFORMER_CONFIG}:1592-1593)"
            )
        values["moe_flex_dispatcher_backend"] = "deepep"
        notes.append(
            "moe_enable_deepep is deprecated; megatron reads it as moe_flex_dispatcher_backend "
            f"deepep ({TRANSFORMER_CONFIG}:1589-1598)"
        )


ARGUMENTS = "megatron/training/arguments.py"
LAYERS_PER_VIRTUAL_STAGE = "num_layers_per_virtual_pipeline_stage"


def _vpp_from_layers_per_stage(values: Dict[str, object]) -> None:
    """Megatron's ``--num-layers-per-virtual-pipeline-stage``: VPP = num_layers / PP / it,
    exclusive of the other VPP arguments and of uneven stages (``arguments.py:894-944``)."""
    n = values.pop(LAYERS_PER_VIRTUAL_STAGE, None)
    if n is None:
        return
    _positive(LAYERS_PER_VIRTUAL_STAGE, n)
    if any(values.get(k) is not None for k in (
        "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_layout",
    )):  # fmt: skip
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: no more than one of it, the virtual stages per rank "
            f"and the layout ({ARGUMENTS}:894-905)"
        )
    if any(values.get(k) is not None for k in (
        "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
    )):  # fmt: skip
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: not with uneven first/last stages ({ARGUMENTS}:921-922)"
        )
    layers, pp = values.get("num_layers"), values.get("pipeline_model_parallel_size") or 1
    if not isinstance(layers, int) or not isinstance(pp, int) or pp <= 0:
        return  # the config's own checks name what is wrong
    if layers % pp or (layers // pp) % n:
        raise ValueError(
            f"{LAYERS_PER_VIRTUAL_STAGE}: {n} does not divide the {layers} layers' share of "
            f"each of the {pp} pipeline stages ({ARGUMENTS}:933-938)"
        )
    vpp = layers // pp // n
    values["virtual_pipeline_model_parallel_size"] = vpp if vpp > 1 else None


RANKS_ENV = "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN"


def _ranks_per_node_from_env(values: Dict[str, object], notes: List[str]) -> None:
    """HybridEP takes its NVLink domain from ``NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN`` when
    set, over what it detects (``deep_ep/hybrid_ep_buffer.py:63-72``, ``int()``), and asserts
    it divides the group (``:74-76``): so does the plan of a hybridep configuration, with a
    note where it overrides ``--ranks-per-node``."""
    raw = os.environ.get(RANKS_ENV)
    if raw is None or values.get("moe_flex_dispatcher_backend") != "hybridep":
        return
    try:
        ranks = int(raw)
    except ValueError:
        raise ValueError(
            f"{RANKS_ENV}={raw[:40]!r}: deep_ep reads it with int(), which refuses it "
            "(deep_ep/hybrid_ep_buffer.py:63-65)"
        ) from None
    ep = values.get("expert_model_parallel_size") or 1
    etp = values.get("expert_tensor_parallel_size") or values.get("tensor_model_parallel_size") or 1
    if not 0 < ranks <= INT_MAX or (ep * etp) % ranks:
        raise ValueError(
            f"{RANKS_ENV}={raw[:40]!r}: HybridEP needs it to divide the group of ETP x EP = "
            f"{ep * etp} ranks (deep_ep/hybrid_ep_buffer.py:74-76)"
        )
    given = values.get("ranks_per_node")
    if given is not None and given != ranks:
        notes.append(f"{RANKS_ENV}={ranks} overrides --ranks-per-node {given}, as in deep_ep")
    values["ranks_per_node"] = ranks


def _check_types(values: Dict[str, object]) -> None:
    """Each value of the type its field takes: a ValueError naming the field otherwise."""
    for name, value in values.items():
        if name in INT_FIELDS and value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}: must be an integer, got {value!r}")
        elif name in FLOAT_FIELDS and value is not None:
            if isinstance(value, str):
                try:
                    number = float(value)
                except ValueError:
                    raise ValueError(f"{name}: must be a number, got {value!r}") from None
                if not math.isfinite(number):
                    raise ValueError(f"{name}: must be a finite number, got {value!r}")
                values[name] = number
            elif not _real(value):
                raise ValueError(f"{name}: must be a finite number, got {value!r}")
        elif name in ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "deep_ep",
                      "moe_router_dtype", "recompute_granularity"):  # fmt: skip
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: must be a name, got {value!r}")
        elif name in BOOL_KEYS and not isinstance(value, bool):
            raise ValueError(f"{name}: must be true or false, got {value!r}")


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: Megatron's argument names, each with what it is, its default and
    its unit; the required ones in their own group."""
    p = _Parser(
        prog="moe_memory_planner",
        allow_abbrev=False,
        description="Every MoE memory term of a configuration on one rank (communication "
        "buffers, dispatcher state held between calls), base (unpatched megatron-core) vs "
        "patched, before anything is allocated. Sizes in bytes. HybridEP reads "
        + ", ".join(CHUNK_ENV.values())
        + " (tokens per chunk, default 64) from the environment, as deep_ep does.",
        epilog="Bad input: one line on stderr naming it, exit status 2.",
    )
    req = p.add_argument_group("required (here or in --config-file)")
    opt = p.add_argument_group("model and parallelism (Megatron's names)")
    for name, arg in ARGS.items():
        group = req if name in REQUIRED else opt
        help_text = arg.help + (" [required]" if name in REQUIRED else "")
        if name == "recompute_modules":
            group.add_argument(arg.flag, nargs="*", dest=name, default=None, help=help_text,
                               metavar=arg.metavar)  # fmt: skip
        else:
            kind = int if name in INT_FIELDS else str
            group.add_argument(arg.flag, dest=name, type=kind, default=None, help=help_text,
                               metavar=arg.metavar)  # fmt: skip
    opt.add_argument("--bf16", action="store_true", default=None,
                     help="16-bit activations, 2 bytes each (default: fp32, 4 bytes, unless "
                     "the YAML's bf16, fp16 or params_dtype says otherwise)")  # fmt: skip
    opt.add_argument("--fp16", action="store_true", default=None,
                     help="16-bit activations, as --bf16 (default off)")  # fmt: skip
    opt.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, metavar="INT",
                     dest=LAYERS_PER_VIRTUAL_STAGE, default=None,
                     help="layers per virtual pipeline stage: VPP = layers / PP / this "
                     "(default: none)")  # fmt: skip
    for flag, name in (("--account-for-embedding-in-pipeline-split", "embedding"),
                       ("--account-for-loss-in-pipeline-split", "loss")):  # fmt: skip
        help_text = f"the {name} counts as a layer of the pipeline split (default off)"
        opt.add_argument(flag, action="store_true", default=None, help=help_text)
    opt.add_argument("--sequence-parallel", action="store_true", default=None,
                     help="sequence parallelism: tokens split over TP too (default: assumed on, "
                     "with a note when TP > 1; the YAML's sequence_parallel: false turns it "
                     "off)")  # fmt: skip
    opt.add_argument("--moe-permute-fusion-into-hybridep", action="store_true", default=None,
                     help="HybridEP's fused permute-dispatch: one chunk size for all three "
                     "variables (default off)")  # fmt: skip
    opt.add_argument("--moe-ncclep-zero-copy", dest="moe_ncclep_zero_copy", action="store_true",
                     default=None, help="NCCL EP's zero-copy buffers (default off)")  # fmt: skip
    out = p.add_argument_group("input and output")
    out.add_argument("--config-file", metavar="YAML",
                     help="a Megatron-Bridge style YAML: model:, train: or top-level keys in "
                     "TransformerConfig's names; flags override it (default: none)")  # fmt: skip
    out.add_argument("--held-rows", type=int, metavar="ROWS",
                     help="rows per rank of a HybridEP buffer already held, to price a call's "
                     "growth against (default: none held)")  # fmt: skip
    out.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    return p


def config_from_args(
    argv: Optional[Sequence[str]] = None, notes: Optional[List[str]] = None
) -> tuple:
    """(MoEMemoryConfig, --json, --held-rows) from the command line; ValueError names the bad
    argument. Notes (deprecated fields read, fields set but not modelled) are appended to
    ``notes``, or printed on stderr if it is None."""
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        flag = next((e.split("=")[0] for e in extra if e.startswith("-")), None)
        near = closest(flag, [a.option_strings[0] for a in p._actions]) if flag else None
        hint = f"; the closest known flag is {near}" if near else ""
        p.error(f"unrecognized arguments: {' '.join(extra)[:80]}{hint}")
    if args.held_rows is not None and not 0 < args.held_rows <= INT_MAX:
        raise ValueError(
            f"--held-rows: must be a positive integer up to {INT_MAX:,}, got {args.held_rows}"
        )
    printed = notes is None
    notes = [] if notes is None else notes
    values = read_config_file(args.config_file, notes) if args.config_file else {}
    values.update({n: getattr(args, n) for n in ARGS if getattr(args, n) is not None})
    if args.moe_ncclep_zero_copy:
        values["moe_ncclep_zero_copy"] = True
    for name in (
        "sequence_parallel",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "moe_permute_fusion_into_hybridep",
    ):
        if getattr(args, name):
            values[name] = True
    if getattr(args, LAYERS_PER_VIRTUAL_STAGE) is not None:
        values[LAYERS_PER_VIRTUAL_STAGE] = getattr(args, LAYERS_PER_VIRTUAL_STAGE)
    _check_types(values)
    tp = values.get("tensor_model_parallel_size")
    if "sequence_parallel" not in values and isinstance(tp, int) and tp > 1:
        if "tokens_per_rank" not in values:
            notes.append(
                "sequence_parallel not given: assumed on, T = seq x micro-batch / (TP x CP) "
                "(megatron's default is off, and warns with EP and TP: model_parallel_config.py"
                ":560-565)"
            )
    apply_deprecated(values, notes)
    _vpp_from_layers_per_stage(values)
    _ranks_per_node_from_env(values, notes)
    if args.bf16 or args.fp16:
        values["bf16"] = True
    elif args.config_file is None or "bf16" not in values:
        values["bf16"] = bool(values.get("fp16", False) or values.get("bf16", False))
    values.pop("fp16", None)
    for name in REQUIRED:
        if name not in values:
            raise ValueError(f"{FIELD_FLAGS[name]}: required")
    if "recompute_modules" in values and isinstance(values["recompute_modules"], list):
        values["recompute_modules"] = tuple(values["recompute_modules"])
    try:
        cfg = MoEMemoryConfig(**values)
    except ValueError as exc:
        field_name, _, rest = str(exc).partition(": ")
        raise ValueError(f"{FIELD_FLAGS.get(field_name, field_name)}: {rest}") from None
    if args.held_rows is not None and (
        cfg.moe_token_dispatcher_type != "flex" or cfg.moe_flex_dispatcher_backend != "hybridep"
    ):
        notes.append("--held-rows prices a HybridEP buffer's growth; not read for this backend")
    for note in notes if printed else ():
        _note(note)
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
        }.get(backend, f"deep_ep {d.get('deep_ep_source', 'hybrid-ep')} {d['deep_ep_commit'][:7]}")
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
    notes: List[str] = []
    try:
        cfg, as_json, held_rows = config_from_args(argv, notes)
        result = plan(cfg, held_rows)
    except ValueError as exc:
        field_name, sep, rest = str(exc).partition(": ")
        return _fail(
            f"{FIELD_FLAGS[field_name]}: {rest}" if field_name in FIELD_FLAGS else str(exc)
        )
    except SystemExit as exc:
        return int(exc.code or 0)
    for note in notes:
        _note(note)
    print(json.dumps(result, indent=1) if as_json else format_plan(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
