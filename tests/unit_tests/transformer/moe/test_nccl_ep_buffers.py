# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL EP's context and zero-copy buffers have the lifecycle of the other comm buffers.

``reset_fused_a2a_buffers()`` releases them (collective: the EP group joins the barrier, the
zero-copy symmetric buffers go before the context is finalized) and the next dispatch bootstraps
again, bitwise equal; ``destroy_model_parallel()`` frees them before the groups go, so a
re-initialized model never finds the old group's symmetric buffers; a model on another EP group gets
a clear error instead of dispatching over the bootstrapped group's communicator (TransformerEngine
serves one EP group per process); a release refuses while a captured graph may replay.
Megatron-core's real MoEFlexTokenDispatcher / MoELayer on CPU gloo ranks with the NCCL EP emulation
(moe_release.runtime.kernels.ncclep_emulation), whose bootstrap allocates NCCL EP's group memory and
whose symmetric buffers are checked in zero-copy mode; where the tree has NCCL EP. Zero-copy needs
TE's fused grouped MLP (the op fuser), so a stand-in expert sits between dispatch and combine there,
with the fused MLP's buffer contract.
"""

import dataclasses
import gc
import os

import pytest
import torch
import torch.distributed as dist

from moe_release import settings
from tests.unit_tests.release_cases import backport

THIS = "tests.unit_tests.transformer.moe.test_nccl_ep_buffers"
pytestmark = pytest.mark.flex_backend("ncclep")
HIDDEN, TOKENS, EXPERTS, FACTOR = 64, 8, 4, 4.0


def _tree_has_zero_copy() -> bool:
    """Whether the tree's NCCL EP manager has the zero-copy buffers (0.19.2, main; not dev)."""
    tree = settings.tree() or ""
    path = os.path.join(tree, "megatron", "core", "transformer", "moe", "token_dispatcher.py")
    try:
        with open(path, encoding="utf-8") as f:
            return "_zc_bwd_token_buf" in f.read()
    except OSError:
        return False


MODES = [pytest.param(False, id="normal")]
if _tree_has_zero_copy():
    MODES.append(pytest.param(True, id="zero-copy"))


def _counter():
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    return cpu_memory


def _config(ep: int, zero_copy: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from moe_release.runtime.megatron.moe_harness import moe_config

    extra = {}
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    static = "moe_ncclep_static_shape" in fields
    if static or zero_copy:  # 0.19.2 and dev need a capacity; main is eager without one
        extra["moe_expert_rank_capacity_factor"] = FACTOR
    if zero_copy:  # the symmetric buffers need the fused grouped MLP's static shapes
        extra.update(moe_ncclep_zero_copy=True, use_transformer_engine_op_fuser=True,
                     moe_grouped_gemm=True)  # fmt: skip
        if static:
            extra["moe_ncclep_static_shape"] = True
    return moe_config("ncclep", ep, num_experts=EXPERTS, hidden=HIDDEN, dtype=torch.bfloat16,
                      **extra)  # fmt: skip


class _ZeroCopyExpert(torch.autograd.Function):
    """Stands in for TE's fused grouped MLP on NCCL EP's zero-copy path (TEGroupedMLP with
    ``output_buffer``/``grad_input_buffer``): rows scaled by their probs, written into the
    symmetric output buffer the combine reads; its backward writes the input gradient into the
    symmetric buffer the dispatch's backward scatters from."""

    @staticmethod
    def forward(ctx, h, p, out_buf, grad_buf):
        ctx.save_for_backward(h, p)
        ctx.grad_buf = grad_buf
        out_buf.copy_(h * p.unsqueeze(-1).to(h.dtype))
        ctx.mark_dirty(out_buf)
        return out_buf

    @staticmethod
    def backward(ctx, g):
        h, p = ctx.saved_tensors
        grad_h = g * p.unsqueeze(-1).to(g.dtype)
        grad_p = (g.float() * h.float()).sum(-1)
        if ctx.grad_buf is not None:
            ctx.grad_buf.copy_(grad_h)
            grad_h = ctx.grad_buf
        return grad_h, grad_p, None, None


def _dispatcher(config, group=None):
    import copy

    from megatron.core.transformer.moe.moe_layer import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    pgc = get_default_pg_collection()
    if group is not None:
        pgc = copy.copy(pgc)
        pgc.ep = pgc.tp_ep = group
    size, rank = dist.get_world_size(pgc.ep), dist.get_rank(pgc.ep)
    local = EXPERTS // size
    return MoEFlexTokenDispatcher(local, list(range(rank * local, (rank + 1) * local)), config,
                                  pg_collection=pgc)  # fmt: skip


def _step(dispatcher, seed: int):
    """Dispatch, the (stand-in) experts, combine and backward: output and input gradient."""
    g = torch.Generator().manual_seed(seed + 10 * dist.get_rank())
    logits = torch.randn(TOKENS, EXPERTS, generator=g)
    top = logits.topk(2, dim=1).indices
    rmap = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top, True)
    probs = (torch.softmax(logits, -1) * rmap).requires_grad_()
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(torch.bfloat16).requires_grad_()
    h, p = dispatcher.dispatch_preprocess(x, rmap, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    # Each row scaled by its global expert's index + 1: what a rank computes depends on which
    # experts it owns, as real experts' weights do.
    experts = torch.tensor(dispatcher.local_expert_indices, device=h.device) + 1
    rows = torch.repeat_interleave(experts, tokens_per_expert.to(h.device))
    scale = torch.ones(h.shape[0], device=h.device)
    scale[: rows.shape[0]] = rows.float()
    p = p * scale.to(p.dtype)
    # dev has no zero-copy path (nor this method).
    zero_copy = getattr(dispatcher, "get_expert_zero_copy_buffers", None)
    out_buf, grad_buf = zero_copy() if zero_copy else (None, None)
    if out_buf is not None:
        y = _ZeroCopyExpert.apply(h, p, out_buf, grad_buf)
    else:
        y = h * p.unsqueeze(-1).to(h.dtype)
    y = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(y)))
    y.float().pow(2).sum().backward()
    return y.detach().clone(), x.grad.clone(), probs.grad.clone()


