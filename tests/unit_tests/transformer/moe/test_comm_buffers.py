# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The flex dispatcher's communication buffers (fused_a2a's HybridEP and DeepEP buffers) are
freed only by ``reset_fused_a2a_buffers(collective=True, group=...)``, which every rank of the
group calls on its main thread: the ranks agree on what each holds, then free what every peer
holds, leak what a peer no longer holds, and refuse on every rank while an autograd graph or a
CUDA graph still uses a buffer. Everything else only takes buffers out of use and waits on
nobody: ``destroy_model_parallel()`` (the no-argument release), a larger buffer needed, a
destroyed group, ``reset_hybrid_ep_buffer()``; the next dispatch of a group of the same ranks
takes its buffer back while that group lives, else allocates. Buffers are kept one per process
group's ranks, so two models on different EP groups each run on their own.

Ranks run megatron-core's real MoELayer / fused_a2a code on CPU gloo ranks with the deep_ep
emulation, whose buffers allocate their documented sizes through the counted CPU allocator
(moe_release.runtime.measure.cpu_memory). Each test fails on the unpatched base.
"""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

THIS = "tests.unit_tests.transformer.moe.test_comm_buffers"
# Every flex backend whose buffers the release waits for (DeepEP v2 on the trees that have it).
WAITING_BACKENDS = [
    "hybridep",
    "deepep",
    pytest.param("deepepv2", marks=pytest.mark.flex_backend("deepepv2")),
]
TOKENS = 12


def _counter():
    from moe_release.runtime.measure import cpu_memory

    cpu_memory.install()
    return cpu_memory


def _layer_step(backend: str, ep: int, seed: int = 99):
    """A MoELayer (global-seeded weights: equal across EP sizes) forward and backward."""
    from moe_release.runtime.megatron import moe_harness
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    # DeepEP v2's combine needs a hidden size that is a multiple of 256, in bf16.
    wide = {"hidden": 256, "dtype": torch.bfloat16} if backend == "deepepv2" else {}
    config = moe_harness.moe_config(backend, ep, **wide)
    layer = moe_harness.build_moe_layer(config)
    layer.train()
    harness.load_layer_weights(layer, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs = harness.seeded((world, TOKENS, config.hidden_size), seed).to(config.params_dtype)
    x = xs[rank].clone().view(TOKENS, 1, -1).requires_grad_()
    out, _ = layer(x)
    grad = harness.seeded((TOKENS, config.hidden_size), seed + 1 + rank)
    out.backward(grad.to(out.dtype).view_as(out))
    return layer, out.detach().clone(), x.grad.clone()


def _buffer(backend: str):
    """The rank's one HybridEP, DeepEP or DeepEP v2 buffer (None if it holds none)."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers

    kind = {"hybridep": "HybridEPBuffer", "deepepv2": "ElasticBuffer"}.get(backend, "Buffer")
    held = [b for b in held_comm_buffers(fused_a2a) if type(b).__name__ == kind]
    assert len(held) <= 1, held
    return held[0] if held else None


def _nbytes(buffer) -> int:
    """The device and pinned host bytes an emulated buffer holds (DeepEP v2: its window and
    host workspace)."""
    if hasattr(buffer, "nbytes"):
        return buffer.nbytes
    return buffer.runtime.window.nbytes + buffer.runtime.host_workspace.nbytes


def rank_teardown(backend: str):
    """Rank side: after a step, destroy_model_parallel(); is the buffer gone, and what did the
    counted allocator get back? Then the collective release, which destroys what the teardown
    took out of use."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    layer, out, grad = _layer_step(backend, dist.get_world_size())
    del layer, out, grad
    buffer = _buffer(backend)
    ref, nbytes = weakref.ref(buffer), buffer.nbytes
    del buffer
    gc.collect()
    # Settled reads: gloo's threads free finished collectives' buffers asynchronously.
    before = mem.settled()
    parallel_state.destroy_model_parallel()
    gc.collect()
    res = {"in_use": _buffer(backend) is not None, "nbytes": nbytes}
    res["freed_by_teardown"] = before - mem.settled()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    res.update(alive=ref() is not None, freed=before - mem.settled())
    return res


@pytest.mark.backport
@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_destroy_model_parallel_releases_the_buffer(dist_job, patched_tree, backend):
    """The teardown takes every buffer out of use and frees none (a free may wait for the peers:
    DeepEP's destroy() runs a barrier with them, HybridEP's destructor synchronizes the device);
    the next collective point, here the collective release, frees exactly its bytes."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_teardown", 2, patched_tree, backend=backend)):
        assert not res["in_use"] and not res["alive"], f"rank {rank}: {res}"
        assert res["nbytes"] > 0 and res["freed"] == res["nbytes"], f"rank {rank}: {res}"
        assert res["freed_by_teardown"] == 0, f"rank {rank}: {res}"


