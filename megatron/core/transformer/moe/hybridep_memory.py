# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""HybridEP memory accounting: what the flex dispatcher's HybridEP backend will hold, predicted
from the model and parallel configuration, for planners that must price memory before it is
allocated (much of it outside PyTorch's allocator, where neither ``memory_allocated`` nor a
learned peak sees it).

* :func:`buffer_rows` / :func:`buffer_bytes`: DeepEP hybrid-ep's intranode buffer, by term.
  Rows per rank are ``max(T, 512)`` rounded up to the combine chunk (env
  ``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``, default 64); for ``N`` = rows x group size (ETP x EP)
  and ``E`` = the group's expert columns it holds BF16 tokens ``N*2H``, FP32 probabilities
  ``N*4E``, a routing-map byte per expert column ``N*E`` and FP32 scaling factors
  ``N*4*ceil(H/128)`` (allocated even without FP8); dispatch outputs alias the combine inputs.
* :func:`growth_bytes`: what a dispatch needing more rows than the held buffer allocates.
* :func:`per_call_bytes`: dispatch and combine outputs of one call (inside the allocator).
* :func:`expert_working_set`: routed rows and bytes reaching the local experts.
* :func:`recompute_combine_floor`: the BF16 ``[P, H]`` combine output a checkpoint recompute
  allocates at the restored communication extent ``P`` while an earlier, larger graph is live.
* :func:`measured_retained_bytes`: what a live dispatcher really holds (the retained-state
  probe), to compare with the prediction.

Only the intranode buffer is modelled; multi-node (RDMA) buffers are not. Imports only the
standard library (and, for :func:`measured_retained_bytes`, the probe).
"""

import math
import os
from dataclasses import dataclass
from typing import Dict, Optional

MIN_ROWS = 512
CHUNK_ENV = "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API"
DEFAULT_CHUNK = 64
BF16 = 2
FP32 = 4


@dataclass(frozen=True)
class HybridEPMemoryConfig:
    """The sizes HybridEP's memory depends on.

    Args:
        hidden: hidden size H.
        num_experts: routed experts of the model.
        topk: experts per token.
        ep: expert-model-parallel size.
        etp: expert tensor-parallel size (the HybridEP group is ETP x EP ranks).
        tokens_per_rank: tokens a rank dispatches per call (T).
        nodes: nodes the group spans; only 1 (intranode) is modelled.
        imbalance: routed rows a rank receives relative to balanced routing (1.0 = balanced;
            the worst case is ``ep``).
    """

    hidden: int
    num_experts: int
    topk: int
    ep: int
    tokens_per_rank: int
    etp: int = 1
    nodes: int = 1
    imbalance: float = 1.0

    def __post_init__(self):
        for name in ("hidden", "num_experts", "topk", "ep", "etp", "tokens_per_rank", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.imbalance > 0:
            raise ValueError(f"imbalance must be positive, got {self.imbalance!r}")
        if self.num_experts % (self.ep * self.etp):
            raise ValueError(
                f"ETP x EP = {self.etp} x {self.ep} must divide the {self.num_experts} experts"
            )
        if self.topk > self.num_experts:
            raise ValueError(f"topk {self.topk} exceeds the {self.num_experts} experts")
        if self.nodes != 1:
            raise ValueError("only intranode HybridEP (nodes=1) is modelled")

    @property
    def group_size(self) -> int:
        """Ranks in the HybridEP group (ETP x EP)."""
        return self.ep * self.etp

    @property
    def expert_columns(self) -> int:
        """The group's expert columns: each expert once per expert-tensor-parallel rank."""
        return self.num_experts * self.etp

    @property
    def local_experts(self) -> int:
        """Experts per EP rank."""
        return self.num_experts // self.ep


def combine_chunk() -> int:
    """Rows per combine chunk (``NUM_OF_TOKENS_PER_CHUNK_COMBINE_API``, default 64)."""
    return int(os.environ.get(CHUNK_ENV, DEFAULT_CHUNK))


