# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The dispatcher state an unpatched megatron-core keeps between calls, per MoE layer: the
dispatchers' fields and the autograd graph their differentiable fields pin."""

import math
from dataclasses import dataclass
from typing import List, Optional

from .deepep import DEFAULT_DEEPEP_SMS, NUM_MAX_NVL_PEERS, SOURCE_META_BYTES
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
        return self.expected_tokens_reaching(self.local_experts, self.group)

    @property
    def expected_rdma_received_tokens(self) -> int:
        """DeepEP across nodes: tokens a rank receives over RDMA for its node (its
        ``num_rdma_recv_tokens``, csrc/kernels/internode.cu:200-210), the tokens of the G / 8
        ranks of its GPU index, one per node, that pick at least one of the node's 8 x L
        experts, under uniform top-k routing."""
        nvl = NUM_MAX_NVL_PEERS
        return self.expected_tokens_reaching(nvl * self.local_experts, self.group // nvl)

    def expected_tokens_reaching(self, columns: int, senders: int) -> int:
        """Tokens ``senders`` ranks of T tokens each send to ``columns`` of the routing map's
        columns: T x senders x P(a token picks at least one of them) under uniform top-k
        routing."""
        e, lx, k = self.experts, columns, self.topk
        if k <= 64:
            miss = math.comb(e - lx, k) / math.comb(e, k)
        elif e - lx < k:
            miss = 0.0
        else:  # the same ratio through lgamma: comb of a large top-k would take too long
            lg = math.lgamma
            miss = math.exp(lg(e - lx + 1) - lg(e - lx - k + 1) - lg(e + 1) + lg(e - k + 1))
        return math.ceil(self.tokens * senders * (1 - miss))


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
    layer of a rank but the last). With recompute every layer's graph ends at its own leaf.
    DeepEP's handle is the one its dispatch returns: intranode up to 8 ranks, the 10 tensors
    of the internode dispatch past them (:func:`deepep_internode_handle_terms`)."""
    s = shape
    if s.recompute != "none" or dispatcher != "flex":
        return []
    if backend == "hybridep":
        return [Term("combine ctx: num_permuted_tokens (0-d int64)", INT64, ALLOCATOR,
                     "megatron/core/transformer/moe/fused_a2a.py HybridEPCombine")]  # fmt: skip
    if s.group > NUM_MAX_NVL_PEERS:
        return deepep_internode_handle_terms(s)
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


# Where deep_ep (DEEP_EP_COMMIT) allocates the internode dispatch's handle: csrc/deep_ep.cpp,
# Buffer::get_dispatch_layout (is_token_in_rank) and Buffer::internode_dispatch; the tuple is
# deep_ep/buffer.py:589-592 (the same 10 tensors at DEEP_EP_MAIN_COMMIT, buffers/legacy.py:500).
_INTERNODE_HANDLE = "deep_ep.cpp:{} (Buffer.internode_dispatch's handle, buffer.py:589-592)"


def deepep_internode_handle_terms(shape: LayerShape) -> List[Term]:
    """The handle DeepEP's internode dispatch returns (G > 8 ranks, N = G / 8 RDMA ranks), which
    FusedCombine's ``ctx`` keeps (``fused_a2a.py:186``): with C channels, T tokens, R tokens
    received (:attr:`LayerShape.expected_received_tokens`) and R_rdma received over RDMA for the
    node (:attr:`LayerShape.expected_rdma_received_tokens`): is_token_in_rank [T, G] bool,
    rdma_channel_prefix_matrix and recv_rdma_channel_prefix_matrix [N, C] int32,
    gbl_channel_prefix_matrix and recv_gbl_channel_prefix_matrix [G, C] int32,
    recv_rdma_rank_prefix_sum [N] and recv_gbl_rank_prefix_sum [G] int32, recv_src_meta [R, 8]
    uint8 (``SourceMeta``), send_rdma_head [T, N] int32 and send_nvl_head [R_rdma, 8] int32."""
    s = shape
    g, c, t = s.group, s.channels, s.tokens
    n, nvl = g // NUM_MAX_NVL_PEERS, NUM_MAX_NVL_PEERS
    r, rr = s.expected_received_tokens, s.expected_rdma_received_tokens

    def term(name: str, nbytes: int, line: int, note: str = "") -> Term:
        return Term(f"handle: {name}", nbytes, ALLOCATOR, _INTERNODE_HANDLE.format(line), note)

    return [
        term("is_token_in_rank [T, G] bool", t * g, 394),
        term("rdma_channel_prefix_matrix [N, C] int32", n * c * INT32, 948),
        term("gbl_channel_prefix_matrix [G, C] int32", g * c * INT32, 950),
        term("recv_rdma_channel_prefix_matrix [N, C] int32", n * c * INT32, 1006),
        term("recv_rdma_rank_prefix_sum [N] int32", n * INT32, 949),
        term("recv_gbl_channel_prefix_matrix [G, C] int32", g * c * INT32, 1007),
        term("recv_gbl_rank_prefix_sum [G] int32", g * INT32, 951),
        term("recv_src_meta [R, 8] uint8", r * SOURCE_META_BYTES, 1005,
             "SourceMeta, csrc/kernels/internode.cu:40-42"),
        term("send_rdma_head [T, N] int32", t * n * INT32, 1008),
        term("send_nvl_head [R_rdma, 8] int32", rr * nvl * INT32, 1009,
             "R_rdma: the tokens this rank receives over RDMA for its node"),
    ]  # fmt: skip
