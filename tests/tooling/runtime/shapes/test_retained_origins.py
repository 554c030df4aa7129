# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The retained bytes split by origin (``moe_release.runtime.shapes.retained_origins``).

In this process on plain torch: each kind of holder is named and the terms sum to the retained
bytes, real and in the production-shape mode. On gloo ranks at small shapes: megatron-core's MoE
layers (base 0.19.2, unpatched: the dispatchers keep their state) give the same terms real and in
the production-shape mode, summing to the retained bytes, and the dispatcher fields the planner
prices have the planner's sizes.
"""

import functools

import pytest
import torch

from moe_release.runtime.shapes.production_shape import (
    LiveBytes,
    ProductionShapeMode,
    RealRun,
    Routing,
)
from moe_release.runtime.shapes.retained_origins import origins


class _KeepInCtx(torch.autograd.Function):
    """Keeps a tensor as a ctx attribute (not saved for backward): it outlives backward."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.kept = kept
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class _Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("counts", torch.zeros(3, dtype=torch.int64))


def _split(mode: str):
    route = Routing(None, num_experts=4, topk=2, rank=0)
    counter = LiveBytes()
    ctx = RealRun(route, counter) if mode == "real" else ProductionShapeMode(route, counter)
    elsewhere = []
    with ctx:
        weight = torch.ones(4)
        before = {k: s.nbytes() for k, s in counter.keyed().items()}
        baseline = counter.live()
        holder = _Holder()
        leaf = torch.ones(8, 4).requires_grad_()  # a leaf the graph keeps, with its .grad
        out = _KeepInCtx.apply(leaf * weight, torch.arange(5))
        holder.out = out  # a field with a graph behind it
        holder.splits = torch.arange(6).clone().numpy()
        elsewhere.append(torch.arange(7) + 1)  # held by a list nothing measured reaches
        out.sum().backward()
        del out
        result = origins(counter, before, [holder])
        retained = counter.live() - baseline
    return result, retained


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_each_holder_is_named_and_the_terms_sum_to_the_retained_bytes(mode):
    result, retained = _split(mode)
    assert result["total"] == retained == sum(t["bytes"] for t in result["terms"])
    terms = {}
    for t in result["terms"]:
        terms[t["kind"], t["holder"]] = terms.get((t["kind"], t["holder"]), 0) + t["bytes"]
    f32, i64 = 4, 8
    assert terms == {
        ("attribute", "_Holder.out"): 8 * 4 * f32,
        ("module buffer", "_Holder.counts"): 3 * i64,
        ("numpy array", "_Holder.splits"): 6 * i64,
        ("autograd ctx", "_KeepInCtxBackward.kept"): 5 * i64,
        ("graph leaf", "AccumulateGrad.variable"): 8 * 4 * f32,
        ("graph leaf", "AccumulateGrad.variable.grad"): 8 * 4 * f32,
        ("unreached", "held by list"): 7 * i64,
    }, terms
    via = {t["holder"]: t["via"] for t in result["terms"]}
    assert via["_KeepInCtxBackward.kept"] == "_Holder.out"


# ---------------------------------------------------------------------------------------------
# megatron-core's MoE layers on gloo ranks (base 0.19.2: the state the series releases)

SMALL = dict(ep=2, tokens=16, layers=2, hidden=16, experts=4, topk=2)
T, E, K, G, L = 16, 4, 2, 2, 2  # tokens per rank, experts, top-k, EP group, local experts


@functools.cache
def _run(tree, dispatcher, backend, mode, recompute=False):
    from moe_release.runtime.shapes.retained_origins import run_origins

    return run_origins(
        tree, 2, mode=mode, dispatcher=dispatcher, backend=backend, recompute=recompute, **SMALL
    )


def _terms(result):
    return sorted(
        (t["root"], t["kind"], t["holder"], t["via"], t["made_by"], t["bytes"])
        for t in result["origins"]["terms"]
    )


@pytest.mark.parametrize(
    "dispatcher,backend,recompute",
    [("alltoall", None, False), ("flex", "hybridep", False), ("alltoall", None, True)],
    ids=["alltoall", "hybridep", "alltoall-recompute"],
)
def test_same_terms_real_and_production_shape(base_tree, dispatcher, backend, recompute):
    """(With the MoE layer recomputed, the all-to-all dispatcher's split sizes are read with
    ``numpy()`` inside backward, where no torch function mode sees the call.)"""
    real = _run(base_tree, dispatcher, backend, "real", recompute)
    fake = _run(base_tree, dispatcher, backend, "fake", recompute)
    for r, f in zip(real, fake):
        for run in (r, f):
            assert run["origins"]["total"] == run["retained"] > 0
            assert run["origins"]["before_changed"] == 0
        assert _terms(r) == _terms(f)
        kinds = {t["kind"] for t in f["origins"]["terms"]}
        assert "unreached" not in kinds, kinds


def test_dispatcher_fields_have_the_planned_sizes(base_tree):
    """Per layer, the all-to-all dispatcher's fields at the sizes megatron-core 0.19.2 gives them
    (token_dispatcher.py MoEAlltoAllTokenDispatcher: ``routing_map`` [T, E] bool and ``probs``
    [T, E] fp32 from ``dispatch_preprocess``, ``num_global_tokens_per_local_expert`` [G, L]
    int64 from ``preprocess``, ``reversed_local_input_permutation_mapping`` [T x k] int64), as
    the planner's ``retained_state_terms`` prices them."""
    (result, *_) = _run(base_tree, "alltoall", None, "fake")
    holder = "MoEAlltoAllTokenDispatcher."
    for layer in ("layer1", "layer2"):
        terms = {
            t["holder"][len(holder) :]: t["bytes"]
            for t in result["origins"]["terms"]
            if t["root"] == layer and t["kind"] == "attribute"
        }
        assert terms == {
            "routing_map": T * E,
            "probs": T * E * 4,
            "num_global_tokens_per_local_expert": G * L * 8,
            "reversed_local_input_permutation_mapping": T * K * 8,
        }, terms
