# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The sources the planner is read from: the deep_ep, DeepEP v2, TransformerEngine and NCCL EP
commits whose lines each term cites (:data:`MODELLED_COMMITS`), and the megatron-core module
the retained-state terms cite.

``DEEP_EP_COMMIT`` is the head of deep_ep's ``hybrid-ep`` branch (HybridEP and DeepEP's normal
mode). megatron's own pins differ (docs/planner.md, "The commits modelled"): main's CI image
pins DeepEP ``de0dd11`` and TransformerEngine ``4329ff8``, dev's DeepEP ``eb9cee7`` and
TransformerEngine ``f031cf8``."""

DEEP_EP_COMMIT = "94a9f8f6b146c07d97ec58f67cd6d303296d6098"
# DeepEP main (2.1.0): normal-mode DeepEP only (no HybridEP); its dispatch and combine configs
# differ from the hybrid-ep branch's (other RDMA chunk sizes, EP 48 and 96 accepted).
DEEP_EP_MAIN_COMMIT = "dd758caf451848bd150e1046af3d0a73e5fff38d"
DEEP_EP_SOURCES = {"hybrid-ep": DEEP_EP_COMMIT, "main": DEEP_EP_MAIN_COMMIT}
# DeepEP v2 (ElasticBuffer, megatron dev's 'deepepv2'): the epv2-release branch.
DEEP_EP_V2_COMMIT = "018f21ea62c6c2888d9b46806aad6d90b399b23d"
# TransformerEngine: the NCCL EP API (pytorch/ep.py: EpBuffer, the routing handle its dispatch
# and combine save for backward) and the fused permute's row_id_map.
TRANSFORMER_ENGINE_COMMIT = "d0067d0da6cb01811b8072a7d304f0e00344ce2b"
# NCCL EP (TransformerEngine's NCCL EP API, the 'ncclep' backend): nccl-extensions, as pinned by
# TransformerEngine d0067d0 (3rdparty/nccl-extensions).
NCCL_EP_COMMIT = "9f47d6eb3b60962d8157a579b4caaaa4ae6b19f4"
# Every library the planner models, by name, and the commit it was read at.
MODELLED_COMMITS = {
    "deep_ep hybrid-ep": DEEP_EP_COMMIT,
    "deep_ep main": DEEP_EP_MAIN_COMMIT,
    "DeepEP v2 epv2-release": DEEP_EP_V2_COMMIT,
    "TransformerEngine": TRANSFORMER_ENGINE_COMMIT,
    "NCCL EP nccl-extensions": NCCL_EP_COMMIT,
}

SRC = "megatron/core/transformer/moe/token_dispatcher.py"
