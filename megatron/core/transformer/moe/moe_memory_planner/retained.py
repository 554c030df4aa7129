# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The dispatcher state an unpatched megatron-core keeps between calls, per MoE layer: the
dispatchers' fields and the autograd graph their differentiable fields pin."""

import math
from dataclasses import dataclass
from typing import List, Optional

from .deepep import DEFAULT_DEEPEP_SMS
from .hybridep import hybridep_handle_terms
from .sources import SRC
from .terms import ALLOCATOR, BF16, FP32, HOST, INT32, INT64, Term

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
        permute_fusion: ``moe_permute_fusion``: the dispatchers permute with Transformer
            Engine's fused kernel, whose ``row_id_map`` ([rows, 2 x columns + 1] int32) they
            keep in place of the sorted indices.
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
    permute_fusion: bool = False

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


# Transformer Engine's fused permute (megatron's moe_utils.permute with fused=True) returns its
# row_id_map as the sorted indices: [tokens, 2 x experts + 1] int32 for a routing map
# (transformer_engine/pytorch/triton/permutation.py:52, make_row_id_map, at TE d0067d0).
TE_ROW_ID_MAP = "transformer_engine/pytorch/triton/permutation.py:52 (TE d0067d0)"


def _permutation_map(
    name: str, rows: int, tokens: int, columns: int, fused: bool, source: str
) -> Term:
    """The permutation map a dispatcher keeps (``name`` with its shape): the sorted indices,
    ``rows`` int64, or with ``moe_permute_fusion`` TE's row_id_map of the ``tokens`` x
    ``columns`` routing map, ``[tokens, 2 x columns + 1]`` int32."""
    if fused:
        base = name.split(" [", 1)[0]
        return Term(f"{base}: TE row_id_map [{tokens:,}, 2 x {columns} + 1] int32",
                    tokens * (2 * columns + 1) * INT32, ALLOCATOR, source,
                    f"moe_permute_fusion: {TE_ROW_ID_MAP}")  # fmt: skip
    return Term(name, rows * INT64, ALLOCATOR, source)


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
            _permutation_map("reversed_mapping_for_combine [P] int64", p, r, lx,
                             s.permute_fusion, f"{where}.get_permuted_hidden_states_by_experts"),
        ]  # fmt: skip
    elif dispatcher == "alltoall":
        where = f"{SRC} MoEAlltoAllTokenDispatcher"
        terms = [
            Term("probs [T, E]", t * e * pb, ALLOCATOR, f"{where}.dispatch_preprocess"),
            Term("routing_map [T, E] bool", t * e, ALLOCATOR, f"{where}.dispatch_preprocess"),
            Term("num_global_tokens_per_local_expert [G, L] int64", g * lx * INT64, ALLOCATOR,
                 f"{where}.preprocess"),
            _permutation_map("reversed_local_input_permutation_mapping [T x k] int64", t * k, t,
                             e, s.permute_fusion, f"{where}.dispatch_preprocess"),
        ]  # fmt: skip
    elif dispatcher == "allgather":
        where = f"{SRC} MoEAllGatherTokenDispatcher"
        terms = [
            Term("local_map [T x G, L] bool", t * g * lx, ALLOCATOR, f"{where}.token_dispatch"),
            Term("local_probs [P]", p * pb, ALLOCATOR, f"{where}.token_dispatch"),
            _permutation_map("reversed_local_input_permutation_mapping [P] int64", p, t * g, lx,
                             s.permute_fusion, f"{where}.dispatch_postprocess"),
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
