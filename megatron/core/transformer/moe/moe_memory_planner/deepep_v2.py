# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""DeepEP v2's ``ElasticBuffer`` (megatron dev's ``deepepv2`` backend), at
``DEEP_EP_V2_COMMIT``."""

from typing import List, Optional

from .terms import HOST, OUTSIDE, Term, _a32, _cdiv

# DeepEP v2: layout::WorkspaceLayout::get_num_bytes() (deep_ep/include/deep_ep/common/
# layout.cuh:43-81): barrier signals, notify reduction, scale-up/out rank and expert counters
# for 1024 ranks and 2048 experts, 1024 x 1024 channel metadata and tails, PP and AGRS signals.
DEEPEP_V2_WORKSPACE = 12_820_544


# ElasticBuffer::kNumMaxChannels = 8 channels per SM x 160 SMs (csrc/elastic/buffer.hpp:56-58):
# the hybrid layout's scale-out buffers hold N + 1280 tokens per domain, the host's bound on
# channels x ceil(N / channels).
DEEPEP_V2_MAX_CHANNELS = 1280


def deepep_v2_buffer_terms(
    group_size: int,
    tokens_per_rank: int,
    hidden: int,
    topk: int,
    fp8: bool = False,
    ranks_per_node: Optional[int] = None,
) -> List[Term]:
    """One rank's DeepEP v2 ``ElasticBuffer`` as megatron dev's ``get_elastic_buffer`` builds it
    (``num_max_tokens_per_rank`` = the call's tokens N; hybrid mode and multiple reduction on,
    the defaults megatron keeps): the NCCL symmetric window of the workspace and the data buffer
    ``get_buffer_size_hint`` sizes, and the mapped pinned host workspace. Tokens: ``Bd =
    a32(H x elem) + a32(4 x sf) + a32(12 K + 4)`` dispatched, ``Bc = a32(2 H) + a32(8 K)``
    combined (layout.cuh:195-208). In one NVLink domain (``ranks_per_node`` None or at least the
    group R): ``max(R x N x Bd, min(R, K) x N x Bc)`` (buffer.hpp:537-543, 566-576). Across
    O = R / U domains of U ranks (the hybrid layout, buffer.hpp:544-556, 577-592):
    ``max(Bd x (U O N + N + O (N + 1280)), Bc x (min(U, K) O N + min(O, K) N + O (N + 1280)))``.
    DeepEP takes U from NCCL's load/store team (csrc/kernels/backend/nccl.cu:53-62), which is
    the NVLink domain. Sources at ``DEEP_EP_V2_COMMIT``, under ``csrc/`` and
    ``deep_ep/include/``."""
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
    bd = _a32(hidden * elem) + _a32(4 * sf) + _a32(12 * k + 4)
    bc = _a32(2 * hidden) + _a32(8 * k)
    n, r = tokens_per_rank, group_size
    u = r if ranks_per_node is None else min(r, ranks_per_node)
    o = r // u
    if o == 1:
        dispatch, combine = r * n * bd, min(r, k) * n * bc
        name, source = "symmetric window: data buffer", "buffer.hpp:595-629"
        note = "get_buffer_size_hint; dispatch and combine tokens (layout.cuh:180-209)"
    else:
        ch = DEEPEP_V2_MAX_CHANNELS
        dispatch = bd * (u * o * n + n + o * (n + ch))
        combine = bc * (min(u, k) * o * n + min(o, k) * n + o * (n + ch))
        name = f"symmetric window: data buffer ({o} domains x {u} ranks)"
        source = "buffer.hpp:544-591"
        note = (
            "hybrid layout: scale-up receive, scale-out send and receive (N + 1280 tokens per "
            "domain, buffer.hpp:56-58)"
        )
    data = max(dispatch, combine)
    window = "ncclMemAlloc: symmetric window (nccl.cu:124)"
    return [
        Term(name, data, OUTSIDE, source, note, alloc=window),
        Term("symmetric window: workspace", DEEPEP_V2_WORKSPACE, OUTSIDE, "layout.cuh:43-81",
             "ncclMemAlloc of workspace + data (buffer.hpp:100-114)", alloc=window),
        Term("host workspace (mapped)", DEEPEP_V2_WORKSPACE, HOST, "buffer.hpp:118-120"),
    ]  # fmt: skip


def deepep_v2_refusal(
    group_size: int, num_experts: int, ranks_per_node: int, topk: int, hidden: int
) -> Optional[str]:
    """Why DeepEP v2 refuses this group, as ``field: reason (source line)``; None if it accepts
    it. ``num_experts`` are those of the whole dispatcher group (TP x EP, megatron dev's
    ``_DeepepV2Manager``); ``ranks_per_node`` is the NVLink domain."""
    r, e = group_size, num_experts
    u = min(r, ranks_per_node)
    o = r // u
    if e % r:
        return (
            f"num_moe_experts: DeepEP v2 needs the {e} experts to divide over {r} ranks "
            "(layout.cuh:37)"
        )
    if r > 1024:
        return (
            f"expert_model_parallel_size: DeepEP v2 takes at most 1024 ranks, got {r} "
            "(layout.cuh:38)"
        )
    if e > 2048:
        return f"num_moe_experts: DeepEP v2 takes at most 2048 experts, got {e} (layout.cuh:39)"
    if e // r > 256:
        return (
            f"num_moe_experts: DeepEP v2 takes at most 256 experts per rank, got {e // r} "
            "(layout.cuh:40)"
        )
    if hidden % 256:
        return (
            f"hidden_size: DeepEP v2's combine needs a multiple of 256, got {hidden} "
            "(combine.cuh:109, hybrid_combine.cuh:219)"
        )
    if o > 1:
        if (topk or 32) > 32:
            return (
                f"moe_router_topk: DeepEP v2's kernels take top-k <= 32, got {topk} "
                "(hybrid_dispatch.cuh:120)"
            )
        if o > 32:
            return (
                f"ranks_per_node: DeepEP v2's hybrid kernels take at most 32 NVLink domains, "
                f"got {o} (hybrid_dispatch.cuh:331)"
            )
        if u > 64:
            return (
                f"ranks_per_node: DeepEP v2's hybrid kernels take at most 64 ranks per "
                f"domain, got {u} (hybrid_dispatch.cuh:598)"
            )
        if u + e // r > 128:
            return (
                f"num_moe_experts: DeepEP v2's hybrid dispatch needs ranks per domain + "
                f"experts per rank <= 128, got {u} + {e // r} (hybrid_dispatch.cuh:260-261)"
            )
    return None
