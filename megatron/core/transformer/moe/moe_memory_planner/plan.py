# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""A configuration's plan: the per-call layer shape, the flex backend's buffer terms and what
its kernels refuse, HybridEP's growth, per-call and expert working-set bytes."""

import math
from typing import Dict, List, Optional

from .config import MoEMemoryConfig
from .deepep import DEEPEP_SOURCE, DEFAULT_DEEPEP_SMS, NUM_MAX_NVL_PEERS, deepep_buffer_terms
from .deepep_v2 import deepep_v2_buffer_terms, deepep_v2_refusal
from .hybridep import (
    CHUNK_ENV,
    HybridEPLayout,
    env_chunk,
    hybridep_buffer_terms,
    hybridep_refusal,
    hybridep_rows,
    hybridep_rows_after,
)
from .nccl_ep import NCCL_EP_MAX_TOKENS_PER_RANK, nccl_ep_capacity, nccl_ep_terms
from .retained import LayerShape
from .sources import DEEP_EP_V2_COMMIT
from .terms import BF16, FP32, INT64, OUTSIDE, Term, total


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
        permute_fusion=cfg.moe_permute_fusion,
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
                                      cfg.moe_router_topk,
                                      ranks_per_node=cfg.ranks_per_node)  # fmt: skip
    if cfg.moe_flex_dispatcher_backend == "ncclep":
        m, mr = nccl_ep_capacity(
            cfg.tokens, cfg.moe_router_topk, cfg.moe_expert_rank_capacity_factor or 1.0
        )
        if cfg.moe_expert_rank_capacity_factor is None:  # eager (main): MR = R x M x top-k
            mr = cfg.group_size * m * cfg.moe_router_topk
        return nccl_ep_terms(cfg.group_size, cfg.num_moe_experts, m, mr, cfg.hidden_size,
                             cfg.moe_ncclep_zero_copy, cfg.ranks_per_node,
                             cfg.moe_router_topk)  # fmt: skip
    if cfg.moe_flex_dispatcher_backend == "deepep":
        sms = cfg.moe_flex_dispatcher_num_sms or DEFAULT_DEEPEP_SMS
        # fused_a2a.get_hidden_bytes: H x max(element size, 2).
        hidden_bytes = cfg.hidden_size * max(BF16 if cfg.bf16 else FP32, 2)
        try:
            # DeepEP's node is its 8 NVLink peers (NUM_MAX_NVL_PEERS, also on an NVL72 rack),
            # or a smaller ranks_per_node (the CPU runtime's scaled-down nodes).
            peers = min(cfg.ranks_per_node, NUM_MAX_NVL_PEERS)
            return deepep_buffer_terms(hidden_bytes, cfg.group_size, sms, cfg.deep_ep, peers)
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
    backend = cfg.moe_flex_dispatcher_backend
    if backend in ("deepep", "deepepv2", "ncclep") and cfg.group_size < 2:
        name = {"deepep": "DeepEP", "deepepv2": "DeepEP v2", "ncclep": "NCCL EP"}[backend]
        at = {
            "deepep": "token_dispatcher.py:1770",
            "deepepv2": "dev token_dispatcher.py:1896",
            "ncclep": "token_dispatcher.py:1788; TransformerEngine pytorch/ep.py:138-139",
        }
        return (f"expert_model_parallel_size: the {name} dispatcher requires ETP x EP > 1, got "
                f"{cfg.group_size} ({at[backend]})")  # fmt: skip
    if backend == "deepepv2":
        return deepep_v2_refusal(cfg.group_size, cfg.num_moe_experts * cfg.etp,
                                 cfg.ranks_per_node, cfg.moe_router_topk,
                                 cfg.hidden_size)  # fmt: skip
    if backend == "ncclep" and 2 * cfg.hidden_size % 16:
        return (
            f"hidden_size: NCCL EP's high-throughput kernels need a token row of 2 x "
            f"{cfg.hidden_size} bytes to be a multiple of 16 (nccl_ep.cc:1634-1641)"
        )
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


def kernel_warnings(cfg: MoEMemoryConfig) -> List[str]:
    """What ``cfg``'s flex backend documents as a limit but does not enforce, one line each
    (``field: what (source line)``): NCCL EP's 8,192 tokens per rank."""
    if cfg.moe_token_dispatcher_type != "flex":
        return []
    out = []
    if cfg.moe_flex_dispatcher_backend == "ncclep" and cfg.tokens > NCCL_EP_MAX_TOKENS_PER_RANK:
        out.append(
            f"tokens_per_rank: NCCL EP documents at most {NCCL_EP_MAX_TOKENS_PER_RANK:,} tokens "
            f"per rank, got {cfg.tokens:,}; nothing checks it at the pinned commit "
            "(include/common.hpp:26, RELEASE.md:19), priced as given"
        )
    return out


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