def rank_reinit(first_ep: int, second_ep: int, restore: bool = False, abort: bool = False):
    """Rank side: a HybridEP step at EP=first_ep, destroy_model_parallel(), then a step at
    EP=second_ep. With first_ep=0 only the second step runs (a fresh process). With
    ``restore``, the first buffer is assigned back to fused_a2a._hybrid_ep_buffer after the
    teardown, as a test fixture that saved it restores it; with ``abort``, the groups megatron
    made are destroyed first (an in-process restart)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import allocated_comm_buffers
    from moe_release.runtime.megatron.moe_harness import init_megatron

    old_group = None
    if first_ep:
        init_megatron(ep=first_ep)
        _layer_step("hybridep", first_ep)
        saved = fused_a2a._hybrid_ep_buffer
        old_group = saved.group
        if abort:
            from moe_release.runtime.megatron.fault_scenarios import abort_groups

            abort_groups()
        parallel_state.destroy_model_parallel()
        if restore:
            fused_a2a._hybrid_ep_buffer = saved
            del saved
    init_megatron(ep=second_ep)
    layer, out, grad = _layer_step("hybridep", second_ep)
    group = layer.token_dispatcher._comm_manager.group
    buffer = fused_a2a.get_hybrid_ep_buffer(group)  # the one this group's dispatches use
    ranks = dist.get_process_group_ranks
    return {
        "out": out,
        "grad": grad,
        "on_call_group_ranks": ranks(buffer.group) == ranks(group),
        "old_group_buffer": old_group is not None and buffer.group is old_group,
        "buffer_group_size": buffer.group_size,
        "allocated": len(allocated_comm_buffers(fused_a2a)),
    }


@pytest.mark.parametrize(
    "first_ep,second_ep,restore,abort,reused,allocated",
    [
        (2, 4, False, False, False, 2),
        pytest.param(2, 2, False, False, True, 1, marks=pytest.mark.backport),
        (2, 2, True, False, True, 1),
        (2, 2, False, True, False, 2),
    ],
    ids=["ep2-then-ep4", "new-ep2", "new-ep2-old-buffer-restored", "new-ep2-after-abort"],
)
def test_hybridep_buffer_rebinds_after_reinitialization(
    dist_job, patched_tree, first_ep, second_ep, restore, abort, reused, allocated
):
    """After a teardown and a re-initialization the next dispatch runs on a buffer of the new
    group's ranks (its peers), bitwise as a fresh process's: the old one while its group lives
    and has the same ranks (memory stays flat over re-initializations, as upstream's tests make
    them), a new one after an abort (the old group is gone, its ranks may be other processes:
    the old buffer stays allocated until the explicit release), never one of other ranks (the
    unpatched base runs EP 4 on its EP 2 buffer)."""
    again = dist_job(
        f"{THIS}:rank_reinit", 4, patched_tree, first_ep=first_ep, second_ep=second_ep,
        restore=restore, abort=abort,
    )  # fmt: skip
    fresh = dist_job(f"{THIS}:rank_reinit", 4, patched_tree, first_ep=0, second_ep=second_ep)
    for rank, (a, f) in enumerate(zip(again, fresh)):
        assert a["on_call_group_ranks"], f"rank {rank}: {a}"
        assert a["old_group_buffer"] == reused, f"rank {rank}: {a}"
        assert a["allocated"] == allocated, f"rank {rank}: {a}"
        assert a["buffer_group_size"] == second_ep
        assert torch.equal(a["out"], f["out"]) and torch.equal(a["grad"], f["grad"]), rank


def rank_growth(backend: str):
    """Rank side: a buffer replaced by a larger one: the counted bytes then, and what the
    explicit release frees after."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    group = parallel_state.get_expert_model_parallel_group()

    def make(size: int):
        if backend == "deepep":
            return fused_a2a.get_buffer(group, hidden_bytes=size)
        # The SM counts and fp8_dispatch have no defaults on megatron-core 0.16.
        defaults = dict(num_sms_dispatch_api=None, num_sms_combine_api=None, fp8_dispatch=False)
        fused_a2a.init_hybrid_ep_buffer(group, size, TOKENS, 2, **defaults)
        return fused_a2a.get_hybrid_ep_buffer(group)

    from moe_release.runtime.kernels import deepep_module as emu

    warnings = _Warnings()
    gc.collect()
    before = mem.settled()
    old = make(32).nbytes
    new = make(64).nbytes
    gc.collect()
    held = mem.settled() - before
    leaked = len(emu.LEAKED_BUFFERS)
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    # What destroy() leaves allocated (DeepEP's RDMA receive counter, deep_ep.cpp:299-304).
    kept = sum(t.nbytes for t in emu.LEAKED_BUFFERS[leaked:])
    return {
        "old": old, "new": new, "held": held, "kept": kept, "after": mem.settled() - before,
        "freed": release.freed, "bytes_freed": release.bytes_freed, "warnings": list(warnings),
    }  # fmt: skip


@pytest.mark.backport
@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_growth_keeps_the_old_buffer_for_the_explicit_release(dist_job, patched_tree, backend):
    """A larger buffer needed does not free the old one (the unpatched DeepEP buffer's destructor
    runs its collective destroy() there, inside the dispatch): both stay allocated, the warning
    says once where the memory returns, and the explicit release frees both."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_growth", 2, patched_tree, backend=backend)):
        assert res["new"] > res["old"] > 0, res
        # The counted bytes include DeepEP's 4-byte RDMA receive counter per buffer (kept).
        assert res["held"] == res["old"] + res["new"] + res["kept"], f"rank {rank}: {res}"
        assert res["freed"] == {backend: 2}, f"rank {rank}: {res}"
        assert res["after"] == res["kept"] == (8 if backend == "deepep" else 0), res
        assert res["bytes_freed"] == {backend: res["old"] + res["new"]}, f"rank {rank}: {res}"
        held = [w for w in res["warnings"] if "taken out of use" in w]
        assert len(held) == 1 and "reset_fused_a2a_buffers(collective=True" in held[0], res


def rank_offload(backend: str, release: bool):
    """Rank side: step, SGD update, (release twice), step; the second step's results. With
    ``release`` the buffers are also released twice before the first dispatch."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    out = {}
    if release:  # idempotent and safe before any dispatch
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
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
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        gc.collect()
        out["freed"] = before - mem.memory_allocated()
        out["nbytes_released"] = None if first_ref() is None else first_ref().nbytes
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


def _layer_on_group(config, ep_group):
    """A HybridEP MoELayer whose expert-parallel group is ``ep_group`` (TP=1: the TPxEP group
    too), built from megatron-core's spec with a ProcessGroupCollection, as a second model on
    other ranks is."""
    import copy

    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from moe_release.runtime.megatron.moe_harness import on_device

    pgc = copy.copy(get_default_pg_collection())
    pgc.ep = pgc.tp_ep = ep_group
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    layer = on_device(spec(config=config, layer_number=1, pg_collection=pgc))
    layer.train()
    return layer


