# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Rank-side helpers: build megatron-core's real MoE pieces on CPU and a dense oracle.

Everything here runs inside ranks spawned by ``tests.unit_tests.dist_utils`` (the deep_ep
emulation is installed before megatron is imported). The oracle is written from the math, not
from megatron: a dense single-process MoE over all ranks' tokens, with each rank's router copy
kept separate so per-rank router gradients compare one to one.
"""

import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from tests.unit_tests.cpu_compat import install_base_tree_shims, install_cpu_rng_shim


def init_megatron(ep: int, tp: int = 1, seed: int = 1234) -> Dict[str, object]:
    """Initialize parallel state (gloo groups) and the CPU shims; returns what was installed."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.core import parallel_state

    install_cpu_rng_shim()
    shims = install_base_tree_shims()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep
    )
    model_parallel_cuda_manual_seed(seed)
    return {"shims": shims}


def moe_config(
    backend: str,
    ep: int,
    num_experts: int = 8,
    topk: int = 2,
    hidden: int = 16,
    ffn: int = 32,
    recompute: bool = False,
    dtype: torch.dtype = torch.float32,
    num_layers: int = 1,
    **overrides,
):
    """A small TransformerConfig for the flex dispatcher on CPU (local, non-TE modules)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=1,
        ffn_hidden_size=ffn,
        moe_ffn_hidden_size=ffn,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend=backend,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if recompute:
        kwargs.update(recompute_granularity="selective", recompute_modules=["moe"])
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_moe_layer(config, layer_number: int = 1):
    """megatron-core's MoELayer with SequentialMLP experts and the real TopKRouter."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    return spec(config=config, layer_number=layer_number)


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
    return os.environ["MOE_RELEASE_TREE"]


def summarize(t: Optional[torch.Tensor]):
    return None if t is None else t.detach().clone()
