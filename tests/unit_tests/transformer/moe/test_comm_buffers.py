# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The flex dispatcher's communication buffers (fused_a2a's HybridEP and DeepEP buffers) have
explicit destructors: ``destroy_model_parallel()`` releases them, a dispatch after a new
``initialize_model_parallel()`` re-binds them to the new group, growth never holds two, and
``release_comm_buffers()`` frees them between steps (offload) for the next dispatch to
re-create.

Ranks run megatron-core's real MoELayer / fused_a2a code on CPU gloo ranks with the deep_ep
emulation, whose buffers allocate their documented sizes through the counted CPU allocator
(cpu_runtime.cpu_memory). Each test fails on the unpatched base.
"""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

THIS = "tests.unit_tests.transformer.moe.test_comm_buffers"
TOKENS = 12


def _counter():
    from cpu_runtime import cpu_memory

    cpu_memory.install()
    return cpu_memory


def _layer_step(backend: str, ep: int, seed: int = 99):
    """A MoELayer (global-seeded weights: equal across EP sizes) forward and backward."""
    from cpu_runtime import moe_harness
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    config = moe_harness.moe_config(backend, ep)
    layer = moe_harness.build_moe_layer(config)
    layer.train()
    harness.load_layer_weights(layer, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = harness.seeded((world, TOKENS, config.hidden_size), seed)
    x = xs[rank].clone().view(TOKENS, 1, -1).requires_grad_()
    out, _ = layer(x)
    out.backward(harness.seeded((TOKENS, config.hidden_size), seed + 1 + rank).view_as(out))
    return layer, out.detach().clone(), x.grad.clone()


def _buffer(backend: str):
    from megatron.core.transformer.moe import fused_a2a

    return fused_a2a._hybrid_ep_buffer if backend == "hybridep" else fused_a2a._buffer


def rank_teardown(backend: str):
    """Rank side: after a step, destroy_model_parallel(); is the buffer gone, and what did the
    counted allocator get back?"""
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core import parallel_state

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    layer, out, grad = _layer_step(backend, dist.get_world_size())
    del layer, out, grad
    buffer = _buffer(backend)
    ref, nbytes = weakref.ref(buffer), buffer.memory.nbytes
    del buffer
    gc.collect()
    # Settled reads: gloo's threads free finished collectives' buffers asynchronously.
    before = mem.settled()
    parallel_state.destroy_model_parallel()
    gc.collect()
    return {
        "alive": ref() is not None,
        "nbytes": nbytes,
        "freed": before - mem.settled(),
    }


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_destroy_model_parallel_releases_the_buffer(dist_job, patched_tree, backend):
    for rank, res in enumerate(dist_job(f"{THIS}:rank_teardown", 2, patched_tree, backend=backend)):
        assert not res["alive"], f"rank {rank}: the {backend} buffer outlived its groups"
        # The counted bytes drop by exactly the buffer's.
        assert res["nbytes"] > 0 and res["freed"] == res["nbytes"], f"rank {rank}: {res}"


def rank_reinit(first_ep: int, second_ep: int):
    """Rank side: a HybridEP step at EP=first_ep, destroy_model_parallel(), then a step at
    EP=second_ep. With first_ep=0 only the second step runs (a fresh process)."""
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core import parallel_state

    old_group = None
    if first_ep:
        init_megatron(ep=first_ep)
        _layer_step("hybridep", first_ep)
        old_group = _buffer("hybridep").group
        parallel_state.destroy_model_parallel()
    init_megatron(ep=second_ep)
    layer, out, grad = _layer_step("hybridep", second_ep)
    group = layer.token_dispatcher._comm_manager.group
    buffer = _buffer("hybridep")
    return {
        "out": out,
        "grad": grad,
        "bound_to_call_group": buffer.group is group,
        "bound_to_old_group": old_group is not None and buffer.group is old_group,
        "buffer_group_size": buffer.group_size,
    }


@pytest.mark.parametrize("first_ep,second_ep", [(2, 4), (2, 2)], ids=["ep2-then-ep4", "new-ep2"])
def test_hybridep_buffer_rebinds_after_reinitialization(
    dist_job, patched_tree, first_ep, second_ep
):
    again = dist_job(f"{THIS}:rank_reinit", 4, patched_tree, first_ep=first_ep, second_ep=second_ep)
    fresh = dist_job(f"{THIS}:rank_reinit", 4, patched_tree, first_ep=0, second_ep=second_ep)
    for rank, (a, f) in enumerate(zip(again, fresh)):
        assert a["bound_to_call_group"] and not a["bound_to_old_group"], f"rank {rank}: {a}"
        assert a["buffer_group_size"] == second_ep
        assert torch.equal(a["out"], f["out"]) and torch.equal(a["grad"], f["grad"]), rank


def rank_growth(backend: str):
    """Rank side: the counted peak while the buffer is replaced by a larger one."""
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    group = parallel_state.get_expert_model_parallel_group()

    def make(size: int):
        if backend == "deepep":
            return fused_a2a.get_buffer(group, hidden_bytes=size)
        # The SM counts and fp8_dispatch have no defaults on megatron-core 0.16.
        defaults = dict(num_sms_dispatch_api=None, num_sms_combine_api=None, fp8_dispatch=False)
        fused_a2a.init_hybrid_ep_buffer(group, size, TOKENS, 2, **defaults)
        return fused_a2a._hybrid_ep_buffer

    old = make(32).memory.nbytes
    gc.collect()
    before = mem.memory_allocated()
    mem.reset_peak_memory_stats()
    new = make(64).memory.nbytes
    peak = mem.max_memory_allocated() - before
    fused_a2a.reset_hybrid_ep_buffer()
    fused_a2a._buffer = None
    return {"old": old, "new": new, "peak": peak}


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_growth_never_holds_two_buffers(dist_job, patched_tree, backend):
    for rank, res in enumerate(dist_job(f"{THIS}:rank_growth", 2, patched_tree, backend=backend)):
        assert res["new"] > res["old"] > 0, res
        # The old buffer is freed before the new one is allocated (the base peaks at old + new).
        assert res["peak"] == res["new"] - res["old"], f"rank {rank}: {res}"


def rank_offload(backend: str, release: bool):
    """Rank side: step, SGD update, (release twice), step; the second step's results. With
    ``release`` the buffers are also released twice before the first dispatch."""
    from cpu_runtime.moe_harness import init_megatron
    from megatron.core.transformer.moe import fused_a2a

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    out = {}
    if release:  # idempotent and safe before any dispatch
        fused_a2a.release_comm_buffers()
        fused_a2a.release_comm_buffers()
    layer, _, _ = _layer_step(backend, dist.get_world_size())
    with torch.no_grad():
        for p in layer.parameters():
            p -= 0.1 * p.grad
            p.grad = None
    first = _buffer(backend)
    first_ref = weakref.ref(first)
    del first
    if release:
        gc.collect()
        before = mem.memory_allocated()
        fused_a2a.release_comm_buffers()
        fused_a2a.release_comm_buffers()
        gc.collect()
        out["freed"] = before - mem.memory_allocated()
        out["nbytes_released"] = None if first_ref() is None else first_ref().memory.nbytes
        out["buffer_after_release"] = _buffer(backend) is not None
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    rank, world = dist.get_rank(), dist.get_world_size()
    xs = harness.seeded((world, TOKENS, layer.config.hidden_size), 7)
    x = xs[rank].clone().view(TOKENS, 1, -1).requires_grad_()
    y, _ = layer(x)
    y.backward(torch.ones_like(y))
    out.update(
        out=y.detach().clone(),
        input_grad=x.grad.clone(),
        grads={n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
        recreated=_buffer(backend) is not None and _buffer(backend) is not first_ref(),
        first_alive=first_ref() is not None,
    )
    return out


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_release_for_offload_then_step_is_bitwise_equal(dist_job, patched_tree, backend):
    kept = dist_job(f"{THIS}:rank_offload", 2, patched_tree, backend=backend, release=False)
    freed = dist_job(f"{THIS}:rank_offload", 2, patched_tree, backend=backend, release=True)
    for rank, (k, r) in enumerate(zip(kept, freed)):
        assert not r["buffer_after_release"] and not r["first_alive"], f"rank {rank}: {r}"
        assert r["freed"] > 0 and r["recreated"], f"rank {rank}: {r}"
        assert torch.equal(k["out"], r["out"]) and torch.equal(k["input_grad"], r["input_grad"])
        assert k["grads"].keys() == r["grads"].keys() and k["grads"]
        assert all(torch.equal(k["grads"][n], r["grads"][n]) for n in k["grads"]), rank