def _held_bytes(zero_copy: bool) -> int:
    """What the release must free: NCCL EP's group memory and the zero-copy buffers."""
    from megatron.core.transformer.moe.token_dispatcher import _NCCLEPManager

    from moe_release.runtime.kernels import ncclep_emulation as te

    backend = te.BACKEND
    sizes = te.context_bytes(dist.get_world_size(backend.group), backend.num_experts,
                             backend.max_tokens, backend.max_recv, backend.hidden,
                             backend.zero_copy)  # fmt: skip
    held = sizes["device"] + sizes["pinned"]
    if zero_copy:
        for name in ("_zc_fwd_token_buf", "_zc_bwd_token_buf", "_zc_recv_topk_weights_buf"):
            buf = getattr(_NCCLEPManager, name)
            held += 0 if buf is None else buf.untyped_storage().nbytes()
    return held


def rank_release_between_steps(zero_copy: bool):
    """Rank side: a step, the release, another step with the same inputs."""
    from megatron.core.transformer.moe.token_dispatcher import _NCCLEPManager

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    dispatcher = _dispatcher(_config(dist.get_world_size(), zero_copy))
    first = _step(dispatcher, 5)
    gc.collect()
    want = _held_bytes(zero_copy)
    before = mem.settled()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)  # idempotent
    gc.collect()
    out = {
        "want": want,
        "freed": before - mem.settled(),
        "bootstrapped": te.installed()._BOOTSTRAPPED,
        "zero_copy_kept": getattr(_NCCLEPManager, "_zc_bwd_token_buf", None) is not None,
    }
    second = _step(dispatcher, 5)
    out["equal"] = all(torch.equal(a, b) for a, b in zip(first, second))
    out["rebootstrapped"] = te.installed()._BOOTSTRAPPED
    return out


@pytest.mark.parametrize("zero_copy", backport(MODES, "normal"))
def test_release_frees_the_context_and_the_next_step_recreates_it(
    dist_job, patched_tree, zero_copy
):
    """The release frees NCCL EP's group memory and (zero-copy) the symmetric buffers, exactly;
    the next dispatch bootstraps again and the step is bitwise the first one. On the base
    reset_fused_a2a_buffers() does not touch NCCL EP (nor exists on 0.19.2)."""
    runs = dist_job(f"{THIS}:rank_release_between_steps", 2, patched_tree, zero_copy=zero_copy)
    for rank, res in enumerate(runs):
        assert res["want"] > 0 and res["freed"] == res["want"], f"rank {rank}: {res}"
        assert not res["bootstrapped"] and not res["zero_copy_kept"], res
        assert res["equal"] and res["rebootstrapped"], res


