# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""Measure a stack of megatron-core's real MoE layers, for real or in the production-shape mode.

:func:`measure` runs on every rank of a job (:func:`run` launches it over gloo, without the
placement rules: they key storages by data pointer, which fake storages lack, so the real twin
runs without them too): it builds the layers, runs one forward and backward on the routing the
policy chose, and returns the live-bytes trace per op, the peak and what is still alive once
the step's inputs, outputs and gradients are dropped (``retained``), with the communication
buffers' share of it (``buffers``) and the rest (``state``: what the dispatchers and their
autograd graphs keep).
"""

import gc
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from moe_release import settings
from moe_release.runtime.shapes.production_shape import (
    LiveBytes,
    ProductionShapeMode,
    RealRun,
    Routing,
    bytes_of,
    routing_policy,
)

MODES = ("real", "fake")


def layer_config(
    dispatcher: str,
    backend: Optional[str],
    ep: int,
    hidden: int,
    experts: int,
    topk: int,
    ffn: int,
    num_layers: int,
    recompute: bool = False,
    dtype: str = "float32",
    tp: int = 1,
):
    """The TransformerConfig of the measured layers: :func:`moe_harness.moe_config`
    (local, non-TE modules, fp32 router, no auxiliary loss) with the flex dispatcher on
    ``backend``, or ``alltoall``/``allgather``; ``recompute`` is ``moe_layer_recompute``."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_release.runtime.megatron.moe_harness import moe_config

    fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    overrides: Dict[str, Any] = dict(num_attention_heads=4, moe_layer_recompute=recompute)
    if dispatcher != "flex":
        overrides["moe_token_dispatcher_type"] = dispatcher
        backend = fields["moe_flex_dispatcher_backend"].default  # unused off the flex dispatcher
    if tp > 1:
        overrides.update(tensor_model_parallel_size=tp, sequence_parallel=True)
    if dispatcher == "flex" and backend == "ncclep" and "moe_ncclep_static_shape" in fields:
        overrides["moe_expert_rank_capacity_factor"] = 2.0
    return moe_config(backend, ep, num_experts=experts, topk=topk, hidden=hidden, ffn=ffn,
                      dtype=getattr(torch, dtype), num_layers=num_layers,
                      **overrides)  # fmt: skip


def _comm_buffer_tensors() -> List[torch.Tensor]:
    """The tensors of fused_a2a's communication buffers (the emulations' allocations: held by
    the buffer object, or by its ``runtime`` as DeepEP v2's window and host workspace)."""
    import sys

    from moe_release.runtime.cuda.compat import held_comm_buffers

    fused_a2a = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused_a2a is None:
        return []
    out = []
    for buffer in held_comm_buffers(fused_a2a):
        runtime = getattr(buffer, "runtime", None)
        for obj in (buffer, runtime) if runtime is not None else (buffer,):
            for value in vars(obj).values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
    return out


