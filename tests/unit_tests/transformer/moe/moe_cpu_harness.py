# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Rank-side test helpers: seeded weights and a dense oracle for megatron-core's real MoE layer.

Everything here runs inside ranks spawned by ``moe_release.runtime.ranks.launcher`` (the deep_ep
emulation is installed before megatron is imported; ``moe_release.runtime.megatron.moe_harness``
builds the layer). The oracle is written from the math, not from megatron: a dense single-process
MoE over all ranks' tokens, with each rank's router copy kept separate so per-rank router gradients
compare one to one.
"""

import contextlib
from typing import List, Optional

import torch
import torch.nn.functional as F

from moe_release import settings


@contextlib.contextmanager
def capturing(module, calls: Optional[list] = None):
    """While the block runs, ``module`` (megatron's token_dispatcher or fused_a2a) sees a CUDA
    stream capture in progress: its ``torch.cuda.is_available()`` and
    ``is_current_stream_capturing()`` answer True (each query of the latter appended to
    ``calls``); the rest of megatron keeps the CPU runtime's view."""
    real = module.torch

    class Cuda:
        def __getattr__(self, name):
            return getattr(real.cuda, name)

        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_current_stream_capturing():
            if calls is not None:
                calls.append(1)
            return True

    class TorchView:
        cuda = Cuda()

        def __getattr__(self, name):
            return getattr(real, name)

    module.torch = TorchView()
    try:
        yield
    finally:
        module.torch = real


def seeded(shape, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """The same tensor on every rank."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def global_expert_weights(config, seed: int = 7):
    """fc1/fc2 weights of every global expert (identical on every rank)."""
    h, f = config.hidden_size, config.moe_ffn_hidden_size
    w1 = [
        seeded((f, h), seed + 2 * e, config.params_dtype, h**-0.5)
        for e in range(config.num_moe_experts)
    ]
    w2 = [
        seeded((h, f), seed + 2 * e + 1, config.params_dtype, f**-0.5)
        for e in range(config.num_moe_experts)
    ]
    return w1, w2


def load_layer_weights(layer, config, seed: int = 7) -> None:
    """Overwrite the layer's router and local experts with the shared seeded weights."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    w1, w2 = global_expert_weights(config, seed)
    with torch.no_grad():
        layer.router.weight.copy_(
            seeded(tuple(layer.router.weight.shape), seed - 1, layer.router.weight.dtype)
        )
        for i, expert in enumerate(layer.experts.local_experts):
            expert.linear_fc1.weight.copy_(w1[ep_rank * local + i])
            expert.linear_fc2.weight.copy_(w2[ep_rank * local + i])


class DenseOracle:
    """Dense reference MoE over the tokens of all ``world`` ranks.

    Routing: logits = x @ Wr^T in fp32, top-k on logits, softmax over the k scores (megatron's
    default "softmax" score function without pre-softmax). Expert: fc2(gelu(fc1(x)) * prob).
    A token's output is summed in float32 over local experts ascending and then over ranks
    ascending, which is the order the dispatcher's combine documents.
    """

    def __init__(self, config, world: int, router_weight: torch.Tensor, seed: int = 7):
        self.config = config
        self.world = world
        self.local = config.num_moe_experts // world
        self.router = [router_weight.detach().clone().requires_grad_() for _ in range(world)]
        w1, w2 = global_expert_weights(config, seed)
        self.w1 = [w.clone().requires_grad_() for w in w1]
        self.w2 = [w.clone().requires_grad_() for w in w2]

    def route(self, x: torch.Tensor, r: int):
        logits = F.linear(x.float(), self.router[r].float())
        scores, idx = torch.topk(logits, self.config.moe_router_topk, dim=1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        dense = torch.zeros_like(logits).scatter(1, idx, probs)
        routing = torch.zeros_like(logits, dtype=torch.bool).scatter(1, idx, True)
        return dense, routing

    def forward(self, xs: List[torch.Tensor], routes=None) -> List[torch.Tensor]:
        """``xs[r]`` is rank r's [N, H] input; returns every rank's [N, H] output."""
        routes = routes or [self.route(x, r) for r, x in enumerate(xs)]
        n = xs[0].shape[0]
        dtype = xs[0].dtype
        outs = [torch.zeros(n, xs[0].shape[1], dtype=torch.float32) for _ in xs]
        # Per destination rank, each token's partial sum over that rank's experts.
        for d in range(self.world):
            partial = [torch.zeros(n, xs[0].shape[1], dtype=torch.float32) for _ in xs]
            for e in range(d * self.local, (d + 1) * self.local):
                rows = [torch.nonzero(routes[r][1][:, e]).flatten() for r in range(len(xs))]
                inp = torch.cat([xs[r][rows[r]] for r in range(len(xs))])
                prob = torch.cat([routes[r][0][rows[r], e] for r in range(len(xs))])
                h = F.gelu(F.linear(inp, self.w1[e]))
                h = (h * prob.unsqueeze(-1)).to(dtype)
                y = F.linear(h, self.w2[e])
                start = 0
                for r in range(len(xs)):
                    k = len(rows[r])
                    partial[r] = partial[r].index_add(0, rows[r], y[start : start + k].float())
                    start += k
            for r in range(len(xs)):
                outs[r] = outs[r] + partial[r].to(dtype).float()
        return [o.to(dtype) for o in outs]


def env_tree() -> str:
    return settings.tree(required=True)


def summarize(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().clone()