def rank_reinitialize(zero_copy: bool):
    """Rank side: a step, destroy_model_parallel(), a new initialize_model_parallel() and a
    step of a new dispatcher on the new groups."""
    from megatron.core.transformer.moe.token_dispatcher import _NCCLEPManager

    from megatron.core import parallel_state
    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    first = _step(_dispatcher(_config(dist.get_world_size(), zero_copy)), 5)
    gc.collect()
    want = _held_bytes(zero_copy)
    before = mem.settled()
    parallel_state.destroy_model_parallel()
    gc.collect()
    kept = getattr(_NCCLEPManager, "_zc_bwd_token_buf", None) is not None
    out = {"want": want, "freed": before - mem.settled(), "zero_copy_kept": kept}
    init_megatron(ep=dist.get_world_size())
    dispatcher = _dispatcher(_config(dist.get_world_size(), zero_copy))
    try:
        again = _step(dispatcher, 5)
        out["equal"] = all(torch.equal(a, b) for a, b in zip(first, again))
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    out["group_is_new"] = te.BACKEND.group is dispatcher._comm_manager.group
    return out


@pytest.mark.parametrize("zero_copy", MODES)
def test_destroy_model_parallel_frees_nccl_ep_and_a_new_model_starts_clean(
    dist_job, patched_tree, zero_copy
):
    """destroy_model_parallel() frees the context and the zero-copy buffers; the next model, on
    new groups, bootstraps on them and computes what the first did. On the base the zero-copy
    buffers survive, rendezvoused on the destroyed group, and the next model's combine refuses
    them (a GPU would read another communicator's window)."""
    for rank, res in enumerate(
        dist_job(f"{THIS}:rank_reinitialize", 2, patched_tree, zero_copy=zero_copy)
    ):
        assert res["error"] is None, f"rank {rank}: {res['error']}"
        assert res["freed"] == res["want"] > 0, f"rank {rank}: {res}"
        assert not res["zero_copy_kept"] and res["equal"] and res["group_is_new"], res


def rank_two_groups():
    """Rank side (4 ranks): a dispatcher on parallel_state's EP groups [0,1],[2,3] (A) and one
    on [0,2],[1,3] (B). B runs first on its own group, then the release; then A, and B while
    A's context is live (a manager that bootstrapped before the release must check the group
    again); then the release and B alone once more."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=2)
    rank = dist.get_rank()
    other = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    config = _config(2, zero_copy=False)
    a, b = _dispatcher(config), _dispatcher(config, other)
    out = {"b_first": _step(b, 2)}
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    _step(a, 1)
    try:
        out["b_with_a_live"] = _step(b, 2)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    out["b_alone"] = _step(b, 2)
    return out


@pytest.mark.backport
def test_a_second_ep_group_is_refused_not_silently_rerouted(dist_job, patched_tree):
    """NCCL EP serves one EP group per process: while it is bootstrapped on A's group, B's
    dispatch raises, naming the release, also when B ran on its own group before an earlier
    release; after the release B runs on its own group again, bitwise what it computed first."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_two_groups", 4, patched_tree)):
        assert res["error"] and "reset_fused_a2a_buffers" in res["error"], f"rank {rank}: {res}"
        assert res["b_alone"][0].shape == (TOKENS, HIDDEN), rank
        assert all(torch.equal(x, y) for x, y in zip(res["b_first"], res["b_alone"])), rank


def test_base_reroutes_a_second_ep_group_over_the_first(dist_job, base_tree):
    """What the base does with it: B dispatches over A's communicator without a word, and its
    output is not what B computes on its own group (the unpatched behaviour this fixes)."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_two_groups_base", 4, base_tree)):
        assert res["error"] is None, rank
        assert not torch.equal(res["b_with_a_live"], res["b_alone"]), rank


def rank_two_groups_base():
    """rank_two_groups on a tree without reset_fused_a2a_buffers: B alone is measured in a
    process where A never bootstrapped (the same seeds and groups)."""
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=2)
    rank = dist.get_rank()
    other = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    config = _config(2, zero_copy=False)
    a, b = _dispatcher(config), _dispatcher(config, other)
    _step(a, 1)
    with_a = _step(b, 2)[0]
    from megatron.core.transformer.moe import fused_a2a

    fused_a2a.nccl_ep_finalize()
    b._comm_manager._bootstrapped = False
    alone = _step(_dispatcher(config, other), 2)[0]
    return {"error": None, "b_with_a_live": with_a, "b_alone": alone}


def rank_capture_guard():
    """Rank side: a dispatch under a (stand-in) capture; the release refuses, then frees with
    graphs_released=True."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.megatron.moe_harness import init_megatron
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    init_megatron(ep=dist.get_world_size())
    dispatcher = _dispatcher(_config(dist.get_world_size(), zero_copy=False))
    _step(dispatcher, 3)
    with harness.capturing(fused_a2a):
        _step(dispatcher, 4)
    out = {}
    try:
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["kept"] = te.installed()._BOOTSTRAPPED
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD, graphs_released=True)
    out["gone"] = not te.installed()._BOOTSTRAPPED
    return out