def measure(
    mode: str,
    dispatcher: str,
    backend: Optional[str],
    ep: int,
    tokens: Union[int, Sequence[int]],
    hidden: int = 16,
    experts: int = 4,
    topk: int = 2,
    ffn: int = 32,
    layers: int = 2,
    recompute: bool = False,
    dtype: str = "float32",
    routing: Optional[Dict[str, Any]] = None,
    trace: bool = True,
    record: bool = False,
    mis_size: Optional[tuple] = None,
    sites: bool = False,
) -> Dict[str, Any]:
    """One forward and backward of ``layers`` MoE layers on this rank (``tokens``: per rank, or
    one count for all), ``mode`` "real" or "fake" (the production-shape mode). Bytes are
    measured from just before the input is made."""
    import time

    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from moe_release.runtime.cuda import placement
    from moe_release.runtime.megatron.moe_harness import (
        init_megatron,
        local_moe_submodules,
        on_device,
    )

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if placement.active():
        raise RuntimeError("measure runs without the placement rules (run() launches it so)")
    start = time.monotonic()
    init_megatron(ep=ep, seed=1234)
    torch.manual_seed(4321)
    rank = dist.get_rank()
    n = tokens if isinstance(tokens, int) else tokens[rank]
    config = layer_config(dispatcher, backend, ep, hidden, experts, topk, ffn, layers, recompute,
                          dtype)  # fmt: skip
    policy = None if record else routing_policy(routing or {"kind": "balanced"})
    route = Routing(policy, experts, topk, rank)
    counter = LiveBytes()
    counter.sites = [] if sites else None
    if mode == "real":
        ctx = RealRun(route, counter, record=record)
    else:
        ctx = ProductionShapeMode(route, counter, mis_size=tuple(mis_size) if mis_size else None)
    result: Dict[str, Any] = {"rank": rank, "tokens": n}
    with ctx:
        stack = []
        for i in range(layers):
            layer = on_device(MoELayer(config, local_moe_submodules(experts)))
            layer.set_layer_number(i + 1)
            layer.train()
            stack.append(layer)
        route.attach([layer.router for layer in stack])
        params = counter.live()
        counter.recording = True
        baseline = counter.live()
        x = torch.randn(n, 1, hidden, dtype=config.params_dtype).requires_grad_()
        h = x
        for layer in stack:
            h, _ = layer(h)
        loss = (h.float() ** 2).sum()
        loss.backward()
        counter.recording = False
        del x, h, loss
        for layer in stack:
            layer.zero_grad(set_to_none=True)
        gc.collect()
        live = counter.live()
        buffers = bytes_of(_comm_buffer_tensors())
    result.update(
        params=params,
        retained=live - baseline,
        buffers=buffers,
        state=live - baseline - buffers,
        peak=max(counter.peak - baseline, 0),
        trace=counter.trace if trace else None,
        sites=counter.sites,
        seconds=time.monotonic() - start,
    )
    if record:
        result["recorded"] = dict(route.recorded)
    return result


def run(tree: str, world_size: int, timeout: float = 600.0, **kwargs) -> List[Dict[str, Any]]:
    """:func:`measure` on ``world_size`` gloo ranks of ``tree`` (parent side), placement rules
    off; returns each rank's result."""
    from moe_release.runtime.ranks.launcher import run_distributed

    with settings.override("MOE_RELEASE_PLACEMENT", "0"):
        return run_distributed(f"{__name__}:measure", world_size, tree, kwargs, timeout)


# ---------------------------------------------------------------------------------------------
# A decoder stack between calls (the report's production-shape section)


def stack_config(
    ep: int,
    hidden: int,
    experts: int,
    topk: int,
    ffn: int,
    layers: int,
    backend: str = "hybridep",
    dtype: str = "bfloat16",
):
    """The config of :func:`measure_calls`' decoder: the flex dispatcher with ``backend``, RMSNorm,
    the MoE layer recomputed (``recompute_granularity='selective', recompute_modules=['moe']``),
    local (non-TE) modules."""
    from moe_release.runtime.megatron.moe_harness import moe_config

    return moe_config(backend, ep, num_experts=experts, topk=topk, hidden=hidden, ffn=ffn,
                      recompute=True, dtype=getattr(torch, dtype), num_layers=layers,
                      normalization="RMSNorm")  # fmt: skip


def _mlp_only_layer_spec(experts: int):
    """megatron-core's local GPT layer spec with its attention left out (IdentityOp, the
    TransformerLayerSubmodules default that MLP-only layers use): RMSNorm, then the MoE layer."""
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")  # fmt: skip
    spec.submodules = dataclasses.replace(
        spec.submodules,
        input_layernorm=IdentityOp,
        self_attention=IdentityOp,
        self_attn_bda=IdentityFuncOp,
    )
    return spec


def _state_attributes(dispatcher) -> List[tuple]:
    """``(owner, name)`` of every attribute of ``dispatcher`` and its comm manager that holds
    a tensor (alone or in a tuple or list, as a dispatch handle): what the layer's next
    dispatch replaces. The communication buffers are module globals of fused_a2a, not
    attributes."""
    found = []
    for obj in (dispatcher, getattr(dispatcher, "_comm_manager", None)):
        if obj is None:
            continue
        for name, value in vars(obj).items():
            items = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) for v in items):
                found.append((obj, name))
    return found


