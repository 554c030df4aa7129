# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""DeepEP v2's ElasticBuffer (dev's ``deepepv2`` flex backend) outlives every backward that
still uses it, and is destroyed at the first dispatch after the last one, or by the collective
release.

``DeepepV2Dispatch`` and ``DeepepV2Combine`` keep their forward's buffer in the autograd ctx and
dispatch or combine on it in their backward, while ``get_elastic_buffer()`` replaces the buffer
whenever a dispatch has more tokens per rank than the last (variable-length or packed
microbatches). Where an earlier microbatch's backward is still pending then (two forwards before
their backwards, the combined-1F1B A2A overlap, PP warm-up), destroying the replaced buffer made
that backward fail ("'NoneType' object has no attribute 'combine'"): a release must not do that.
Each case runs megatron dev's real MoELayer / GPTModel / schedules on CPU gloo ranks with the
DeepEP v2 emulation (whose destroy() leaves the buffer unusable, as DeepEP's does), and only
where the tree has DeepEP v2 (dev; deselected elsewhere).
"""

import gc

import pytest
import torch
import torch.distributed as dist

THIS = "tests.unit_tests.transformer.moe.test_deepep_v2_buffer"
HIDDEN = 256  # DeepEP v2's combine kernel needs a multiple of 256
pytestmark = pytest.mark.flex_backend("deepepv2")


def _layer(ep: int):
    from moe_release.runtime.megatron import moe_harness
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    config = moe_harness.moe_config("deepepv2", ep, hidden=HIDDEN, dtype=torch.bfloat16)
    layer = moe_harness.build_moe_layer(config)
    layer.train()
    harness.load_layer_weights(layer, config)
    return layer


def _live_v2_bytes() -> int:
    """Bytes the emulated DeepEP v2 buffers of this process still hold (window and host)."""
    from moe_release.runtime.kernels import deepepv2_emulation as v2

    return sum(
        r.window.nbytes + r.host_workspace.nbytes for r in list(v2._RUNTIMES) if not r.destroyed
    )


def rank_pending_backward():
    """Rank side: forwards of 8 then 16 tokens (the buffer is replaced by a larger one while the
    first forward's backward is pending), then both backwards; and the same layer with each
    backward right after its forward. Returns both runs' outputs and input gradients, and what
    the DeepEP v2 buffers hold at each point."""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    init_megatron(ep=dist.get_world_size())
    layer = _layer(dist.get_world_size())
    rank = dist.get_rank()
    inputs = [harness.seeded((n, 1, HIDDEN), 40 + n + rank, torch.bfloat16) for n in (8, 16)]
    grads = [harness.seeded((n, 1, HIDDEN), 60 + n + rank, torch.bfloat16) for n in (8, 16)]
    out = {"held": {}}

    def forward(i):
        x = inputs[i].clone().requires_grad_()
        return x, layer(x)[0]

    pending = [forward(0)]
    first = fused_a2a._elastic_buffer
    pending.append(forward(1))
    out["replaced"] = fused_a2a._elastic_buffer is not first
    out["held"]["both forwards"] = _live_v2_bytes()
    del first
    results = []
    try:
        for (x, y), g in zip(pending, grads):
            y.backward(g)
            results.append((y.detach().clone(), x.grad.clone()))
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        out["error"] = f"{type(exc).__name__}: {exc}"
    del pending, x, y
    gc.collect()
    out["held"]["backwards done"] = _live_v2_bytes()
    with torch.no_grad():  # the next dispatch, which no backward follows
        layer(inputs[0])
    out["held"]["next dispatch"] = _live_v2_bytes()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    out["held"]["released"] = _live_v2_bytes()
    # The reference: each backward right after its forward.
    in_order = []
    for i, g in enumerate(grads):
        x, y = forward(i)
        y.backward(g)
        in_order.append((y.detach().clone(), x.grad.clone()))
    out["pending"], out["in_order"] = results, in_order
    out["in_order_held"] = _live_v2_bytes()
    return out


@pytest.mark.backport
def test_a_replaced_buffer_serves_its_pending_backward(dist_job, patched_tree):
    """Two forwards of 8 and 16 tokens, then their backwards: the first backward runs on the
    buffer its forward used (replaced, not destroyed), bitwise as if each backward had followed
    its forward; no dispatch destroys the replaced buffer (its destroy() is collective), the
    explicit release frees both, and the same steps in order hold the same two buffers. On dev's
    series before the fix the first backward raised on the destroyed buffer."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_pending_backward", 2, patched_tree)):
        assert res["error"] is None, f"rank {rank}: {res['error']}"
        assert res["replaced"], rank
        for (y, g), (ry, rg) in zip(res["pending"], res["in_order"]):
            assert torch.equal(y, ry) and torch.equal(g, rg), rank
        held = res["held"]
        # Both buffers until the explicit release, the next dispatch included; nothing after it.
        # In order the 8-token buffer grows into the 16-token one too, and is kept the same way:
        # the pending backward costs no buffer beyond what the growth costs.
        assert held["both forwards"] == held["backwards done"] == held["next dispatch"], held
        assert held["released"] == 0, held
        assert res["in_order_held"] == held["next dispatch"] > 0, (held, res["in_order_held"])