def rank_two_groups():
    """Rank side (4 ranks): layer A on EP groups [0,1],[2,3] (parallel_state's), layer B on
    [0,2],[1,3]. Sequential: A forward+backward, then B (the buffers reset in between, so even
    a single-buffer tree binds each layer's to its group). Interleaved: A forward, B forward,
    A backward, B backward. Returns both runs' outputs and gradients and the buffers held."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from moe_release.runtime.megatron.moe_harness import init_megatron, moe_config
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    init_megatron(ep=2)
    rank = dist.get_rank()
    other = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    config = moe_config("hybridep", 2)
    layers = {
        "A": _layer_on_group(config, parallel_state.get_expert_model_parallel_group()),
        "B": _layer_on_group(config, other),
    }
    xs = {
        k: harness.seeded((4, TOKENS, config.hidden_size), s)[rank] for k, s in (("A", 5), ("B", 6))
    }

    def forward(k):
        x = xs[k].clone().view(TOKENS, 1, -1).requires_grad_()
        out, _ = layers[k](x)
        return x, out

    def backward(k, x, out):
        out.backward(harness.seeded(out.shape, 11).to(out.dtype))
        grads = {n: p.grad.clone() for n, p in layers[k].named_parameters() if p.grad is not None}
        for p in layers[k].parameters():
            p.grad = None
        return {"out": out.detach().clone(), "x_grad": x.grad.clone(), "grads": grads}

    sequential = {}
    for k in "AB":
        fused_a2a.reset_hybrid_ep_buffer()
        sequential[k] = backward(k, *forward(k))
    fused_a2a.reset_hybrid_ep_buffer()
    xa, oa = forward("A")
    xb, ob = forward("B")
    interleaved = {"A": backward("A", xa, oa), "B": backward("B", xb, ob)}
    return {
        "sequential": sequential,
        "interleaved": interleaved,
        "buffers": len(held_comm_buffers(fused_a2a)),
    }


@pytest.mark.backport
def test_two_models_on_different_groups_keep_their_own_buffers(dist_job, patched_tree):
    """Two MoE layers on different EP groups (an RL policy and its reference model on other
    ranks), forwards and backwards interleaved: each dispatch, combine and backward runs on the
    buffer of its own group, so every result is bitwise that of running each alone. The base
    runs the second layer on the first layer's buffer; re-binding on a group change alone
    would run the first backward on the second group's buffer."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_two_groups", 4, patched_tree)):
        for k in "AB":
            s, i = res["sequential"][k], res["interleaved"][k]
            assert torch.equal(s["out"], i["out"]), f"rank {rank}: layer {k} output"
            assert torch.equal(s["x_grad"], i["x_grad"]), f"rank {rank}: layer {k} input grad"
            assert s["grads"].keys() == i["grads"].keys() and s["grads"]
            for n in s["grads"]:
                assert torch.equal(s["grads"][n], i["grads"][n]), f"rank {rank}: {k} {n}"
        assert res["buffers"] == 2, f"rank {rank}: {res['buffers']} HybridEP buffers"


def rank_capture_guard(backend: str):
    """Rank side: a step, then a forward whose dispatch runs while a (stand-in) capture is on.
    reset_fused_a2a_buffers() must refuse and keep the buffer; with graphs_released=True it
    frees it."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    layer, _, _ = _layer_step(backend, dist.get_world_size())
    with harness.capturing(fused_a2a), torch.no_grad():
        layer(harness.seeded((TOKENS, 1, layer.config.hidden_size), 3))
    out = {}
    try:
        fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["kept"] = _buffer(backend) is not None
    nbytes = _buffer(backend).nbytes if out["kept"] else 0
    gc.collect()
    before = mem.settled()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD, graphs_released=True)
    gc.collect()
    out.update(nbytes=nbytes, freed=before - mem.settled(), gone=_buffer(backend) is None)
    return out


# DeepEP's normal-mode dispatch waits on the host: a CUDA graph never captures it.
@pytest.mark.parametrize("backend", [pytest.param("hybridep", marks=pytest.mark.backport)])
def test_release_refuses_while_a_captured_graph_holds_the_buffer(dist_job, patched_tree, backend):
    """A CUDA graph that captured a dispatch keeps raw pointers into the buffer: the release
    raises (naming the fix) and frees nothing; once the caller says the graphs are gone it
    frees the buffer."""
    runs = dist_job(f"{THIS}:rank_capture_guard", 2, patched_tree, backend=backend)
    for rank, res in enumerate(runs):
        assert res["refused"] and "graphs_released=True" in res["refused"], f"rank {rank}: {res}"
        assert res["kept"] and res["gone"], f"rank {rank}: {res}"
        assert res["nbytes"] > 0 and res["freed"] == res["nbytes"], f"rank {rank}: {res}"


def rank_release_waits_for_peers(backend: str, delay: float):
    """Rank side: after a step, rank 1 calls the release ``delay`` seconds after rank 0. Returns
    when each rank entered and left it (wall clock, one host)."""
    import time

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    _counter()
    init_megatron(ep=dist.get_world_size())
    _layer_step(backend, dist.get_world_size())
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(delay)
    entered = time.time()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return {"entered": entered, "left": time.time(), "gone": _buffer(backend) is None}


@pytest.mark.parametrize(
    "backend", [pytest.param("hybridep", marks=pytest.mark.backport), "deepep"]
)
def test_release_waits_for_every_peer_before_freeing(dist_job, patched_tree, backend):
    """The release is collective: rank 0 does not return (and so has not freed) before rank 1,
    one second later, has entered it."""
    r0, r1 = dist_job(
        f"{THIS}:rank_release_waits_for_peers", 2, patched_tree, backend=backend, delay=1.0
    )
    assert r1["entered"] - r0["entered"] >= 0.9, (r0, r1)
    assert r0["left"] >= r1["entered"], (r0, r1)
    assert r0["gone"] and r1["gone"]


class _Warnings(list):
    """The WARNING records of megatron-core's loggers on this rank, as messages."""

    def __init__(self):
        import logging

        super().__init__()
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: self.append(record.getMessage())
        logging.getLogger("megatron.core").addHandler(handler)


