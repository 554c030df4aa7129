# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL EP's context and megatron's zero-copy buffers (the ``ncclep`` backend), at
``NCCL_EP_COMMIT``."""

from typing import List

from .sources import SRC
from .terms import HOST, OUTSIDE, Term, _a256, _cdiv, _up


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
