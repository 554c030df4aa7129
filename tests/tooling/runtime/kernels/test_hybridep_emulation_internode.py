# Copyright (c) 2026, moe-release contributors. All rights reserved.

"""HybridEP across nodes: four gloo ranks as two emulated nodes of two
(``MOE_RELEASE_RANKS_PER_NODE=2``) take HybridEPBuffer's multi-node path, as the real buffer does
for a group larger than its NVLink domain (deep_ep 94a9f8f ``hybrid_ep.cu:62-70``).

* The buffer adds the RDMA coordinator's rows (``internode_doca.cu``) to the NVLink ones, at the
  sizes deep_ep's source gives, worked by hand here (not by the emulation's function), and lists
  exactly the docstring's ``[hybridep buffer, multi-node]`` table.
* Every output of the docstring's tables has its row's shape with M = 2 (the handle's per-node
  maps), the same rows the one-node job checks.
* megatron-core's real MoELayer (flex dispatcher, hybridep) gives bitwise the one-node forward and
  backward at the same seeds.
* The constructor connects the queue pairs through two all-gathers over the whole group (emulated
  as bounded rendezvous: a peer that never arrives makes the others raise, not hang); the
  patched tree's ``reset_fused_a2a_buffers(collective=True, group=...)`` frees the multi-node
  buffer, whose RDMA teardown is local (``internode_doca.cu:698-787``): a rank frees without
  waiting for a peer that never frees its own.
"""

import gc
import os
import time

import pytest

THIS = "tests.tooling.runtime.kernels.test_hybridep_emulation_internode"
WORLD, PER_NODE = 4, 2
LAYOUT_ENV = "MOE_RELEASE_RANKS_PER_NODE"


def _release_ops(entries, start: int):
    """``(op, ranks, extra)`` of the HybridEP entries the collective log holds from ``start``."""
    return [
        (e["op"], e["ranks"], {k: e[k] for k in ("collective", "peers") if k in e})
        for e in entries[start:]
        if str(e.get("op", "")).startswith("hybridep")
    ]


# --------------------------------------------------------------------------------------------
# Rank side: the MoELayer on one node, then on two.


def _layer_step(seed: int = 99):
    """megatron-core's MoELayer (flex, hybridep; global-seeded weights), forward and backward
    (test_comm_buffers' step): the output, the input's gradient and every parameter's."""
    import torch.distributed as dist

    from tests.unit_tests.transformer.moe import test_comm_buffers

    layer, out, x_grad = test_comm_buffers._layer_step("hybridep", dist.get_world_size(), seed)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out, x_grad, grads


def _held_buffer():
    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.cuda.compat import held_comm_buffers

    held = [b for b in held_comm_buffers(fused_a2a) if type(b).__name__ == "HybridEPBuffer"]
    assert len(held) <= 1, held
    return held[0] if held else None


def _release(fused_a2a):
    """The series' collective release (what it freed, per backend); on the base, which has
    none, its ``reset_hybrid_ep_buffer()`` drops the one buffer reference (the destructor
    frees it)."""
    import torch.distributed as dist

    if not hasattr(fused_a2a, "reset_fused_a2a_buffers"):
        fused_a2a.reset_hybrid_ep_buffer()
        return "no reset_fused_a2a_buffers on this tree (reset_hybrid_ep_buffer() used)"
    release = fused_a2a.reset_fused_a2a_buffers(collective=True, group=dist.group.WORLD)
    return dict(release.freed)