def rank_teardown_with_a_stuck_peer(backend: str):
    """Rank side: after a step, rank 1 is stuck in a collective on another group (the world)
    that rank 0 joins only after its teardown, as a rank that failed a test or never reaches
    teardown. How long does rank 0's destroy_model_parallel() take, and what does it leave?"""
    import time

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=2)
    _layer_step(backend, 2)
    warnings = _Warnings()
    if dist.get_rank() == 1:
        dist.barrier()
        parallel_state.destroy_model_parallel()
        return {}
    start = time.monotonic()
    parallel_state.destroy_model_parallel()
    elapsed = time.monotonic() - start
    out = {
        "elapsed": elapsed,
        "in_use": len(held_comm_buffers(fused_a2a)),
        "warnings": list(warnings),
    }
    dist.barrier()
    return out


@pytest.mark.parametrize("backend", WAITING_BACKENDS)
def test_teardown_waits_on_no_peer(dist_job, patched_tree, backend):
    """destroy_model_parallel() adds no wait on a peer: with the peer stuck elsewhere it returns
    at once, as the unpatched teardown does, with every buffer out of use and nothing logged.
    The series at 9ee7333 waited its 60 s bound here, then parked the buffers for the life of
    the process."""
    r0, _ = dist_job(
        f"{THIS}:rank_teardown_with_a_stuck_peer", 2, patched_tree, timeout=120.0, backend=backend
    )
    assert r0["elapsed"] < 2.0, r0
    assert r0["in_use"] == 0 and r0["warnings"] == [], r0


def rank_restart_after_abort(backend: str, rounds: int, recipe: bool):
    """Rank side: ``rounds`` in-process restarts as NVRx's does them: after a step, every
    process group megatron created is destroyed (the abort), then destroy_model_parallel(),
    initialize_model_parallel(), with ``recipe`` the explicit release over the world (every
    rank, before the first step), and a step. The counted bytes, the buffers alive and the
    teardown's seconds after each round."""
    import time

    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from moe_release.runtime.kernels import deepep_emulation, hybridep_emulation
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    kinds = {"hybridep": hybridep_emulation.HybridEPBuffer, "deepep": deepep_emulation.Buffer}
    cls = kinds[backend]
    warnings = _Warnings()
    rows = []
    init_megatron(ep=2)
    for _ in range(rounds):
        _layer_step(backend, 2)
        gc.collect()
        rows.append(
            {
                "bytes": mem.settled(),
                "deep_ep_leaks": sum(t.nbytes for t in deepep_emulation.LEAKED_BUFFERS),
                "alive": sum(isinstance(o, cls) for o in gc.get_objects()),
                "in_use": len(held_comm_buffers(fused_a2a)),
            }
        )
        world = dist.group.WORLD
        groups = {
            g
            for g in vars(parallel_state).values()
            if isinstance(g, dist.ProcessGroup) and g is not world
        }
        for group in groups:
            dist.destroy_process_group(group)
        start = time.monotonic()
        parallel_state.destroy_model_parallel()
        rows[-1]["teardown"] = time.monotonic() - start
        init_megatron(ep=2)
        if recipe:
            release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
            rows[-1]["released"] = (release.freed, release.leaked, release.left)
    return {"rows": rows, "warnings": list(warnings)}


@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_restart_after_an_abort_keeps_memory_flat(dist_job, patched_tree, backend):
    """An abort (the groups destroyed) followed by the teardown waits on nobody and frees
    nothing; the restart recipe (every rank calls the explicit release over the new world before
    the first step) frees the old lifetime's buffer, so the restarted job holds what the first
    one held: the same bytes and one buffer after every round. The series at e19ffb0 freed the
    old buffer inside the next dispatch instead, where a replaced peer or a new layout never
    meets it."""
    for rank, res in enumerate(
        dist_job(
            f"{THIS}:rank_restart_after_abort",
            2,
            patched_tree,
            timeout=180.0,
            backend=backend,
            rounds=3,
            recipe=True,
        )  # fmt: skip
    ):
        rows = res["rows"]
        assert all(r["teardown"] < 2.0 for r in rows), (rank, rows)
        # Flat but for the 4-byte RDMA receive counter deep_ep's destroy() never frees
        # (deep_ep.cpp:299-304), as the unpatched buffer's destructor leaks it too.
        kept = [r["bytes"] - r["deep_ep_leaks"] for r in rows]
        assert kept == [kept[0]] * len(rows), (rank, rows)
        leaks = [r["deep_ep_leaks"] - rows[0]["deep_ep_leaks"] for r in rows]
        assert leaks == [4 * i if backend == "deepep" else 0 for i in range(len(rows))], rows
        assert all(r["alive"] == 1 and r["in_use"] == 1 for r in rows), (rank, rows)
        assert all(r["released"] == ({backend: 1}, [], []) for r in rows), (rank, rows)
        assert res["warnings"] == [], (rank, res)


def test_restart_without_the_recipe_keeps_each_lifetime_and_says_so(dist_job, patched_tree):
    """Without the explicit release after a restart nothing frees the old lifetime's buffer:
    each abort keeps one more (the next dispatch allocates, as the old group is gone), and the
    first allocation after the first abort says once where the memory returns."""
    for rank, res in enumerate(
        dist_job(
            f"{THIS}:rank_restart_after_abort",
            2,
            patched_tree,
            timeout=180.0,
            backend="hybridep",
            rounds=3,
            recipe=False,
        )  # fmt: skip
    ):
        rows = res["rows"]
        assert [r["alive"] for r in rows] == [1, 2, 3], (rank, rows)
        assert all(r["in_use"] == 1 for r in rows), (rank, rows)
        held = [w for w in res["warnings"] if "taken out of use" in w]
        assert len(held) == 1, (rank, res["warnings"])