def test_release_refuses_while_a_captured_graph_may_replay(dist_job, patched_tree):
    for res in dist_job(f"{THIS}:rank_capture_guard", 2, patched_tree):
        assert res["refused"] and "NCCL EP context" in res["refused"], res
        assert res["kept"] and res["gone"], res


def rank_local_release_leaves_the_context():
    """Rank side: after a step and a dispatch under a (stand-in) capture, the release that waits
    on nobody; then the collective one without and with graphs_released."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.megatron.moe_harness import init_megatron
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    init_megatron(ep=2)
    dispatcher = _dispatcher(_config(2, zero_copy=False))
    _step(dispatcher, 3)
    with harness.capturing(fused_a2a):  # a graph that may still replay on the context
        _step(dispatcher, 4)
    fused_a2a.reset_fused_a2a_buffers()
    out = {"bootstrapped": te.installed()._BOOTSTRAPPED}
    try:
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        out["collective"] = "released"
    except RuntimeError as exc:
        out["collective"] = str(exc)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD, graphs_released=True)
    out["after"] = te.installed()._BOOTSTRAPPED
    parallel_state.destroy_model_parallel()
    return out


def test_the_release_that_waits_on_nobody_leaves_the_context(dist_job, patched_tree):
    """TE's ep_finalize deregisters symmetric memory and synchronizes with the peers, so the
    release that waits on nobody (destroy_model_parallel's, an abort's) leaves the NCCL EP
    context, and the capture it saw: the collective release still refuses while that graph may
    replay, and frees the context once told the graphs are gone."""
    for rank, res in enumerate(
        dist_job(f"{THIS}:rank_local_release_leaves_the_context", 2, patched_tree)
    ):
        assert res["bootstrapped"] and not res["after"], (rank, res)
        assert "CUDA graph" in res["collective"], (rank, res)


def rank_two_groups_without_te_private_group():
    """rank_two_groups with TransformerEngine's private ``_EP_GROUP`` read by nobody but TE:
    every read from a megatron module is recorded (TE keeps it for its symmetric-memory pool; no
    public API names the bootstrapped group)."""
    import sys
    import types

    from moe_release.runtime.kernels import ncclep_emulation as te

    module = te.installed()
    reads = []

    class _Watched(types.ModuleType):
        @property
        def _EP_GROUP(self):  # noqa: N802 - TE's name
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("megatron."):
                reads.append(caller)
            return self.__dict__["_ep_group_value"]

        @_EP_GROUP.setter
        def _EP_GROUP(self, value):  # noqa: N802
            self.__dict__["_ep_group_value"] = value

    value = module.__dict__.pop("_EP_GROUP", None)
    module.__class__ = _Watched
    module._EP_GROUP = value
    out = rank_two_groups()
    out["megatron_reads"] = sorted(set(reads))
    return out


def test_megatron_reads_no_private_te_ep_group(dist_job, patched_tree):
    """The second-group refusal and the release work from the group megatron recorded when it
    bootstrapped NCCL EP, not from TE's private ``te_ep._EP_GROUP`` (which the series at 2b85988
    read in ensure_nccl_ep_bootstrapped, is_nccl_ep_bootstrapped and reset_fused_a2a_buffers)."""
    for rank, res in enumerate(
        dist_job(f"{THIS}:rank_two_groups_without_te_private_group", 4, patched_tree)
    ):
        assert res["megatron_reads"] == [], f"rank {rank}: {res['megatron_reads']}"
        assert res["error"] and "reset_fused_a2a_buffers" in res["error"], f"rank {rank}: {res}"
        assert all(torch.equal(x, y) for x, y in zip(res["b_first"], res["b_alone"])), rank
