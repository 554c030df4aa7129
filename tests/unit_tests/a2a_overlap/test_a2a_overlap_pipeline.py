# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""The 1F1B A2A overlap under pipeline parallelism, as it is trained: megatron-core's
``combined_1f1b_schedule_for_interleaved_pipelining`` through ``get_forward_backward_func()`` on
GPTModel chunks built per virtual stage (moe_release.runtime.megatron.a2a_overlap), PP=2 x EP=2 on
four gloo ranks, with megatron's training p2p for an interleaved schedule (``overlap_p2p_comm``, not
batched) under NCCL's matching rule (moe_release.runtime.cuda.p2p_rules).

* Overlap on is bitwise equal to overlap off (losses on the last stage, every gradient of every
  chunk), on the patched tree and on the base.
* Retention, per virtual stage: at each layer's finished backward nothing of its schedule state
  is held and what its forward stored is dead; every chunk plan is empty after its backward.
  These fail on the unpatched base (each layer plan keeps its dispatched probs and detached
  tensors, each chunk state its inputs).
* "PP=2 without virtual stages": megatron-core refuses the overlap with PP > 1 and no virtual
  stages (TransformerConfig), so it runs as one virtual stage per rank (one chunk each). Its
  reference with the overlap off is megatron's 1F1B without interleaving (the interleaved
  schedule with one chunk and ``overlap_p2p_comm`` fails in megatron-core 0.19.2 itself when
  the overlap is off: its steady state reads an ``output_tensor`` its warmup never set).
"""

import pytest
import torch

from moe_release.runtime.ranks.launcher import DistributedTestError

RUNNER = "moe_release.runtime.megatron.a2a_overlap:overlap_run"
SMALL = dict(experts=4, topk=2, hidden=16, ffn=32, heads=2, vocab=64, seq=8, mbs=2)
SMALL.update(microbatches=4, seed=7)

# (dispatcher, backend, pp, vpp, layers, ranks)
CASES = [
    pytest.param(("flex", "hybridep", 2, 2, 4, 4), id="hybridep-pp2-vpp2-ep2"),
    pytest.param(("flex", "deepep", 2, 2, 4, 4), id="deepep-pp2-vpp2-ep2"),
    pytest.param(("alltoall", "dropless", 2, 2, 4, 4), id="alltoall-pp2-vpp2-ep2"),
    pytest.param(("flex", "hybridep", 2, 1, 2, 4), id="hybridep-pp2-vpp1-ep2"),
    pytest.param(
        ("flex", "hybridep", 2, 2, 8, 4), id="hybridep-pp2-vpp2-8layers", marks=pytest.mark.slow
    ),
    pytest.param(("flex", "deepep", 3, 2, 6, 6), id="deepep-pp3-vpp2-ep2", marks=pytest.mark.slow),
    pytest.param(
        ("alltoall", "dropless", 2, 1, 2, 4), id="alltoall-pp2-vpp1-ep2", marks=pytest.mark.slow
    ),
]


def _cfg(case, **kw):
    dispatcher, backend, pp, vpp, layers, _ = case
    backend = backend if dispatcher == "flex" else "hybridep"
    cfg = dict(SMALL, dispatcher=dispatcher, backend=backend, pp=pp, vpp=vpp, layers=layers)
    cfg["microbatches"] = max(SMALL["microbatches"], 2 * pp)
    return dict(cfg, **kw)


def _run(dist_job, tree, case, **kw):
    return dist_job(RUNNER, case[-1], tree, cfg=_cfg(case, **kw))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tree", ["patched", "base"])
def test_pipelined_overlap_is_bitwise_equal_to_no_overlap(
    dist_job, patched_tree, base_tree, case, tree
):
    path = patched_tree if tree == "patched" else base_tree
    _, _, pp, vpp, _, ranks = case
    on = _run(dist_job, path, case, overlap=True)
    # One virtual stage: the reference is 1F1B without interleaving (see above).
    off = _run(dist_job, path, case, overlap=False, **({"vpp": None} if vpp == 1 else {}))
    last_stage = [rank for rank in range(ranks) if rank >= ranks - ranks // pp]
    for rank, (a, b) in enumerate(zip(on, off)):
        assert a["pipeline"] == {"pp": pp, "vpp": vpp, "ep": ranks // pp, "chunks": vpp}
        # The overlap path really ran (its nodes used the comm stream); the losses are the
        # last stage's.
        assert a["comm_ops"] > 0 and b["comm_ops"] == 0, rank
        expected = _cfg(case)["microbatches"] if rank in last_stage else 0
        assert len(a["losses"]) == len(b["losses"]) == expected, rank
        assert all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"])), rank
        assert a["grads"].keys() == b["grads"].keys() and a["grads"], rank
        differ = [n for n in a["grads"] if not torch.equal(a["grads"][n], b["grads"][n])]
        assert differ == [], f"rank {rank}: {differ}"


@pytest.mark.parametrize("case", CASES)
def test_pipelined_finished_layer_holds_nothing(dist_job, patched_tree, case):
    """Every layer plan of every virtual stage and microbatch, at its finished backward."""
    _, _, pp, vpp, layers, _ = case
    per_chunk = layers // (pp * vpp)
    microbatches = _cfg(case)["microbatches"]
    for rank, res in enumerate(_run(dist_job, patched_tree, case, overlap=True)):
        assert len(res["layers"]) == vpp * microbatches * per_chunk, f"rank {rank}"
        assert {r["stage"] for r in res["layers"]} == set(range(vpp)), f"rank {rank}"
        for rec in res["layers"]:
            where = f"rank {rank}, stage {rec['stage']}, plan {rec['microbatch']}"
            assert rec["bytes"] == {}, f"{where}: still held {rec['bytes']}"
            assert rec["alive"], where
            alive = [k for k, v in rec["alive"].items() if v]
            assert alive == [], f"{where}: still alive {alive}"


@pytest.mark.parametrize("case", CASES)
def test_pipelined_chunk_plans_released_after_backward(dist_job, patched_tree, case):
    _, _, _, vpp, _, _ = case
    for rank, res in enumerate(_run(dist_job, patched_tree, case, overlap=True)):
        assert len(res["chunks"]) == vpp * _cfg(case)["microbatches"], f"rank {rank}"
        assert {c["stage"] for c in res["chunks"]} == set(range(vpp)), f"rank {rank}"
        for chunk in res["chunks"]:
            assert chunk["bytes"] == {}, f"rank {rank}: {chunk}"
            assert not any(chunk["nodes_hold_chunk_state"]), f"rank {rank}: {chunk}"


def test_batched_p2p_with_two_stages_is_refused(dist_job, patched_tree):
    """The configuration that computes with swapped tensors on a GPU (two stages, virtual
    stages, batched p2p) stops at its first exchange instead of training on."""
    case = ("flex", "hybridep", 2, 2, 4, 4)
    batched = dict(batch_p2p_comm=True, overlap_p2p_comm=False)
    with pytest.raises(DistributedTestError, match="P2PMatchError: pipeline p2p: rank"):
        _run(dist_job, patched_tree, case, overlap=True, config_overrides=batched)