def rank_release_holding_different_buffers():
    """Rank side (3 ranks): DeepEP buffers on groups [0, 1] and [1, 2] (each made by its own
    ranks): the ranks hold different sets, and rank 1 two. Every rank releases collectively."""
    import time

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import allocated_comm_buffers

    _counter()
    groups = [dist.new_group([0, 1]), dist.new_group([1, 2])]
    for group in groups:
        if dist.get_rank() in dist.get_process_group_ranks(group):
            fused_a2a.get_buffer(group, hidden_bytes=32)
    held = len(allocated_comm_buffers(fused_a2a))
    start = time.monotonic()
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return {
        "held": held,
        "elapsed": time.monotonic() - start,
        "left": len(allocated_comm_buffers(fused_a2a)),
        "freed": release.freed,
    }


def test_ranks_holding_different_buffers_release_without_deadlock(dist_job, patched_tree):
    """The collective release is one exchange on one group (the world), whatever buffers each
    rank holds, then each buffer's destroy() among its own peers, in one order on every rank: a
    barrier per held buffer's group would leave rank 0 waiting on a group it is not in."""
    outs = dist_job(f"{THIS}:rank_release_holding_different_buffers", 3, patched_tree)
    assert [r["held"] for r in outs] == [1, 2, 1], outs
    assert [r["freed"] for r in outs] == [{"deepep": 1}, {"deepep": 2}, {"deepep": 1}], outs
    for rank, res in enumerate(outs):
        assert res["left"] == 0 and res["elapsed"] < 5.0, (rank, res)


def rank_collective_release_after_abort(backend: str, reuse_comm: bool = False):
    """Rank side: after a step the groups megatron created are destroyed (an abort), then the
    teardown; the job's world still holds every peer, so the collective release over it frees
    what the teardown took out of use. ``reuse_comm``: DeepEP v2 built on the process group's
    own NCCL communicator (EP_REUSE_NCCL_COMM=1), which the abort destroyed."""
    import os

    if reuse_comm:
        os.environ["EP_REUSE_NCCL_COMM"] = "1"
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=2)
    _layer_step(backend, 2)
    ref = weakref.ref(_buffer(backend))
    nbytes = _nbytes(ref())
    world = dist.group.WORLD
    groups = {g for g in vars(parallel_state).values() if isinstance(g, dist.ProcessGroup)}
    for group in groups - {world}:
        dist.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
    gc.collect()
    before = mem.settled()
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    out = {
        "freed": before - mem.settled(),
        "nbytes": nbytes,
        "alive": ref() is not None and getattr(ref(), "runtime", None) is not None,
        "held": len(held_comm_buffers(fused_a2a)),
        "leaked": release.leaked,
    }
    if reuse_comm and out["alive"]:
        ref().runtime.exiting = True  # leaked: the process's exit frees it, as on a GPU
    return out


@pytest.mark.parametrize("backend", WAITING_BACKENDS)
def test_collective_release_after_an_abort_frees_every_buffer(dist_job, patched_tree, backend):
    """After an abort the teardown waits on nobody and the collective release (over the world,
    which the abort kept) frees the buffers the teardown took out of use: nothing is kept for
    the life of the process. The series at 9ee7333 parked them, unfreed, for good. DeepEP v2's
    destroy() runs on the NCCL communicator DeepEP made for the group, which the abort left."""
    for rank, out in enumerate(
        dist_job(
            f"{THIS}:rank_collective_release_after_abort", 2, patched_tree, backend=backend
        )  # fmt: skip
    ):
        assert out["held"] == 0 and not out["alive"], (rank, out)
        assert out["freed"] == out["nbytes"] > 0 and out["leaked"] == [], (rank, out)


@pytest.mark.flex_backend("deepepv2")
def test_deep_ep_v2_on_the_groups_communicator_is_leaked_after_an_abort(dist_job, patched_tree):
    """With EP_REUSE_NCCL_COMM=1 DeepEP v2 runs on the process group's own communicator, gone
    with the aborted group: its destroy() would use it after free, so the release leaks the
    buffer on every rank, says why, and waits on nothing."""
    for rank, out in enumerate(
        dist_job(
            f"{THIS}:rank_collective_release_after_abort",
            2,
            patched_tree,
            backend="deepepv2",
            reuse_comm=True,
        )  # fmt: skip
    ):
        assert out["alive"] and out["freed"] == 0, (rank, out)
        why = "its process group is gone, which its free needs"
        assert out["leaked"] == [("deepepv2", [0, 1], why)], (rank, out)