def rank_layer_across_nodes():
    """One node (the layout unset), released; then two nodes of two: the buffer's layout and
    terms, bitwise equality of the step, the collective log of its construction, and what the
    patched release frees with its log."""
    import torch
    import torch.distributed as dist

    from megatron.core.transformer.moe import fused_a2a
    from moe_release.runtime.measure import cpu_memory, faults
    from moe_release.runtime.megatron.moe_harness import init_megatron

    cpu_memory.install()
    os.environ.pop(LAYOUT_ENV, None)
    init_megatron(ep=dist.get_world_size())
    one = _layer_step()
    one_node = _held_buffer().num_of_nodes
    _release(fused_a2a)
    gc.collect()

    os.environ[LAYOUT_ENV] = str(PER_NODE)
    start = len(faults.ENTRIES)
    two = _layer_step()
    built = _release_ops(faults.ENTRIES, start)
    buf = _held_buffer()
    res = {
        "one_node": one_node,
        "layout": (buf.num_of_ranks_per_node, buf.num_of_nodes, buf.node_rank, buf.local_rank),
        "shape": (buf.rows, buf.hidden_dim, buf.num_local_experts),
        "blocks": (buf.num_sms_preprocessing_api, buf.num_of_blocks_dispatch_api,
                   buf.num_of_blocks_combine_api),
        "terms": [(t.name, t.nbytes, t.source) for t in buf.terms],
        "nbytes": buf.nbytes,
        "memory": buf.memory.nbytes,
        "built": built,
    }  # fmt: skip
    res["equal"] = {
        "output": torch.equal(one[0], two[0]),
        "input grad": torch.equal(one[1], two[1]),
        "param grads": one[2].keys() == two[2].keys()
        and all(torch.equal(one[2][k], two[2][k]) for k in one[2]),
    }
    del buf, one, two
    gc.collect()
    before = cpu_memory.settled()
    start = len(faults.ENTRIES)
    res["released"] = _release(fused_a2a)
    gc.collect()
    res["freed"] = before - cpu_memory.settled()
    res["teardown"] = _release_ops(faults.ENTRIES, start)
    res["gone"] = _held_buffer() is None
    return res


# --------------------------------------------------------------------------------------------
# Rank side: the emulated kernels on two nodes of two (the layout from the test's environment).


class _TwoNodeHybridEP:
    """The emulation module, with HybridEPBuffer built on two nodes of two and everything else
    (DeepEP's buffer) on one, as the one-node job runs it."""

    def __init__(self, emu):
        self._emu = emu

    def __getattr__(self, name):
        return getattr(self._emu, name)

    def HybridEPBuffer(self, *args, **kwargs):
        os.environ[LAYOUT_ENV] = str(PER_NODE)
        try:
            return self._emu.HybridEPBuffer(*args, **kwargs)
        finally:
            os.environ.pop(LAYOUT_ENV)


def rank_kernels_across_nodes(hold: float):
    """The outputs job of test_deepep_emulation_outputs with HybridEP on two nodes; then a
    buffer rank 3 keeps ``hold`` seconds while the others free theirs; then a regrowth rank 3
    never makes (its queue pairs' all-gathers: the others must raise within the bound)."""
    import contextlib

    import torch
    import torch.distributed as dist

    from moe_release import settings
    from moe_release.runtime.cuda import placement
    from moe_release.runtime.kernels.install import load_deep_ep_emulation
    from moe_release.runtime.measure import cpu_memory, faults
    from tests.tooling.runtime.kernels import test_deepep_emulation_outputs as outputs

    res = {"ranks_per_node_env": settings.ranks_per_node()}
    emu = load_deep_ep_emulation()
    os.environ.pop(LAYOUT_ENV)
    rules = contextlib.nullcontext() if placement.active() else placement.rules()
    with rules:
        res["outputs"] = outputs._kernel_runs(_TwoNodeHybridEP(emu), torch, dist, placement)
    os.environ[LAYOUT_ENV] = str(PER_NODE)

    # The teardown: local. Rank 3 keeps its buffer; the others free theirs at once.
    cpu_memory.install()
    gc.collect()
    rank = dist.get_rank()
    buf = emu.HybridEPBuffer(dist.group.WORLD, 256, 64, 2)
    res["nodes"] = buf.num_of_nodes
    dist.barrier()
    start, before, t0 = len(faults.ENTRIES), cpu_memory.settled(), time.monotonic()
    if rank == WORLD - 1:
        time.sleep(hold)
    nbytes = buf.nbytes
    buf.runtime = None
    gc.collect()
    res["free_s"] = time.monotonic() - t0
    res["freed"] = before - cpu_memory.settled() == nbytes
    res["teardown"] = _release_ops(faults.ENTRIES, start)
    dist.barrier()

    # The connection: a regrowth rank 3 never makes (a peer that never arrives).
    buf = emu.HybridEPBuffer(dist.group.WORLD, 256, 64, 2)
    dist.barrier()
    t0 = time.monotonic()
    if rank != WORLD - 1:
        try:
            buf._grow(4096)
            res["grow"] = "returned"
        except Exception as exc:  # noqa: BLE001 - the verdict is the exception
            res["grow"] = f"{type(exc).__name__}: {exc}"
    res["grow_s"] = time.monotonic() - t0
    return res


