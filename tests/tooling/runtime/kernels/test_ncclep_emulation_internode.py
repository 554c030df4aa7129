# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""NCCL EP across LSA teams: four gloo ranks as two emulated NVLink domains of two
(``MOE_RELEASE_RANKS_PER_NODE=2``): the bootstrap's group takes ``init_ht_internode``'s path
(nccl-extensions 9f47d6eb ``nccl_ep.cc:1300-1510``).

* The GIN buffer's regions and the context's team-sized terms, worked by hand here.
* megatron-core's real MoELayer (flex, ncclep) gives bitwise the one-team forward and backward.
* The GIN window is registered at the bootstrap and deregistered at ``ep_finalize`` over the
  whole EP group (collective log); the patched tree's ``reset_fused_a2a_buffers(collective=True,
  group=...)`` frees the context with the GIN buffer; a peer that never finalizes makes the
  others raise "a GPU would trap" within the bound.
"""

import gc
import os
import time

import pytest

THIS = "tests.tooling.runtime.kernels.test_ncclep_emulation_internode"
WORLD, PER_NODE = 4, 2
LAYOUT_ENV = "MOE_RELEASE_RANKS_PER_NODE"
pytestmark = pytest.mark.flex_backend("ncclep")


def _ops(entries, start: int):
    return [(e["op"], e["ranks"]) for e in entries[start:] if str(e["op"]).startswith("ncclep")]


def _step(seed: int = 11):
    import torch
    import torch.distributed as dist

    from moe_release.runtime.megatron import moe_harness
    from tests.unit_tests.transformer.moe import moe_cpu_harness as harness
    from tests.unit_tests.transformer.moe import test_nccl_ep_buffers as buffers

    config = buffers._config(WORLD, False)
    layer = moe_harness.build_moe_layer(config)
    layer.train()
    harness.load_layer_weights(layer, config)
    rank, h = dist.get_rank(), config.hidden_size
    x = harness.seeded((buffers.TOKENS, 1, h), seed + rank, torch.bfloat16).requires_grad_()
    out, _ = layer(x)
    out.backward(harness.seeded((buffers.TOKENS, 1, h), seed + 50 + rank, torch.bfloat16))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach().clone(), x.grad.clone(), grads


def rank_layer_across_teams():
    import torch
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.measure import cpu_memory, faults
    from moe_release.runtime.megatron.moe_harness import init_megatron

    cpu_memory.install()
    os.environ.pop(LAYOUT_ENV, None)
    init_megatron(ep=WORLD)
    one = _step()
    one_team = (te.BACKEND.lsa, te.BACKEND.teams, te.BACKEND.gin)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    os.environ[LAYOUT_ENV] = str(PER_NODE)
    start = len(faults.ENTRIES)
    two = _step()
    b = te.BACKEND
    res = {
        "one_team": (one_team[0], one_team[1], one_team[2] is None),
        "teams": (b.lsa, b.teams),
        "shape": (b.num_experts, b.max_tokens, b.max_recv, b.hidden),
        "gin": b.gin.nbytes,
        "device": b.memory[0].nbytes,
        "pinned": b.memory[1].nbytes,
        "built": _ops(faults.ENTRIES, start),
        "equal": [torch.equal(one[0], two[0]), torch.equal(one[1], two[1]),
                  one[2].keys() == two[2].keys()
                  and all(torch.equal(one[2][k], two[2][k]) for k in one[2])],
    }  # fmt: skip
    leaked = len(te.LEAKED)
    del b, one, two
    gc.collect()
    before, start = cpu_memory.settled(), len(faults.ENTRIES)
    fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    gc.collect()
    res.update(freed=before - cpu_memory.settled(), leaked=len(te.LEAKED) - leaked)
    res["teardown"] = _ops(faults.ENTRIES, start)
    res["bootstrapped"] = te.installed()._BOOTSTRAPPED
    return res


def rank_missing_peer():
    """Rank 3 never finalizes: the others' ep_finalize must raise within the bound."""
    import torch.distributed as dist

    from moe_release.runtime.kernels import ncclep_emulation as te
    from moe_release.runtime.megatron.moe_harness import init_megatron

    init_megatron(ep=WORLD)
    m = te.installed()
    if m._BOOTSTRAPPED:
        m.ep_finalize()
    kwargs = dict(num_experts=8, max_tokens_per_rank=8, hidden_dim=64)
    if "num_topk" in m.ep_bootstrap.__code__.co_varnames:
        kwargs.update(num_topk=2, recv_capacity_per_rank=32)
    else:
        kwargs.update(recv_capacity_per_rank=32)
    m.ep_bootstrap(dist.group.WORLD, **kwargs)
    res = {"teams": te.BACKEND.teams}
    dist.barrier()
    t0 = time.monotonic()
    if dist.get_rank() != WORLD - 1:
        try:
            m.ep_finalize()
            res["verdict"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the verdict is the exception
            res["verdict"] = f"{type(exc).__name__}: {exc}"[:400]
    else:
        time.sleep(5)
        te.release_for_exit()
    res["s"] = time.monotonic() - t0
    res["bootstrapped"] = m._BOOTSTRAPPED
    return res


def _a(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _gin_by_hand(e: int, m: int, h: int) -> int:
    """nccl_ep.cc:1300-1358 at R = 4, L = 2 (D = 2 teams), E experts (E_l = E / 4), M tokens,
    B = 2H, 64-token chunks; every region rounded up to 4096."""
    b, p = 2 * h, (e // 4) * 2 * 4
    ht_m = _a(m, 64)
    regions = [
        ht_m * 1 * b, ht_m * 1 * b,  # combine RED / G2S tokens, (D - 1) = 1 peer team
        ht_m * 1 * p, ht_m * 1 * p,  # combine RED / G2S probabilities
        1 * (ht_m // 64) * 8, 1 * (ht_m // 64) * 8,  # dispatch / combine G2S flags
        2 * 8, 2 * 8,  # sync guards, D uint64 each
        m * b,  # token staging
        m * e * 4,  # dense probabilities
        1 * m * (b + p), 1 * m * (b + p),  # RDMA send / receive staging
    ]  # fmt: skip
    return sum(_a(r, 4096) for r in regions)


def _device_by_hand(e: int, m: int, mr: int, h: int) -> int:
    """The context's device bytes at L = 2 of R = 4 (nccl_ep.cc:1013-1063, 1950-1962)."""
    b = 2 * h
    mega = 2 * _a(m * 4 * b, 256) + 2 * _a(mr * (e // 4) * 2 * 4, 256) + _a(mr * b, 256)
    routing = 4 * m * (((e // 4) * 2 + 7) // 8) * 2
    return 32 * 1024 * 1024 + 32 + routing + mega + 8


@pytest.fixture(scope="module")
def layer_runs(dist_job, patched_tree):
    return dist_job(f"{THIS}:rank_layer_across_teams", WORLD, patched_tree, timeout=240.0)


def test_gin_buffer_and_context_by_hand(layer_runs):
    for res in layer_runs:
        assert res["one_team"] == (4, 1, True), res["one_team"]
        assert res["teams"] == (2, 2), res["teams"]
        e, m, mr, h = res["shape"]
        assert res["gin"] == _gin_by_hand(e, m, h), (res["shape"], res["gin"])
        assert res["device"] == _device_by_hand(e, m, mr, h), res["shape"]
        assert res["pinned"] == 40 * 2


def test_layer_is_bitwise_the_one_team_layer(layer_runs):
    for rank, res in enumerate(layer_runs):
        assert all(res["equal"]), (rank, res["equal"])


def test_gin_window_registered_and_released_over_the_group(layer_runs):
    everyone = list(range(WORLD))
    for res in layer_runs:
        assert ("ncclep gin window register", everyone) in res["built"], res["built"]
        assert res["teardown"] == [
            ("ncclep ep_finalize", everyone),
            ("ncclep gin window deregister", everyone),
        ], res["teardown"]
        assert not res["bootstrapped"] and res["leaked"] == 0
        assert res["freed"] >= res["gin"] + res["device"] + res["pinned"], res


def test_a_peer_that_never_finalizes(dist_job, patched_tree):
    mp = pytest.MonkeyPatch()
    mp.setenv(LAYOUT_ENV, str(PER_NODE))
    mp.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "3")
    try:
        runs = dist_job(f"{THIS}:rank_missing_peer", WORLD, patched_tree, timeout=90.0)
    finally:
        mp.undo()
    for rank, res in enumerate(runs[:-1]):
        assert res["teams"] == 2
        assert res["verdict"].startswith("DeviceBarrierTimeout"), (rank, res)
        assert "ncclep gin window deregister" in res["verdict"] and "would trap" in res["verdict"]
        assert 2.9 <= res["s"] < 15 and not res["bootstrapped"], res
