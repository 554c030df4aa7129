# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL's p2p matching rule on the CPU runtime (p2p_rules), through megatron-core's
own ``P2PCommunicator`` on gloo ranks.

One steady-state exchange of the interleaved schedule: each stage sends an activation to the
next stage and a gradient to the previous one, and receives both. With two stages the previous
and the next stage are one rank; megatron's batched p2p then matches the activation with the
gradient (by posting order, as NCCL does), which the rules refuse. The unbatched p2p of
``overlap_p2p_comm`` and three or more stages exchange correctly under the rules.
"""

import pytest

THIS = "tests.tooling.runtime.cuda.test_p2p_rules"


def exchange(batch: bool, rules: bool) -> dict:
    """Rank side: every rank is one pipeline stage; returns what it received from each side
    (an activation is ``100 * rank + 1``, a gradient ``100 * rank + 2``) or the error."""
    import torch
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from megatron.core import parallel_state
    from moe_release.runtime.cuda import p2p_rules
    from moe_release.runtime.megatron.moe_harness import init_megatron

    world = dist.get_world_size()
    init_megatron(ep=1, pp=world, vpp=2)
    if not rules:
        p2p_rules.uninstall()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=batch,
        overlap_p2p_comm=not batch,
    )
    comm = P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    rank, shape = dist.get_rank(), (2, 1, 4)
    activation = torch.full(shape, 100.0 * rank + 1, device="cuda")
    gradient = torch.full(shape, 100.0 * rank + 2, device="cuda")
    try:
        received, received_grad = comm.send_forward_backward_recv_forward_backward(
            activation, gradient, recv_prev=True, recv_next=True, tensor_shape=shape
        )
    except p2p_rules.P2PMatchError as exc:
        return {"error": str(exc)}
    finally:
        p2p_rules.uninstall()
    return {
        "from_prev": sorted({float(v) for v in received.flatten().tolist()}),
        "from_next": sorted({float(v) for v in received_grad.flatten().tolist()}),
    }


def _expected(rank: int, world: int) -> dict:
    return {
        "from_prev": [100.0 * ((rank - 1) % world) + 1],
        "from_next": [100.0 * ((rank + 1) % world) + 2],
    }


def test_two_stages_batched_swap_is_what_the_rule_refuses(dist_job, patched_tree):
    # Without the rules the swap happens (gloo matches by posting order, as NCCL does):
    # the "activation" each stage receives is its neighbour's gradient.
    plain = dist_job(f"{THIS}:exchange", 2, patched_tree, batch=True, rules=False)
    for rank, res in enumerate(plain):
        peer = 1 - rank
        assert res == {"from_prev": [100.0 * peer + 2], "from_next": [100.0 * peer + 1]}, res
    checked = dist_job(f"{THIS}:exchange", 2, patched_tree, batch=True, rules=True)
    for rank, res in enumerate(checked):
        assert "recv_prev (waiting for an activation" in res["error"], res
        assert f"rank {1 - rank}'s send_prev (a gradient" in res["error"], res


@pytest.mark.parametrize(
    "world,batch",
    [
        pytest.param(2, False, id="pp2-overlap_p2p_comm"),
        pytest.param(3, True, id="pp3-batched"),
        pytest.param(4, False, id="pp4-overlap_p2p_comm"),
    ],
)
def test_exchange_is_correct_under_the_rule(dist_job, patched_tree, world, batch):
    results = dist_job(f"{THIS}:exchange", world, patched_tree, batch=batch, rules=True)
    for rank, res in enumerate(results):
        assert res == _expected(rank, world), f"rank {rank}: {res}"
