# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The sources the planner is read from: the deep_ep, DeepEP v2 and NCCL EP commits whose lines
each term cites, and the megatron-core module the retained-state terms cite.

``DEEP_EP_COMMIT`` is the head of deep_ep's ``hybrid-ep`` branch (HybridEP and DeepEP's normal
mode)."""

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

SRC = "megatron/core/transformer/moe/token_dispatcher.py"
