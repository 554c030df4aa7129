# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""What NCCL EP allocates for TE's configuration: the handle memory and the group context,
worked from nccl-extensions' source (the package docstring cites each term)."""

from __future__ import annotations

from typing import Dict, List, Optional

# The TE commits of the three APIs (module docstring).
TE_COMMITS = {
    "4329ff8": "4329ff84bfbdaa778a33cba02a15fb0807c64689",
    "622a3ee": "622a3eea1",
    "d0067d0": "d0067d0da6cb01811b8072a7d304f0e00344ce2b",
}
NCCL_EP_COMMIT = "9f47d6eb"  # nccl-extensions, the NCCL EP kernels TE d0067d0 pins

# SMs of the device the placement rules describe (an H100): NCCL EP sizes its scan scratch by it.
DEVICE_SMS = 132
# Prepared handles kept, by handle_mem address (TE's cache of NCCL EP handles is an LRU).
HANDLE_CACHE = 1024


def _a256(n: int) -> int:
    return (n + 255) // 256 * 256


def handle_mem_terms(
    max_tokens: int,
    max_recv_tokens: int,
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    zero_copy: bool = False,
    device_sms: int = DEVICE_SMS,
) -> List[tuple]:
    """``(name, bytes)`` of one ``EpBuffer.handle_mem``, in order: NCCL EP's
    ``HtBlockLayout::compute`` for one NVLink domain and the expert-major layout
    (``nccl_ep.cc:2397-2471``; the local-permute mode without zero-copy, local-dup with it,
    ``nccl_ep.cc:1885-1906``): the routing and rank masks, the local-expert routing map, the scan
    scratch (8 bytes per block and rank, ``ht_ep_adapter.cu:641-647``), the dense probabilities,
    the cached top-k indices, the per-expert tables and the permute scratch, each rounded up to
    256."""
    m, mr, r, k = max_tokens, max_recv_tokens, num_ranks, num_topk
    local = num_experts // r
    permute = not zero_copy
    terms = [
        ("r2a", _a256((m + 15) // 16 * 16)),  # bool, one node
        ("ler", _a256(mr * local)),  # bool
        ("ntfe", _a256(4)),
        ("s2d", _a256(m * (r if permute else k) * 4)),
        ("rank_mask", _a256(m * r * ((r + 63) // 64) * 8)),
        ("scan_tmp", _a256(device_sms * r * 8)),
        ("prob", _a256(m * num_experts * 4)),  # dense probabilities, one node
        ("topk_idx", _a256(m * k * 8)),  # the cached top-k indices
        ("pec_active", _a256(local * 4)),
        ("eto", _a256((local + 1) * 8)),
    ]
    if zero_copy:  # local-dup fan-out groups
        terms += [("emuf_group_buf", _a256(mr // 2 * min(k, local) * 4)), ("emuf_count", _a256(4))]
    else:  # local-permute scratch
        terms += [("flat2em", _a256(mr * k * 4)), ("recv_topk_weights_flat", _a256(mr * k * 4)),
                  ("token_to_recv_slot", _a256(m * r * 4))]  # fmt: skip
    return terms


def handle_mem_size(*args, **kwargs) -> int:
    """Bytes of one ``EpBuffer.handle_mem`` (:func:`handle_mem_terms`, same arguments)."""
    return sum(n for _, n in handle_mem_terms(*args, **kwargs))


# NCCL EP's group workspace (``NUM_WORKSPACE_BYTES``, nccl_ep include/common.hpp:19) and its
# counter block (``kCounterBlockBytes``, nccl_ep.cc:1102-1128).
WORKSPACE_BYTES = 32 * 1024 * 1024
COUNTER_BLOCK_BYTES = 32
# What ncclEpCreateGroup leaks on one NVLink domain (a device communicator ncclEpGroupDestroy
# never destroys, nccl_ep.cc:1280-1297, 1515): one cuMem granule, 2 MiB on Hopper (a driver
# property; the struct copy beside it, sizeof(ncclDevComm_t), is not modelled).
LEAKED_PER_GROUP_BYTES = 2 * 1024 * 1024


# GPUs of one LSA team (NVLink domain) on the node the placement rules describe: an 8-GPU H100
# node; ``emulation_common.node_layout`` caps the emulated node at it.
LSA_RANKS_PER_NODE = 8
# The cross-LSA-team chunk (``HT_TOKENS_PER_CHUNK_RDMA_DEFAULT``, nccl_ep include/common.hpp:32,
# chosen when the rail team has more than one rank, nccl_ep.cc:1929-1946) and the GIN buffer's
# region alignment (``GIN_ALIGNMENT``, nccl_ep.cc:1306).
HT_TOKENS_PER_CHUNK_RDMA = 64
GIN_ALIGNMENT = 4096


def _a4096(n: int) -> int:
    return (n + GIN_ALIGNMENT - 1) // GIN_ALIGNMENT * GIN_ALIGNMENT


def gin_buffer_terms(
    num_ranks: int,
    lsa_ranks: int,
    num_experts: int,
    max_tokens: int,
    hidden: int,
    token_bytes: int = 2,
) -> List[tuple]:
    """``(name, bytes)`` of the GIN buffer ``init_ht_internode`` allocates with one
    ``ncclMemAlloc`` when the rail team has ``D = R / L > 1`` ranks (nccl_ep.cc:1300-1358), in
    its order; each region rounded up to 4096. ``M'`` is ``max_tokens`` rounded up to the 64-token
    chunk (``ht_aligned_max_tokens``, nccl_ep.cc:1945), ``B`` the token bytes, ``P = E_l x L x 4``
    the bytes of one token's probabilities over the LSA team's experts."""
    d, m, b = num_ranks // lsa_ranks, max_tokens, hidden * token_bytes
    local = num_experts // num_ranks
    chunk = HT_TOKENS_PER_CHUNK_RDMA
    ht_m = -(-m // chunk) * chunk
    p = local * lsa_ranks * 4
    chunks = -(-ht_m // chunk)
    return [
        ("combine_gin_RED_tokens", _a4096(ht_m * (d - 1) * b)),
        ("combine_gin_G2S_tokens", _a4096(ht_m * (d - 1) * b)),
        ("combine_gin_RED_prob", _a4096(ht_m * (d - 1) * p)),
        ("combine_gin_G2S_prob", _a4096(ht_m * (d - 1) * p)),
        ("dispatch_gin_G2S_flags", _a4096((d - 1) * chunks * 8)),
        ("combine_gin_G2S_flags", _a4096((d - 1) * chunks * 8)),
        ("dispatch guard", _a4096(d * 8)),
        ("combine guard", _a4096(d * 8)),
        ("token_staging", _a4096(m * b)),
        ("dense_prob", _a4096(m * num_experts * 4)),
        ("rdma_send_staging", _a4096((d - 1) * m * (b + p))),
        ("rdma_recv_packed", _a4096((d - 1) * m * (b + p))),
    ]


def context_bytes(
    num_ranks: int,
    num_experts: int,
    max_tokens: int,
    max_recv_tokens: int,
    hidden: int,
    zero_copy: bool = False,
    token_bytes: int = 2,
    lsa_ranks: Optional[int] = None,
) -> Dict[str, int]:
    """What ``ncclEpCreateGroup`` allocates for TE's configuration (HT, one NVLink domain,
    expert-major; nccl_ep.cc:1013-1248, 1900-1963) and ``ncclEpGroupDestroy`` frees, by kind:
    ``device`` (the 32 MiB workspace, the counter block, the all-gathered routing map
    ``R x M x ceil(E / 8)``, and the symmetric "mega" buffer: dispatch and combine token staging
    ``a256(M x R x B)`` each (none with zero-copy), their probabilities ``a256(MR x E x 4)`` each
    and the scale region ``a256(MR x B)``, allocated even for bf16, plus the 8-byte completion
    flags) and ``pinned`` (the mapped host pointer block, ``40 x R``); ``leaked``, what destroy
    does not free. Requested sizes: NCCL's cuMem granule rounding is not modelled.

    ``lsa_ranks`` (default: all ``R``, one NVLink domain) is the LSA team's size ``L``; across
    teams (``D = R / L > 1``) the probability regions hold the team's experts (``E_l x L``,
    nccl_ep.cc:1026-1028), the host pointer block ``40 x L`` (nccl_ep.cc:1072-1075), the routing
    map a byte-padded block per team (``R x M x ceil(E_l x L / 8) x D``, nccl_ep.cc:1950-1962),
    and ``gin`` (that key across teams only) is the GIN buffer (:func:`gin_buffer_terms`); nothing
    leaks then:
    ``destroy_ht_internode`` destroys the device communicator (nccl_ep.cc:1514-1564)."""
    r, m, mr, e = num_ranks, max_tokens, max_recv_tokens, num_experts
    lsa = r if lsa_ranks is None else lsa_ranks
    teams, local = r // lsa, e // r
    b = hidden * token_bytes
    tokens = 0 if zero_copy else 2 * _a256(m * r * b)
    mega = tokens + 2 * _a256(mr * local * lsa * 4) + _a256(mr * b)
    routing = r * m * ((local * lsa + 7) // 8) * teams
    device = WORKSPACE_BYTES + COUNTER_BLOCK_BYTES + routing + mega + 8
    if teams == 1:
        return {"device": device, "pinned": 40 * lsa, "leaked": LEAKED_PER_GROUP_BYTES}
    gin = sum(n for _, n in gin_buffer_terms(r, lsa, e, m, hidden, token_bytes))
    return {"device": device, "pinned": 40 * lsa, "leaked": 0, "gin": gin}