def rank_deep_ep_explicit_destroy():
    """Rank side: after a DeepEP step, keep a second reference to the buffer; the release frees
    its bytes anyway (Buffer.destroy()), and the buffer refuses any later use. Then the
    emulation's own contract: destroy() needs the flag, and a flagged buffer dropped without
    destroy() stays allocated, as deep_ep leaks it."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.kernels import deepep_module as emu
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    _layer_step("deepep", dist.get_world_size())
    buffer = _buffer("deepep")
    out = {"flag": buffer.explicitly_destroy, "nbytes": buffer.nbytes}
    gc.collect()
    before = mem.settled()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    out["freed_while_referenced"] = before - mem.settled()
    out["runtime"] = buffer.runtime is not None
    try:
        buffer.get_dispatch_layout(torch.zeros(2, 1, dtype=torch.int64), 2)
        out["used_after_destroy"] = "ran"
    except AttributeError as exc:
        out["used_after_destroy"] = str(exc)
    group = dist.group.WORLD
    plain = emu.Buffer(group, 64, 0)
    try:
        plain.destroy()
        out["destroy_without_flag"] = "ran"
    except AssertionError as exc:
        out["destroy_without_flag"] = str(exc)
    del plain
    gc.collect()
    before = mem.settled()
    leaked = len(emu.LEAKED_BUFFERS)
    flagged = emu.Buffer(group, 4096, 0, explicitly_destroy=True)
    out["flagged_nbytes"] = flagged.nbytes
    del flagged
    gc.collect()
    out["leaked_bytes"] = mem.settled() - before
    out["leaked"] = len(emu.LEAKED_BUFFERS) - leaked
    try:
        emu.Buffer(group, 64, 0, not_a_deep_ep_argument=True)
        out["unknown_kwarg"] = "accepted"
    except TypeError:
        out["unknown_kwarg"] = "refused"
    return out


@pytest.mark.backport
def test_deep_ep_buffer_is_destroyed_explicitly(dist_job, patched_tree):
    for rank, res in enumerate(dist_job(f"{THIS}:rank_deep_ep_explicit_destroy", 2, patched_tree)):
        assert res["flag"], f"rank {rank}: the buffer was built without explicitly_destroy"
        assert res["freed_while_referenced"] == res["nbytes"] > 0, f"rank {rank}: {res}"
        assert not res["runtime"] and "NoneType" in res["used_after_destroy"], res
        assert "explicitly_destroy" in res["destroy_without_flag"], res
        # Device memory, the pinned counters and the RDMA counter: ~Buffer frees none of them.
        assert res["leaked"] == 3 and res["leaked_bytes"] == res["flagged_nbytes"] + 4 > 4096, res
        assert res["unknown_kwarg"] == "refused"


def failing_rank_exit_job(peer_free: str) -> None:
    """A training job as a launcher runs it: one MoE step on DeepEP; then rank 1 fails, catches
    its exception and exits with sys.exit(1), as torch.multiprocessing.spawn's children and
    pytest do (no uncaught exception: sys.last_exc stays unset), while rank 0 is busy elsewhere
    until the file ``peer_free`` appears, and never reaches any teardown. Run as a fresh
    process per rank (the emulation and placement rules installed as a rank does)."""
    import os
    import sys
    import time

    from moe_release import settings
    from moe_release.runtime.cuda import placement
    from moe_release.runtime.kernels.install import install_kernel_emulations
    from moe_release.runtime.megatron.moe_harness import build_moe_layer, init_megatron, moe_config

    install_kernel_emulations(settings.tree(required=True), False)
    placement.install()
    dist.init_process_group("gloo")
    init_megatron(ep=dist.get_world_size())
    layer = build_moe_layer(moe_config("deepep", dist.get_world_size()))
    y, _ = layer(torch.randn(TOKENS, 1, layer.config.hidden_size).requires_grad_())
    y.sum().backward()
    if dist.get_rank() == 0:
        deadline = time.monotonic() + 180
        while not os.path.exists(peer_free) and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    try:
        raise RuntimeError("a failure on this rank")
    except RuntimeError:
        sys.exit(1)


@pytest.mark.backport
def test_a_rank_exiting_after_a_caught_exception_waits_on_no_peer(patched_tree, tmp_path):
    """A rank that exits with sys.exit(1) after catching its failure runs no collective on its
    way out: it exits while its peer is still busy elsewhere (deep_ep may print that destroy()
    was not called; the driver frees the memory). The series at 9ee7333 ran DeepEP's collective
    destroy() from an atexit hook there (sys.last_exc is unset after a caught exception), and
    the unpatched base runs it from the buffer's destructor at interpreter exit: the rank waits
    for its peer until the device barrier gives up ("a GPU would trap"). Two fresh rank
    processes, bounded, always reaped."""
    import subprocess
    import sys
    import time

    from moe_release.runtime.ranks.launcher import free_port, rank_env

    port = free_port()
    peer_free = tmp_path / "peer-free"
    code = f"from {THIS} import failing_rank_exit_job; failing_rank_exit_job({str(peer_free)!r})"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env=rank_env(patched_tree, rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        deadline = time.monotonic() + 240
        while procs[1].poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        peer_busy = procs[0].poll() is None  # rank 0 waits for peer_free, written only now
        peer_free.write_text("")
        out = procs[1].communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        procs[0].wait(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[1].returncode == 1, out[-3000:]
    assert peer_busy, "rank 0 was gone before rank 1 exited"
    assert "a GPU would trap" not in out, out[-3000:]


def rank_teardown_without_fused_a2a():
    """Rank side: destroy_model_parallel() in a process where the MoE dispatcher modules were
    never imported (taken out of sys.modules here, and put back after): does it import them,
    and what does it log?"""
    import sys

    from megatron.core import parallel_state
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=dist.get_world_size())
    warnings = _Warnings()
    names = [n for n in sys.modules if n.startswith("megatron.core.transformer.moe.")]
    saved = {n: sys.modules.pop(n) for n in names}
    try:
        parallel_state.destroy_model_parallel()
        imported = sorted(n for n in sys.modules if n.startswith("megatron.core.transformer.moe."))
    finally:
        for name in [n for n in sys.modules if n.startswith("megatron.core.transformer.moe.")]:
            del sys.modules[name]
        sys.modules.update(saved)
    return {"warnings": list(warnings), "imported": imported}


def test_teardown_imports_no_moe_module_and_logs_nothing(dist_job, patched_tree):
    """Where no MoE dispatcher module was imported nothing can hold a buffer: the teardown
    imports none (fused_a2a, token_dispatcher) and logs nothing (the series at 3c43fe0 imported
    fused_a2a on every teardown and logged a failed import as a failed release)."""
    for rank, out in enumerate(
        dist_job(f"{THIS}:rank_teardown_without_fused_a2a", 2, patched_tree)
    ):
        assert out == {"warnings": [], "imported": []}, (rank, out)


def _alive(backend: str) -> int:
    """The emulated buffers of ``backend`` whose memory is still allocated (in use or not)."""
    from moe_release.runtime.kernels import deepep_emulation, hybridep_emulation

    cls = {"hybridep": hybridep_emulation.HybridEPBuffer, "deepep": deepep_emulation.Buffer}
    return sum(
        isinstance(o, cls[backend]) and getattr(o, "memory", None) is not None
        for o in gc.get_objects()
    )


def rank_live_graph(backend: str, attempt: bool):
    """Rank side: a forward whose backward has not run, (with ``attempt``) the explicit release
    tried on every rank, then the backward, then the explicit release."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import build_moe_layer, init_megatron, moe_config
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    mem = _counter()
    init_megatron(ep=dist.get_world_size())
    torch.manual_seed(5)
    layer = build_moe_layer(moe_config(backend, dist.get_world_size()))
    layer.train()
    x = harness.seeded((dist.get_world_size(), TOKENS, 16), 8)[dist.get_rank()]
    x = x.view(TOKENS, 1, -1).requires_grad_()
    y, _ = layer(x)
    out = {"refused": None}
    if attempt:
        gc.collect()
        before = mem.settled()
        try:
            fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        except RuntimeError as exc:
            out["refused"] = str(exc)
        gc.collect()
        out["freed_by_refusal"] = before - mem.settled()
        out["in_use_after_refusal"] = _buffer(backend) is not None
    y.backward(harness.seeded(y.shape, 9))
    out["y"], out["x_grad"] = y.detach().clone(), x.grad.clone()
    del y
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    out.update(freed=release.freed, alive=_alive(backend))
    return out


