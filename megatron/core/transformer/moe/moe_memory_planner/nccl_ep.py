# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL EP's context and megatron's zero-copy buffers (the ``ncclep`` backend), at
``NCCL_EP_COMMIT``."""

from typing import List, Optional

from .sources import SRC
from .terms import ALLOCATOR, HOST, OUTSIDE, Term, _a256, _cdiv, _up

# Who holds the routing handle after megatron drops its EpBuffer at combine (main
# token_dispatcher.py:1788): TransformerEngine's dispatch and combine save it for their
# backward (TRANSFORMER_ENGINE_COMMIT, transformer_engine/pytorch/ep.py:554, 639).
NCCL_EP_HANDLE_HELD_BY = (
    "held by: the layer's forward until its backward (TE pytorch/ep.py:554,639 "
    "save_for_backward; megatron drops its EpBuffer at combine, token_dispatcher.py:1788)"
)


def nccl_ep_capacity(tokens_per_rank: int, topk: int, capacity_factor: float, alignment: int = 0):
    """``(M, MR)``: the tokens per rank NCCL EP is bootstrapped for (rounded up to 64) and the
    receive capacity (``M x top-k x capacity factor``, rounded up to the alignment), as
    megatron's ``_NCCLEPManager._ensure_bootstrap`` sizes them."""
    m = _up(tokens_per_rank, 64)
    mr = int(m * topk * capacity_factor)
    return m, (_up(mr, alignment) if alignment else mr)


# NCCL EP's documented ceiling on tokens per rank (include/common.hpp:26, RELEASE.md:19); no
# host-side check enforces it at NCCL_EP_COMMIT.
NCCL_EP_MAX_TOKENS_PER_RANK = 8192
# The RDMA chunk of the high-throughput kernels across NVLink domains
# (HT_TOKENS_PER_CHUNK_RDMA_DEFAULT, include/common.hpp:31; nccl_ep.cc:1929-1945).
NCCL_EP_RDMA_CHUNK = 64
# The SMs of an H100 or H200 SXM: the routing handle's scan scratch is sized for the device's
# SM count (nccl_ep.cc:2426-2429).
NCCL_EP_DEFAULT_SMS = 132


def _a4k(n: int) -> int:
    return _up(n, 4096)  # GIN_ALIGNMENT (nccl_ep.cc:1306-1307)


