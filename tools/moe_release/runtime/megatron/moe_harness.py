# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Rank-side helpers: build megatron-core's real MoE pieces on CPU.

Everything here runs inside ranks spawned by :mod:`moe_release.runtime.ranks.launcher` (the deep_ep
emulation is installed before megatron is imported); the memory report and the tests build on it.
"""

from typing import Any, Dict, Optional

import torch

from moe_release import backends
from moe_release.runtime.cuda import placement
from moe_release.runtime.cuda.compat import (
    install_base_tree_shims,
    install_cpu_rng_shim,
    install_dtoh_stream_cpu_shim,
    install_router_buffers_cpu_shim,
    install_tensor_parallel_cpu_shim,
)


def init_megatron(
    ep: int,
    tp: int = 1,
    seed: int = 1234,
    pp: int = 1,
    vpp: Optional[int] = None,
    timeout_minutes: Optional[float] = None,
) -> Dict[str, object]:
    """Initialize parallel state (gloo groups) and the CPU shims; returns what was installed.

    With pipeline stages (``pp`` > 1) the pipeline p2p is checked by NCCL's matching rule
    (:mod:`moe_release.runtime.cuda.p2p_rules`). ``timeout_minutes`` is the groups' collective
    timeout
    (megatron's ``distributed_timeout_minutes``, default 30; the fault matrix uses seconds)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.core import parallel_state

    install_cpu_rng_shim()
    shims = install_base_tree_shims()
    install_tensor_parallel_cpu_shim()
    install_dtoh_stream_cpu_shim()
    install_router_buffers_cpu_shim()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        **({} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}),
    )
    model_parallel_cuda_manual_seed(seed)
    if pp > 1:
        from moe_release.runtime.cuda import p2p_rules

        p2p_rules.install()
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


def model_kwargs(backend: str) -> Dict[str, Any]:
    """What the backend's kernels take: bf16 payloads for DeepEP v2 and NCCL EP, hidden 256 for
    DeepEP v2's combine (a multiple of 256), and a receive capacity where the tree's NCCL EP
    manager has no eager mode (its config still has ``moe_ncclep_static_shape``)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    if backend not in backends.BF16_PAYLOADS:
        return {}
    out: Dict[str, Any] = {"dtype": torch.bfloat16}
    multiple = backends.get(backend).hidden_multiple
    if multiple > 1:
        out["hidden"] = multiple
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if backend == "ncclep" and "moe_ncclep_static_shape" in fields:
        out["moe_expert_rank_capacity_factor"] = 2.0
    return out


def gpt_moe_config(cfg: Dict, ep: int, **overrides):
    """The config of the report's and the overlap runs' GPTModel: the sizes in ``cfg``
    (experts, topk, hidden, ffn, layers, heads), the flex dispatcher with ``cfg['backend']``
    unless ``cfg['dispatcher']`` names another (with what the backend's kernels take:
    :func:`model_kwargs`; ``cfg['hidden']`` must already be a size they take), and the unfused
    local kernels."""
    backend = cfg.get("backend", "hybridep")
    dispatcher = cfg.get("dispatcher", "flex")
    if dispatcher != "flex":
        overrides.setdefault("moe_token_dispatcher_type", dispatcher)
    else:
        multiple = backends.get(backend).hidden_multiple
        if cfg["hidden"] % multiple:
            raise ValueError(f"{backend}: hidden {cfg['hidden']} is not a multiple of {multiple}")
        for key, value in model_kwargs(backend).items():
            if key != "hidden":
                overrides.setdefault(key, value)
    return moe_config(
        backend,
        ep,
        num_experts=cfg["experts"],
        topk=cfg["topk"],
        hidden=cfg["hidden"],
        ffn=cfg["ffn"],
        num_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **overrides,
    )


def gpt_model(config, cfg: Dict, spec, mtp_spec=None):
    """megatron-core's GPTModel with learned absolute positions, sized by ``cfg`` (vocab,
    seq); in bf16 where ``config.bf16`` (DeepEP v2 and NCCL EP take bf16 payloads only), cast
    as megatron-core's ``Float16Module`` casts the model it wraps (its inputs are token ids)."""
    from megatron.core.models.gpt import GPTModel

    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg["vocab"],
        max_sequence_length=max(cfg.get("seqs") or [cfg["seq"]]),
        position_embedding_type="learned_absolute",
        mtp_block_spec=mtp_spec,
    )
    return on_device(model.bfloat16() if config.bf16 else model)


def local_moe_submodules(num_experts: int):
    """The MoESubmodules of megatron-core's local (non-TE) GPT layer spec, on every tree: the
    ModuleSpec form where the submodules function is missing (0.16), the spec's own
    ``submodules`` before ``spec_utils.get_submodules`` (#3426, main 2026-03-24)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron.core.transformer import spec_utils

    if not hasattr(gpt_layer_specs, "get_gpt_layer_local_submodules"):
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, moe_grouped_gemm=False
        )
        return spec.submodules.mlp.submodules
    mlp = gpt_layer_specs.get_gpt_layer_local_submodules(
        num_experts=num_experts, moe_grouped_gemm=False
    ).mlp
    if not hasattr(spec_utils, "get_submodules"):
        return mlp.submodules
    return spec_utils.get_submodules(mlp)


def build_moe_layer(config, layer_number: int = 1):
    """megatron-core's MoELayer with SequentialMLP experts and the real TopKRouter."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    return on_device(spec(config=config, layer_number=layer_number))


def train_step(layer, tokens: int, seed: int) -> Dict[str, Any]:
    """Forward, backward and an SGD update of ``layer``; its output and gradients."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(world, tokens, layer.config.hidden_size, generator=gen)
    x = xs[rank].to(layer.config.params_dtype).view(tokens, 1, -1).requires_grad_()
    y, _ = layer(x)
    y.float().pow(2).sum().backward()
    out = {"y": y.detach().clone(), "x_grad": x.grad.clone(), "grads": {}}
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.grad is not None:
                out["grads"][name] = p.grad.clone()
                p -= 0.01 * p.grad.to(p.dtype)
            p.grad = None
    return out


class InputHolder(torch.nn.Module):
    """A model input held as a parameter (an embedding's output stands for it): what follows
    sees a graph output, and probes count the input as the model's own."""

    def __init__(self, x: torch.Tensor) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(x.clone())

    def forward(self) -> torch.Tensor:
        return self.x * 1.0


def on_device(module: torch.nn.Module) -> torch.nn.Module:
    """``module.cuda()`` under the placement rules (:mod:`runtime.cuda.placement`), as megatron's
    training loop and upstream's tests move a model built with ``use_cpu_initialization``:
    its parameters become device tensors. Without the rules the host module as it is."""
    return module.cuda() if placement.active() else module