# --------------------------------------------------------------------------------------------
# Tests.


@pytest.fixture(scope="module")
def layer_runs(dist_job, patched_tree):
    return dist_job(f"{THIS}:rank_layer_across_nodes", WORLD, patched_tree, timeout=240.0)


@pytest.fixture(scope="module")
def kernel_runs(dist_job, patched_tree):
    mp = pytest.MonkeyPatch()
    mp.setenv(LAYOUT_ENV, str(PER_NODE))  # the launcher copies the environment into the ranks
    mp.setenv("MOE_RELEASE_DEVICE_BARRIER_TIMEOUT", "3")
    try:
        return dist_job(f"{THIS}:rank_kernels_across_nodes", WORLD, patched_tree, hold=3.0)
    finally:
        mp.undo()


def _by_hand(rows: int, h: int, e_l: int, local_rank: int, blocks: int, pre: int) -> dict:
    """deep_ep 94a9f8f's allocations for R = 2 ranks per node, M = 2 nodes, chunks of 64,
    ``blocks`` dispatch and combine blocks: each line is the cited source's expression with its
    numbers put in (N = rows x R x M tokens, intranode.cu:127-129)."""
    n = rows * 2 * 2
    chunks = (rows - 1) // 64 + 1
    flags = (chunks * 1 + 2 * 1) * 8  # (chunks x (M-1) + 2 x (M-1)) uint64, doca.cu:404-407
    qps = 1 * blocks  # (M-1) x blocks, doca.cu:453,608
    return {
        "preprocessing scratch (ranks)": pre * 2 * 8,
        "preprocessing scratch (local experts)": pre * e_l * 8,
        "combine expert_input_token": n * h * 2,
        "combine expert_input_prob": n * (e_l * 2) * 4,
        "combine write-completion flags": 2 * 4 if local_rank == 0 else None,
        "combine expected flag value": 2 * 4,
        "combine flag parity": 4,
        "combine expected unpermute flag": 4,
        "combine chunk flags": chunks * 2 * 2 * 4,
        "dispatch expert_output_scaling_factor": n * (h // 128) * 4 or None,
        "dispatch write-completion flags": 2 * 4 if local_rank == 0 else None,
        "dispatch expected flag value": 2 * 4,
        "dispatch flag parity": 4,
        "dispatch expected permute flag": 4,
        "dispatch chunk flags": chunks * 2 * 2 * 4,
        "all-gather routing map": (e_l * 2 * 2) * rows * 2 * 2,
        "allocator probe": 128 * 4,
        "RDMA combine intra_node_red_token": rows * 1 * h * 2,
        "RDMA combine intra_node_red_prob": rows * 1 * (e_l * 2) * 4,
        "RDMA combine inter_node_group_token": rows * 1 * h * 2,
        "RDMA combine inter_node_group_prob": rows * 1 * (e_l * 2) * 4,
        "RDMA combine inter_node_group_flags": flags,
        "RDMA combine attn_output_flags": flags,
        "RDMA combine expected_rdma_flag_value": 8,
        "RDMA combine queue-pair pointers": qps * 8,
        "RDMA combine memory-region info": qps * (6 * 4 + 7 * 8),
        "RDMA dispatch attn_input_token": rows * h * 2,
        "RDMA dispatch attn_input_prob": rows * (e_l * 2 * 2) * 4,
        "RDMA dispatch attn_input_sf": rows * (h // 128) * 4 or None,
        "RDMA dispatch inter_node_group_token": rows * 1 * h * 2,
        "RDMA dispatch inter_node_group_prob": rows * 1 * (e_l * 2) * 4,
        "RDMA dispatch inter_node_group_sf": rows * 1 * (h // 128) * 4 or None,
        "RDMA dispatch inter_node_group_flags": flags,
        "RDMA dispatch attn_input_flags": flags,
        "RDMA dispatch expected_rdma_flag_value": 8,
        "RDMA dispatch queue-pair pointers": qps * 8,
        "RDMA dispatch memory-region info": qps * (8 * 4 + 9 * 8),
    }


def test_layer_takes_the_multi_node_path(layer_runs):
    """Unset, the four ranks are one node; at two per node each is (node, local rank) of two
    nodes of two, with the multi-node defaults (8 dispatch and combine blocks)."""
    for rank, res in enumerate(layer_runs):
        assert res["one_node"] == 1, res
        assert res["layout"] == (2, 2, rank // 2, rank % 2), res
        assert res["blocks"] == (108, 8, 8), res


def test_multi_node_buffer_terms_by_hand(layer_runs):
    """The buffer megatron-core's layer built: every term at deep_ep's size worked by hand, the
    RDMA ones included, in one counted tensor of their sum."""
    for rank, res in enumerate(layer_runs):
        rows, h, e_l = res["shape"]
        assert (rows, h, e_l) == (512, 16, 2), res["shape"]
        want = {k: v for k, v in _by_hand(rows, h, e_l, rank % 2, 8, 108).items() if v}
        got = {name: nbytes for name, nbytes, _ in res["terms"]}
        assert got == want, f"rank {rank}"
        assert res["memory"] == res["nbytes"] == sum(want.values())
    # At this shape: 227,392 bytes on local rank 0 (108,432 of them RDMA), 16 fewer on 1.
    assert [r["nbytes"] for r in layer_runs] == [227_392, 227_376] * 2


def test_multi_node_terms_with_scaling_factors_by_hand():
    """At H = 256 (two scaling factors a token), a 1,000-token first call (rows 1,024), the
    explicit block counts: the function against the same hand formulas."""
    from moe_release.runtime.kernels import hybridep_emulation as hep

    for local_rank in (0, 1):
        terms = hep.hybrid_ep_buffer_terms(
            1024, 256, 4, 2, local_rank, 32, num_of_nodes=2, blocks_dispatch=8, blocks_combine=8
        )
        want = {k: v for k, v in _by_hand(1024, 256, 4, local_rank, 8, 32).items() if v}
        assert {t.name: t.nbytes for t in terms} == want


def _table(module, first_cell: str) -> list:
    """The rows of the docstring table whose header starts with ``first_cell``."""
    rows, in_table = [], False
    for line in module.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            in_table = False
        elif cells[0] == first_cell:
            in_table = True
        elif in_table and not set(line) <= set("|-"):
            rows.append(cells)
    return rows


def test_multi_node_table_lists_every_term():
    """Several nodes allocate the ``[hybridep buffer]`` rows (less the custom all-gather's
    one-node state) then exactly the ``[hybridep buffer, multi-node]`` table, row for row (name
    and cited source), and each row's bytes formula gives the term's bytes."""
    from moe_release.runtime.kernels import hybridep_emulation as hep

    rows, h, e_l, r, m, blocks = 512, 256, 4, 2, 3, 8
    terms = hep.hybrid_ep_buffer_terms(rows, h, e_l, r, 0, num_of_nodes=m)
    one_node = _table(hep, "term")
    multi = _table(hep, "multi-node term")
    kept = [(row[0], row[-1]) for row in one_node if "M = 1" not in row[1]]
    assert len(kept) == len(one_node) - 4
    assert [(t.name, t.source) for t in terms] == kept + [(row[0], row[-1]) for row in multi]
    names = dict(rows=rows, H=h, E_l=e_l, R=r, M=m, Cc=rows // 64, Cd=rows // 64, floor=lambda v: v)
    names.update({"Qc": (m - 1) * blocks, "Qd": (m - 1) * blocks, "M_": m - 1})
    got = {t.name: t.nbytes for t in terms}
    for name, ranks, formula, _src in multi:
        expr = formula.replace("M'", "M_").replace(" x ", " * ").replace("H/128", "H//128")
        assert ranks == "all"
        assert eval(expr, {"__builtins__": {}}, names) == got[name], (name, formula)


def test_layer_is_bitwise_the_one_node_layer(layer_runs):
    """Forward output, input gradient and every parameter gradient: bitwise equal across the
    two layouts on every rank."""
    for rank, res in enumerate(layer_runs):
        assert all(res["equal"].values()), f"rank {rank}: {res['equal']}"


def test_construction_connects_over_the_whole_group(layer_runs):
    """The constructor's collectives, in order: the NVLink handle exchange, then the RDMA
    coordinator's combine and dispatch queue-pair exchanges, each over the four ranks."""
    everyone = list(range(WORLD))
    for rank, res in enumerate(layer_runs):
        assert res["built"][:3] == [
            ("hybridep handle exchange", everyone, {}),
            ("hybridep rdma info exchange (combine)", everyone, {}),
            ("hybridep rdma info exchange (dispatch)", everyone, {}),
        ], f"rank {rank}: {res['built']}"


def test_release_frees_the_multi_node_buffer(layer_runs):
    """The patched tree's collective release frees the whole buffer (RDMA rows included) on
    every rank; its log: the buffer's release over its four ranks, then the RDMA teardown on
    the rank alone (local)."""
    for rank, res in enumerate(layer_runs):
        assert res["gone"] and res["released"] == {"hybridep": 1}, res["released"]
        assert res["freed"] == res["nbytes"], (rank, res["freed"], res["nbytes"])
        assert res["teardown"] == [
            ("hybridep release_buffer", list(range(WORLD)), {}),
            ("hybridep rdma release", [rank], {"collective": False, "peers": list(range(WORLD))}),
        ], f"rank {rank}: {res['teardown']}"


def test_kernel_outputs_across_nodes(kernel_runs):
    """Every HybridEP row of the output tables, with M = 2 nodes of R = 2: the handle's per-node
    maps (``sparse_to_dense_map [N*M, R]``, ``rdma_to_attn_map [ceil16(N), M]``,
    ``attn_to_rdma_map [N, M-1]``) and the rest, on every rank, run and mode."""
    from tests.tooling.runtime.kernels import test_deepep_emulation_outputs as outputs

    assert [r["ranks_per_node_env"] for r in kernel_runs] == [PER_NODE] * WORLD
    results = [r["outputs"] for r in kernel_runs]
    for result in results:
        assert result["placement_active"]
        for run in result["runs"]:
            if run["call"].startswith("hybridep"):
                run["ctx"] = dict(run["ctx"], R=PER_NODE, M=WORLD // PER_NODE)
    rows = [row for row in outputs.OUTPUT_ROWS if row["call"].startswith("hybridep")]
    wrong, checked = [], 0
    for row in rows:
        for rank, run in outputs._runs_for(results, row["call"], row["mode"]):
            checked += 1
            want = outputs._expected(row, run["ctx"])
            got = run["outputs"].get(row["output"])
            if got is None or any(got.get(k) != v for k, v in want.items()):
                wrong.append(f"{row['call']} {row['output']} rank {rank} {run['mode']}: {got}")
    assert checked and not wrong, wrong


def test_teardown_is_local(kernel_runs):
    """A rank frees its multi-node buffer without waiting for a peer that keeps its own three
    seconds (RDMACoordinator::destroy deregisters and frees locally)."""
    for rank, res in enumerate(kernel_runs):
        assert res["nodes"] == 2 and res["freed"], res
        ops = [op for op, _, _ in res["teardown"]]
        assert ops == ["hybridep release_buffer", "hybridep rdma release"], res["teardown"]
        if rank != WORLD - 1:
            assert res["free_s"] < 1.5, f"rank {rank} waited {res['free_s']:.1f} s"
    assert kernel_runs[-1]["free_s"] >= 2.9


def test_connection_without_a_peer_raises_within_the_bound(kernel_runs):
    """A regrowth's queue-pair exchange a peer never joins: the others raise "a GPU would trap"
    after the device barrier bound (3 s here), never hang."""
    for rank, res in enumerate(kernel_runs[:-1]):
        assert res["grow"].startswith("DeviceBarrierTimeout"), f"rank {rank}: {res['grow']}"
        assert "hybridep rdma info exchange (combine)" in res["grow"]
        assert "[0, 1, 2, 3]" in res["grow"] and "would trap" in res["grow"]
        assert 2.9 <= res["grow_s"] < 15, res["grow_s"]
