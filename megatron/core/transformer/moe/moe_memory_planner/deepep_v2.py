# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""DeepEP v2's ``ElasticBuffer`` (megatron dev's ``deepepv2`` backend), at
``DEEP_EP_V2_COMMIT``."""

from typing import List

from .terms import HOST, OUTSIDE, Term, _a32, _cdiv

# DeepEP v2: layout::WorkspaceLayout::get_num_bytes() (deep_ep/include/deep_ep/common/
# layout.cuh:43-81): barrier signals, notify reduction, scale-up/out rank and expert counters
# for 1024 ranks and 2048 experts, 1024 x 1024 channel metadata and tails, PP and AGRS signals.
DEEPEP_V2_WORKSPACE = 12_820_544


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