def rank_growth_without_pending():
    """Rank side: the buffer grows while nothing else references the old one: the old one stays
    allocated beside its replacement until the explicit release frees both."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory
    from moe_release.runtime.megatron.moe_harness import init_megatron

    cpu_memory.install()
    init_megatron(ep=dist.get_world_size())
    group = parallel_state.get_expert_model_parallel_group()
    fused_a2a.get_elastic_buffer(group, 8, HIDDEN, 2)
    old = _live_v2_bytes()
    gc.collect()
    before = cpu_memory.memory_allocated()
    cpu_memory.reset_peak_memory_stats()
    fused_a2a.get_elastic_buffer(group, 16, HIDDEN, 2)
    peak = cpu_memory.max_memory_allocated() - before
    new = _live_v2_bytes()
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return {"old": old, "new": new, "peak": peak, "after": _live_v2_bytes()}


def test_growth_keeps_the_old_buffer_for_the_explicit_release(dist_job, patched_tree):
    """No dispatch destroys a DeepEP v2 buffer (destroy() is collective, and a pending backward
    may still use it): growth holds both, and the explicit release frees both."""
    for rank, res in enumerate(dist_job(f"{THIS}:rank_growth_without_pending", 2, patched_tree)):
        assert res["old"] > 0 and res["new"] > 2 * res["old"], res  # both held, new the larger
        # The new buffer on top of the old one (and the constructor's exchange, a few bytes).
        assert res["new"] - res["old"] <= res["peak"] < res["new"] - res["old"] + 512, (rank, res)
        assert res["after"] == 0, res


# The same through megatron's schedules, with microbatches that grow (4, 8, 12, 16 tokens x 2).
SMALL = dict(experts=4, topk=2, hidden=HIDDEN, ffn=64, heads=2, vocab=64, seq=8, mbs=2)
SMALL.update(microbatches=4, seed=7, seqs=[4, 8, 12, 16], dispatcher="flex", backend="deepepv2")


@pytest.mark.parametrize("tree", ["patched", "base"])
def test_overlap_with_growing_microbatches(dist_job, patched_tree, base_tree, tree):
    """The combined-1F1B A2A overlap runs each microbatch's forward beside the previous one's
    backward, so every growth replaces the buffer a pending backward holds: the step completes
    and is bitwise equal to the same step with the overlap off, on the series and the base."""
    path = patched_tree if tree == "patched" else base_tree
    runner = "moe_release.runtime.megatron.a2a_overlap:overlap_run"
    on = dist_job(runner, 2, path, cfg=dict(SMALL, layers=2, overlap=True))
    off = dist_job(runner, 2, path, cfg=dict(SMALL, layers=2, overlap=False))
    for rank, (a, b) in enumerate(zip(on, off)):
        assert a["comm_ops"] > 0, rank
        assert all(torch.equal(p, q) for p, q in zip(a["losses"], b["losses"])), rank
        assert a["grads"].keys() == b["grads"].keys() and a["grads"], rank
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), rank


def test_pipeline_warmup_with_growing_microbatches(dist_job, patched_tree, base_tree):
    """PP=2 x EP=2, 1F1B: the first stage runs the next microbatch's forward (larger: the buffer
    grows) before the previous one's backward. The step completes and is bitwise the base's."""
    runner = "moe_release.runtime.megatron.a2a_overlap:overlap_run"
    cfg = dict(SMALL, layers=2, overlap=False, pp=2,
               config_overrides=dict(variable_seq_lengths=True))  # fmt: skip
    patched = dist_job(runner, 4, patched_tree, cfg=cfg)
    base = dist_job(runner, 4, base_tree, cfg=cfg)
    for rank, (a, b) in enumerate(zip(patched, base)):
        assert all(torch.equal(p, q) for p, q in zip(a["losses"], b["losses"])), rank
        assert a["grads"].keys() == b["grads"].keys() and a["grads"], rank
        assert all(torch.equal(a["grads"][n], b["grads"][n]) for n in a["grads"]), rank


def rank_one_rank_raises_with_a_backward_pending():
    """Rank side: forwards of 8 then 16 tokens (the buffer is replaced while the first
    backward is pending), then rank 1 fails: its handler drops the graphs, and so the last
    references to the replaced buffer. Then both ranks meet in a barrier on the world. Did
    anything destroy (a collective) the replaced buffer on rank 1 alone?"""
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.megatron.moe_harness import init_megatron
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness

    init_megatron(ep=dist.get_world_size())
    layer = _layer(dist.get_world_size())
    rank = dist.get_rank()
    pending = []
    for n in (8, 16):
        x = harness.seeded((n, 1, HIDDEN), 40 + n + rank, torch.bfloat16).requires_grad_()
        pending.append(layer(x)[0])
        if n == 8:
            runtime = fused_a2a._elastic_buffer.runtime
    if rank == 1:
        try:
            raise RuntimeError("a failure on this rank")
        except RuntimeError:
            del pending
            gc.collect()
    out = {"destroyed_alone": rank == 1 and runtime.destroyed}
    dist.barrier()
    pending = None
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return out


def test_one_rank_failing_with_a_backward_pending_destroys_nothing_alone(dist_job, patched_tree):
    """A replaced buffer whose pending backward is dropped by one failing rank is not destroyed
    there: destroy() is collective, and its peer is elsewhere (here in a barrier on the world).
    The dev series at 9ee7333 destroyed it from a weakref.finalize on that rank alone, and the
    two ranks deadlocked; the unpatched dev branch does the same through ~ElasticBuffer."""
    for rank, out in enumerate(
        dist_job(
            f"{THIS}:rank_one_rank_raises_with_a_backward_pending", 2, patched_tree, timeout=90.0
        )  # fmt: skip
    ):
        assert not out["destroyed_alone"], (rank, out)