@pytest.mark.backport
@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_release_refuses_on_every_rank_while_a_graph_uses_a_buffer(dist_job, patched_tree, backend):
    """The explicit release between a forward and its backward raises on every rank and frees
    nothing (the backward still needs the buffer); the backward then runs bitwise as without
    the attempt, and the release after it frees the buffer. The series at e19ffb0 ran its
    barrier and returned, freeing nothing on HybridEP (the graph held the buffer) and destroying
    DeepEP's, which the backward silently re-created."""
    tried = dist_job(f"{THIS}:rank_live_graph", 2, patched_tree, backend=backend, attempt=True)
    plain = dist_job(f"{THIS}:rank_live_graph", 2, patched_tree, backend=backend, attempt=False)
    for rank, (t, p) in enumerate(zip(tried, plain)):
        assert t["refused"] and "autograd graph" in t["refused"], (rank, t)
        assert "nothing was freed on any rank" in t["refused"], (rank, t)
        assert t["freed_by_refusal"] == 0 and t["in_use_after_refusal"], (rank, t)
        assert torch.equal(t["y"], p["y"]) and torch.equal(t["x_grad"], p["x_grad"]), rank
        assert t["freed"] == {backend: 1} and t["alive"] == 0, (rank, t)


def rank_refusals():
    """Rank side: the explicit release without a group, and on another thread: each refused
    before any collective, nothing freed."""
    import threading

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=dist.get_world_size())
    _layer_step("hybridep", dist.get_world_size())
    out = {}
    try:
        fused_a2a.reset_fused_a2a_buffers(collective=True)
        out["no_group"] = None
    except ValueError as exc:
        out["no_group"] = str(exc)
    caught = []

    def release():
        try:
            fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
            caught.append(None)
        except RuntimeError as exc:
            caught.append(str(exc))

    thread = threading.Thread(target=release)
    thread.start()
    thread.join(timeout=30)
    out["off_main_thread"] = caught[0] if caught else "still running"
    out["in_use"] = _buffer("hybridep") is not None
    return out


@pytest.mark.backport
def test_release_refuses_without_a_group_or_off_the_main_thread(dist_job, patched_tree):
    """The explicit release names its group (every rank of it calls it) and runs on the main
    thread: without either it raises before any collective and frees nothing. The series at
    e19ffb0 released over the world by default and from any thread."""
    for rank, out in enumerate(dist_job(f"{THIS}:rank_refusals", 2, patched_tree)):
        assert out["no_group"] and "needs group=" in out["no_group"], (rank, out)
        assert out["off_main_thread"] and "main thread" in out["off_main_thread"], (rank, out)
        assert out["in_use"], (rank, out)