def measure_calls(
    tokens: Union[int, Sequence[int]],
    ep: int = 2,
    hidden: int = 16,
    experts: int = 4,
    topk: int = 2,
    ffn: int = 32,
    layers: int = 2,
    calls: int = 2,
    backend: str = "hybridep",
    dtype: str = "bfloat16",
    mode: str = "fake",
    routing: Optional[Dict[str, Any]] = None,
    peak_origins: bool = False,
) -> Dict[str, Any]:
    """``calls`` forward-backward calls of a decoder of ``layers`` TransformerLayers (megatron's
    TransformerBlock, its layers' attention left out, the MoE layer recomputed) on this rank.

    Returns, in live bytes (:class:`LiveBytes`): ``params`` (after construction), per call the
    peak of the call (``peaks``, the held bytes included) and what is held after it once the
    input, output and gradients are dropped (``held``), ``buffers`` (the communication
    buffers), and ``per_layer``: what dropping each layer's dispatcher state frees after the
    last call, layer by layer, and per attribute in the order dropped
    (``per_attribute``; :func:`_state_attributes`). With ``peak_origins``, per call what was
    alive at its peak by the call and megatron-core function that made it
    (``peak_origins``, :meth:`LiveBytes.peak_origins`; they sum to the peak) and the op that
    reached it (``peak_sites``)."""
    import time

    import torch.distributed as dist
    from megatron.core.transformer.transformer_block import TransformerBlock

    from moe_release.runtime.cuda import placement
    from moe_release.runtime.megatron.moe_harness import init_megatron

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}")
    if placement.active():
        raise RuntimeError("measure_calls runs without the placement rules (run_calls does)")
    start = time.monotonic()
    init_megatron(ep=ep, seed=1234)
    torch.manual_seed(4321)
    rank = dist.get_rank()
    n = tokens if isinstance(tokens, int) else tokens[rank]
    config = stack_config(ep, hidden, experts, topk, ffn, layers, backend, dtype)
    route = Routing(routing_policy(routing or {"kind": "balanced"}), experts, topk, rank)
    counter = LiveBytes()
    ctx = RealRun(route, counter) if mode == "real" else ProductionShapeMode(route, counter)
    result: Dict[str, Any] = {"rank": rank, "tokens": n, "held": [], "peaks": [], "seconds": []}
    with ctx:
        block = TransformerBlock(config, _mlp_only_layer_spec(experts))
        block.train()
        moe = [layer.mlp for layer in block.layers]
        route.attach([m.router for m in moe])
        result["params"] = counter.live()
        if peak_origins:
            counter.follow_peak()
            counter.context = lambda: f"MoE layer {route.layer}'s router ran last"
            result["peak_origins"], result["peak_sites"] = [], []
        for call in range(calls):
            t0 = time.monotonic()
            counter.call = call
            counter.reset_peak()
            counter.recording = True
            x = torch.randn(n, 1, hidden, dtype=config.params_dtype).requires_grad_()
            out = block(x, attention_mask=None)
            loss = (out.float() ** 2).sum()
            loss.backward()
            counter.recording = False
            del x, out, loss
            block.zero_grad(set_to_none=True)
            gc.collect()
            result["held"].append(counter.live())
            result["peaks"].append(counter.peak)
            if peak_origins:
                origins = counter.peak_origins()
                if sum(origins.values()) != counter.peak:
                    raise AssertionError(f"peak {counter.peak:,} but {sum(origins.values()):,} "
                                         "alive at it")  # fmt: skip
                result["peak_origins"].append(origins)
                result["peak_sites"].append(counter.peak_site)
            result["seconds"].append(time.monotonic() - t0)
        result["buffers"] = bytes_of(_comm_buffer_tensors())
        per_layer, per_attr = [], []
        before = counter.live()
        for m in moe:
            freed = {}
            for owner, name in _state_attributes(m.token_dispatcher):
                setattr(owner, name, None)
                gc.collect()
                after = counter.live()
                freed[f"{type(owner).__name__}.{name}"] = before - after
                before = after
            per_layer.append(sum(freed.values()))
            per_attr.append(freed)
        result["per_layer"] = per_layer
        result["per_attribute"] = per_attr
        result["after_drop"] = before
        result["buffers_after_drop"] = bytes_of(_comm_buffer_tensors())
    result["total_seconds"] = time.monotonic() - start
    return result


def run_calls(tree: str, world_size: int, timeout: float = 1800.0, **kwargs) -> List[Dict]:
    """:func:`measure_calls` on ``world_size`` gloo ranks of ``tree`` (parent side), placement
    rules off; returns each rank's result."""
    from moe_release.runtime.ranks.launcher import run_distributed

    return run_distributed(f"{__name__}:measure_calls", world_size, tree,
                           kwargs, timeout, placement=False)  # fmt: skip