def nccl_ep_gin_bytes(
    group_size: int, ranks_per_node: int, num_experts: int, max_tokens: int, hidden: int
) -> int:
    """The GIN buffer NCCL EP allocates across N = R / L NVLink domains of L ranks
    (``init_ht_internode``, one ``ncclMemAlloc``, nccl_ep.cc:1300-1358); 0 in one domain. With
    T = M rounded up to the 64-token RDMA chunk, B = 2 H (bf16) and Ed = L x E / R the experts
    of one domain: combine tokens and probabilities reduced and gathered ``2 a4k(T (N-1) B) +
    2 a4k(T (N-1) Ed 4)``, flags and guards ``2 a4k((N-1) ceil(T / 64) 8) + 2 a4k(8 N)``, token
    staging ``a4k(M B)``, the dense probabilities of all E experts ``a4k(M E 4)``, and RDMA send
    and receive ``2 a4k((N-1) M (B + 4 Ed))``."""
    r, m, e, b = group_size, max_tokens, num_experts, 2 * hidden
    lsa = min(r, ranks_per_node)
    n = r // lsa
    if n <= 1:
        return 0
    ed = lsa * (e // r)
    t = _up(m, NCCL_EP_RDMA_CHUNK)
    return (
        2 * _a4k(t * (n - 1) * b)
        + 2 * _a4k(t * (n - 1) * ed * 4)
        + 2 * _a4k((n - 1) * _cdiv(t, NCCL_EP_RDMA_CHUNK) * 8)
        + 2 * _a4k(n * 8)
        + _a4k(m * b)
        + _a4k(m * e * 4)
        + 2 * _a4k((n - 1) * m * (b + ed * 4))
    )


def nccl_ep_handle_bytes(
    group_size: int,
    ranks_per_node: int,
    num_experts: int,
    max_tokens: int,
    recv_capacity: int,
    topk: int,
    zero_copy: bool = False,
    sms: int = NCCL_EP_DEFAULT_SMS,
) -> int:
    """One MoE layer's routing handle (``HtBlockLayout::compute``, nccl_ep.cc:2397-2464),
    allocated by TransformerEngine as a torch tensor per ``EpBuffer`` (pytorch/ep.py:301-302)
    and kept by its dispatch and combine for backward (:data:`NCCL_EP_HANDLE_HELD_BY`):
    expert-major layout, local permute without zero-copy, local (one domain) or NVLink
    (across domains) duplication with it (nccl_ep.cc:1889-1906)."""
    r, m, mr, e, k = group_size, max_tokens, recv_capacity, num_experts, topk
    lsa = min(r, ranks_per_node)
    n = r // lsa
    le = e // r
    permute = not zero_copy
    local_dup = zero_copy and n == 1
    a = _a256
    return (
        a(n * _up(m, 16))  # r2a
        + (a(m * (n - 1)) if n > 1 else 0)  # a2r
        + a(mr * le)  # ler
        + a(4)  # ntfe
        + a(n * m * (lsa if permute else k) * 4)  # s2d
        + a(n * m * lsa * _cdiv(lsa, 64) * 8)  # rank mask (ht_ep_adapter.cu:645-647)
        + a(sms * lsa * 8)  # scan scratch (ht_ep_adapter.cu:641-643)
        + (a(m * e * 4) if n == 1 else 0)  # dense probabilities: the GIN buffer's across domains
        + a(m * k * 8)  # top-k indices
        + a(le * 4)  # per-expert counts
        + a((le + 1) * 8)  # expert offsets
        + (a((mr // 2) * min(k, le) * 4) + 256 if local_dup else 0)  # local fan-out groups
        + (2 * a(mr * k * 4) + a(m * lsa * n * 4) if permute else 0)  # permute scratch
    )


def nccl_ep_terms(
    group_size: int,
    num_experts: int,
    max_tokens: int,
    recv_capacity: int,
    hidden: int,
    zero_copy: bool = False,
    ranks_per_node: Optional[int] = None,
    topk: Optional[int] = None,
    sms: int = NCCL_EP_DEFAULT_SMS,
) -> List[Term]:
    """One rank's NCCL EP context (``ncclEpCreateGroup`` for TransformerEngine's configuration:
    high throughput, expert-major) and, with zero-copy, megatron's two persistent symmetric
    buffers; ``max_tokens`` (M) and ``recv_capacity`` (MR) as :func:`nccl_ep_capacity` gives
    them, bf16 payloads (B = 2 x hidden). ``ranks_per_node`` (L, NCCL's load/store team: the
    NVLink domain; None: the whole group) sizes what NCCL EP lays out per domain: the
    probabilities hold the L x E / R experts of one domain (nccl_ep.cc:1011-1028), and across
    N = R / L domains a GIN buffer (:func:`nccl_ep_gin_bytes`). With ``topk``, the routing
    handle each MoE layer holds from its forward until its backward (``in_flight``, priced per
    layer in flight: :func:`nccl_ep_handle_bytes`, at ``sms`` SMs). Sources at
    ``NCCL_EP_COMMIT``, ``nccl_ep/nccl_ep.cc``."""
    r, m, mr, e, b = group_size, max_tokens, recv_capacity, num_experts, 2 * hidden
    lsa = r if ranks_per_node is None else min(r, ranks_per_node)
    n = r // lsa
    ed = lsa * (e // r)  # the experts of one NVLink domain
    mega = "ncclMemAlloc: intranode buffer (nccl_ep.cc:1044)"
    terms = [
        Term("workspace", 32 * 1024 * 1024, OUTSIDE, "nccl_ep.cc:1910-1911",
             "NUM_WORKSPACE_BYTES, include/common.hpp:19"),
        Term("counter block", 32, OUTSIDE, "nccl_ep.cc:1102-1128"),
        Term("all-gathered routing map", r * m * _cdiv(ed, 8) * n, OUTSIDE,
             "nccl_ep.cc:1953-1963", "a byte-padded block per NVLink domain"),
    ]  # fmt: skip
    if not zero_copy:
        terms.append(Term("dispatch and combine token staging", 2 * _a256(m * r * b), OUTSIDE,
                          "nccl_ep.cc:1013-1045", "symmetric window", alloc=mega))  # fmt: skip
    terms += [
        Term("dispatch and combine probabilities", 2 * _a256(mr * ed * 4), OUTSIDE,
             "nccl_ep.cc:1026-1028", "the experts of one NVLink domain", alloc=mega),
        Term("scale region", _a256(mr * b), OUTSIDE, "nccl_ep.cc:1032-1038",
             "allocated for bf16 too", alloc=mega),
        Term("completion flags", 8, OUTSIDE, "nccl_ep.cc:1089-1091",
             alloc="ncclMemAlloc: completion flags (nccl_ep.cc:1089-1091)"),
        Term("host pointer block (mapped)", 40 * lsa, HOST, "nccl_ep.cc:1072-1075"),
    ]  # fmt: skip
    if n > 1:
        terms.append(Term(f"GIN buffer ({n} domains x {lsa} ranks)",
                          nccl_ep_gin_bytes(r, lsa, e, m, hidden), OUTSIDE,
                          "nccl_ep.cc:1300-1358", "across NVLink domains; freed at destroy "
                          "(nccl_ep.cc:2064)", alloc="ncclMemAlloc: GIN buffer "
                          "(nccl_ep.cc:1358)"))  # fmt: skip
    else:
        terms.append(Term("device communicator, never freed (not priced)", 0, OUTSIDE,
                          "nccl_ep.cc:1282-1297", "one NVLink domain: NCCL-internal bytes; "
                          "never released, the destroy at nccl_ep.cc:2064 runs across domains "
                          "only", released=False))  # fmt: skip
    if zero_copy:
        terms.append(Term("zero-copy buffers (fc2 output, fc1 dgrad) [MR, H] bf16 x 2",
                          2 * mr * b, OUTSIDE, f"{SRC} _NCCLEPManager._ensure_bootstrap",
                          "torch symmetric memory on the EP group"))  # fmt: skip
    if topk is not None:
        handle = nccl_ep_handle_bytes(r, lsa, e, m, mr, topk, zero_copy, sms)
        terms.append(Term(f"routing handle, per MoE layer in flight ({sms} SMs)", handle,
                          ALLOCATOR, "nccl_ep.cc:2397-2464", NCCL_EP_HANDLE_HELD_BY,
                          in_flight=True))  # fmt: skip
    return terms