def rank_nothing_freed_implicitly(backend: str):
    """Rank side: every way a buffer goes out of use, each followed by a dispatch that
    allocates: the teardown after an abort (the next forward allocates), a fixture clearing
    the module global between a forward and its backward (the backward, or with HybridEP the
    recomputed forward inside it, allocates). No buffer is freed on the way; the explicit
    release then frees them all."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.fault_scenarios import abort_groups
    from moe_release.runtime.megatron.moe_harness import build_moe_layer, init_megatron, moe_config
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    alias = {"hybridep": "_hybrid_ep_buffer", "deepep": "_buffer"}[backend]
    _counter()
    init_megatron(ep=2)
    _layer_step(backend, 2)
    out = {"made": [_alive(backend)]}
    abort_groups()
    parallel_state.destroy_model_parallel()
    init_megatron(ep=2)
    torch.manual_seed(5)
    layer = build_moe_layer(moe_config(backend, 2, recompute=backend == "hybridep"))
    layer.train()
    x = harness.seeded((2, TOKENS, 16), 8)[dist.get_rank()].view(TOKENS, 1, -1)
    y, _ = layer(x.requires_grad_())
    out["made"].append(_alive(backend))
    setattr(fused_a2a, alias, None)  # a fixture's clear: the backward's dispatch allocates
    y.backward(harness.seeded(y.shape, 9))
    del y
    gc.collect()
    out["made"].append(_alive(backend))
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    out.update(freed=release.freed, leaked=release.leaked, left=release.left, alive=_alive(backend))
    return out


@pytest.mark.backport
@pytest.mark.parametrize("backend", ["hybridep", "deepep"])
def test_no_buffer_is_freed_outside_the_explicit_release(dist_job, patched_tree, backend):
    """Neither a dispatch after an abort's teardown nor a backward (or recompute) that
    allocates frees a buffer: every buffer made stays allocated until the explicit release,
    which frees all three. The series at e19ffb0 destroyed the buffers a release took out of use
    inside the next allocating dispatch (a replaced peer or a new layout never meets it) and
    inside a backward; the base frees a replaced buffer in its destructor."""
    for rank, out in enumerate(
        dist_job(f"{THIS}:rank_nothing_freed_implicitly", 2, patched_tree, backend=backend)
    ):
        assert out["made"] == [1, 2, 3], (rank, out)
        assert out["freed"] == {backend: 3} and out["alive"] == 0, (rank, out)
        assert out["leaked"] == [] and out["left"] == [], (rank, out)


def rank_rebuild_for_new_group():
    """Rank side: NVIDIA/Megatron-LM#7029's test_hybridep_rebuilds_buffer_for_new_group, as that
    PR writes it (a stand-in HybridEPBuffer, bare objects as groups, the autograd function's
    forward called directly), and two models' groups switching back."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe import fused_a2a

    created = []

    class Buffer:
        def __init__(self, group, **kwargs):
            self.group = group
            created.append(self)

        def dispatch_with_permute(self, **kwargs):
            return None, None, None, None, object()

    saved = fused_a2a.HybridEPBuffer, fused_a2a._hybrid_ep_buffer, fused_a2a._buffer
    fused_a2a.HybridEPBuffer, fused_a2a._hybrid_ep_buffer, fused_a2a._buffer = Buffer, None, None
    try:
        first_group, second_group = object(), object()
        routing_map = torch.ones(2, 1, dtype=torch.bool)
        aliases = []
        for group in (first_group, first_group, second_group, first_group):
            fused_a2a.HybridEPDispatch.forward(
                SimpleNamespace(), torch.ones(2, 4), routing_map, None, group, 1
            )
            aliases.append(fused_a2a._hybrid_ep_buffer.group is group)
        made = [buffer.group for buffer in created] == [first_group, second_group]
        fused_a2a.reset_fused_a2a_buffers()
        return {"aliases": aliases, "made": made, "reset": fused_a2a._hybrid_ep_buffer is None}
    finally:
        fused_a2a.HybridEPBuffer = saved[0]


@pytest.mark.backport
def test_hybridep_rebuilds_buffer_for_new_group_as_7029_tests_it(dist_job, patched_tree):
    """#7029's contract for the HybridEP buffer: a dispatch on the same group reuses its buffer,
    one on a new group makes its own and ``_hybrid_ep_buffer`` names it, and the no-argument
    release empties it; switching back to the first group reuses the first buffer (no new one
    per switch). The base reuses the first group's buffer for the second group."""
    (out,) = dist_job(f"{THIS}:rank_rebuild_for_new_group", 1, patched_tree)
    assert out == {"aliases": [True, True, True, True], "made": True, "reset": True}, out


def rank_release_with_one_rank_apart(how: str):
    """Rank side: after a HybridEP step, rank 1 alone has dropped its buffer's C++ runtime
    ("destroyed"), has its free fail ("fails"), or every rank keeps a reference to its buffer
    ("referenced"); then every rank calls the explicit release."""
    import time

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron

    mem = _counter()
    init_megatron(ep=2)
    _layer_step("hybridep", 2)
    buffer = _buffer("hybridep")
    nbytes = _nbytes(buffer)
    if dist.get_rank() == 1 and how == "destroyed":
        buffer.runtime = None
    if dist.get_rank() == 1 and how == "fails":

        def failing(buffer):
            raise RuntimeError("injected free failure")

        fused_a2a._free = failing
    kept = buffer if how == "referenced" else None
    del buffer
    gc.collect()
    before = mem.settled()
    start = time.monotonic()
    out = {"raised": None, "leaked": None, "freed": None}
    try:
        release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
        out.update(freed=release.freed, leaked=release.leaked, left=release.left)
    except RuntimeError as exc:
        out["raised"] = str(exc)
    gc.collect()
    out.update(
        elapsed=time.monotonic() - start,
        freed_bytes=before - mem.settled(),
        nbytes=nbytes,
        kept_runtime=kept is not None and kept.runtime is not None,
    )
    return out


def _apart(dist_job, patched_tree, how: str) -> list:
    return dist_job(f"{THIS}:rank_release_with_one_rank_apart", 2, patched_tree, how=how)


def test_a_buffer_referenced_outside_is_freed_on_every_rank(dist_job, patched_tree):
    """Code outside fused_a2a holding the buffer (ART reads _hybrid_ep_buffer) does not make one
    rank keep memory its peers free: the release drops the C++ buffer on every rank, and the
    Python object left behind holds none (e19ffb0's series left it, rank by rank)."""
    for rank, out in enumerate(_apart(dist_job, patched_tree, "referenced")):
        assert out["raised"] is None and out["freed"] == {"hybridep": 1}, (rank, out)
        assert out["freed_bytes"] == out["nbytes"] > 0 and not out["kept_runtime"], (rank, out)


def test_a_buffer_destroyed_on_one_rank_is_leaked_on_every_rank(dist_job, patched_tree):
    """What a rank destroyed outside the release is in the exchange: every rank takes the same
    decision (leak, naming the rank), not each its own."""
    why = "rank(s) [1] destroyed it outside this call"
    for rank, out in enumerate(_apart(dist_job, patched_tree, "destroyed")):
        assert out["raised"] is None and out["leaked"] == [("hybridep", [0, 1], why)], out
        assert out["freed"] == {}, (rank, out)


def test_a_failed_free_raises_on_every_rank(dist_job, patched_tree):
    """A free failing on rank 1 does not stop rank 0's, and after the last the ranks exchange
    their failures: both raise, naming the rank and the buffer, and neither waits."""
    for rank, out in enumerate(_apart(dist_job, patched_tree, "fails")):
        assert out["raised"] is not None, (rank, out)
        failure = "rank 1: the hybridep buffer of ranks [0, 1]: RuntimeError: injected free"
        assert failure in out["raised"], (rank, out)
        assert out["elapsed"] < 5.0, (rank, out)
