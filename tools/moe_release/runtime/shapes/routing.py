# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The routing of the production-shape mode: which expert each token goes to, without running
the router on values the mode does not hold (balanced, random, or recorded from a real run)."""

from typing import Any, Dict, Optional, Sequence, Tuple

import torch

aten = torch.ops.aten


class Refused(RuntimeError):
    """The mode cannot follow an op without guessing a value or a size."""


# ---------------------------------------------------------------------------------------------
# Routing


class RoutingPolicy:
    """Which experts each token of a rank's layer call goes to: ``[num_tokens, topk]`` int64."""

    def indices(self, rank: int, layer: int, num_tokens: int, num_experts: int, topk: int):
        raise NotImplementedError

    def describe(self) -> str:
        return type(self).__name__


class BalancedRouting(RoutingPolicy):
    """Token ``t`` of rank ``r`` goes to experts ``(t*k + j + r*k) mod E``, ``j < k``: every
    expert receives the same number of tokens when ``N*k`` is a multiple of ``E``."""

    def indices(self, rank: int, layer: int, num_tokens: int, num_experts: int, topk: int):
        t = torch.arange(num_tokens, dtype=torch.int64).unsqueeze(1) * topk
        return (t + torch.arange(topk, dtype=torch.int64) + rank * topk) % num_experts

    def describe(self) -> str:
        return "balanced"


class RandomRouting(RoutingPolicy):
    """The top-k of uniform scores drawn from a generator seeded by (seed, rank, layer)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def indices(self, rank: int, layer: int, num_tokens: int, num_experts: int, topk: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + layer)
        scores = torch.rand(num_tokens, num_experts, generator=g)
        return scores.topk(topk, dim=1).indices

    def describe(self) -> str:
        return f"random(seed={self.seed})"


class RecordedRouting(RoutingPolicy):
    """Indices recorded from a real run (:class:`RealRun`, ``record=True``), by (rank, layer)."""

    def __init__(self, recorded: Dict[Tuple[int, int], torch.Tensor]) -> None:
        self.recorded = recorded

    def indices(self, rank: int, layer: int, num_tokens: int, num_experts: int, topk: int):
        idx = self.recorded.get((rank, layer))
        if idx is None or tuple(idx.shape) != (num_tokens, topk):
            raise Refused(
                f"no recorded routing of shape [{num_tokens}, {topk}] for rank {rank}, layer "
                f"{layer} (recorded: {sorted(self.recorded)})"
            )
        return idx.clone()

    def describe(self) -> str:
        return f"recorded({len(self.recorded)} layer calls)"


def routing_policy(spec: Dict[str, Any]) -> RoutingPolicy:
    """A policy from plain data: ``{"kind": "balanced"}``, ``{"kind": "random", "seed": 3}``,
    ``{"kind": "recorded", "indices": {(rank, layer): tensor}}``."""
    kind = spec.get("kind")
    if kind == "balanced":
        return BalancedRouting()
    if kind == "random":
        return RandomRouting(int(spec["seed"]))
    if kind == "recorded":
        return RecordedRouting(dict(spec["indices"]))
    raise ValueError(f"unknown routing policy {spec!r}")


class Routing:
    """Where the policy enters the program: ``aten.topk`` over the experts (last dim
    ``num_experts``, ``k == topk``) returns the policy's indices for the layer whose router ran
    last (:meth:`attach` hooks the routers), and values gathered at them. That is the router's
    top-k and the top-k by which the DeepEP and NCCL EP managers turn the routing map back into
    indices; the order of a token's experts is the policy's, not by score."""

    def __init__(
        self, policy: Optional[RoutingPolicy], num_experts: int, topk: int, rank: int
    ) -> None:
        self.policy = policy
        self.num_experts = num_experts
        self.topk = topk
        self.rank = rank
        self.layer: Optional[int] = None
        self.recorded: Dict[Tuple[int, int], torch.Tensor] = {}

    def attach(self, routers: Sequence[torch.nn.Module]) -> None:
        """Note each router's layer before its forward (recompute included)."""

        def hook(module, args):
            self.layer = int(getattr(module, "layer_number", 0) or 0)

        for router in routers:
            router.register_forward_pre_hook(hook)

    def applies(self, func, args, kwargs) -> bool:
        if func is not aten.topk.default or self.layer is None:
            return False
        x, k = args[0], args[1]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        return k == self.topk and x.dim() == 2 and dim in (-1, 1) and x.shape[1] == self.num_experts

    def indices(self, num_tokens: int) -> torch.Tensor:
        idx = self.policy.indices(self.rank, self.layer, num_tokens, self.num_experts, self.topk)
        if tuple(idx.shape) != (num_tokens, self.topk) or idx.dtype != torch.int64:
            raise Refused(
                f"routing policy {self.policy.describe()} returned {idx.shape} {idx.dtype}"
            )
        return idx.contiguous()