def buffer_rows(tokens_per_rank: int, chunk: Optional[int] = None) -> int:
    """Rows per rank the buffer is sized for: ``max(T, 512)`` rounded up to the chunk."""
    chunk = chunk or combine_chunk()
    return math.ceil(max(tokens_per_rank, MIN_ROWS) / chunk) * chunk


def buffer_bytes(cfg: HybridEPMemoryConfig, rows: Optional[int] = None) -> Dict[str, int]:
    """The intranode buffer by term (``tokens``, ``probs``, ``routing_map``,
    ``scaling_factors``) and ``total``; ``rows`` per rank defaults to :func:`buffer_rows`."""
    rows = rows if rows is not None else buffer_rows(cfg.tokens_per_rank)
    n, h, e = rows * cfg.group_size, cfg.hidden, cfg.expert_columns
    terms = {
        "tokens": n * BF16 * h,
        "probs": n * FP32 * e,
        "routing_map": n * e,
        "scaling_factors": n * FP32 * math.ceil(h / 128),
    }
    terms["total"] = sum(terms.values())
    return terms


def growth_bytes(cfg: HybridEPMemoryConfig, held_rows: Optional[int]) -> Dict[str, object]:
    """What a call allocates for the buffer against one already held (``held_rows`` per rank;
    None: none held). The capacity only grows; a larger one is allocated at its full size.
    ``transient_peak`` is the most buffer memory alive at once while it is replaced: old + new
    where the old buffer stays referenced while the new one is allocated (upstream
    megatron-core), the new one alone where it is dropped first (this series)."""
    needed = buffer_rows(cfg.tokens_per_rank)
    grows = held_rows is None or held_rows < needed
    new = buffer_bytes(cfg, needed)["total"] if grows else 0
    old = buffer_bytes(cfg, held_rows)["total"] if held_rows else 0
    return {
        "needed_rows": needed,
        "held_rows": held_rows,
        "grows": grows,
        "growth_bytes": new,
        "transient_peak_holding_old": old + new if grows else old,
        "transient_peak_dropping_old": new if grows else old,
    }


def routed_rows(cfg: HybridEPMemoryConfig) -> int:
    """Token-expert rows a rank's local experts receive: ``T x topk`` with balanced routing
    (every rank receives as many pairs as it sends), times ``imbalance``."""
    return math.ceil(cfg.tokens_per_rank * cfg.topk * cfg.imbalance)


def per_call_bytes(cfg: HybridEPMemoryConfig, token_bytes: int = BF16) -> Dict[str, int]:
    """Allocator bytes of one dispatch and combine: the permuted tokens and FP32 probs the
    dispatch returns (one prob per routed row), its int64 tokens-per-expert, and the combine
    output ``[T, H]``; tokens of ``token_bytes`` each (BF16 unless given)."""
    rows = routed_rows(cfg)
    return {
        "dispatch_tokens": rows * cfg.hidden * token_bytes,
        "dispatch_probs": rows * FP32,
        "tokens_per_expert": cfg.local_experts * 8,
        "combine_output": cfg.tokens_per_rank * cfg.hidden * token_bytes,
    }


def expert_working_set(cfg: HybridEPMemoryConfig) -> Dict[str, int]:
    """Routed rows reaching the local experts and their BF16 input bytes: balanced, with the
    configured imbalance, and in the worst case (all of the group's routed pairs on one rank:
    ``ep`` x balanced)."""
    balanced = cfg.tokens_per_rank * cfg.topk
    rows = routed_rows(cfg)
    worst = balanced * cfg.ep
    h = cfg.hidden * BF16
    return {
        "balanced_rows": balanced,
        "rows": rows,
        "worst_rows": worst,
        "balanced_bytes": balanced * h,
        "bytes": rows * h,
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
